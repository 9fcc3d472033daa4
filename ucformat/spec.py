"""Constants of the ucformat store layout (see docs/format.md)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUFFERS_PREFIX",
    "BUFFER_STATE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FP32_STATE",
    "MANIFEST_KEY",
    "PARAMS_PREFIX",
    "STEP_STATE",
    "buffer_array_path",
    "state_array_path",
]

FORMAT_NAME: Final = "ucformat"
#: Major.minor. Readers accept any minor of their major and refuse a newer major.
FORMAT_VERSION = "1.0"
#: Key of the manifest in the store root. Written last; its presence marks the store complete.
MANIFEST_KEY = "ucformat.json"
PARAMS_PREFIX = "params"
BUFFERS_PREFIX = "buffers"
#: State name of the fp32 master weights (frozen params: their losslessly stored values).
FP32_STATE = "fp32"
#: The state name under which readers return a buffer (buffers have no optimizer states).
BUFFER_STATE = "buffer"
#: Optimizer step counter; kept in the manifest as a scalar, never as an array.
STEP_STATE = "step"


def state_array_path(fqn: str, state: str) -> str:
    """Return the zarr path of the array holding ``state`` of parameter ``fqn``."""
    return f"{PARAMS_PREFIX}/{fqn}/{state}"


def buffer_array_path(fqn: str) -> str:
    """Return the zarr path of the array holding buffer ``fqn``."""
    return f"{BUFFERS_PREFIX}/{fqn}"


def shard_object_key(array_path: str, coords: tuple[int, ...]) -> str:
    """The store key of the object holding shard ``coords`` of the array at ``array_path``.

    Every ucformat array declares zarr v3's ``default`` chunk key encoding with separator ``/``
    (docs/format.md §2.1), so the key is ``<path>/c/<i>/<j>...`` (``<path>/c`` for a 0-d array);
    readers compute it without building a zarr array.
    """
    return "/".join([array_path, "c", *map(str, coords)])
