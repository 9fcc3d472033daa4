"""Hugging Face weights (safetensors) as a weights-only ``SourceCheckpoint``.

What ``save_pretrained`` writes: ``model.safetensors``, or shards ``model-0000i-of-0000n
.safetensors`` listed by ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map":
{name: file}}``), beside ``config.json``. Accepted sources: one ``.safetensors`` file; or a
folder holding ``model.safetensors.index.json`` (else one ``*.safetensors.index.json``), else
``model.safetensors`` (else one ``*.safetensors``).

Algorithm:

1. pick the files (above); for a sharded folder check the index: a plain file name per tensor,
   every listed file present, every tensor of a file listed under that file, no tensor in two
   files;
2. read and check every header (:mod:`~ucformat.sources.safetensors_header`; no tensor byte is
   read here);
3. describe each tensor as one array whose single fragment is its bytes in place
   (:class:`SafetensorsTensor`, read with ``preadv`` by the converter's writer). A safetensors
   file records values only (no optimizer, no trainability): floating tensors are stored as
   parameters with their value in their own dtype (``frozen_param``: state ``value``), the
   others and the usual buffer names (``running_mean``, ...) as buffers. Loaders read a value
   as the parameter's fp32 weight (upcast, lossless) and cast it to the target's dtype;
4. keep ``config.json`` (a JSON object) as client state ``config.json``, and the files'
   ``__metadata__`` strings as ``safetensors.metadata``.

Names are the file's (Hugging Face names as they are), with the wrapper-component rule of
:mod:`ucformat.format.names` applied by the caller (:mod:`~ucformat.sources.unwrap`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ucformat.errors import (
    NotACheckpointError,
    SourceNotFoundError,
    TruncatedFileError,
)
from ucformat.format.dtypes import itemsize, numpy_storage_dtype, storage_to_torch
from ucformat.format.models import SourceFile, SourceInfo, TrainingProgress
from ucformat.format.training_values import encode_client_state
from ucformat.sources.base import (
    ArraySource,
    SourceCheckpoint,
    SourceFragment,
    SourceParam,
    frozen_param,
)
from ucformat.sources.dcp import BUFFER_NAMES
from ucformat.sources.reading import describing
from ucformat.sources.safetensors_header import SafetensorsFile, TensorEntry, read_header
from ucformat.sysio.fileio import preadv_all

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "SafetensorsTensor",
    "is_safetensors_source",
    "read_safetensors",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_SUFFIX = ".safetensors"
_INDEX_SUFFIX = ".safetensors.index.json"
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})
#: Files that make a folder another kind of checkpoint (a DeepSpeed run or tag folder, DCP):
#: a Trainer's ``checkpoint-N/`` holds ``model.safetensors`` beside its DeepSpeed files.
_OTHER_KINDS = ("latest", ".metadata", "metadata.pkl")


def is_safetensors_source(src: Path) -> bool:
    """Whether ``src`` is a ``.safetensors`` file, or a folder of Hugging Face weights that is
    not also a DeepSpeed or DCP checkpoint."""
    path = Path(src)
    if path.is_file():
        return path.name.endswith(_SUFFIX)
    if not path.is_dir() or any((path / name).exists() for name in _OTHER_KINDS):
        return False
    names = [child.name for child in path.iterdir()]
    if any(name.endswith("_model_states.pt") for name in names):
        return False
    return any(name.endswith((_SUFFIX, _INDEX_SUFFIX)) for name in names)


class SafetensorsTensor:
    """A tensor's bytes in place in a safetensors file (contiguous, little-endian)."""

    def __init__(self, fd: int, path: Path, name: str, entry: TensorEntry, data_start: int) -> None:
        self._fd, self.path, self.name = fd, path, name
        self.entry = entry
        self.offset = data_start + entry.begin
        self.item = itemsize(entry.dtype)

    @property
    def dtype_name(self) -> str:
        """The manifest's name of the dtype."""
        return self.entry.dtype

    def is_contiguous(self) -> bool:
        """Always: safetensors stores every tensor row-major."""
        return True

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Copy elements from ``start`` on into ``views``, one after another."""
        total = sum(len(view) for view in views)
        count = total // self.item
        if not 0 <= start <= start + count <= self.entry.numel:
            raise TruncatedFileError(
                f"{self.path}: elements [{start}, {start + count}) requested from tensor "
                f"'{self.name}' of {self.entry.numel} elements."
            )
        if preadv_all(self._fd, views, self.offset + start * self.item) != total:
            raise TruncatedFileError(
                f"{self.path}: the file ended inside tensor '{self.name}'; it was truncated "
                "after its header was read."
            )

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy elements ``[start, stop)`` into ``out`` (storage dtype, contiguous)."""
        self.read_scattered(start, [out.reshape(-1).data.cast("B")])

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        flat = np.empty(self.entry.numel, dtype=numpy_storage_dtype(self.entry.dtype))
        self.read_into(flat, 0, self.entry.numel)
        return storage_to_torch(flat, self.entry.dtype).reshape(self.entry.shape)


