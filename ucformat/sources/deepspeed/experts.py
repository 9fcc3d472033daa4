"""Read the expert-parallel part of a DeepSpeed native-MoE checkpoint (``deepspeed.moe.layer.MoE``).

What DeepSpeed 0.19.8 writes (``DeepSpeedEngine._save_moe_checkpoint``), per tag folder:

* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: one file per MoE layer ``L`` and *global*
  expert id ``E``, holding that expert's parameters under their global names;
* ``mp_rank_00_model_states.pt``: the dense (non-expert) module, ``param_shapes`` (ZeRO), and
  ``num_experts`` (per layer);
* ZeRO-0: ``expp_rank_{e}_mp_rank_00_optim_states.pt``, the whole optimizer state of EP rank
  ``e`` (dense params + its local experts) by position (a bare torch optimizer in fp32, an fp16
  wrapper with its masters in fp16), parameters numbered, not named;
* ZeRO-1/2: ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank: the dense groups partitioned
  over all ``W`` ranks, the expert group (``'moe': True``) over the rank's ``W / ep``
  expert-data-parallel ranks, with the experts under their *local* names (``param_shapes`` lists
  rank 0's local names); the group's ``partition_count`` gives ``W / ep``.

Each EP rank's local experts are mapped to their global ids by :mod:`ucformat.layout.experts`; every
expert parameter becomes one stored parameter under its global name. ZeRO-0 parameter numbers are
matched to names in module order (the order ``split_params_into_different_moe_groups_for_optimizer``
keeps); :mod:`.positional` names and proves them (the expert group among the EP rank's experts,
the others among the dense parameters).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from ucformat.errors import LayoutMismatchError, NotACheckpointError, UnsupportedCheckpointError
from ucformat.format.experts import ExpertLayer, ExpertLayout
from ucformat.format.spec import FP32_STATE
from ucformat.layout.experts import ExpertRanks, expert_id
from ucformat.layout.partition import PartitionedFlatLayout
from ucformat.sources.base import ArraySource, SourceFragment, split_state
from ucformat.sources.deepspeed.positional import (
    PositionalOptimizer,
    decode_positional,
    module_weights,
    read_positional,
)
from ucformat.sources.deepspeed.states import FlatStates, read_zero12_states
from ucformat.sources.torchfile import TensorRef, TorchFile

__all__ = [
    "MOE_KEYS",
    "ExpertFiles",
    "MoeStates",
    "expert_group",
    "find_expert_files",
    "read_moe_states",
]

#: Top-level model-states keys an MoE engine adds (not client state).
MOE_KEYS = frozenset({"num_experts", "ds_autoep_layers"})

_EXPERT_FILE = re.compile(
    r"^layer_(?P<layer>\d+)_expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$"
)
_EXPP = re.compile(r"^expp_rank_(?P<ep>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_ANY_EXPERT = re.compile(r"expp_rank_|(^|_)experts?_")
_SHOWN = 3


@dataclass(frozen=True)
class ExpertFiles:
    """The expert files of a tag folder."""

    #: MoE layer -> global expert id -> file.
    layers: dict[int, dict[int, Path]]
    #: ZeRO-0 optimizer files by EP rank (empty at ZeRO-1/2).
    expp_optim: tuple[Path, ...]
    #: The folder's other file names.
    other: tuple[str, ...]


def _listed(names: Sequence[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def find_expert_files(folder: Path, names: Sequence[str]) -> ExpertFiles | None:
    """The native-MoE expert files among ``names``; None if there are none.

    Raises:
        UnsupportedCheckpointError: expert files of a layout ucformat does not read (tensor-parallel
            experts, Megatron-DeepSpeed or other naming), naming the files.
        LayoutMismatchError: a layer's expert file or an EP rank's optimizer file is missing.
    """
    expert_like = [n for n in names if _ANY_EXPERT.search(n)]
    if not expert_like:
        return None
    layers: dict[int, dict[int, Path]] = {}
    expp: dict[int, Path] = {}
    foreign, tensor_parallel = [], []
    for name in expert_like:
        match = _EXPERT_FILE.match(name) or _EXPP.match(name)
        if match is None:
            foreign.append(name)
        elif int(match["mp"]) != 0:
            tensor_parallel.append(name)
        elif "layer" in match.groupdict():
            layers.setdefault(int(match["layer"]), {})[int(match["expert"])] = folder / name
        else:
            expp[int(match["ep"])] = folder / name
    if tensor_parallel:
        raise UnsupportedCheckpointError(
            f"{folder}: tensor-parallel expert files ({_listed(tensor_parallel)}); ucformat reads "
            "DeepSpeed MoE checkpoints without tensor or expert-tensor parallelism only."
        )
    if foreign or not layers:
        raise UnsupportedCheckpointError(
            f"{folder}: expert files of an unsupported layout ({_listed(foreign or expert_like)}); "
            "ucformat reads DeepSpeed native MoE (layer_L_expert_E_mp_rank_00_model_states.pt) "
            "only, not Megatron-DeepSpeed or AutoEP expert files."
        )
    for layer, experts in sorted(layers.items()):
        missing = sorted(set(range(max(experts) + 1)) - set(experts))
        if missing:
            raise LayoutMismatchError(
                f"{folder}: MoE layer {layer} has no file for expert(s) {missing} (found "
                f"{len(experts)} of {max(experts) + 1}); the checkpoint is incomplete."
            )
    if sorted(layers) != list(range(len(layers))):
        raise LayoutMismatchError(
            f"{folder}: MoE layer files for layers {sorted(layers)}; expected 0..{len(layers) - 1}."
        )
    if expp and sorted(expp) != list(range(len(expp))):
        raise LayoutMismatchError(
            f"{folder}: expp_rank optimizer files for EP ranks {sorted(expp)}; expected "
            f"0..{len(expp) - 1}."
        )
    other = tuple(n for n in names if n not in set(expert_like))
    return ExpertFiles(layers, tuple(expp[e] for e in sorted(expp)), other)


@dataclass
class MoeStates:
    """What :func:`read_moe_states` recovers."""

    stage: int
    world_size: int
    flat: FlatStates
    layout: ExpertLayout
    #: Handles of the expert files (for the source's file list).
    handles: list[TorchFile] = field(default_factory=list)
    #: ZeRO-0: EP rank 0's positional optimizer (its fp16 wrapper's loss scale, clipping).
    positional: PositionalOptimizer | None = None


def read_moe_states(
    meta: Mapping[str, Any],
    model: TorchFile,
    optim: Sequence[TorchFile],
    files: ExpertFiles,
    open_file: Callable[[Path], TorchFile],
    train_dtype: str = "float32",
) -> MoeStates:
    """Describe every trainable array of an MoE checkpoint: dense and experts, global names."""
    if meta.get("ds_autoep_layers"):
        raise UnsupportedCheckpointError(
            f"{model.path}: an AutoEP checkpoint (ds_autoep_layers); ucformat reads DeepSpeed "
            "native MoE (deepspeed.moe.layer.MoE) expert files only."
        )
    experts = {
        layer: {e: open_file(path) for e, path in sorted(ids.items())}
        for layer, ids in sorted(files.layers.items())
    }
    handles = [h for ids in experts.values() for h in ids.values()]
    layers = [_layer(layer, ids, meta) for layer, ids in experts.items()]
    world_size = int(meta["dp_world_size"])
    data_before = _data_before_expert(meta.get("ds_config"))
    if files.expp_optim:
        ep_size = len(files.expp_optim)
        group = _expert_group_name_zero0(optim[0])
        layout = _layout(layers, ep_size, group, data_before, world_size, model)
        flat, opt = _zero0_states(meta, optim, experts, layout, world_size, train_dtype)
        return MoeStates(0, world_size, flat, layout, handles, opt)
    if len(optim) != world_size:
        raise LayoutMismatchError(
            f"{model.path}: dp_world_size is {world_size} but the folder has {len(optim)} "
            "optimizer shards; files from different runs are mixed."
        )
    flat, layout = _zero12_states(meta, optim, layers, data_before, model)
    stage = int(optim[0].obj["optimizer_state_dict"].get("zero_stage", 1))
    return MoeStates(stage, world_size, flat, layout, handles)


def _layer(layer: int, ids: Mapping[int, TorchFile], meta: Mapping[str, Any]) -> ExpertLayer:
    first = ids[0]
    if not isinstance(first.obj, Mapping) or not first.obj:
        raise NotACheckpointError(f"{first.path}: not a DeepSpeed expert model-states file.")
    split = [expert_id(str(name)) for name in first.obj]
    prefix = split[0][0] if split[0] is not None else ""
    suffixes = []
    for name, parts in zip(first.obj, split, strict=True):
        if parts is None or parts[1] != 0 or parts[0] != prefix:
            raise LayoutMismatchError(
                f"{first.path}: key '{name}' is not a parameter of expert 0 of one MoE layer."
            )
        suffixes.append(parts[2])
    for e, handle in ids.items():
        expected = [f"{prefix}.{e}.{s}" for s in suffixes]
        if not isinstance(handle.obj, Mapping) or list(handle.obj) != expected:
            raise LayoutMismatchError(
                f"{handle.path}: expected the keys {expected[:2]}...; files from different runs "
                "are mixed."
            )
    counts = meta.get("num_experts")
    if isinstance(counts, list) and layer < len(counts) and int(counts[layer]) != len(ids):
        raise LayoutMismatchError(
            f"{first.path}: num_experts of layer {layer} is {counts[layer]} but {len(ids)} expert "
            "files exist; the checkpoint is incomplete."
        )
    gate = prefix.replace(".experts.deepspeed_experts", ".gate.wg.weight")
    module = meta.get("module") or {}
    return ExpertLayer(
        layer=layer,
        prefix=prefix,
        num_experts=len(ids),
        params=suffixes,
        gate=gate if gate in module else None,
    )


def _data_before_expert(ds_config: Any) -> bool:
    return bool(
        isinstance(ds_config, Mapping) and ds_config.get("use_data_before_expert_parallelism")
    )


def _layout(
    layers: list[ExpertLayer],
    ep_size: int,
    group: str | None,
    data_before: bool,
    world_size: int,
    where: TorchFile,
) -> ExpertLayout:
    if group is not None and group != f"ep_size_{ep_size}":
        raise LayoutMismatchError(
            f"{where.path}: the expert group is '{group}' but the files say ep_size {ep_size}."
        )
    for layer in layers:
        ExpertRanks(world_size, ep_size, layer.num_experts, data_before)  # checks divisibility
    return ExpertLayout(
        ep_size=ep_size,
        expert_group=group or f"ep_size_{ep_size}",
        data_before_expert=data_before,
        layers=layers,
    )


def _expert_group_name_zero0(first: TorchFile) -> str | None:
    groups = decode_positional(first.obj.get("optimizer"), first).inner["param_groups"]
    names = [str(g["name"]) for g in groups if g.get("moe")]
    if len(names) > 1:
        raise UnsupportedCheckpointError(
            f"{first.path}: {len(names)} expert optimizer groups ({names}); ucformat reads MoE "
            "checkpoints with one expert group (one ep_size) only."
        )
    return names[0] if names else None


def _zero0_states(
    meta: Mapping[str, Any],
    optim: Sequence[TorchFile],
    experts: Mapping[int, Mapping[int, TorchFile]],
    layout: ExpertLayout,
    world_size: int,
    train_dtype: str,
) -> tuple[FlatStates, PositionalOptimizer]:
    """ZeRO-0: each EP rank's optimizer by position (:mod:`.positional`), its expert groups
    (``'moe': True``) among its own experts (global names, 16-bit weights from the expert
    files), its other groups among the dense parameters; dense states from EP rank 0."""
    module: Mapping[str, Any] = meta["module"]
    dense, _ = module_weights(module, [str(n) for n in meta.get("buffer_names") or []])
    ranks = ExpertRanks(world_size, layout.ep_size, layout.layers[0].num_experts)
    states = FlatStates(wrapper="none")
    first: PositionalOptimizer | None = None
    for ep, handle in enumerate(optim):
        osd = handle.obj.get("optimizer") if isinstance(handle.obj, Mapping) else None
        opt = decode_positional(osd, handle)
        first = first or opt
        own: dict[str, TensorRef] = {}
        for layer in layout.layers:
            for local in range(ranks.num_local):
                gid = ranks.global_id(ep, local)
                for param in layer.params:
                    name = f"{layer.prefix}.{gid}.{param}"
                    value = experts[layer.layer][gid].obj[name]
                    if not isinstance(value, TensorRef):
                        raise LayoutMismatchError(f"{handle.path}: '{name}' is not a tensor.")
                    own[name] = value
        expert_names, dense_names = frozenset(own), frozenset(dense)

        def group_names(group: Mapping[str, Any]) -> frozenset[str]:
            return expert_names if group.get("moe") else dense_names  # noqa: B023

        read = read_positional(opt, {**dense, **own}, train_dtype, handle, group_names)
        missing = sorted(set(own) & set(read.unplaced))
        if missing:
            raise UnsupportedCheckpointError(
                f"{handle.path}: expert parameter(s) {_listed(missing)} are in no optimizer "
                "group; ucformat reads MoE checkpoints whose experts are all trained."
            )
        if ep == 0:
            states.wrapper = read.flat.wrapper
            states.param_groups = read.flat.param_groups
        for name, group in read.flat.groups.items():
            if ep == 0 or name in own:
                states.groups[name] = group
                states.arrays[name] = read.flat.arrays[name]
                states.scalars[name] = read.flat.scalars[name]
                if name in read.flat.whole:
                    states.whole[name] = read.flat.whole[name]
    _order_groups(states, layout.layers)
    assert first is not None  # at least one expp_rank file (find_expert_files)
    return states, first


def _zero12_states(
    meta: Mapping[str, Any],
    optim: Sequence[TorchFile],
    layers: list[ExpertLayer],
    data_before: bool,
    model: TorchFile,
) -> tuple[FlatStates, ExpertLayout]:
    """ZeRO-1/2: the dense groups as usual, each expert group per EP rank, renamed to global ids."""
    first = optim[0].obj["optimizer_state_dict"]
    groups = first["base_optimizer_state"]["param_groups"]
    g = expert_group(optim[0], "MoE")
    moe_groups = [g]
    world_size = len(optim)
    states = read_zero12_states(meta, optim, world_size, skip_groups=frozenset(moe_groups))
    counts = first.get("partition_count")
    expert_dp = int(counts[g]) if counts is not None else world_size
    if expert_dp < 1 or world_size % expert_dp:
        raise LayoutMismatchError(
            f"{optim[0].path}: the expert group's partition_count {expert_dp} does not divide the "
            f"{world_size} ranks."
        )
    layout = _layout(
        layers, world_size // expert_dp, str(groups[g].get("name")), data_before, world_size, model
    )
    ranks = ExpertRanks(world_size, layout.ep_size, layers[0].num_experts, data_before)
    shapes = meta["param_shapes"][g]
    local = [(str(n), prod(tuple(s))) for n, s in shapes.items()]
    expected = {
        f"{layer.prefix}.{i}.{p}"
        for layer in layers
        for i in range(ranks.num_local)
        for p in layer.params
    }
    if set(n for n, _ in local) != expected:
        raise LayoutMismatchError(
            f"{model.path}: the expert group's param_shapes do not name the local experts "
            f"0..{ranks.num_local - 1} of every MoE layer; files from different runs are mixed."
        )
    for rank, handle in enumerate(optim):
        osd = handle.obj["optimizer_state_dict"]
        if int(osd["partition_count"][g]) != expert_dp:
            raise LayoutMismatchError(
                f"{handle.path}: the expert group's partition_count is {osd['partition_count'][g]} "
                f"here but {expert_dp} in rank 0's shard; files from different runs are mixed."
            )
        paddings = (osd.get("param_alignment_paddings") or [None] * (g + 1))[g]
        flat_layout = PartitionedFlatLayout.build(local, expert_dp, paddings)
        position = ranks.expert_dp_rank(rank)
        fp32 = osd["single_partition_of_fp32_groups"][g]
        if not isinstance(fp32, TensorRef) or fp32.numel != flat_layout.partition_size:
            raise LayoutMismatchError(
                f"{handle.path}: the expert group's fp32 partition has "
                f"{getattr(fp32, 'numel', '?')} elements, expected {flat_layout.partition_size}."
            )
        flat, scalars = split_state(
            osd["base_optimizer_state"]["state"].get(g, {}),
            f"{handle.path}: expert state",
            flat_layout.partition_size,
        )
        tensors: dict[str, TensorRef] = {FP32_STATE: fp32, **flat}
        for frag in flat_layout.fragments(position):
            name = ranks.global_name(rank, frag.name)
            shape = tuple(int(d) for d in shapes[frag.name])
            per_state = states.arrays.setdefault(name, {})
            states.groups[name] = g
            known = states.scalars.setdefault(name, {})
            for key, value in scalars.items():
                if key in known and known[key] != value:
                    raise LayoutMismatchError(
                        f"{handle.path}: optimizer scalar '{key}' of '{name}' differs between the "
                        "shards of its expert-data-parallel ranks; shards from different steps "
                        "are mixed."
                    )
                known[key] = value
            for key, tensor in tensors.items():
                target = per_state.setdefault(key, ArraySource(shape, tensor.dtype_name))
                target.fragments.append(
                    SourceFragment(tensor, frag.partition_start, frag.param_start, frag.length)
                )
    _order_groups(states, layers)
    return states, layout


def expert_group(shard: TorchFile, what: str) -> int:
    """The index of the one expert optimizer group (``'moe': True``) of a ZeRO-1/2 shard.

    Raises:
        UnsupportedCheckpointError: none, or several (layers with different EP sizes).
    """
    groups = shard.obj["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    found = [g for g, group in enumerate(groups) if group.get("moe")]
    if len(found) != 1:
        raise UnsupportedCheckpointError(
            f"{shard.path}: {len(found)} expert optimizer groups; ucformat reads {what} "
            "checkpoints with exactly one expert group (one EP size) only."
        )
    return found[0]


def _order_groups(states: FlatStates, layers: Sequence[ExpertLayer]) -> None:
    """Dense params first, then experts in global order (layer, expert id, param)."""
    index = {layer.prefix: i for i, layer in enumerate(layers)}

    def key(name: str) -> tuple[int, int]:
        parts = expert_id(name)
        return (-1, 0) if parts is None or parts[0] not in index else (index[parts[0]], parts[1])

    states.groups = dict(sorted(states.groups.items(), key=lambda item: key(item[0])))
