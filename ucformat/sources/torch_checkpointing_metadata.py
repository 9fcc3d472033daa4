"""A torch_checkpointing ``metadata.pkl`` decoded without running code, checked into dataclasses.

torch_checkpointing 0.1 (meta-pytorch; what torchtitan 0.3 installs) saves a checkpoint as one
file per item and rank (default ``<item>_<rank>.pt``, a ``torch.save`` of the rank's value of
that item) and, when an item declares a resharder, ``metadata.pkl``: a pickle of
``DistributedMetadata.to_dict()``, plain data only (format version ``2.0``)::

    {"world_size": W, "version": "2.0", "metadata": {item: {
        "nested_path_to_metadata": {json.dumps(list(path)): [
            {"sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
                "global_shape": [...], "dtype": "torch.float32", "stride": [...],
                "mesh_spec": {"device_type", "mesh_shape", "mesh_data", "mesh_dim_names"},
                "placements": [{"type": "Shard", "dim": 0} | {"type": "StridedShard", "dim",
                               "split_factor"} | {"type": "Replicate"}]}},
             "ranks": (r, ...)}]},
        "rank_to_layout_info": {rank: None | {"file_path": "...", "serialization_format":
                                              {"type": "TorchSerialization" | ...}}}}}}

It is decoded by :func:`~ucformat.sources.safe_unpickle.load_data_pickle` (no global admitted),
then every field used is type-checked here: a path is a list of strings and integers (the keys
and list indices leading to the tensor inside the item's value), a file path is relative and
stays inside the folder, ranks lie in ``[0, world_size)``, the mesh's ranks are distinct and
fill its shape, dtypes are ones a store can hold. Only DTensor sharding metadata is read
(``default_tensor_v1``, for tensors implementing torch_checkpointing's ``CheckpointableTensor``,
is refused by name).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucformat.errors import NotACheckpointError, SourceNotFoundError, UnsupportedCheckpointError
from ucformat.format.dtypes import DTYPE_NAMES
from ucformat.layout.placements import Placement
from ucformat.sources.safe_unpickle import load_data_pickle

__all__ = [
    "METADATA_NAME",
    "SERIALIZATIONS",
    "TcItem",
    "TcMetadata",
    "TcTensor",
    "read_tc_metadata",
]

METADATA_NAME = "metadata.pkl"
#: The serialization formats of an item's files that ucformat reads.
SERIALIZATIONS = ("TorchSerialization", "SafetensorsSerialization", "JsonSerialization")
_VERSIONS = ("2.0",)
NestedPath = tuple[str | int, ...]


@dataclass(frozen=True)
class TcTensor:
    """A DTensor of an item: dtype (manifest name), global shape, mesh and placements."""

    dtype: str
    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class TcItem:
    """One item: per rank, its file (relative to the folder) and serialization; its tensors."""

    files: dict[int, str]
    formats: dict[int, str]
    tensors: dict[NestedPath, TcTensor]


@dataclass(frozen=True)
class TcMetadata:
    """The parts of ``metadata.pkl`` a reader needs."""

    world_size: int
    version: str
    items: dict[str, TcItem]


def _fail(where: str, what: str) -> NotACheckpointError:
    return NotACheckpointError(
        f"{where}: {what}; not a torch_checkpointing metadata.pkl (or a version ucformat does "
        "not know)."
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_count(v) for v in value):
        raise _fail(where, f"{what} is {str(value)[:60]}, not a list of non-negative integers")
    return tuple(value)


def default_file(item: str, rank: int) -> str:
    """Where torch_checkpointing's default layout puts ``item`` of ``rank``."""
    return f"{item}_{rank}.pt"


def _relative(path: Any, where: str) -> str:
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not parts
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise NotACheckpointError(
            f"{where}: names the file {str(path)[:80]!r}, which is not a relative path inside "
            "the checkpoint folder; refusing to read it."
        )
    return str(path)


def _path(text: Any, where: str) -> NestedPath:
    try:
        path = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        path = None
    if not isinstance(path, list) or not all(
        isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path
    ):
        raise _fail(where, f"the nested path {str(text)[:60]!r} is not a JSON list of keys")
    return tuple(path)


def _placement(value: Any, ndim: int, where: str) -> Placement:
    fields: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
    kind, dim = fields.get("type"), fields.get("dim")
    if kind == "Replicate":
        return Placement("replicate")
    if kind in ("Shard", "StridedShard") and isinstance(dim, int) and _count(dim) and dim < ndim:
        factor = fields.get("split_factor", 1) if kind == "StridedShard" else 1
        if isinstance(factor, int) and _count(factor) and factor >= 1:
            return Placement("strided" if kind == "StridedShard" else "shard", dim, factor)
    raise _fail(where, f"placement {str(value)[:60]} is not Shard, StridedShard or Replicate")


