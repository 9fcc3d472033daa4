"""Constants of the ucformat store layout (see docs/format.md)."""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "BUFFERS_PREFIX",
    "BUFFER_STATE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FP32_STATE",
    "MANIFEST_KEY",
    "PARAMS_PREFIX",
    "KNOWN_MINOR",
    "STACKED_VERSION",
    "STACKS_PREFIX",
    "STACK_SEPARATOR",
    "STEP_STATE",
    "VALUE_STATE",
    "MAX_NAME_BYTES",
    "buffer_array_path",
    "is_stacked_version",
    "name_problem",
    "shard_object_key",
    "stack_array_path",
    "stack_number",
    "state_array_path",
]

FORMAT_NAME: Final = "ucformat"
#: The newest major.minor this implementation writes (docs/format.md §5). Readers accept any
#: minor of a major they know and refuse a newer major. 3.1 adds stacks (§2.5) and optional
#: members (``manifest.megatron``'s layouts; optimizer states that are not elementwise: §5.4).
FORMAT_VERSION = "3.1"
#: The first version whose arrays are stacks (§2.5): several logical arrays of one layout in
#: one zarr array, under ``stacks/<n>``, chunk keys separated by ``.``. Older versions store
#: one array per (parameter, state) at its own path, chunk keys separated by ``/``.
STACKED_VERSION = "3.1"
#: Per major this implementation reads: the newest minor whose members it knows. A manifest of
#: a newer minor may hold members it does not know; they are ignored, and digested (§3.7, §5).
#: Format 1 differs from 2 only in its digest rule and in the state name of frozen parameters;
#: format 3 from 2 only in its chunk shapes; 3.1 from 3.0 in its stacks (§5.4).
KNOWN_MINOR: dict[int, int] = {1: 0, 2: 1, 3: 1}
#: Key of the manifest in the store root. Written last; its presence marks the store complete.
MANIFEST_KEY = "ucformat.json"
PARAMS_PREFIX = "params"
BUFFERS_PREFIX = "buffers"
#: State name of the fp32 master weights of trainable parameters. Readers also answer it for
#: a frozen parameter, with its value upcast to float32 (format 1 stored that value under it).
FP32_STATE = "fp32"
#: The state name under which readers return a buffer (buffers have no optimizer states).
BUFFER_STATE = "buffer"
#: State name of a frozen parameter's value, stored in the parameter's own dtype (format 2).
VALUE_STATE = "value"
#: Optimizer step counter; kept in the manifest as a scalar, never as an array.
STEP_STATE = "step"
#: The group holding every stack of a format-3.1 store (§2.5).
STACKS_PREFIX = "stacks"
#: The chunk key separator of stacks (zarr v3 ``default`` encoding): shard ``(i, j)`` of the
#: stack ``stacks/3`` is the object ``stacks/3/c.i.j``.
STACK_SEPARATOR = "."
_STACK_PATH = re.compile(r"stacks/(0|[1-9][0-9]{0,8})\Z")


def is_stacked_version(version: str) -> bool:
    """Whether a store of ``version`` (``MAJOR.MINOR``) keeps its arrays in stacks (§2.5)."""
    major, _, minor = version.partition(".")
    return (int(major), int(minor or 0)) >= (3, 1)


def stack_array_path(number: int) -> str:
    """The zarr path of stack ``number`` (``stacks/<n>``)."""
    return f"{STACKS_PREFIX}/{number}"


def stack_number(path: str) -> int | None:
    """The ``n`` of a stack path ``stacks/<n>`` (decimal, no leading zeros), else None."""
    match = _STACK_PATH.match(path)
    return None if match is None else int(match.group(1))


def state_array_path(fqn: str, state: str) -> str:
    """Return the zarr path of the array holding ``state`` of parameter ``fqn``."""
    return f"{PARAMS_PREFIX}/{fqn}/{state}"


def buffer_array_path(fqn: str) -> str:
    """Return the zarr path of the array holding buffer ``fqn``."""
    return f"{BUFFERS_PREFIX}/{fqn}"


def shard_object_key(array_path: str, coords: tuple[int, ...], separator: str = "/") -> str:
    """The store key of the object holding shard ``coords`` of the array at ``array_path``.

    Every ucformat array declares zarr v3's ``default`` chunk key encoding (docs/format.md
    §2.1): with separator ``/`` (format 3.0 and older) the key is ``<path>/c/<i>/<j>...``
    (``<path>/c`` for a 0-d array), with ``.`` (stacks, §2.5) ``<path>/c.<i>.<j>...``; readers
    compute it without building a zarr array.
    """
    return f"{array_path}/" + separator.join(["c", *map(str, coords)])


#: A name is one key component; local stores make it a file name, and file systems allow 255.
MAX_NAME_BYTES = 255
_STATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FORBIDDEN = re.compile(r"[/\\\x00-\x1f\x7f]")


def name_problem(name: str, kind: str) -> str | None:
    """Why ``name`` may not name a ``kind`` (``"parameter"``, ``"buffer"`` or ``"state"``), or
    None when docs/format.md §2.4 admits it.

    Parameter and buffer names are ``.``-separated non-empty components of Unicode characters
    other than ``/``, ``\\`` and control characters, not starting with ``__`` and not
    ``zarr.json``, at most :data:`MAX_NAME_BYTES` bytes of UTF-8; state names are identifiers
    (``[A-Za-z_][A-Za-z0-9_]*``) other than ``step``. The key is the name's UTF-8, unescaped.
    """
    if kind == "state":
        if not _STATE_NAME.match(name):
            return "a state name must be an identifier ([A-Za-z_][A-Za-z0-9_]*)"
        if name == STEP_STATE:
            return f"'{STEP_STATE}' is a scalar state, never an array"
        return None
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it holds a lone surrogate, which is not a Unicode character"
    if not name or "" in name.split("."):
        return "it has an empty '.'-separated component"
    if _FORBIDDEN.search(name):
        return "it holds '/', '\\' or a control character"
    if name.startswith("__"):
        return "zarr reserves names starting with '__'"
    if name == "zarr.json":
        return "it is the name of zarr's metadata objects"
    if size > MAX_NAME_BYTES:
        return f"it is {size} bytes of UTF-8, more than {MAX_NAME_BYTES}"
    return None
