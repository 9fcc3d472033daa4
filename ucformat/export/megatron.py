"""``ucformat export megatron``: a Megatron-Core ``torch_dist`` checkpoint that stock
``dist_checkpointing.load`` and Megatron-LM's ``load_checkpoint`` resume at a new TP x PP x EP.

What is written, in Megatron-LM's ``--save`` folder layout::

    OUT/iter_0000200/__<rank>_0.distcp       each rank's boxes (torch.save'd tensors, back to back)
    OUT/iter_0000200/.metadata               DCP's metadata (written last in the folder)
    OUT/iter_0000200/common.pt               what is not sharded (below)
    OUT/iter_0000200/metadata.json           {"sharded_backend": "torch_dist", ...}
    OUT/latest_checkpointed_iteration.txt    "200": the tracker, written last (the commit)

Tensors, under the ShardedTensor keys the store recorded at convert (``manifest.megatron``),
each a global tensor ``(*prepended axes, *parameter shape)``:

* ``<key>``: the weights, in the training dtype (the fp32 master weights rounded: what
  Megatron copies into a 16-bit model after each step);
* the distributed optimizer's ``fully_reshardable`` form (``--distributed-optimizer``):
  ``optimizer.state.param.<key>`` (fp32 master), ``optimizer.state.exp_avg.<key>``,
  ``optimizer.state.exp_avg_sq.<key>``; a non-distributed optimizer's form
  (``FP32Optimizer``, or ``Float16OptimizerWithFloat16Params`` for a 16-bit model, which
  also keeps ``optimizer.state.fp32_param.<key>``): ``optimizer.state.<state>.<key>``;
* each box is written by the rank of the target layout that holds it as Megatron's main
  replica (:mod:`ucformat.layout.megatron`: Megatron-Core's TP split rules, even PP stages, EP
  ranks), so the files look like the ones the job itself would write.

Objects: every linear layer's (and attention's) ``_extra_state`` as ``None``, the value of
Megatron's local layers and of Transformer Engine's without fp8 (a key nobody asks for is
ignored by the loader).

``common.pt``: ``args`` (the run's Megatron-LM arguments as stored, the parallel sizes of the
target layout, ``use_distributed_optimizer``, ``no_save_rng``: the store holds no RNG state),
``checkpoint_version``, ``iteration``, the optimizer's param groups and step in the form the
chosen optimizer keeps them (:mod:`ucformat.format.megatron_state`; one entry per chained
optimizer: dense, then expert-parallel), the client state kept exactly (scheduler, flops), and
``content_metadata``.

Algorithm: plan from the manifest alone (keys, boxes, writers; ``--dry-run`` stops here), then
write the DCP files through :func:`~ucformat.export.dcp.write_dcp_files` (each box one
``read_runs`` of the store), ``common.pt``, ``metadata.json`` and the tracker.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucformat.errors import StoreExistsError, UnsupportedExportError
from ucformat.export.common import (
    ExportHooks,
    ExportResult,
    Stopwatch,
    open_store_arg,
    parse_dtype,
)
from ucformat.export.dcp import DcpPiece, DcpTensorItem, DcpValueItem, write_dcp_files
from ucformat.export.destination import save_torch, transactional, write_bytes
from ucformat.export.run_folder import Destination, check_run_folder, prepare_folder
from ucformat.export.url_target import export_to_url, is_url
from ucformat.format.megatron_state import (
    MegatronKeys,
    common_step,
    content_metadata,
    job_param_groups,
    megatron_keys,
    optimizer_common,
)
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE
from ucformat.format.summary import format_bytes
from ucformat.layout.megatron import (
    MegatronGrid,
    expert_rank,
    layer_stage,
    split_dim,
    stage_layers,
    tp_boxes,
)
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.store.keys import StoreLike

__all__ = ["MegatronPlan", "export_megatron", "plan_megatron"]

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
#: ``metadata.json`` of a ``torch_dist`` checkpoint (Megatron-Core's CheckpointingConfig).
BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
#: Modules whose ``_extra_state`` a Megatron layer saves (Megatron's local linear layers and
#: Transformer Engine's modules).
_EXTRA_STATE_MODULES = frozenset({"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"})
#: Megatron-LM arguments of the saving job's layout, replaced or dropped for the target.
_LAYOUT_ARGS = (
    "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
)  # fmt: skip
#: Client-state keys rebuilt for the target (or tied to the saving job's layout).
_REBUILT = frozenset(
    {"args", "iteration", "checkpoint_version", "content_metadata", "optimizer", "rng_state",
     "rerun_state_machine", "model"}
)  # fmt: skip
_ADAM = ("exp_avg", "exp_avg_sq")
_SIXTEEN_BIT = frozenset({"bfloat16", "float16"})


@dataclass(frozen=True)
class MegatronPlan:
    """Everything an export writes, decided from the manifest.

    Attributes:
        grid: the target's TP x PP x EP.
        distributed: the distributed optimizer's form (else a non-distributed optimizer's).
        dtype: the weights' dtype.
        iteration: the iteration (the folder is ``iter_<iteration:07d>``).
        tensors: every tensor key with its pieces (writer ranks, store boxes).
        objects: every ShardedObject (``<key>/shard_<index>_<axes>``, value ``[None]``).
        groups: the param groups per chained optimizer (empty: no optimizer written).
        step: the shared optimizer step (None: none stored).
        client: client-state values carried into ``common.pt`` as they are.
        args: Megatron-LM's arguments for ``common.pt`` (None: none written).
        notes: what the target does not carry.
    """

    grid: MegatronGrid
    distributed: bool
    dtype: str
    iteration: int
    tensors: tuple[DcpTensorItem, ...]
    objects: tuple[DcpValueItem, ...]
    groups: tuple[tuple[dict[str, Any], ...], ...]
    step: int | float | None
    client: dict[str, Any]
    args: dict[str, Any]
    notes: tuple[str, ...] = field(default=())

    @property
    def folder(self) -> str:
        """The iteration folder's name."""
        return f"iter_{self.iteration:07d}"

    @property
    def nbytes(self) -> int:
        """Tensor payload bytes."""
        return sum(item.nbytes for item in self.tensors)

    @property
    def files(self) -> list[str]:
        """Files written, relative to the destination, in writing order."""
        ranks = [f"{self.folder}/__{r}_0.distcp" for r in range(self.grid.world_size)]
        tail = [DCP_METADATA, COMMON, METADATA_JSON]
        return [*ranks, *(f"{self.folder}/{name}" for name in tail), TRACKER]

    @property
    def float16_optimizer(self) -> bool:
        """A non-distributed optimizer of a 16-bit model (it keeps ``fp32_param``)."""
        return not self.distributed and self.dtype in _SIXTEEN_BIT


