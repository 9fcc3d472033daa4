"""A safetensors file's header, read and checked as untrusted input (no pickle, no library).

The format (huggingface/safetensors, README "Format"): an 8-byte little-endian unsigned ``N``,
then ``N`` bytes of UTF-8 JSON (the header), then the byte buffer. The header is an object
``{name: {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}`` with an
optional ``"__metadata__"`` object of string values; offsets are relative to the buffer.

What is checked before any tensor byte is trusted (one :class:`~ucformat.errors.UCFormatError`
line naming the file, and the tensor where there is one):

1. the file holds the 8 length bytes and the whole header; the header is at most
   :data:`MAX_HEADER_BYTES` (the reference implementation's limit), starts with ``{``, is
   UTF-8 JSON without duplicate members, ``NaN`` or ``Infinity``;
2. every entry has exactly ``dtype``, ``shape`` and ``data_offsets``; the dtype is one a store
   can hold (:data:`DTYPES`; others, e.g. ``F8_E4M3``, are refused by name); dimensions and
   offsets are non-negative integers, ``begin <= end``;
3. ``end - begin`` is the tensor's byte size (elements x item size);
4. sorted by offset, the tensors tile the buffer exactly: the first starts at 0, each starts
   where the previous ends (no overlap, no hole), the last ends at the end of the file (no
   trailing bytes), as the reference implementation requires (no polyglot files).

Pure apart from reading the header bytes: :func:`read_header` opens the file, reads ``8 + N``
bytes and closes it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucformat.errors import NotACheckpointError, TruncatedFileError, UnsupportedCheckpointError
from ucformat.format.dtypes import itemsize

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "SafetensorsFile",
    "TensorEntry",
    "parse_header",
    "read_header",
]

#: safetensors dtype names -> the manifest's dtype names (what a store can hold).
DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
#: The largest header the reference implementation reads (100 MB).
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
_LENGTH = struct.Struct("<Q")
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype (manifest name), shape, and its bytes
    ``[begin, end)`` relative to the buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsFile:
    """A checked header: where the buffer starts in the file, the tensors in header order,
    and the ``__metadata__`` strings."""

    path: Path
    size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> SafetensorsFile:
    """Read and check ``path``'s header (see the module docstring).

    Raises:
        SourceNotFoundError: (``FileNotFoundError``) no such file.
        TruncatedFileError: the file ends before its header does.
        NotACheckpointError: the header is not a valid safetensors header.
        UnsupportedCheckpointError: a tensor's dtype cannot be stored.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _LENGTH.size, 0)
        if len(head) < _LENGTH.size:
            raise TruncatedFileError(
                f"{path}: {size} bytes; a safetensors file starts with an 8-byte header length."
            )
        (length,) = _LENGTH.unpack(head)
        _check_length(path, length, size)
        header = os.pread(fd, length, _LENGTH.size)
    finally:
        os.close(fd)
    if len(header) < length:
        raise TruncatedFileError(f"{path}: the file ended inside its safetensors header.")
    return parse_header(path, header, size)


def _check_length(path: Path, length: int, size: int) -> None:
    if length > MAX_HEADER_BYTES:
        raise NotACheckpointError(
            f"{path}: safetensors header of {length} bytes, more than the {MAX_HEADER_BYTES} "
            "a safetensors reader accepts; not a safetensors file, or a damaged one."
        )
    if _LENGTH.size + length > size:
        raise TruncatedFileError(
            f"{path}: the safetensors header says it is {length} bytes, but the file has only "
            f"{size - _LENGTH.size} after its length; the file is truncated or not safetensors."
        )


