"""Pieces shared by every export target: options, destinations, progress and results.

Nothing here knows a target format. Each target module plans what to write from the manifest
alone (pure, so ``--dry-run`` and unit tests need no tensor bytes), then executes the plan by
streaming reads through :class:`~ucformat.read.checkpoint.UniversalCheckpoint`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ucformat.errors import UnsupportedExportError
from ucformat.read.checkpoint import UniversalCheckpoint, open_checkpoint
from ucformat.store.keys import StoreLike

__all__ = [
    "ExportHooks",
    "ExportResult",
    "Stopwatch",
    "open_store_arg",
    "parse_dtype",
    "parse_size",
]

_DTYPES: dict[str, str] = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS: dict[str, int] = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


@dataclass
class ExportHooks:
    """Progress callbacks (all optional).

    ``on_plan(total_bytes)`` is called once, before anything is written; ``on_bytes(n)`` after
    each ``n`` tensor bytes written.
    """

    on_plan: Callable[[int], None] | None = None
    on_bytes: Callable[[int], None] | None = None

    def plan(self, total: int) -> None:
        """Report the total payload."""
        if self.on_plan is not None:
            self.on_plan(total)

    def advance(self, count: int) -> None:
        """Report ``count`` more bytes written."""
        if self.on_bytes is not None and count:
            self.on_bytes(count)


@dataclass
class ExportResult:
    """What an export wrote (or, for a dry run, would write).

    Attributes:
        target: ``"safetensors"``, ``"deepspeed-universal"``, ``"deepspeed"`` or ``"dcp"``.
        out: the destination folder.
        files: paths relative to ``out``, in writing order.
        nbytes: tensor payload bytes.
        dry_run: nothing was written.
        seconds: wall time.
        summary: one line describing the result.
        notes: things the target cannot carry, said once each (never silently dropped).
    """

    target: str
    out: Path | str  # a str for a URL destination
    files: list[str]
    nbytes: int
    dry_run: bool
    seconds: float
    summary: str
    notes: list[str] = field(default_factory=list)


class Stopwatch:
    """Wall time since construction."""

    def __init__(self) -> None:
        self._started = time.perf_counter()

    @property
    def seconds(self) -> float:
        """Seconds elapsed."""
        return time.perf_counter() - self._started


def open_store_arg(store: StoreLike | UniversalCheckpoint) -> UniversalCheckpoint:
    """Open ``store`` unless it is already an opened checkpoint."""
    return store if isinstance(store, UniversalCheckpoint) else open_checkpoint(store)


def parse_dtype(value: str | torch.dtype | None) -> str | None:
    """Manifest dtype name (``float32``/``float16``/``bfloat16``) of a user's dtype choice."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    name = _DTYPES.get(value.lower())
    if name is None:
        raise UnsupportedExportError(
            f"dtype {value!r} is not an export dtype; expected one of fp32, fp16, bf16."
        )
    return name


def parse_size(value: str | int) -> int:
    """Bytes of a size such as ``5GB`` (10**9), ``500MiB`` (2**20) or ``1000`` (bytes)."""
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if match is None:
            raise UnsupportedExportError(
                f"size {value!r} is not understood; expected e.g. 5GB, 500MB, 2GiB or a byte count."
            )
        number, unit = match.groups()
        size = int(float(number) * _UNITS[(unit or "").upper()])
    if size < 1:
        raise UnsupportedExportError(f"size {value!r} must be at least one byte.")
    return size