def _source_distributed(manifest: CheckpointManifest) -> bool:
    """Whether the source trained with Megatron's distributed optimizer."""
    layout = manifest.megatron
    if layout is not None and layout.optimizers:
        return "DistributedOptimizer" in layout.optimizers
    if layout is not None and layout.optimizer_sharding is not None:
        return True
    return "Distributed" in (manifest.source.optimizer_wrapper or "")


def _state_keys(manifest: CheckpointManifest, distributed: bool) -> list[str]:
    optimizer = manifest.optimizer
    if optimizer is None:
        return []
    keys = list(optimizer.state_keys)
    if distributed and sorted(keys) != sorted(_ADAM):
        raise UnsupportedExportError(
            f"Megatron-Core's distributed optimizer keeps Adam's {', '.join(_ADAM)}; the store's "
            f"optimizer ({optimizer.name}) has {', '.join(keys) or 'no states'}. Export with "
            "--no-distributed-optimizer."
        )
    return keys


def _tensor_items(
    manifest: CheckpointManifest,
    keys: MegatronKeys,
    grid: MegatronGrid,
    stages: list[int],
    dtype: str,
    optimizer_states: list[tuple[str, str]],
) -> list[DcpTensorItem]:
    """Every tensor key: the model's, then each optimizer state's (``(prefix, store state)``)."""
    layout = manifest.megatron
    assert layout is not None
    pieces: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], str, tuple[int, ...]]]]
    pieces = {}
    experts = [e.expert for e in keys.entries.values() if e.expert is not None]
    num_experts = layout.num_experts or (max(experts) + 1 if experts else 0)
    for name, entry in keys.entries.items():
        stage = layer_stage(entry.layer, entry.key, stages, grid.pp)
        ep_rank = None
        if entry.expert is not None:
            ep_rank = expert_rank(entry.expert, num_experts, grid.ep)
        fused = layout.params[name].fused
        halves = tuple(fused.sizes) if fused and fused.kind == "gate_up" and fused.sizes else ()
        degree = grid.tp if ep_rank is None else grid.expert_tp
        for box in tp_boxes(name, entry.shape, split_dim(entry.key), degree, halves):
            writer = (
                grid.rank(box.tp_rank, stage)
                if ep_rank is None
                else grid.expert_rank(box.tp_rank, ep_rank, stage)
            )
            offsets = (*entry.index, *box.offsets)
            sizes = (*(1 for _ in entry.index), *box.sizes)
            pieces.setdefault(entry.key, []).append((writer, offsets, sizes, name, box.offsets))
    items: list[DcpTensorItem] = []
    trainable = {n for n, e in manifest.params.items() if e.group is not None}
    for prefix, state in [("", FP32_STATE), *optimizer_states]:
        for key, cut in pieces.items():
            if prefix and not all(p[3] in trainable for p in cut):
                continue
            item_dtype = dtype if not prefix else _state_dtype(manifest, cut[0][3], state)
            item_key = f"{prefix}{key}"
            item_pieces = tuple(
                DcpPiece(rank, offsets, sizes, name, state, source)
                for rank, offsets, sizes, name, source in cut
            )
            shape = keys.global_shape(key)
            items.append(DcpTensorItem(item_key, (item_key,), shape, item_dtype, item_pieces))
    return items


