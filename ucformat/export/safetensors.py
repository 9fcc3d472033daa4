"""``ucformat export safetensors``: consolidated weights in the Hugging Face sharded layout.

The replacement for DeepSpeed's ``zero_to_fp32.py`` that does not need the model twice in RAM.

Algorithm:

1. **Plan** (pure, manifest only). One tensor per parameter under its owner fqn (fp32 master
   weights, or frozen values, cast to the chosen dtype) and one per persistent buffer (its own
   dtype). Tied aliases are left out, the way ``transformers`` saves tied weights (it re-ties
   them on load); ``tied="copy"`` writes each alias as its own tensor instead. Tensors are
   cut into shards with Hugging Face's rule: in order, a new shard starts when the next tensor
   would push the current one past ``max_shard_size``; a tensor larger than that gets a shard of
   its own. Each file's safetensors header (8-byte little-endian length, JSON, space padding
   to 8 bytes) is computed here, so every byte offset is known before any data is read.
2. **Execute**. Each file is written into the destination's staging folder
   (``export/destination.py``): header first, then each tensor streamed in pieces of at most
   ``piece_bytes`` (read with ``read_range``, cast, written, dropped). The commit fsyncs the
   files and moves them in, ``model.safetensors.index.json`` last. Peak memory is about two
   pieces, whatever the model size.

One file is named ``model.safetensors``; several are ``model-00001-of-0000N.safetensors`` plus
the index ``{"metadata": {"total_size": ...}, "weight_map": {key: file}}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ucformat.errors import UnsupportedExportError
from ucformat.export.common import (
    ExportHooks,
    ExportResult,
    Stopwatch,
    open_store_arg,
    parse_dtype,
    parse_size,
)
from ucformat.export.destination import (
    file_writes,
    prepare_destination,
    transactional,
    write_bytes,
)
from ucformat.export.hf_names import HF_NAMINGS, NAMINGS, hf_config, hf_tensors
from ucformat.export.url_target import export_to_url, is_url
from ucformat.format.dtypes import itemsize, torch_dtype
from ucformat.format.models import CheckpointManifest
from ucformat.format.spec import BUFFER_STATE, FP32_STATE
from ucformat.format.summary import format_bytes
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.store.keys import StoreLike

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "SafetensorsFile",
    "SafetensorsPlan",
    "TensorItem",
    "export_safetensors",
    "plan_safetensors",
]

SINGLE_NAME = "model.safetensors"
#: Written with ``names="hf-llama"`` / ``"hf-mixtral"`` when the store records the model's
#: shape arguments.
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
DEFAULT_PIECE_BYTES = 64 * 2**20
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass(frozen=True)
class TensorItem:
    """One tensor of the output: where it comes from and where its bytes go."""

    key: str
    #: Store name (owner fqn or buffer fqn) and state (``fp32`` or ``buffer``) to read.
    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    begin: int
    end: int
    #: Flat ``[start, stop)`` ranges of the stored array that make the tensor, in order; None:
    #: the whole array (a renamed split, e.g. ``--names hf-llama``'s q/k/v, has several).
    segments: tuple[tuple[int, int], ...] | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return prod(self.shape)

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The flat ranges to read, in order."""
        return self.segments if self.segments is not None else ((0, self.numel),)


@dataclass(frozen=True)
class SafetensorsFile:
    """One output file: its tensors in byte order and its complete header."""

    filename: str
    items: tuple[TensorItem, ...]
    header: bytes

    @property
    def size(self) -> int:
        """File size in bytes."""
        return len(self.header) + (self.items[-1].end if self.items else 0)


@dataclass(frozen=True)
class SafetensorsPlan:
    """Every file to write, and the index (None for a single file)."""

    files: tuple[SafetensorsFile, ...]
    index: dict[str, object] | None
    dtype: str
    dropped_aliases: dict[str, str]

    @property
    def nbytes(self) -> int:
        """Tensor payload bytes."""
        return sum(item.end - item.begin for f in self.files for item in f.items)

    @property
    def filenames(self) -> list[str]:
        """Files in writing order (index last)."""
        names = [f.filename for f in self.files]
        return [*names, INDEX_NAME] if self.index is not None else names


_Tensor = tuple[str, str, str, tuple[int, ...], str, tuple[tuple[int, int], ...] | None]


