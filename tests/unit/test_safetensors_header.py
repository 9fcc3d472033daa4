"""The safetensors header reader refuses every malformed header in one line naming the file
(and the tensor), and reads valid ones exactly as the format says (no torch, no library)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from ucformat.errors import NotACheckpointError, TruncatedFileError, UnsupportedCheckpointError
from ucformat.sources.safetensors_header import MAX_HEADER_BYTES, read_header


def _write(path: Path, header: Any, data: bytes = b"", raw: bytes | None = None) -> Path:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _error(path: Path, kind: type[Exception] = NotACheckpointError) -> str:
    with pytest.raises(kind) as info:
        read_header(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_valid_header_with_metadata_zero_size_and_padding(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "b": _entry("BF16", [2, 3], 16, 28),
        "a": _entry("F32", [4], 0, 16),
        "empty": _entry("F16", [0, 5], 28, 28),
        "scalar": _entry("I64", [], 28, 36),
    }
    raw = json.dumps(header).encode() + b"   "  # trailing spaces pad the header (allowed)
    path = _write(tmp_path / "m.safetensors", None, bytes(36), raw=raw)
    parsed = read_header(path)
    assert parsed.metadata == {"format": "pt"}
    assert list(parsed.tensors) == ["b", "a", "empty", "scalar"]  # header order
    assert parsed.tensors["b"].dtype == "bfloat16" and parsed.tensors["b"].shape == (2, 3)
    assert parsed.tensors["scalar"].numel == 1 and parsed.data_start == 8 + len(raw)


@pytest.mark.parametrize(
    ("header", "data", "expected"),
    [
        (
            {"a": _entry("F32", [4], 0, 12)},
            12,
            "F32[4] is 16 bytes, but data_offsets [0, 12] hold 12",
        ),
        (
            {"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)},
            12,
            "'b' (bytes 4-12) overlaps 'a'",
        ),
        ({"a": _entry("F32", [2], 4, 12)}, 12, "leaves a hole after the start of the buffer"),
        ({"a": _entry("F32", [2], 0, 8)}, 12, "bytes no tensor holds follow them"),
        ({"a": _entry("F32", [2], 8, 0)}, 8, "end before they begin"),
        ({"a": _entry("F32", [-1], 0, 0)}, 0, "is not a list of non-negative integers"),
        ({"a": _entry("F32", [2.0], 0, 8)}, 8, "is not a list of non-negative integers"),
        ({"a": _entry("F32", [True], 0, 4)}, 4, "is not a list of non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, 4, "is not [begin, end]"),
        ({"a": {"dtype": "F32", "shape": [1]}}, 4, "expected exactly the members"),
        ({"a": {**_entry("F32", [1], 0, 4), "x": 1}}, 4, "expected exactly the members"),
        ({"a": [1, 2]}, 4, "expected exactly the members"),
        ({"__metadata__": {"k": 1}}, 0, "must map strings to strings"),
        ({"": _entry("F32", [1], 0, 4)}, 4, "a tensor without a name"),
        ([1, 2], 0, "must be a JSON object starting with"),
    ],
)
def test_malformed_headers_are_refused_naming_the_problem(
    tmp_path: Path, header: Any, data: int, expected: str
) -> None:
    assert expected in _error(_write(tmp_path / "m.safetensors", header, bytes(data)))


def test_unknown_and_unstorable_dtypes_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.safetensors", {"w": _entry("F8_E4M3", [4], 0, 4)}, bytes(4))
    message = _error(path, UnsupportedCheckpointError)
    assert "tensor 'w'" in message and "F8_E4M3" in message and "BF16" in message


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}',  # duplicate
        b'{"a": NaN}',
        b"{\xff}",
        b'{"a": ',
    ],
)
def test_invalid_json_is_refused(tmp_path: Path, raw: bytes) -> None:
    message = _error(_write(tmp_path / "m.safetensors", None, bytes(4), raw=raw))
    assert "not valid JSON" in message


def test_lengths_past_the_file_or_the_limit_are_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x00")
    assert "8-byte header length" in _error(short, TruncatedFileError)
    long = tmp_path / "long.safetensors"
    long.write_bytes(struct.pack("<Q", 1000) + b"{}")
    assert "only 2 after its length" in _error(long, TruncatedFileError)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    assert "more than the 100000000" in _error(huge)
    truncated = _write(tmp_path / "t.safetensors", {"a": _entry("F32", [4], 0, 16)}, bytes(8))
    assert "the file is truncated" in _error(truncated, TruncatedFileError)
