"""What a Megatron-LM checkpoint holds beside the model and optimizer, as client state.

``common.pt`` keeps ``iteration``, ``checkpoint_version``, ``num_floating_point_operations_so_far``,
``opt_param_scheduler`` and Megatron-LM's ``args`` (an ``argparse.Namespace``: kept as the map of
its attributes); the RNG states are ShardedObjects ``rng_state/shard_<pp>.<tp>_<PP>.<TP>`` (per
pipeline x tensor rank, a list over data-parallel ranks of ``{"random_rng_state",
"np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}``).

Client state is exact JSON (docs/format.md §3.6). The RNG states are kept under ``rng_state`` as
``{"<pp>.<tp>": [...]}``, each state's arrays as lists of their integers: numpy's MT19937 key
(uint32) and torch's generator states (uint8), read from the pickles' raw bytes, nothing run.
Whatever has no exact form is listed as unrepresentable by key and type.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

from ucformat.format.models import ClientState
from ucformat.format.training_values import NotStored, encode_client_state
from ucformat.sources.megatron.files import MegatronFiles, attributes
from ucformat.sources.safe_unpickle import StandIn
from ucformat.sources.torchfile import TensorRef

__all__ = ["client_state"]

_RNG = re.compile(r"^rng_state/shard_([\d.]+)_[\d.]+$")
#: numpy dtype codes of the arrays an RNG state holds, and their widths.
_INT_CODES = {
    "u1": (1, False),
    "u4": (4, False),
    "i4": (4, True),
    "u8": (8, False),
    "i8": (8, True),
}


def client_state(files: MegatronFiles) -> ClientState:
    """``common.pt``'s values but the optimizer's, and the RNG states, as client state."""
    items: list[tuple[str, Any]] = []
    for key, value in files.common.items():
        if key in ("optimizer", "content_metadata"):
            continue
        items.append((key, attributes(value) if key == "args" else _plain(value)))
    rng: dict[str, Any] = {}
    for key in files.objects():
        match = _RNG.match(key)
        if match:
            rng[match.group(1)] = _plain(_unwrap(files.value(key)))
    if rng:
        items.append(("rng_state", rng))
    return encode_client_state(items)


def _unwrap(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _plain(value: Any) -> Any:
    """``value`` with tensors and numpy arrays as lists of their integers (where exact)."""
    if isinstance(value, TensorRef):
        if value.dtype_name == "uint8" or value.numel > 1:
            return _tensor_list(value)
        return value
    if isinstance(value, StandIn):
        decoded = _ndarray(value)
        return decoded if decoded is not None else value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _tensor_list(value: TensorRef) -> Any:
    if not value.dtype_name.startswith(("uint", "int")):
        return NotStored(f"tensor {value.dtype_name}{list(value.shape)}")
    return value.load().flatten().tolist()


def _ndarray(value: StandIn) -> list[int] | None:
    """A pickled 1-D integer numpy array's values, from its ``__setstate__`` tuple."""
    if not value.ucformat_qualname.endswith("multiarray._reconstruct"):
        return None
    state = value.__dict__.get("_state")
    if not isinstance(state, tuple) or len(state) != 5:
        return None
    _, shape, dtype, _, raw = state
    code = _dtype_code(dtype)
    if code not in _INT_CODES or not isinstance(raw, (bytes, bytearray)) or len(shape) != 1:
        return None
    width, signed = _INT_CODES[code]
    order = "big" if _byte_order(dtype) == ">" else "little"
    if len(raw) != shape[0] * width:
        return None
    return list(_ints(bytes(raw), width, signed, order))


def _dtype_code(dtype: Any) -> str:
    args = dtype.__dict__.get("_init_args", ()) if isinstance(dtype, StandIn) else ()
    return str(args[0]) if args else ""


def _byte_order(dtype: Any) -> str:
    state = dtype.__dict__.get("_state") if isinstance(dtype, StandIn) else None
    if isinstance(state, tuple) and len(state) > 1 and state[1] in "<>|=":
        return "<" if state[1] in "|=" and sys.byteorder == "little" else str(state[1])
    return "<"


def _ints(raw: bytes, width: int, signed: bool, order: str) -> Iterator[int]:
    for at in range(0, len(raw), width):
        yield int.from_bytes(raw[at : at + width], order, signed=signed)  # type: ignore[arg-type]
