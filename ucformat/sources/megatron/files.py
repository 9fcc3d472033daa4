"""The files of a Megatron-Core ``torch_dist`` checkpoint, opened: what is in ``metadata.json``,
``common.pt`` and the DCP folder.

``dist_checkpointing.save`` writes a PyTorch DCP folder (``.metadata``, ``__<rank>_<n>.distcp``)
whose keys are Megatron's ShardedTensor and ShardedObject keys, plus ``common.pt`` (every value
that is not sharded: Megatron-LM's ``args``, ``iteration``, the optimizers' param groups and
steps, ``content_metadata`` (Megatron-LM's ``sharded_state_dict`` metadata: the distributed
optimizer's format, ``chained_optim_avoid_prefix``, ...), ``num_floating_point_operations_so_far``,
``opt_param_scheduler``) and ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``).

:class:`MegatronFiles` holds them decoded under the allow-list unpickler, and reads a
ShardedObject's value (a bytes item, e.g. the distributed optimizer's per-bucket sizes) on
demand. It also answers which global rank wrote a chunk (from its data file's name).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ucformat.errors import NotACheckpointError
from ucformat.format.pyvalue import describe_type
from ucformat.sources.dcp import DcpItems
from ucformat.sources.dcp_metadata import (
    METADATA_NAME,
    DcpBytes,
    DcpChunk,
    DcpMetadata,
    DcpTensor,
    read_dcp_metadata,
)
from ucformat.sources.safe_unpickle import PicklePolicy, StandIn
from ucformat.sources.torchfile import TorchFile, open_torch_file

__all__ = [
    "COMMON_NAME",
    "METADATA_JSON",
    "MegatronFiles",
    "attributes",
    "is_megatron_folder",
]

COMMON_NAME = "common.pt"
METADATA_JSON = "metadata.json"
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def is_megatron_folder(path: Path) -> bool:
    """Whether ``path`` holds a ``torch_dist`` checkpoint (``metadata.json`` + ``.metadata``)."""
    folder = Path(path)
    if not (folder / METADATA_NAME).is_file() or not (folder / METADATA_JSON).is_file():
        return False
    try:
        config = json.loads((folder / METADATA_JSON).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("sharded_backend") == "torch_dist"


def attributes(value: Any) -> dict[str, Any]:
    """The attributes of an ``argparse.Namespace`` placeholder (or a dict's items)."""
    if isinstance(value, StandIn):
        return value.attributes()
    return dict(value) if isinstance(value, dict) else {}


class MegatronFiles:
    """An opened ``torch_dist`` folder: ``config`` (metadata.json), ``metadata`` (DCP),
    ``common`` (common.pt), ``args`` (Megatron-LM's), ``content`` (``content_metadata``) and
    ``items``, the DCP item reader (close it when done)."""

    def __init__(self, folder: Path, policy: PicklePolicy | None = None) -> None:
        self.folder = Path(folder)
        self.config: dict[str, Any] = json.loads((self.folder / METADATA_JSON).read_text())
        self.metadata: DcpMetadata = read_dcp_metadata(self.folder)
        self.common_file, self.common = _read_common(self.folder, policy or PicklePolicy())
        self.args = attributes(self.common.get("args"))
        content = self.common.get("content_metadata")
        self.content: dict[str, Any] = content if isinstance(content, dict) else {}
        try:
            self.items = DcpItems(self.folder, self.metadata, policy or PicklePolicy())
        except BaseException:
            if self.common_file is not None:
                self.common_file.close()
            raise

    def tensor(self, key: str) -> DcpTensor:
        """The tensor entry ``key``."""
        entry = self.metadata.entries[key]
        if not isinstance(entry, DcpTensor):
            raise NotACheckpointError(f"{self.folder}: '{key}' is not a tensor entry.")
        return entry

    def tensors(self) -> dict[str, DcpTensor]:
        """Every tensor entry, in the saving job's order."""
        return {k: e for k, e in self.metadata.entries.items() if isinstance(e, DcpTensor)}

    def objects(self) -> list[str]:
        """Every bytes entry (a ShardedObject: ``<key>/shard_<offsets>_<shape>``)."""
        return [k for k, e in self.metadata.entries.items() if isinstance(e, DcpBytes)]

    def value(self, key: str) -> Any:
        """The decoded value of the bytes entry ``key``."""
        return self.items.value(key)

    def writer(self, key: str, chunk: DcpChunk) -> int:
        """The global rank whose data file holds ``chunk`` of ``key`` (0 if the name is not
        ``__<rank>_<n>.distcp``)."""
        item = self.metadata.items[(key, chunk.offsets)]
        match = _DATA_FILE.match(item.relative_path.rpartition("/")[2])
        return int(match.group(1)) if match else 0

    def handles(self) -> list[TorchFile]:
        """Every ``torch.save`` archive opened so far (``common.pt`` and the DCP items)."""
        own = [self.common_file] if self.common_file is not None else []
        return [*own, *self.items.handles]

    def close(self) -> None:
        """Close every file opened so far."""
        if self.common_file is not None:
            self.common_file.close()
        self.items.close()


def _read_common(folder: Path, policy: PicklePolicy) -> tuple[TorchFile | None, dict[str, Any]]:
    """``common.pt``, open (its tensors, e.g. the optimizers' steps, are read later), and its
    dict; ``(None, {})`` when the folder has none."""
    path = folder / COMMON_NAME
    if not path.is_file():
        return None, {}
    handle = open_torch_file(path, policy)
    common = handle.obj
    if not isinstance(common, dict):
        handle.close()
        raise NotACheckpointError(
            f"{path}: holds {describe_type(common)}, expected the dict dist_checkpointing saves."
        )
    return handle, common