def _state_dtype(manifest: CheckpointManifest, name: str, state: str) -> str:
    ref = manifest.params[name].states.get(state)
    if ref is None:
        raise UnsupportedExportError(f"'{name}': the store holds no '{state}' array for it.")
    return "float32" if state == FP32_STATE else ref.dtype


def _objects(keys: MegatronKeys) -> list[DcpValueItem]:
    """``_extra_state`` of every linear layer and attention, one per index on its axes."""
    modules: dict[str, tuple[int, ...]] = {}
    for key, axes in keys.axes.items():
        parts = key.split(".")
        if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in _EXTRA_STATE_MODULES:
            continue
        modules[".".join(parts[:-1])] = axes
        if parts[-2] == "linear_qkv" and len(parts) >= 3:
            modules[".".join([*parts[:-2], "core_attention"])] = axes
    objects = []
    for module, axes in modules.items():
        key = f"{module}._extra_state"
        shape = ".".join(map(str, axes or (1,)))
        for index in _indices(axes):
            unique = f"{key}/shard_{'.'.join(map(str, index or (0,)))}_{shape}"
            objects.append(DcpValueItem(unique, (unique,), [None]))
    return objects


def _indices(axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in axes:
        out = [(*prefix, i) for prefix in out for i in range(size)]
    return out


def _chained_groups(groups: list[dict[str, Any]]) -> tuple[tuple[dict[str, Any], ...], ...]:
    """Megatron's chain: the dense groups' optimizer, then the expert-parallel groups' one
    (expert-parallel groups exist only with EP > 1: ``job_param_groups``)."""
    dense = tuple(g for g in groups if not g.get("is_expert_parallel"))
    expert = tuple(g for g in groups if g.get("is_expert_parallel"))
    return tuple(part for part in (dense, expert) if part)


def _stored_args(manifest: CheckpointManifest) -> dict[str, Any]:
    raw = manifest.client_state.values.get("args")
    value = decode(raw) if raw is not None else None
    return dict(value) if isinstance(value, dict) else {}


def plan_megatron(
    manifest: CheckpointManifest,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    distributed_optimizer: bool | None = None,
    dtype: str | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    vpp: int | None = None,
    etp: int | None = None,
) -> MegatronPlan:
    """Plan a Megatron export from the manifest alone (see the module docstring).

    Raises:
        UnsupportedExportError: the store is not from Megatron-Core, or the layout cannot hold
            it (a split dim, the layers or the experts not divisible by the degrees).
    """
    layout = manifest.megatron
    source = layout.parallel if layout is not None else None
    if etp is None and source is not None and (source.tensor, source.expert) == (tp, ep):
        etp = source.expert_tensor  # the source's own expert TP at its own TP and EP
    grid = MegatronGrid(tp, pp, ep, etp)
    keys = megatron_keys(manifest)
    notes: list[str] = []
    source_distributed = _source_distributed(manifest)
    distributed = source_distributed if distributed_optimizer is None else distributed_optimizer
    target_dtype = dtype or manifest.source.train_dtype or "float32"
    if target_dtype not in ("float32", *_SIXTEEN_BIT):
        raise UnsupportedExportError(f"dtype {target_dtype!r}; expected fp32, bf16 or fp16.")
    has_experts = any(e.expert is not None for e in keys.entries.values())
    if ep > 1 and not has_experts:
        raise UnsupportedExportError(f"--ep {ep}: the store has no experts; leave --ep at 1.")
    optimizer_states: list[tuple[str, str]] = []
    groups: tuple[tuple[dict[str, Any], ...], ...] = ()
    step = None
    if manifest.optimizer is not None:
        state_keys = _state_keys(manifest, distributed)
        masters = (
            ["param"] if distributed else (["fp32_param"] if target_dtype in _SIXTEEN_BIT else [])
        )
        optimizer_states = [(f"optimizer.state.{m}.", FP32_STATE) for m in masters]
        optimizer_states += [(f"optimizer.state.{s}.", s) for s in state_keys]
        job_groups = job_param_groups(
            manifest, distributed=distributed, expert_parallel=ep > 1 and has_experts
        )
        groups = _chained_groups(job_groups)
        step = common_step(manifest)
        if distributed != source_distributed:
            kinds = ("non-distributed", "distributed")
            notes.append(
                f"the optimizer is written for Megatron's {kinds[distributed]} optimizer (the "
                f"source used the {kinds[source_distributed]} one)"
            )
    else:
        why = manifest.megatron.optimizer_note if manifest.megatron else ""
        notes.append(
            "the store holds no optimizer state: the model only is written (args.no_save_optim)"
            + (f"; {why}" if why else "")
        )
    args = _stored_args(manifest)
    own_stages = args.get("pipeline_model_parallel_size") == pp  # the source's stages
    if first_stage_layers is None and last_stage_layers is None and vpp is None and own_stages:
        first_stage_layers = args.get("decoder_first_pipeline_num_layers")
        last_stage_layers = args.get("decoder_last_pipeline_num_layers")
        vpp = args.get("virtual_pipeline_model_parallel_size")
    vpp = vpp or 1
    layers = [e.layer for e in keys.entries.values() if e.layer is not None]
    assert manifest.megatron is not None
    num_layers = manifest.megatron.num_layers or (max(layers) + 1 if layers else 0)
    stages = stage_layers(num_layers, pp, first_stage_layers, last_stage_layers, vpp)
    tensors = _tensor_items(manifest, keys, grid, stages, target_dtype, optimizer_states)
    if not args:
        notes.append("the store holds no Megatron-LM args: common.pt's args name the layout only")
    for name in _LAYOUT_ARGS:
        args.pop(name, None)
    args.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_tensor_parallel_size=grid.expert_tp,
        decoder_first_pipeline_num_layers=first_stage_layers,
        decoder_last_pipeline_num_layers=last_stage_layers,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep,
        data_parallel_size=grid.dp, world_size=grid.world_size,
        use_distributed_optimizer=distributed, dist_ckpt_optim_fully_reshardable=distributed,
        ckpt_format="torch_dist", no_save_rng=True, no_save_optim=manifest.optimizer is None,
        bf16=target_dtype == "bfloat16", fp16=target_dtype == "float16",
    )  # fmt: skip
    notes.append(
        "no RNG state is written (args.no_save_rng: Megatron-LM seeds its generators afresh); "
        "_extra_state objects are written empty (None)"
    )
    client = {k: decode(v) for k, v in manifest.client_state.values.items() if k not in _REBUILT}
    return MegatronPlan(
        grid=grid,
        distributed=distributed,
        dtype=target_dtype,
        iteration=manifest.progress.global_steps,
        tensors=tuple(tensors),
        objects=tuple(_objects(keys)),
        groups=groups,
        step=step,
        client=client,
        args=args,
        notes=tuple(notes),
    )


