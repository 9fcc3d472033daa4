"""Read an optimizer state DeepSpeed saved by position (ZeRO stage 0), named and proven.

Without ZeRO, DeepSpeed 0.19.8 saves ``engine.optimizer.state_dict()`` whole in the model
states (``optimizer``; native MoE: in each ``expp_rank_{e}`` file) in one of three forms:

* a bare torch optimizer (fp32 training): ``{'state': {position: {...}}, 'param_groups': [...]}``,
  every state parameter-shaped (the module weight is the fp32 master);
* ``FP16_UnfusedOptimizer`` (fp16 with a non-fused optimizer, or "DDP bf16"): that dict under
  ``optimizer_state_dict`` plus ``fp32_groups`` (per group, one fp32 master per position) and
  the loss scale (``cur_scale``, ``cur_iter``, ...);
* ``FP16_Optimizer`` (fp16 with FusedAdam): one flat fp32 master per group
  (``fp32_groups_flat``), the inner state keyed by group, ``clip_grad`` and the loss scale.

Positions carry no names. :mod:`ucformat.layout.positions` names them from the evidence the
files hold: each position's shape, and where a master of another dtype exists, the digest of
the master rounded to the training dtype (round to nearest even, as DeepSpeed's
``copy_`` into the 16-bit weight does), which must equal the digest of one module weight's
bytes. ``FP16_Optimizer``'s flat masters are cut into parameters by the same digests. The
fp32 masters are the stored ``fp32`` arrays, the states are sliced per parameter (a state of
another shape than its parameter's, e.g. Adafactor's row and column factors or a 1-element
tensor, is kept whole as saved: format 3.1 ``whole_states``); module weights no position takes
are parameters outside the optimizer (frozen).

Nothing is executed from the pickles; module weights and masters are read for the digests
(once each), everything else stays on disk until the writer copies it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from ucformat.errors import LayoutMismatchError, NotACheckpointError, UnsupportedCheckpointError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.models import LossScaler, ScalarState
from ucformat.format.spec import FP32_STATE
from ucformat.format.training_values import encode_exact
from ucformat.layout.positions import Candidate, Slot, match_positions, segment_flat
from ucformat.sources.base import ArraySource, SourceFragment, scalar_state
from ucformat.sources.deepspeed.states import FlatStates
from ucformat.sources.torchfile import TensorRef, TorchFile

__all__ = [
    "LOSS_SCALE_KEYS",
    "loss_scale_config",
    "PositionalOptimizer",
    "decode_positional",
    "module_weights",
    "read_positional",
]

#: The loss-scale entries of an fp16 wrapper's ``state_dict()`` (its ``LossScaleConfig``).
LOSS_SCALE_KEYS = (
    "dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
    "scale_window",
)  # fmt: skip
#: The wrapper class of each form, by the key of its masters.
_WRAPPERS = {"fp32_groups_flat": "FP16_Optimizer", "fp32_groups": "FP16_UnfusedOptimizer"}


@dataclass
class PositionalOptimizer:
    """One positional optimizer state, decoded (no tensor bytes read).

    Attributes:
        wrapper: ``FP16_Optimizer``, ``FP16_UnfusedOptimizer``, or ``none`` (bare optimizer).
        inner: the torch optimizer's ``state_dict()`` (``state``, ``param_groups``).
        masters: per group: its flat master (``FP16_Optimizer``), its masters in position
            order (``FP16_UnfusedOptimizer``), or None (bare: the weights are the masters).
        loss_scale: the wrapper's loss-scale entries (:data:`LOSS_SCALE_KEYS`), if any.
        clip_grad: ``FP16_Optimizer``'s gradient clipping, if recorded.
    """

    wrapper: str
    inner: Mapping[str, Any]
    masters: list[Any]
    loss_scale: dict[str, Any] = field(default_factory=dict)
    clip_grad: float | None = None


def decode_positional(obj: Any, handle: TorchFile) -> PositionalOptimizer:
    """The positional optimizer state ``obj`` (the model states' ``optimizer`` entry).

    Raises:
        NotACheckpointError: ``obj`` is none of the three forms.
    """
    if isinstance(obj, Mapping):
        for key, wrapper in _WRAPPERS.items():
            if key in obj:
                inner = _check_inner(obj.get("optimizer_state_dict"), handle)
                clip = obj.get("clip_grad")
                return PositionalOptimizer(
                    wrapper=wrapper,
                    inner=inner,
                    masters=list(obj[key]),
                    loss_scale={k: obj[k] for k in LOSS_SCALE_KEYS if k in obj},
                    clip_grad=float(clip) if isinstance(clip, (int, float)) else None,
                )
        if "state" in obj and "param_groups" in obj:
            inner = _check_inner(obj, handle)
            return PositionalOptimizer("none", inner, [None] * len(inner["param_groups"]))
    raise NotACheckpointError(
        f"{handle.path}: its 'optimizer' entry is not a torch optimizer's state_dict nor a "
        "DeepSpeed FP16_Optimizer's or FP16_UnfusedOptimizer's; not a DeepSpeed checkpoint "
        "ucformat can read."
    )


def loss_scale_config(entries: Mapping[str, Any]) -> LossScaler:
    """The manifest's loss scaler from an fp16 wrapper's loss-scale entries (ZeRO-0:
    ``LossScaleConfig``'s attributes, saved flat in its ``state_dict()``)."""
    attributes = {str(k): encode_exact(v, "loss_scaler") for k, v in entries.items()}
    return LossScaler(
        class_name="LossScaleConfig",
        dynamic=bool(entries.get("dynamic_loss_scale", False)),
        cur_scale=float(entries.get("cur_scale", 1.0)),
        attributes=attributes,
    )


def _check_inner(inner: Any, handle: TorchFile) -> Mapping[str, Any]:
    if not (
        isinstance(inner, Mapping)
        and isinstance(inner.get("state"), Mapping)
        and isinstance(inner.get("param_groups"), list)
    ):
        raise NotACheckpointError(
            f"{handle.path}: the optimizer state has no 'state' and 'param_groups'; not a "
            "torch optimizer's state_dict."
        )
    return inner


def module_weights(
    module: Mapping[str, Any], buffer_names: Sequence[str]
) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """The parameters of a ``module`` state dict in module order, and its tied aliases.

    A name whose tensor is the very storage slice of an earlier name's (``torch.save`` keeps
    tensors that share storage shared) is a tied alias of that name: ``{alias: owner}``.
    """
    skip = set(buffer_names)
    seen: dict[tuple[Any, ...], str] = {}
    weights: dict[str, TensorRef] = {}
    tied: dict[str, str] = {}
    for name, value in module.items():
        if name in skip or not isinstance(value, TensorRef):
            continue
        identity = (value.storage.key, value.offset, value.shape, value.stride)
        if identity in seen:
            tied[str(name)] = seen[identity]
            continue
        seen[identity] = str(name)
        weights[str(name)] = value
    return weights, tied


def _lp_bytes(values: np.ndarray, lp_dtype: str) -> bytes:
    """fp32 ``values`` rounded to the training dtype (nearest even), as its bytes."""
    if lp_dtype == "float16":
        return values.astype(np.float16).tobytes()
    bits = values.view(np.uint32).astype(np.uint64)  # bfloat16: keep the high half, rounded
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    return rounded.tobytes()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _read(ref: TensorRef, start: int, numel: int) -> np.ndarray:
    out = np.empty(numel, dtype=numpy_storage_dtype(ref.dtype_name))
    ref.read_into(out, start, start + numel)
    return out


def _master_key(ref: TensorRef, start: int, numel: int, lp_dtype: str, where: str) -> str:
    if ref.dtype_name != "float32":
        raise LayoutMismatchError(f"{where}: an fp32 master is {ref.dtype_name}.")
    return _digest(_lp_bytes(_read(ref, start, numel), lp_dtype))


@dataclass
class PositionalRead:
    """What :func:`read_positional` recovers: the named states, and the weights no position
    took (parameters outside the optimizer)."""

    flat: FlatStates
    unplaced: list[str]


def read_positional(
    opt: PositionalOptimizer,
    weights: Mapping[str, TensorRef],
    train_dtype: str,
    handle: TorchFile,
    group_names: Callable[[Mapping[str, Any]], Collection[str] | None] | None = None,
) -> PositionalRead:
    """Name every position of ``opt`` among ``weights`` (module order) and describe its arrays.

    ``group_names(param_group)`` may say which names a param group can hold (None: any).

    Raises:
        LayoutMismatchError: the files contradict each other (a master matching no weight, a
            state of the wrong length).
        UnsupportedCheckpointError: the files leave the naming ambiguous (the message names the
            parameters), or a state this reader cannot place.
    """
    where = str(handle.path)
    keyed = opt.wrapper != "none" and train_dtype != "float32"
    candidates = [
        Candidate(
            name,
            ref.shape,
            _digest(_read(ref, 0, ref.numel).tobytes()) if keyed and ref.is_contiguous() else None,
        )
        for name, ref in weights.items()
    ]
    flat = FlatStates(wrapper=opt.wrapper)
    flat.param_groups = [dict(group) for group in opt.inner["param_groups"]]
    state = opt.inner["state"]
    if opt.wrapper == "FP16_Optimizer":
        claimed: set[str] = set()
        for g, master in enumerate(opt.masters):
            if not isinstance(master, TensorRef) or len(master.shape) != 1:
                raise LayoutMismatchError(f"{where}: fp32_groups_flat[{g}] is not a 1-D tensor.")

            def key_at(offset: int, numel: int, m: TensorRef = master) -> str:
                return _master_key(m, offset, numel, train_dtype, where)

            names = group_names(flat.param_groups[g]) if group_names is not None else None
            allowed = [c for c in candidates if names is None or c.name in names]
            cuts = segment_flat(g, master.numel, allowed, key_at, claimed, where)
            positions = list(flat.param_groups[g].get("params", [g]))
            group_state = state.get(positions[0], {}) if positions else {}
            _add_flat_group(flat, g, master, cuts, weights, group_state, where)
        return PositionalRead(flat, [n for n in weights if n not in claimed])
    slots, master_of = _slots(opt, weights, train_dtype, where, group_names)
    placed = match_positions(slots, candidates, where)
    by_position = {s.position: s for s in slots}
    for position in sorted(placed, key=lambda p: (by_position[p].group, p)):
        name = placed[position]
        group = by_position[position].group
        shape = weights[name].shape
        master = master_of.get(position, weights[name])
        if master.shape != shape:
            raise LayoutMismatchError(
                f"{where}: the fp32 master at position {position} has shape {list(master.shape)}"
                f", its parameter '{name}' {list(shape)}."
            )
        flat.groups[name] = group
        flat.arrays[name] = {FP32_STATE: _whole(master, shape)}
        flat.scalars[name] = {}
        _add_param_state(flat, name, shape, state.get(position, {}), f"{where}: '{name}'")
    return PositionalRead(flat, [n for n in weights if n not in set(placed.values())])


def _slots(
    opt: PositionalOptimizer,
    weights: Mapping[str, TensorRef],
    train_dtype: str,
    where: str,
    group_names: Callable[[Mapping[str, Any]], Collection[str] | None] | None,
) -> tuple[list[Slot], dict[int, TensorRef]]:
    """One :class:`Slot` per position (bare optimizer, ``FP16_UnfusedOptimizer``)."""
    shapes = {ref.shape for ref in weights.values()}
    state = opt.inner["state"]
    slots: list[Slot] = []
    master_of: dict[int, TensorRef] = {}
    for g, group in enumerate(opt.inner["param_groups"]):
        positions = [int(p) for p in group.get("params", [])]
        names = group_names(group) if group_names is not None else None
        allowed = frozenset(names) if names is not None else None
        masters = opt.masters[g] if g < len(opt.masters) else None
        if masters is not None and len(masters) != len(positions):
            raise LayoutMismatchError(
                f"{where}: group {g} lists {len(positions)} positions but holds "
                f"{len(masters)} fp32 masters."
            )
        for i, position in enumerate(positions):
            key = None
            if masters is not None:
                master = masters[i]
                if not isinstance(master, TensorRef):
                    raise LayoutMismatchError(f"{where}: fp32_groups[{g}][{i}] is not a tensor.")
                master_of[position] = master
                shape: tuple[int, ...] | None = master.shape
                if train_dtype != "float32":
                    key = _master_key(master, 0, master.numel, train_dtype, where)
            else:
                shape = _state_shape(state.get(position, {}), shapes)
            slots.append(Slot(position, g, shape, key, allowed))
    return slots, master_of


def _state_shape(held: Mapping[str, Any], shapes: set[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The parameter shape a position's state shows: its largest tensor whose shape is some
    parameter's (None when no state tensor has a parameter's shape)."""
    found = [v.shape for v in held.values() if isinstance(v, TensorRef) and v.shape in shapes]
    return max(found, key=prod) if found else None


def _whole(tensor: TensorRef, shape: tuple[int, ...]) -> ArraySource:
    array = ArraySource(shape, tensor.dtype_name)
    if tensor.numel:
        array.fragments.append(SourceFragment(tensor, 0, 0, tensor.numel))
    return array


def _add_param_state(
    flat: FlatStates, name: str, shape: tuple[int, ...], held: Mapping[str, Any], where: str
) -> None:
    """A parameter's own optimizer state: parameter-shaped tensors (elementwise), tensors of
    another shape (kept whole), scalars."""
    for key, value in held.items():
        key = str(key)
        if key == FP32_STATE:
            raise LayoutMismatchError(f"{where}: optimizer state key '{FP32_STATE}' is reserved.")
        if isinstance(value, TensorRef) and value.shape == shape:
            flat.arrays[name][key] = _whole(value, shape)
            continue
        if isinstance(value, TensorRef) and value.shape:  # kept whole, as saved (format 3.1)
            flat.whole.setdefault(name, {})[key] = _whole(value, value.shape)
            continue
        flat.scalars[name][key] = _scalar(value, f"{where} state '{key}'")


def _scalar(value: Any, where: str) -> ScalarState:
    try:
        return scalar_state(value, where)
    except TypeError as exc:
        raise LayoutMismatchError(str(exc)) from None


def _add_flat_group(
    flat: FlatStates,
    g: int,
    master: TensorRef,
    cuts: Sequence[tuple[str, int]],
    weights: Mapping[str, TensorRef],
    held: Mapping[str, Any],
    where: str,
) -> None:
    """``FP16_Optimizer`` group ``g``: each parameter's slice of the flat master and states."""
    tensors: dict[str, TensorRef] = {}
    scalars: dict[str, ScalarState] = {}
    for key, value in held.items():
        key = str(key)
        if isinstance(value, TensorRef) and value.shape == master.shape:
            tensors[key] = value
        elif isinstance(value, TensorRef) and value.shape:
            raise UnsupportedCheckpointError(
                f"{where}: optimizer state '{key}' of group {g} has shape {list(value.shape)}, "
                f"not the flat master's {list(master.shape)}; ucformat stores elementwise "
                "states and scalars only."
            )
        else:
            scalars[key] = _scalar(value, f"{where}: group {g} state '{key}'")
    if FP32_STATE in tensors:
        raise LayoutMismatchError(f"{where}: optimizer state key '{FP32_STATE}' is reserved.")
    for name, offset in cuts:
        shape = weights[name].shape
        numel = prod(shape)
        flat.groups[name] = g
        flat.arrays[name] = {}
        for key, tensor in {FP32_STATE: master, **tensors}.items():
            array = ArraySource(shape, tensor.dtype_name)
            if numel:
                array.fragments.append(SourceFragment(tensor, offset, 0, numel))
            flat.arrays[name][key] = array
        flat.scalars[name] = dict(scalars)