def _tensors(
    manifest: CheckpointManifest, dtype: str, tied: str, buffers: bool, names: str = "store"
) -> list[_Tensor]:
    """(key, name, state, shape, dtype, segments) of every output tensor, in module order."""
    if names in HF_NAMINGS:
        return [
            (t.key, t.name, FP32_STATE, t.shape, dtype, t.segments)
            for t in hf_tensors(manifest, names)
        ]
    if names != "store":
        raise UnsupportedExportError(f"names={names!r}; expected one of {', '.join(NAMINGS)}.")
    out: list[_Tensor] = []
    aliases: dict[str, list[str]] = {}
    for alias, owner in manifest.tied.items():
        aliases.setdefault(owner, []).append(alias)
    for name, entry in manifest.params.items():
        kind = dtype if entry.dtype in _FLOATING else entry.dtype
        keys = [name, *aliases.get(name, [])] if tied == "copy" else [name]
        out.extend((key, name, FP32_STATE, tuple(entry.shape), kind, None) for key in keys)
    if buffers:
        for name, buffer in manifest.buffers.items():
            out.append((name, name, BUFFER_STATE, tuple(buffer.shape), buffer.dtype, None))
    return out


def _shards(sizes: list[int], max_size: int) -> list[list[int]]:
    """Hugging Face's greedy split: indices per shard, in order."""
    shards: list[list[int]] = []
    current: list[int] = []
    current_size = 0
    for position, size in enumerate(sizes):
        if size > max_size:
            shards.append([position])
            continue
        if current and current_size + size > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(position)
        current_size += size
    if current:
        shards.append(current)
    return shards