# --- execution ------------------------------------------------------------------------------


def _optimizer_common(plan: MegatronPlan) -> Any:
    """``common.pt``'s ``optimizer``: one entry per chained optimizer (just the one if one)."""
    step = None
    if plan.step is not None and not plan.distributed:
        step = torch.tensor(float(plan.step), dtype=torch.float32)  # torch Adam's step
    entries = [
        optimizer_common(
            [dict(g) for g in groups],
            distributed=plan.distributed,
            float16=plan.float16_optimizer,
            step=step,
        )
        for groups in plan.groups
    ]
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def common_state(plan: MegatronPlan) -> dict[str, Any]:
    """What ``common.pt`` holds (see the module docstring)."""
    common: dict[str, Any] = {
        "args": argparse.Namespace(**plan.args),
        "checkpoint_version": 3.0,
        "iteration": plan.iteration,
    }
    if plan.groups:
        common["optimizer"] = _optimizer_common(plan)
    common.update(plan.client)
    common["content_metadata"] = content_metadata(plan.distributed)
    return common


def _tracker_iteration(folder: Path) -> str | None:
    tracker = folder / TRACKER
    return tracker.read_text().strip() if tracker.is_file() else None


def _destination(folder: Path, plan: MegatronPlan, overwrite: bool) -> Destination:
    """Check ``folder`` (names only): a new or empty folder, or a Megatron-LM checkpoint folder
    (it has the tracker) without this iteration, unless ``overwrite``."""
    previous = _tracker_iteration(folder)
    check_run_folder(
        folder, pointer=previous, pointer_name=TRACKER, kind="Megatron-LM", overwrite=overwrite
    )
    exists = (folder / plan.folder).exists()
    if exists and not overwrite:
        raise StoreExistsError(
            f"{folder / plan.folder}: already exists; pass overwrite=True to replace it."
        )
    return Destination(folder, plan.folder, previous, exists, remove_previous=False)