def parse_header(path: Path, header: bytes, size: int) -> SafetensorsFile:
    """Check the header bytes of a file of ``size`` bytes (see the module docstring).

    Raises:
        NotACheckpointError: the header is not a valid safetensors header.
        UnsupportedCheckpointError: a tensor's dtype cannot be stored.
        TruncatedFileError: the header is longer than the file allows.
    """
    _check_length(path, len(header), size)
    if not header.startswith(b"{"):
        raise NotACheckpointError(
            f"{path}: the safetensors header must be a JSON object starting with '{{'; found "
            f"{header[:16]!r}; not a safetensors file."
        )
    document = _json(path, header)
    if not isinstance(document, dict):
        raise NotACheckpointError(f"{path}: the safetensors header is not a JSON object.")
    metadata = _metadata(path, document.pop(METADATA_KEY, {}))
    tensors = {name: _entry(path, name, value) for name, value in document.items()}
    _check_tiling(path, tensors, size - _LENGTH.size - len(header))
    return SafetensorsFile(path, size, _LENGTH.size + len(header), tensors, metadata)


def _json(path: Path, header: bytes) -> Any:
    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"member '{key}' appears twice")
            out[key] = value
        return out

    try:
        text = header.decode("utf-8")
        return json.loads(text, object_pairs_hook=unique, parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:160]
        raise NotACheckpointError(
            f"{path}: the safetensors header is not valid JSON ({reason}); the file is damaged "
            "or not safetensors."
        ) from None


def _metadata(path: Path, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise NotACheckpointError(
            f"{path}: the safetensors '{METADATA_KEY}' must map strings to strings; found "
            f"{json.dumps(value)[:80]}."
        )
    return dict(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, value: Any) -> TensorEntry:
    where = f"{path}: tensor '{name}'"
    if not name:
        raise NotACheckpointError(f"{path}: the safetensors header has a tensor without a name.")
    if not isinstance(value, dict) or set(value) != _ENTRY_KEYS:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise NotACheckpointError(
            f"{where}: expected exactly the members data_offsets, dtype, shape; found {found}."
        )
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in DTYPES:
        raise UnsupportedCheckpointError(
            f"{where}: dtype {str(dtype)[:24]} cannot be stored in a ucformat store; supported "
            f"safetensors dtypes: {', '.join(DTYPES)}."
        )
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise NotACheckpointError(
            f"{where}: shape {json.dumps(shape)[:80]} is not a list of non-negative integers."
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise NotACheckpointError(
            f"{where}: data_offsets {json.dumps(offsets)[:80]} is not [begin, end] of "
            "non-negative integers."
        )
    begin, end = offsets
    if begin > end:
        raise NotACheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin.")
    entry = TensorEntry(DTYPES[dtype], tuple(shape), begin, end)
    expected = entry.numel * itemsize(entry.dtype)
    if end - begin != expected:
        raise NotACheckpointError(
            f"{where}: {dtype}{list(shape)} is {expected} bytes, but data_offsets [{begin}, "
            f"{end}] hold {end - begin}; the header is damaged."
        )
    return entry


def _by_offset(tensors: dict[str, TensorEntry]) -> Iterator[tuple[str, TensorEntry]]:
    return iter(sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)))


def _check_tiling(path: Path, tensors: dict[str, TensorEntry], buffer: int) -> None:
    at, previous = 0, ""
    for name, entry in _by_offset(tensors):
        if entry.begin != at:
            what = "overlaps" if entry.begin < at else "leaves a hole after"
            other = f"'{previous}'" if previous else "the start of the buffer"
            raise NotACheckpointError(
                f"{path}: tensor '{name}' (bytes {entry.begin}-{entry.end}) {what} {other} "
                f"(which ends at {at}); safetensors tensors must tile the buffer exactly."
            )
        at, previous = entry.end, name
    if at != buffer:
        raise (TruncatedFileError if at > buffer else NotACheckpointError)(
            f"{path}: the tensors end at byte {at} of the buffer, which has {buffer} bytes; "
            + (
                "the file is truncated."
                if at > buffer
                else "bytes no tensor holds follow them (not a plain safetensors file)."
            )
        )