def _header(items: list[TensorItem], metadata: dict[str, str]) -> bytes:
    document: dict[str, object] = {"__metadata__": metadata}
    for item in items:
        document[item.key] = {
            "dtype": _CODES[item.dtype],
            "shape": list(item.shape),
            "data_offsets": [item.begin, item.end],
        }
    body = json.dumps(document, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def plan_safetensors(
    manifest: CheckpointManifest,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tied: Literal["drop", "copy"] = "drop",
    buffers: bool = True,
    names: str = "store",
) -> SafetensorsPlan:
    """Plan the files of a safetensors export from the manifest alone.

    Args:
        manifest: the store's manifest.
        dtype: dtype of floating parameters (``fp32`` default, ``bf16``, ``fp16``); buffers
            keep their own dtype.
        max_shard_size: largest file payload, e.g. ``"5GB"`` (10**9) or ``"2GiB"`` (2**30).
        tied: ``"drop"`` leaves tied aliases out (transformers re-ties them); ``"copy"`` writes
            each alias as its own tensor.
        buffers: include persistent buffers.
        names: ``store`` (the store's names), ``hf-llama`` or ``hf-mixtral`` (a Megatron-Core
            GPT store under Hugging Face Llama / Mixtral names, fused q/k/v and gate/up split:
            :mod:`.hf_names`).
    """
    out_dtype = parse_dtype(dtype) or "float32"
    if tied not in ("drop", "copy"):
        raise UnsupportedExportError(f"tied={tied!r}; expected 'drop' or 'copy'.")
    limit = parse_size(max_shard_size)
    tensors = _tensors(manifest, out_dtype, tied, buffers, names)
    sizes = [prod(shape) * itemsize(kind) for _, _, _, shape, kind, _ in tensors]
    groups = _shards(sizes, limit)
    filenames = (
        [SINGLE_NAME]
        if len(groups) <= 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    files: list[SafetensorsFile] = []
    weight_map: dict[str, str] = {}
    for filename, members in zip(filenames, groups or [[]], strict=True):
        items: list[TensorItem] = []
        offset = 0
        for position in members:
            key, name, state, shape, kind, segments = tensors[position]
            size = sizes[position]
            items.append(TensorItem(key, name, state, shape, kind, offset, offset + size, segments))
            offset += size
            weight_map[key] = filename
        files.append(SafetensorsFile(filename, tuple(items), _header(items, {"format": "pt"})))
    index: dict[str, object] | None = None
    if len(files) > 1:
        total = sum(sizes)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    dropped = {} if tied == "copy" else dict(manifest.tied)
    return SafetensorsPlan(tuple(files), index, out_dtype, dropped)


def _little_endian_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.contiguous()
    bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    array = bits.numpy()
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _write_file(
    ckpt: UniversalCheckpoint, path: Path, plan: SafetensorsFile, piece: int, hooks: ExportHooks
) -> None:
    """Stream one file's tensors into ``path`` (in the staging folder; the commit fsyncs it)."""
    with file_writes(path), open(path, "wb") as handle:
        handle.write(plan.header)
        for item in plan.items:
            step = max(1, piece // max(itemsize(item.dtype), 4))
            target = torch_dtype(item.dtype)
            written = 0
            for first, last in item.ranges():
                for start in range(first, last, step):
                    stop = min(start + step, last)
                    values = ckpt.read_range(item.name, item.state, start, stop).to(target)
                    data = _little_endian_bytes(values)
                    handle.write(data)
                    written += len(data)
                    hooks.advance(len(data))
            if written != item.end - item.begin:
                raise UnsupportedExportError(
                    f"'{item.name}': wrote {written} bytes but planned {item.end - item.begin}; "
                    "the store's arrays disagree with its manifest (run 'ucformat verify')."
                )


def _owned(name: str) -> bool:
    return name in (SINGLE_NAME, INDEX_NAME, CONFIG_NAME) or bool(_SHARD_NAME.match(name))


@transactional
def export_safetensors(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tied: Literal["drop", "copy"] = "drop",
    buffers: bool = True,
    overwrite: bool = False,
    dry_run: bool = False,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    hooks: ExportHooks | None = None,
    names: str = "store",
) -> ExportResult:
    """Write the store's consolidated weights as Hugging Face safetensors files.

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        out: destination folder (created; must be empty unless ``overwrite``), or a URL
            (``s3://...``: written locally, then uploaded; see docs/s3.md).
        dtype: dtype of floating parameters: ``fp32`` (default, the exact master weights),
            ``bf16`` or ``fp16``. Buffers keep their own dtype.
        max_shard_size: largest file payload (``"5GB"`` = 5·10**9 bytes, ``"2GiB"`` = 2·2**30).
        tied: ``"drop"`` (transformers' convention) or ``"copy"`` for tied aliases.
        buffers: include persistent buffers (BatchNorm statistics, ...).
        overwrite: replace earlier safetensors files in ``out`` (other files are kept).
        dry_run: plan only; write nothing.
        piece_bytes: read granularity; bounds the memory used (default 64 MiB).
        hooks: progress callbacks.
        names: ``store``, ``hf-llama`` or ``hf-mixtral`` (a Megatron-Core GPT store, dense or
            MoE, as Hugging Face Llama or Mixtral tensors, plus its ``config.json`` when the
            store records the model's arguments: :mod:`.hf_names`).

    Returns:
        An :class:`~ucformat.export.ExportResult`.

    Example:
        >>> ucformat.export.export_safetensors("ckpt.ucf", "hf/", dtype="bf16")  # doctest: +SKIP
    """
    clock = Stopwatch()
    hooks = hooks or ExportHooks()
    ckpt = open_store_arg(store)
    if is_url(out):
        return export_to_url(
            str(out),
            lambda folder: export_safetensors(
                ckpt,
                folder,
                dtype=dtype,
                max_shard_size=max_shard_size,
                tied=tied,
                buffers=buffers,
                dry_run=dry_run,
                piece_bytes=piece_bytes,
                hooks=hooks,
                names=names,
            ),
            owned=_owned,
            overwrite=overwrite,
            dry_run=dry_run,
            last=(INDEX_NAME,),
        )
    plan = plan_safetensors(
        ckpt.manifest,
        dtype=dtype,
        max_shard_size=max_shard_size,
        tied=tied,
        buffers=buffers,
        names=names,
    )
    config = hf_config(ckpt.manifest, names) if names in HF_NAMINGS else None
    folder = Path(out)
    staged = prepare_destination(
        folder, overwrite=overwrite, owned=_owned, dry_run=dry_run, last=(INDEX_NAME,)
    )
    hooks.plan(plan.nbytes)
    if not dry_run:
        for file_plan in plan.files:
            _write_file(ckpt, staged / file_plan.filename, file_plan, piece_bytes, hooks)
        if plan.index is not None:
            document = json.dumps(plan.index, indent=2, sort_keys=True) + "\n"
            write_bytes(staged / INDEX_NAME, document.encode())
        if config is not None:
            config["torch_dtype"] = plan.dtype
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
            write_bytes(staged / CONFIG_NAME, text.encode())
    count = sum(len(f.items) for f in plan.files)
    verb = "would write" if dry_run else "wrote"
    summary = (
        f"{verb} {count} tensors ({format_bytes(plan.nbytes)}, {plan.dtype} params) in "
        f"{len(plan.files)} safetensors file(s) to {folder} in {clock.seconds:.2f}s"
    )
    notes = []
    if plan.dropped_aliases:
        pairs = ", ".join(f"{a} -> {o}" for a, o in plan.dropped_aliases.items())
        notes.append(f"tied aliases not stored (transformers re-ties them on load): {pairs}")
    filenames = [*plan.filenames, CONFIG_NAME] if config is not None else plan.filenames
    return ExportResult(
        "safetensors", folder, filenames, plan.nbytes, dry_run, clock.seconds, summary, notes
    )