def _write(
    ckpt: UniversalCheckpoint, plan: MegatronPlan, dest: Destination, hooks: ExportHooks
) -> None:
    iteration_dir = prepare_folder(dest, pointer=TRACKER)  # staged: the commit moves it in
    world = plan.grid.world_size
    checkpoint_id = dest.folder / dest.tag  # what the DCP metadata names: where it will be
    write_dcp_files(ckpt, iteration_dir, plan.tensors, plan.objects, world, checkpoint_id, hooks)
    save_torch(common_state(plan), iteration_dir / COMMON)
    write_bytes(iteration_dir / METADATA_JSON, json.dumps(BACKEND).encode())
    write_bytes(iteration_dir.parent / TRACKER, str(plan.iteration).encode())


@transactional
def export_megatron(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    distributed_optimizer: bool | None = None,
    dtype: str | torch.dtype | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    vpp: int | None = None,
    etp: int | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    hooks: ExportHooks | None = None,
) -> ExportResult:
    """Write the store as a Megatron-Core ``torch_dist`` checkpoint for TP x PP x EP.

    Resume it with Megatron-LM (``--load OUT --ckpt-format torch_dist``, the same TP/PP/EP,
    ``--use-distributed-optimizer`` as written) or with stock ``dist_checkpointing.load`` of
    ``OUT/iter_<N>`` (docs/megatron.md).

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint, converted from Megatron-Core.
        out: the Megatron-LM checkpoint folder (created; a folder holding the tracker gets a new
            iteration beside the others), or a URL (written locally, then uploaded).
        tp: tensor-parallel degree of the job that will load it.
        pp: pipeline-parallel stages.
        ep: expert-parallel degree (MoE stores).
        distributed_optimizer: write the distributed optimizer's ``fully_reshardable`` form
            (True) or a non-distributed optimizer's (False); default: the source's.
        dtype: the weights' dtype (default: the source's training dtype).
        first_stage_layers: layers of the first pipeline stage when it differs from the others
            (Megatron-LM's ``--decoder-first-pipeline-num-layers``; default: the source's when
            ``pp`` is the source's, else none).
        last_stage_layers: the same for the last stage.
        vpp: virtual (interleaved) pipeline stages per pipeline rank (default: the source's when
            ``pp`` is the source's, else 1).
        etp: the experts' tensor-parallel degree (default: the source's at its own TP and EP,
            else ``tp``, Megatron's default).
        overwrite: replace this iteration's folder (and, in a folder that is not a Megatron-LM
            checkpoint folder, write anyway; other files are kept).
        dry_run: plan only; write nothing.
        hooks: progress callbacks.

    Raises:
        UnsupportedExportError: the store is not from Megatron-Core or the layout cannot hold
            it.
        StoreExistsError: the destination is taken and ``overwrite`` is not set.

    Example:
        >>> ucformat.export.export_megatron("ckpt.ucf", "ckpts/", tp=4, pp=2)  # doctest: +SKIP
    """
    clock = Stopwatch()
    hooks = hooks or ExportHooks()
    ckpt = open_store_arg(store)
    plan = plan_megatron(
        ckpt.manifest,
        tp=tp,
        pp=pp,
        ep=ep,
        distributed_optimizer=distributed_optimizer,
        dtype=parse_dtype(dtype),
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        vpp=vpp,
        etp=etp,
    )
    if is_url(out):
        return export_to_url(
            str(out),
            lambda folder: _export_local(ckpt, plan, folder, False, dry_run, hooks, clock),
            owned=lambda name: name in (plan.folder, TRACKER),
            overwrite=overwrite,
            dry_run=dry_run,
            last=(TRACKER,),
        )
    return _export_local(ckpt, plan, Path(out), overwrite, dry_run, hooks, clock)