def _plain_name(folder: Path, name: Any, where: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or "\x00" in name
    ):
        raise NotACheckpointError(
            f"{where}: names the file {str(name)[:80]!r}, which is not a plain file name in "
            f"{folder}; refusing to read it."
        )
    return name


def _read_index(folder: Path, index: Path) -> dict[str, str]:
    """tensor name -> shard file name, checked."""
    try:
        document = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise NotACheckpointError(f"{index}: not valid JSON ({str(exc)[:120]}).") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise NotACheckpointError(
            f"{index}: has no 'weight_map' object of tensor name -> file; not a Hugging Face "
            "safetensors index."
        )
    return {str(k): _plain_name(folder, v, f"{index}: tensor '{k}'") for k, v in weight_map.items()}


def _single(folder: Path, suffix: str, preferred: str) -> Path | None:
    if (folder / preferred).is_file():
        return folder / preferred
    found = sorted(p for p in folder.iterdir() if p.name.endswith(suffix) and p.is_file())
    if suffix == _SUFFIX:
        found = [p for p in found if not p.name.endswith(_INDEX_SUFFIX)]
    if len(found) > 1:
        raise NotACheckpointError(
            f"{folder}: holds {len(found)} {suffix} files ({', '.join(p.name for p in found[:4])}"
            f"{', ...' if len(found) > 4 else ''}) and no {preferred}; convert one of them by "
            "naming it."
        )
    return found[0] if found else None


def _files(src: Path) -> tuple[Path, Path | None, dict[str, str] | None]:
    """``(folder, index file or None, weight map or None)``; the weight map names the files."""
    if not src.exists():
        raise SourceNotFoundError(f"{src}: no such file or directory.")
    if src.is_file():
        return src.parent, None, {"": src.name}
    index = _single(src, _INDEX_SUFFIX, INDEX_NAME)
    if index is not None:
        return src, index, _read_index(src, index)
    single = _single(src, _SUFFIX, WEIGHTS_NAME)
    if single is None:
        raise NotACheckpointError(
            f"{src}: no {WEIGHTS_NAME}, {INDEX_NAME} or other .safetensors file; expected a "
            "folder written by save_pretrained."
        )
    return src, None, {"": single.name}