def _tensor(groups: Any, world_size: int, where: str) -> TcTensor:
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], Mapping):
        count = len(groups) if isinstance(groups, list) else "no"
        raise UnsupportedCheckpointError(
            f"{where}: {count} sharding groups; ucformat reads tensors with one sharding over "
            "every rank that holds them."
        )
    packed = groups[0].get("sharding_metadata")
    kind = packed.get("type") if isinstance(packed, Mapping) else None
    if kind != "DTensorShardingMetadata" or not isinstance(packed, Mapping):
        raise UnsupportedCheckpointError(
            f"{where}: sharding metadata of type {str(kind)[:40]!r}; ucformat reads DTensor "
            "sharding (DTensorShardingMetadata) only."
        )
    data = packed.get("data")
    if not isinstance(data, Mapping):
        raise _fail(where, "the sharding metadata has no data")
    shape = _ints(data.get("global_shape"), where, "global_shape")
    dtype = str(data.get("dtype", "")).removeprefix("torch.")
    if dtype not in DTYPE_NAMES:
        raise UnsupportedCheckpointError(
            f"{where}: tensors of dtype {dtype[:24]} cannot be stored; expected one of "
            f"{', '.join(DTYPE_NAMES)}."
        )
    mesh = data.get("mesh_spec")
    if not isinstance(mesh, Mapping):
        raise _fail(where, "the DTensor has no mesh_spec")
    mesh_shape = _ints(mesh.get("mesh_shape"), where, "mesh_shape")
    ranks = _ints(mesh.get("mesh_data"), where, "mesh_data")
    if (
        not mesh_shape
        or len(ranks) != math.prod(mesh_shape)
        or len(set(ranks)) != len(ranks)
        or any(r >= world_size for r in ranks)
    ):
        raise _fail(where, f"mesh {list(mesh_shape)} of ranks {list(ranks)[:16]} is not valid")
    raw = data.get("placements")
    if not isinstance(raw, list) or len(raw) != len(mesh_shape):
        raise _fail(where, "the placements do not match the mesh's dims")
    placements = tuple(_placement(p, len(shape), where) for p in raw)
    return TcTensor(dtype, shape, mesh_shape, ranks, placements)


def _item(name: str, value: Any, world_size: int, where: str) -> TcItem:
    if not isinstance(value, Mapping):
        raise _fail(where, f"item '{name}' is not a mapping")
    layouts = value.get("rank_to_layout_info")
    paths = value.get("nested_path_to_metadata")
    if not isinstance(layouts, Mapping) or not isinstance(paths, Mapping):
        raise _fail(where, f"item '{name}' has no rank_to_layout_info / nested_path_to_metadata")
    files: dict[int, str] = {}
    formats: dict[int, str] = {}
    for rank, layout in layouts.items():
        if not _count(rank) or rank >= world_size:
            raise _fail(where, f"item '{name}' names rank {str(rank)[:20]}")
        if layout is None:
            files[rank], formats[rank] = default_file(name, rank), "TorchSerialization"
            continue
        kind = layout.get("serialization_format") if isinstance(layout, Mapping) else None
        kind = kind.get("type") if isinstance(kind, Mapping) else None
        if kind not in SERIALIZATIONS:
            raise UnsupportedCheckpointError(
                f"{where}: item '{name}' of rank {rank} is stored as {str(kind)[:40]}; ucformat "
                f"reads {', '.join(SERIALIZATIONS)}."
            )
        files[rank] = _relative(layout.get("file_path"), f"{where}: item '{name}' rank {rank}")
        formats[rank] = str(kind)
    if sorted(files) != list(range(world_size)):
        raise _fail(where, f"item '{name}' lists ranks {sorted(files)}, not 0..{world_size - 1}")
    tensors = {
        _path(text, where): _tensor(groups, world_size, f"{where}: '{name}' {text}")
        for text, groups in paths.items()
    }
    return TcItem(files, formats, tensors)


def read_tc_metadata(folder: Path) -> TcMetadata:
    """Read and check ``folder/metadata.pkl``.

    Raises:
        SourceNotFoundError: there is no ``metadata.pkl``.
        UnsafePickleError: the pickle names any global (nothing ran).
        TruncatedFileError: the pickle is damaged.
        NotACheckpointError: the pickle is not torch_checkpointing's metadata.
        UnsupportedCheckpointError: another format version, sharding or serialization, or a
            dtype a store cannot hold.
    """
    path = folder / METADATA_NAME
    if not path.is_file():
        raise SourceNotFoundError(f"{path}: no such file; not a torch_checkpointing checkpoint.")
    where = str(path)
    root = load_data_pickle(path.read_bytes(), source=where)
    if not isinstance(root, Mapping) or not {"metadata", "world_size"} <= set(root):
        raise _fail(where, "expected a mapping with 'metadata' and 'world_size'")
    version = root.get("version", "1.0")
    if version not in _VERSIONS:
        raise UnsupportedCheckpointError(
            f"{where}: torch_checkpointing metadata version {str(version)[:20]}; ucformat reads "
            f"version {', '.join(_VERSIONS)} (torch_checkpointing 0.1). Load and save it again "
            "with a newer torch_checkpointing."
        )
    world_size = root["world_size"]
    if not _count(world_size) or world_size < 1:
        raise _fail(where, f"world_size {str(world_size)[:20]}")
    items = root["metadata"]
    if not isinstance(items, Mapping) or not all(isinstance(k, str) for k in items):
        raise _fail(where, "'metadata' is not a mapping of item names")
    return TcMetadata(
        world_size,
        str(version),
        {name: _item(name, value, world_size, where) for name, value in items.items()},
    )