def _export_local(
    ckpt: UniversalCheckpoint,
    plan: MegatronPlan,
    folder: Path,
    overwrite: bool,
    dry_run: bool,
    hooks: ExportHooks,
    clock: Stopwatch,
) -> ExportResult:
    dest = _destination(folder, plan, overwrite)
    if not dry_run:
        hooks.plan(plan.nbytes)
        _write(ckpt, plan, dest, hooks)
    notes = list(plan.notes)
    if dest.previous is not None and dest.previous != str(plan.iteration):
        notes.append(f"{TRACKER}: {dest.previous} -> {plan.iteration} (iteration "
                     f"{dest.previous}'s folder is kept)")  # fmt: skip
    grid = plan.grid
    optim = (
        "no optimizer"
        if not plan.groups
        else "distributed optimizer (fully_reshardable)"
        if plan.distributed
        else "non-distributed optimizer"
    )
    verb = "would write" if dry_run else "wrote"
    summary = (
        f"{verb} Megatron-Core torch_dist iteration {plan.iteration} for TP={grid.tp} x "
        f"PP={grid.pp} x EP={grid.ep} ({plan.dtype} weights, {optim}; {len(plan.tensors)} "
        f"tensors, {format_bytes(plan.nbytes)}) to {folder / plan.folder} in {clock.seconds:.2f}s"
    )
    return ExportResult(
        "megatron", folder, plan.files, plan.nbytes, dry_run, clock.seconds, summary, notes
    )
