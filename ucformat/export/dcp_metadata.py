"""DCP's own ``Metadata`` for the items an export wrote (``.metadata`` is its pickle).

Built from ``torch.distributed.checkpoint``'s dataclasses, as its file-system writer builds it:
``state_dict_metadata`` (key -> tensor entry with its chunks, or bytes entry), ``storage_data``
(``MetadataIndex(key, chunk offsets, index)`` -> ``_StorageInfo(file, offset, length)``),
``planner_data`` (key -> its path in the saved dict), ``storage_meta`` and DCP's version.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ucformat.format.dtypes import torch_dtype

if TYPE_CHECKING:
    from ucformat.export.dcp import DcpTensorItem, DcpValueItem

__all__ = ["dcp_metadata"]


def dcp_metadata(
    tensors: tuple[DcpTensorItem, ...],
    values: tuple[DcpValueItem, ...],
    where: dict[tuple[str, int], tuple[str, int, int]],
    out: str | Path,
) -> Any:
    """DCP's own ``Metadata`` for the written items."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[str | int, ...]] = {}
    for item in tensors:
        chunks = []
        for index, piece in enumerate(item.pieces):
            offsets, sizes = piece.offsets, piece.sizes
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            file, offset, length = where[(item.key, index)]
            storage[MetadataIndex(item.key, torch.Size(offsets), index)] = _StorageInfo(
                file, offset, length
            )
        entries[item.key] = TensorStorageMetadata(
            TensorProperties(dtype=torch_dtype(item.dtype)), torch.Size(item.shape), chunks
        )
        planner[item.key] = item.path
    for value in values:
        entries[value.key] = BytesStorageMetadata()
        file, offset, length = where[(value.key, -1)]
        storage[MetadataIndex(value.key)] = _StorageInfo(file, offset, length)
        planner[value.key] = value.path
    meta = StorageMeta(checkpoint_id=out, save_id=str(uuid.uuid4()))
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner,
        storage_data=storage,
        storage_meta=meta,
        version=CURRENT_DCP_VERSION,
    )
