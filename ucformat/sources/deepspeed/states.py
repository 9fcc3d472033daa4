"""Map DeepSpeed's flat optimizer partitions onto per-parameter arrays (ZeRO-1/2 and ZeRO-3).

Trust ``param_shapes`` and the partition formulas of :mod:`ucformat.layout.partition`, not
DeepSpeed's ``param_slice_mappings`` (wrong with ``round_robin_gradients``). Every tensor length
found in a shard is checked against the layout, so a wrong assumption fails loudly instead of
shifting values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ucformat.errors import LayoutMismatchError, NotACheckpointError
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
    state: Mapping[str, Any], handle: TorchFile, where: str
) -> tuple[dict[str, TensorRef], dict[str, ScalarState]]:
    arrays, scalars = split_state(state, f"{handle.path}: {where}")
    if FP32_STATE in arrays:
        raise LayoutMismatchError(f"{handle.path}: optimizer state key '{FP32_STATE}' is reserved.")
    return arrays, scalars


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
            tensors, scalars = _split_state(group_state, handle, f"group {g} state")
            for key, tensor in tensors.items():
                low = valid if elastic else size
                _check_length(tensor, low, size, handle, f"state '{key}' of group {g}")
            _record_scalars(states, [n for n, _ in params], scalars, handle)
            _add_fragments(
                states, list(layout.fragments(rank)), {FP32_STATE: fp32, **tensors}, shapes
            )
    if not elastic:
        states.param_groups = [dict(group) for group in base0["param_groups"]]
    return states


def read_zero3_states(
    model_meta: Mapping[str, Any], optim: Sequence[TorchFile], world_size: int
) -> FlatStates:
    """Describe the arrays of a ZeRO-3 checkpoint (``DeepSpeedZeroOptimizer_Stage3``)."""
    states = FlatStates(wrapper="DeepSpeedZeroOptimizer_Stage3")
    sub_group_shapes = model_meta["param_shapes"]
    states.sub_groups = len(sub_group_shapes)
    first = _key(
        _key(optim[0].obj, "optimizer_state_dict", optim[0]), "optimizer_state_dict", optim[0]
    )
    states.param_groups = [dict(group) for group in first["param_groups"]]
    owner = {sg: g for g, group in enumerate(states.param_groups) for sg in group["params"]}
    for sg, shapes in enumerate(sub_group_shapes):
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
            if int(osd.get("partition_count", world_size)) != world_size:
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
            tensors, scalars = _split_state(inner["state"].get(sg, {}), handle, f"sub-group {sg}")
            for key, tensor in tensors.items():
                _check_length(tensor, size, size, handle, f"state '{key}' of sub-group {sg}")
            _record_scalars(states, [n for n, _ in params], scalars, handle)
            rank = optim.index(handle)
            _add_fragments(
                states, list(layout.fragments(rank)), {FP32_STATE: fp32, **tensors}, shapes
            )
    return states