def read_safetensors(src: Path) -> SourceCheckpoint:
    """Describe the Hugging Face weights at ``src`` (a file or a folder; module docstring).

    The returned object holds one open descriptor per file; close it (or use it as a context
    manager).

    Raises:
        UCFormatError: missing or damaged files, an inconsistent index, a header that is not
            valid safetensors, a dtype a store cannot hold.
    """
    folder, index, weight_map = _files(Path(src))
    assert weight_map is not None
    names = sorted(set(weight_map.values()))
    fds: list[int] = []

    def close() -> None:
        for fd in fds:
            os.close(fd)
        fds.clear()

    try:
        headers: dict[str, SafetensorsFile] = {}
        for name in names:
            path = folder / name
            if not path.is_file():
                raise SourceNotFoundError(
                    f"{path}: missing; {index} lists tensors in it. Copy the whole folder."
                )
            headers[name] = read_header(path)
        if index is not None:
            _check_index(index, weight_map, headers)
        tensors: dict[str, SafetensorsTensor] = {}
        for header in headers.values():
            fd = os.open(header.path, os.O_RDONLY)
            fds.append(fd)
            for tensor, entry in header.tensors.items():
                tensors[tensor] = SafetensorsTensor(
                    fd, header.path, tensor, entry, header.data_start
                )
    except BaseException:
        close()
        raise
    with describing(folder, "the safetensors headers", "save_pretrained", close):
        return _checkpoint(folder, index, headers, tensors, close)


def _check_index(
    index: Path, weight_map: dict[str, str], headers: dict[str, SafetensorsFile]
) -> None:
    held: dict[str, str] = {}
    for name, header in headers.items():
        for tensor in header.tensors:
            if tensor in held:
                raise NotACheckpointError(
                    f"{index}: tensor '{tensor}' is in both {held[tensor]} and {name}; the "
                    "folder mixes files of different saves."
                )
            held[tensor] = name
    for tensor, name in weight_map.items():
        if held.get(tensor) != name:
            where = f"in {held[tensor]}" if tensor in held else "in none of its files"
            raise NotACheckpointError(
                f"{index}: lists tensor '{tensor}' in {name}, but it is {where}; the folder "
                "mixes files of different saves."
            )
    extra = sorted(set(held) - set(weight_map))
    if extra:
        raise NotACheckpointError(
            f"{index}: does not list tensor '{extra[0]}' of {held[extra[0]]}"
            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; the folder mixes "
            "files of different saves."
        )


def _config(folder: Path) -> dict[str, Any] | None:
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise NotACheckpointError(f"{path}: not valid JSON ({str(exc)[:120]}).") from None
    if not isinstance(config, dict):
        raise NotACheckpointError(f"{path}: expected a JSON object (a model config).")
    return config


def _checkpoint(
    folder: Path,
    index: Path | None,
    headers: dict[str, SafetensorsFile],
    tensors: dict[str, SafetensorsTensor],
    close: Any,
) -> SourceCheckpoint:
    params: dict[str, SourceParam] = {}
    buffers: dict[str, ArraySource] = {}
    for name, tensor in tensors.items():
        entry = tensor.entry
        array = ArraySource(entry.shape, entry.dtype)
        if entry.numel:
            array.fragments.append(SourceFragment(tensor, 0, 0, entry.numel))
        if entry.dtype not in _FLOATING or name.rpartition(".")[2] in BUFFER_NAMES:
            buffers[name] = array
        else:
            params[name] = frozen_param(array)
    client: list[tuple[str, Any]] = []
    config = _config(folder)
    if config is not None:
        client.append((CONFIG_NAME, config))
    metadata = {name: header.metadata for name, header in headers.items() if header.metadata}
    if metadata:
        client.append(("safetensors.metadata", metadata))
    files = [p for p in (index, *(h.path for h in headers.values())) if p is not None]
    if config is not None:
        files.append(folder / CONFIG_NAME)
    floats = Counter(p.dtype for p in params.values())
    source = SourceInfo(
        framework="pytorch",
        framework_version="unknown",
        written_by="convert",
        checkpoint_format="safetensors",
        path=str(folder.resolve()),
        tag="",
        world_size=1,
        train_dtype=floats.most_common(1)[0][0] if floats else "float32",  # type: ignore[arg-type]
        files=[SourceFile(name=p.name, size=p.stat().st_size) for p in files],
    )
    return SourceCheckpoint(
        source=source,
        params=params,
        buffers=buffers,
        tied={},
        optimizer=None,
        progress=TrainingProgress(),
        client_state=encode_client_state(client),
        closers=[close],
    )
