"""``ucformat export deepspeed --tp T``: a native DeepSpeed AutoTP checkpoint (ZeRO-1, 2 or 3).

The output is what ``engine.save_checkpoint`` writes in a job of ``world_size`` processes with
``"tensor_parallel": {"autotp_size": T}``: per tensor-parallel rank ``t`` an ordinary ZeRO
checkpoint of that rank's *shards* (``mp_rank_{t:02d}_model_states.pt``, at ZeRO-3 one
``zero_pp_rank_{dp}_mp_rank_{t:02d}_model_states.pt`` per data-parallel rank instead, and one
``[bf16_]zero_pp_rank_{dp}_mp_rank_{t:02d}_optim_states.pt`` per data-parallel rank, at
``world_size / T`` data-parallel ranks), so that a stock ``engine.load_checkpoint`` at that
layout restores it.

The shard geometry at degree ``T`` comes from the split rules the manifest records
(:mod:`ucformat.export.tp_layout`): the recorded shards when the store was converted at tp
``T``; at another degree each parameter is cut again by its recorded rule (replicated; split on a
dim, per sub-parameter, near-even); at tp 1 every parameter is whole. A store without a
``tensor_parallel`` section can take the rules of another store (``tp_layout``). What the rules
cannot cut exactly is refused, naming the parameter. Algorithm: for each rank ``t``, a *shard
view* of the store (parameters in their shard shapes, every flat range of a shard read as the
full-array ranges its pieces name) is handed to the plain native export's planner and file
builders (:mod:`ucformat.export.deepspeed_native`), which write that rank's files.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch

from ucformat.errors import StoreExistsError, UnsupportedExportError
from ucformat.export.common import open_store_arg
from ucformat.export.deepspeed_common import (
    build_loss_scaler,
    deepspeed_classes,
    group_shapes,
    model_states,
    module_state_dict,
)
from ucformat.export.destination import save_torch, transactional, write_bytes
from ucformat.export.destination import stage as stage_folder
from ucformat.export.native_files import RankFiles
from ucformat.export.native_target import NativeTarget, native_target, plan_native
from ucformat.export.tp_layout import target_shard_maps, tp_grain_size
from ucformat.format.models import CheckpointManifest
from ucformat.layout.tensor_parallel import ShardMap
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.sources.deepspeed.files import LATEST_FILE, model_states_file, optim_states_file
from ucformat.store.keys import StoreLike

__all__ = ["export_deepspeed_tensor_parallel"]


@dataclass(frozen=True)
class _RankTarget(NativeTarget):
    """The plain target, with the file names of tensor-parallel rank ``mp``."""

    mp: int = 0

    def optim_file(self, rank: int) -> str:
        """Optimizer-states file name of data-parallel ``rank`` at this tp rank."""
        return optim_states_file(rank, self.file_prefix, self.mp)

    def model_file(self, rank: int) -> str:
        """Model-states file name at this tp rank."""
        return model_states_file(rank if self.stage == 3 else None, self.mp)


class _ShardView:
    """The store seen by tensor-parallel rank ``rank``: every parameter in its shard shape."""

    def __init__(self, ckpt: UniversalCheckpoint, maps: dict[str, ShardMap]) -> None:
        self.ckpt = ckpt
        self.maps = maps
        manifest = ckpt.manifest
        params = {
            name: entry.model_copy(update={"shape": list(maps[name].shard_shape)})
            for name, entry in manifest.params.items()
        }
        self.manifest: CheckpointManifest = manifest.model_copy(
            update={"params": params, "tensor_parallel": None}
        )

    def read_range(self, name: str, state: str, start: int, stop: int) -> torch.Tensor:
        """Shard flat elements ``[start, stop)`` of ``state``: one read of the span they cover."""
        runs = self.maps[name].translate(start, stop - start)
        if not runs:
            return self.ckpt.read_range(name, state, 0, 0)
        low = min(r.logical_start for r in runs)
        high = max(r.logical_start + r.length for r in runs)
        span = self.ckpt.read_range(name, state, low, high)
        if len(runs) == 1:
            return span
        return torch.cat(
            [span[r.logical_start - low : r.logical_start - low + r.length] for r in runs]
        )

    def read(self, name: str, state: str) -> Any:
        """The whole shard of ``state`` in its shard shape."""
        shard = self.maps[name]
        numel = 1
        for dim in shard.shard_shape:
            numel *= dim
        return self.read_range(name, state, 0, numel).reshape(shard.shard_shape)


@transactional
def export_deepspeed_tensor_parallel(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    world_size: int,
    tp: int,
    stage: int,
    dtype: str | None = None,
    tag: str | None = None,
    overwrite: bool = False,
    tp_layout: StoreLike | UniversalCheckpoint | None = None,
) -> list[str]:
    """Write a native AutoTP checkpoint for ``world_size`` processes at tp ``tp``; return the
    files written (relative to ``out``).

    ``tp_layout``: another store whose ``tensor_parallel`` section gives the split rules (for a
    store without one, e.g. from a data-parallel-only run); default: the store's own.

    Raises:
        UnsupportedExportError: the split rules cannot cut some parameter exactly at ``tp``
            (the message names it), or ``world_size`` is not a multiple of ``tp``.
        StoreExistsError: ``out/<tag>`` exists and ``overwrite`` is not set.
    """
    ckpt = open_store_arg(store)
    manifest = ckpt.manifest
    rules_ckpt = ckpt if tp_layout is None else open_store_arg(tp_layout)
    if world_size % tp:
        raise UnsupportedExportError(
            f"world size {world_size} is not a multiple of tp {tp}; expected tp x dp processes."
        )
    rules = rules_ckpt.manifest
    rank_maps = target_shard_maps(
        manifest.params,
        rules.tensor_parallel,
        tp,
        str(rules_ckpt.where),
        tp_grain_size(rules.source.ds_config),
    )
    dp = world_size // tp
    base = native_target(manifest, world_size=dp, stage=stage, dtype=dtype, tag=tag)
    folder = Path(out)

    def check(folder: Path) -> None:
        if (folder / base.tag).exists() and not overwrite:
            raise StoreExistsError(
                f"{folder / base.tag}: exists; pass overwrite=True (--overwrite) to replace it."
            )

    staged = stage_folder(
        folder,
        owned=lambda name: name in (base.tag, LATEST_FILE),
        last=(LATEST_FILE,),
        check=check,
    )
    tag_dir = staged / base.tag
    tag_dir.mkdir()
    classes = deepspeed_classes("deepspeed")
    scaler, dynamic = build_loss_scaler(classes, manifest, base.dtype, base.ds_config)
    written: list[str] = []
    for rank, maps in enumerate(rank_maps):
        view = cast("UniversalCheckpoint", _ShardView(ckpt, maps))
        target = _RankTarget(**{f.name: getattr(base, f.name) for f in fields(base)}, mp=rank)
        plan = plan_native(view.manifest, target)
        if plan.frozen or view.manifest.buffers:
            raise UnsupportedExportError(
                "frozen parameters or buffers in a tensor-parallel export are not supported."
            )
        # ZeRO-3: one model-states file per data-parallel rank, the module as placeholders (the
        # weights live in the optimizer files' partitions), the tied names in rank 0's only
        module = module_state_dict(view, target.dtype, placeholders=stage == 3)
        for dp_rank in range(dp if stage == 3 else 1):
            state, _ = model_states(
                view.manifest,
                module=module,
                param_shapes=group_shapes(view.manifest, [g.members for g in plan.flat_groups]),
                frozen_shapes=OrderedDict() if stage in (2, 3) else None,
                frozen_fragments=OrderedDict() if stage in (2, 3) else None,
                shared_params=dict(manifest.tied) if dp_rank == 0 else {},
                world_size=dp,
                ds_config=target.ds_config,
                ds_version=classes.version,
            )
            state["mp_world_size"] = tp
            state["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": tp}
            save_torch(state, tag_dir / target.model_file(dp_rank))
            written.append(f"{base.tag}/{target.model_file(dp_rank)}")
        files = RankFiles(view, plan, classes, scaler, dynamic)
        for dp_rank in range(dp):
            save_torch(files.optimizer_file(dp_rank), tag_dir / target.optim_file(dp_rank))
            written.append(f"{base.tag}/{target.optim_file(dp_rank)}")
    write_bytes(staged / LATEST_FILE, base.tag.encode())
    written.append(LATEST_FILE)
    return written
