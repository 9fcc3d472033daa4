"""Decode a PyTorch Distributed Checkpoint's ``.metadata`` into plain, checked dataclasses.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``. It is decoded by
:func:`~ucformat.sources.safe_unpickle.load_dcp_metadata_pickle` (an allow-list: nothing from the
file is imported or run), then every field ucformat uses is type-checked here, so that the
reader downstream only meets the shapes below. Layout facts are those of torch 2.x
(docs/format.md, "Sources: PyTorch DCP").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucformat.errors import NotACheckpointError, SourceNotFoundError, UnsupportedCheckpointError
from ucformat.format.dtypes import DTYPE_NAMES
from ucformat.sources.safe_unpickle import StandIn, load_dcp_metadata_pickle

__all__ = [
    "METADATA_NAME",
    "DcpBytes",
    "DcpChunk",
    "DcpItem",
    "DcpMetadata",
    "DcpTensor",
    "read_dcp_metadata",
]

METADATA_NAME = ".metadata"
_MODULE = "torch.distributed.checkpoint.metadata."
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


@dataclass(frozen=True)
class DcpChunk:
    """A box of the global tensor: ``offsets`` and ``sizes`` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class DcpTensor:
    """A tensor entry: dtype (manifest name), global shape and its chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpBytes:
    """A non-tensor entry (``torch.save``d Python value)."""


@dataclass(frozen=True)
class DcpItem:
    """Where one stored item is: ``length`` bytes at ``offset`` of data file ``relative_path``."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    """The parts of ``.metadata`` a reader needs.

    Attributes:
        entries: flattened key -> entry, in the order the saving job flattened its state dict
            (``planner_data`` order when it names every key, else the file's order).
        items: ``(key, chunk offsets)`` (``None`` offsets for bytes entries) -> item.
        version: DCP's metadata version string (``""`` when absent).
    """

    entries: dict[str, DcpTensor | DcpBytes]
    items: dict[tuple[str, tuple[int, ...] | None], DcpItem]
    version: str

    @property
    def data_files(self) -> list[str]:
        """Every data file some item lives in, sorted."""
        return sorted({item.relative_path for item in self.items.values()})

    @property
    def world_size(self) -> int:
        """Ranks that wrote data files (``__<rank>_<n>.distcp``); 1 if the names say nothing."""
        names = [name.rpartition("/")[2] for name in self.data_files]  # merged folders: sub/__r_n
        ranks = [int(m.group(1)) for m in map(_DATA_FILE.match, names) if m]
        return max(ranks, default=0) + 1


def _stand_in(value: Any, name: str, where: str) -> dict[str, Any]:
    if not (isinstance(value, StandIn) and type(value).ucformat_qualname.endswith(name)):
        raise NotACheckpointError(
            f"{where}: expected a DCP {name}, found {type(value).__name__}; the file is not a "
            "PyTorch Distributed Checkpoint .metadata (or a version ucformat does not know)."
        )
    return value.attributes()


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise NotACheckpointError(f"{where}: expected a tuple of ints, found {value!r:.80}.")
    return tuple(value)


def _dtype(properties: Any, where: str) -> str:
    state = properties.__dict__.get("_state") if isinstance(properties, StandIn) else None
    dtype = state[0] if isinstance(state, tuple) and state else None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise UnsupportedCheckpointError(
            f"{where}: tensors of dtype {name} cannot be stored; expected one of "
            f"{', '.join(DTYPE_NAMES)}."
        )
    return name


def _entry(key: str, value: Any, where: str) -> DcpTensor | DcpBytes:
    if (
        isinstance(value, StandIn)
        and type(value).ucformat_qualname == _MODULE + "BytesStorageMetadata"
    ):
        return DcpBytes()
    fields = _stand_in(value, "TensorStorageMetadata", f"{where}: entry '{key}'")
    shape = _ints(fields.get("size"), f"{where}: '{key}' size")
    chunks = []
    for chunk in fields.get("chunks") or []:
        box = _stand_in(chunk, "ChunkStorageMetadata", f"{where}: '{key}' chunk")
        chunks.append(
            DcpChunk(
                _ints(box.get("offsets"), f"{where}: '{key}' chunk offsets"),
                _ints(box.get("sizes"), f"{where}: '{key}' chunk sizes"),
            )
        )
    return DcpTensor(_dtype(fields.get("properties"), f"{where}: '{key}'"), shape, tuple(chunks))


def _item(index: Any, info: Any, where: str) -> tuple[tuple[str, tuple[int, ...] | None], DcpItem]:
    key = _stand_in(index, "MetadataIndex", where)
    fqn, offset = key.get("fqn"), key.get("offset")
    stored = _stand_in(info, "_StorageInfo", where)
    path, start, length = stored.get("relative_path"), stored.get("offset"), stored.get("length")
    if not isinstance(fqn, str) or not isinstance(path, str):
        raise NotACheckpointError(f"{where}: a storage entry has no key or file name.")
    if not isinstance(start, int) or not isinstance(length, int) or start < 0 or length < 0:
        raise NotACheckpointError(f"{where}: '{fqn}' has a bad byte range ({start}, {length}).")
    if "/" in path or "\\" in path or path in ("", ".", "..") or path.startswith("."):
        raise NotACheckpointError(
            f"{where}: '{fqn}' names the data file {path!r}, which is not a plain file name in "
            "the checkpoint folder; refusing to read it."
        )
    if stored.get("transform_descriptors"):
        raise UnsupportedCheckpointError(
            f"{where}: '{fqn}' is stored through the transforms {stored['transform_descriptors']} "
            "(a DCP storage extension such as compression); ucformat reads untransformed items "
            "only. Save without extensions, or re-save with dcp.load + dcp.save."
        )
    chunk = None if offset is None else _ints(offset, f"{where}: '{fqn}' offset")
    return (fqn, chunk), DcpItem(path, start, length)


def read_dcp_metadata(folder: Path) -> DcpMetadata:
    """Read and check ``folder/.metadata``.

    Raises:
        SourceNotFoundError: there is no ``.metadata`` file.
        UnsafePickleError: the pickle names a global outside the allow-list (nothing ran).
        TruncatedFileError: the pickle is damaged.
        NotACheckpointError: the pickle is not DCP's ``Metadata``.
        UnsupportedCheckpointError: items use storage transforms, or a dtype has no store form.
    """
    path = folder / METADATA_NAME
    if not path.is_file():
        raise SourceNotFoundError(f"{path}: no such file; not a PyTorch Distributed Checkpoint.")
    where = str(path)
    root = _stand_in(load_dcp_metadata_pickle(path.read_bytes(), source=where), "Metadata", where)
    raw_entries = root.get("state_dict_metadata")
    raw_items = root.get("storage_data")
    if not isinstance(raw_entries, Mapping) or not isinstance(raw_items, Mapping):
        raise NotACheckpointError(
            f"{where}: the Metadata has no state_dict_metadata/storage_data mapping; written by a "
            "custom storage writer ucformat does not read."
        )
    entries = {str(k): _entry(str(k), v, where) for k, v in raw_entries.items()}
    planner = root.get("planner_data")
    if isinstance(planner, Mapping) and set(map(str, planner)) == set(entries):
        entries = {str(k): entries[str(k)] for k in planner}
    items = dict(_item(index, info, where) for index, info in raw_items.items())
    version = root.get("version")
    return DcpMetadata(entries, items, version if isinstance(version, str) else "")
