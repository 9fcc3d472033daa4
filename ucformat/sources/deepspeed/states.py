"""Map DeepSpeed's flat optimizer partitions onto per-parameter arrays (ZeRO-1/2 and ZeRO-3).

Trust ``param_shapes`` and the partition formulas of :mod:`ucformat.layout.partition`, not
DeepSpeed's ``param_slice_mappings`` (wrong with ``round_robin_gradients``). Every tensor length
found in a shard is checked against the layout, so a wrong assumption fails loudly instead of
shifting values.

A ZeRO-1/2 group's state tensor is, by its length on a rank:

* the partition's (``P``): elementwise, cut like the fp32 partition (Adam's moments);
* the sum of the *whole* sizes of the parameters the partition touches: one whole copy of each,
  end to end (DeepSpeed's Muon keeps ``momentum_buffer`` so, a matrix touched by two ranks on
  both): elementwise too, each parameter from the first rank holding it, the other copies
  compared byte for byte. In a group saved with ``use_muon`` (DeepSpeed's Muon) this reading
  comes first: its buffer can have the partition's length by chance (the last partition, whose
  padding equals the head of its first matrix held by the rank before);
* anything else (a 1-element tensor, a per-partition statistic): a state of the partition, kept
  as saved, one row per rank (format 3.1 ``partition_states``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from ucformat.errors import LayoutMismatchError, NotACheckpointError, UnsupportedCheckpointError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.models import ScalarState
from ucformat.format.spec import FP32_STATE
from ucformat.layout.partition import Fragment, PartitionedFlatLayout, PerParamLayout
from ucformat.sources.base import ArraySource, SourceFragment, split_state
from ucformat.sources.torchfile import TensorRef, TorchFile

__all__ = ["FlatStates", "read_zero12_states", "read_zero3_states"]


@dataclass
class FlatStates:
    """Per-parameter arrays and scalars recovered from the optimizer shards."""

    wrapper: str
    #: trainable fqn -> optimizer group index, in flattening order.
    groups: dict[str, int] = field(default_factory=dict)
    arrays: dict[str, dict[str, ArraySource]] = field(default_factory=dict)
    scalars: dict[str, dict[str, ScalarState]] = field(default_factory=dict)
    #: Per optimizer group: its param-group dict from rank 0 (including 'params').
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    #: ZeRO-3 sub-group count.
    sub_groups: int | None = None
    #: States kept whole per parameter in their own shape (ZeRO-0: :mod:`.positional`).
    whole: dict[str, dict[str, ArraySource]] = field(default_factory=dict)
    #: Per group, per key: each rank's tensor of a state kept once per partition (ZeRO-1/2).
    partition: dict[int, dict[str, list[TensorRef]]] = field(default_factory=dict)


def _key(obj: Mapping[str, Any], key: str, handle: TorchFile) -> Any:
    if not isinstance(obj, Mapping) or key not in obj:
        raise NotACheckpointError(
            f"{handle.path}: missing key '{key}'; not a DeepSpeed ZeRO optimizer shard."
        )
    return obj[key]


def _numels(shapes: Mapping[str, Any]) -> list[tuple[str, int]]:
    return [(str(name), prod(tuple(shape))) for name, shape in shapes.items()]


def _flat_tensor(value: Any, handle: TorchFile, what: str) -> TensorRef:
    if not isinstance(value, TensorRef) or len(value.shape) != 1:
        raise LayoutMismatchError(f"{handle.path}: {what} is not a 1-D tensor.")
    return value


def _check_length(tensor: TensorRef, low: int, high: int, handle: TorchFile, what: str) -> None:
    if not low <= tensor.numel <= high:
        expected = str(high) if low == high else f"between {low} and {high}"
        raise LayoutMismatchError(
            f"{handle.path}: {what} has {tensor.numel} elements, expected {expected} from "
            "param_shapes and the world size; the shard does not match its model-states file."
        )


def _add_fragments(
    states: FlatStates,
    fragments: Sequence[Fragment],
    tensors: Mapping[str, TensorRef],
    shapes: Mapping[str, Any],
) -> None:
    for frag in fragments:
        per_state = states.arrays.setdefault(frag.name, {})
        for state, tensor in tensors.items():
            target = per_state.get(state)
            if target is None:
                shape = tuple(int(d) for d in shapes[frag.name])
                target = per_state[state] = ArraySource(shape, tensor.dtype_name)
            target.fragments.append(
                SourceFragment(tensor, frag.partition_start, frag.param_start, frag.length)
            )


def _split_state(
    state: Mapping[str, Any], handle: TorchFile, where: str, *, odd: bool = False
) -> tuple[dict[str, TensorRef], dict[str, ScalarState]]:
    """Tensors and scalars of a flat group's state; ``odd``: tensors of any shape count as
    tensors (the caller sorts them out), else only 1-D ones."""
    if odd:
        tensors = {str(k): v for k, v in state.items() if isinstance(v, TensorRef) and v.shape}
        rest = {k: v for k, v in state.items() if str(k) not in tensors}
        _, scalars = split_state(rest, f"{handle.path}: {where}")
        arrays: dict[str, Any] = tensors
    else:
        arrays, scalars = split_state(state, f"{handle.path}: {where}")
    if FP32_STATE in arrays:
        raise LayoutMismatchError(f"{handle.path}: optimizer state key '{FP32_STATE}' is reserved.")
    return arrays, scalars


def _whole_params_length(fragments: Sequence[Fragment], params: Sequence[tuple[str, int]]) -> int:
    """The summed whole sizes of the parameters ``fragments`` touch (a Muon buffer's length)."""
    touched = {f.name for f in fragments}
    return sum(numel for name, numel in params if name in touched)


def _add_whole_copies(
    states: FlatStates,
    fragments: Sequence[Fragment],
    params: Sequence[tuple[str, int]],
    key: str,
    tensor: TensorRef,
    shapes: Mapping[str, Any],
    handle: TorchFile,
) -> None:
    """A state holding one whole copy of each parameter the partition touches, end to end:
    each parameter's array from the first rank holding it; later copies must be equal."""
    touched = {f.name for f in fragments}
    offset = 0
    for name, numel in params:
        if name not in touched:
            continue
        per_state = states.arrays.setdefault(name, {})
        if key not in per_state:
            shape = tuple(int(d) for d in shapes[name])
            per_state[key] = ArraySource(shape, tensor.dtype_name)
            if numel:
                per_state[key].fragments.append(SourceFragment(tensor, offset, 0, numel))
        else:
            kept = per_state[key].fragments[0] if per_state[key].fragments else None
            same = kept is None or _equal(kept.tensor, kept.tensor_start, tensor, offset, numel)
            if not same:
                raise LayoutMismatchError(
                    f"{handle.path}: optimizer state '{key}' of '{name}' (a whole copy per "
                    "partition touching it) differs from another rank's copy; the ranks diverged."
                )
        offset += numel


def _equal(a: Any, a_start: int, b: TensorRef, b_start: int, numel: int) -> bool:
    """Whether ``numel`` elements of two tensors agree bit for bit (read now)."""
    dtype = numpy_storage_dtype(b.dtype_name)
    left, right = np.empty(numel, dtype), np.empty(numel, dtype)
    a.read_into(left, a_start, a_start + numel)
    b.read_into(right, b_start, b_start + numel)
    return bool(np.array_equal(left.view(np.uint8), right.view(np.uint8)))


def _saved_with_muon(base: Mapping[str, Any], g: int) -> bool:
    """Whether param group ``g`` was saved by DeepSpeed's Muon (``use_muon`` in the group)."""
    groups = base.get("param_groups") or []
    group = groups[g] if g < len(groups) else None
    return isinstance(group, Mapping) and bool(group.get("use_muon", False))


def _record_scalars(
    states: FlatStates, names: Sequence[str], scalars: Mapping[str, ScalarState], handle: TorchFile
) -> None:
    for name in names:
        known = states.scalars.setdefault(name, {})
        for key, value in scalars.items():
            if key in known and known[key] != value:
                raise LayoutMismatchError(
                    f"{handle.path}: optimizer scalar '{key}' of '{name}' is {value.value} here "
                    f"but {known[key].value} in another shard; shards from different steps are "
                    "mixed."
                )
            known[key] = value


def read_zero12_states(
    model_meta: Mapping[str, Any],
    optim: Sequence[TorchFile],
    world_size: int,
    skip_groups: frozenset[int] = frozenset(),
) -> FlatStates:
    """Describe the arrays of a ZeRO-1/2 checkpoint (ZeRO optimizer or ``BF16_Optimizer``).

    Groups in ``skip_groups`` are left to the caller (MoE expert groups, partitioned over fewer
    ranks: :mod:`ucformat.sources.deepspeed.experts`).
    """
    first = _key(optim[0].obj, "optimizer_state_dict", optim[0])
    is_bf16_optimizer = "zero_stage" not in first and "loss_scaler" not in first
    states = FlatStates(wrapper="BF16_Optimizer" if is_bf16_optimizer else "DeepSpeedZeroOptimizer")
    param_shapes = model_meta["param_shapes"]
    paddings = first.get("param_alignment_paddings") or [None] * len(param_shapes)
    base0 = _key(first, "base_optimizer_state", optim[0])
    elastic = isinstance(base0, list)
    for g, shapes in enumerate(param_shapes):
        if g in skip_groups:
            continue
        muon = not elastic and _saved_with_muon(base0, g)
        params = _numels(shapes)
        layout = PartitionedFlatLayout.build(params, world_size, paddings[g])
        for name, _ in params:
            states.groups[name] = g
        for rank, handle in enumerate(optim):
            osd = _key(handle.obj, "optimizer_state_dict", handle)
            counts = osd.get("partition_count")
            if counts is not None and int(counts[g]) != world_size:
                raise LayoutMismatchError(
                    f"{handle.path}: partition_count of group {g} is {counts[g]} but the folder "
                    f"has {world_size} ranks' shards; files from different runs are mixed."
                )
            fp32 = _flat_tensor(
                _key(osd, "single_partition_of_fp32_groups", handle)[g], handle, f"fp32 group {g}"
            )
            valid, size = layout.valid_length(rank), layout.partition_size
            _check_length(fp32, valid, size, handle, f"fp32 partition of group {g}")
            base = _key(osd, "base_optimizer_state", handle)
            group_state = base[g] if elastic else base["state"].get(g, {})
            tensors, scalars = _split_state(group_state, handle, f"group {g} state", odd=True)
            fragments = list(layout.fragments(rank))
            wholes = _whole_params_length(fragments, params)
            for key, tensor in list(tensors.items()):
                low = valid if elastic else size
                copies = tensor.numel == wholes and len(tensor.shape) == 1 and not elastic
                if low <= tensor.numel <= size and len(tensor.shape) == 1 and not (muon and copies):
                    continue
                if copies:
                    _add_whole_copies(states, fragments, params, key, tensor, shapes, handle)
                else:
                    states.partition.setdefault(g, {}).setdefault(key, []).append(tensor)
                del tensors[key]
            _record_scalars(states, [n for n, _ in params], scalars, handle)
            _add_fragments(states, fragments, {FP32_STATE: fp32, **tensors}, shapes)
        for key, per_rank in states.partition.get(g, {}).items():
            if len(per_rank) != world_size:
                raise LayoutMismatchError(
                    f"{optim[0].path}: optimizer state '{key}' of group {g} is held by "
                    f"{len(per_rank)} of the {world_size} ranks' shards; shards from different "
                    "runs are mixed."
                )
    if not elastic:
        states.param_groups = [dict(group) for group in base0["param_groups"]]
    return states


def read_zero3_states(
    model_meta: Mapping[str, Any],
    optim: Sequence[TorchFile],
    world_size: int,
    sub_groups: frozenset[int] | None = None,
) -> FlatStates:
    """Describe the arrays of a ZeRO-3 checkpoint (``DeepSpeedZeroOptimizer_Stage3``).

    ``sub_groups``: only these (partitioned over ``optim``'s ranks, e.g. one AutoEP rank's
    expert-data-parallel ranks, so the files' overall ``partition_count`` is not checked).
    """
    states = FlatStates(wrapper="DeepSpeedZeroOptimizer_Stage3")
    sub_group_shapes = model_meta["param_shapes"]
    states.sub_groups = len(sub_group_shapes)
    first = _key(
        _key(optim[0].obj, "optimizer_state_dict", optim[0]), "optimizer_state_dict", optim[0]
    )
    states.param_groups = [dict(group) for group in first["param_groups"]]
    owner = {sg: g for g, group in enumerate(states.param_groups) for sg in group["params"]}
    for sg, shapes in enumerate(sub_group_shapes):
        if sub_groups is not None and sg not in sub_groups:
            continue
        params = _numels(shapes)
        layout = PerParamLayout.build(params, world_size)
        if sg not in owner:
            raise LayoutMismatchError(
                f"{optim[0].path}: sub-group {sg} belongs to no optimizer param group."
            )
        for name, _ in params:
            states.groups[name] = owner[sg]
        for handle in optim:
            osd = _key(handle.obj, "optimizer_state_dict", handle)
            if sub_groups is None and int(osd.get("partition_count", world_size)) != world_size:
                raise LayoutMismatchError(
                    f"{handle.path}: partition_count is {osd['partition_count']} but the folder "
                    f"has {world_size} ranks' shards; files from different runs are mixed."
                )
            flat_groups = _key(osd, "fp32_flat_groups", handle)
            if len(flat_groups) != len(sub_group_shapes):
                raise LayoutMismatchError(
                    f"{handle.path}: {len(flat_groups)} fp32 sub-groups, but param_shapes lists "
                    f"{len(sub_group_shapes)}; the shard does not match its model-states file."
                )
            fp32 = _flat_tensor(flat_groups[sg], handle, f"fp32 sub-group {sg}")
            size = layout.partition_size
            _check_length(fp32, size, size, handle, f"fp32 partition of sub-group {sg}")
            inner = _key(osd, "optimizer_state_dict", handle)
            held = inner["state"].get(sg, {})
            tensors, scalars = _split_state(held, handle, f"sub-group {sg}", odd=True)
            for key, tensor in tensors.items():
                if tensor.numel != size or len(tensor.shape) != 1:
                    raise UnsupportedCheckpointError(
                        f"{handle.path}: optimizer state '{key}' of sub-group {sg} has shape "
                        f"{list(tensor.shape)}, not the partition's [{size}]; ucformat keeps "
                        "states that are not elementwise for ZeRO 0-2 only."
                    )
            _record_scalars(states, [n for n, _ in params], scalars, handle)
            rank = optim.index(handle)
            _add_fragments(
                states, list(layout.fragments(rank)), {FP32_STATE: fp32, **tensors}, shapes
            )
    return states
