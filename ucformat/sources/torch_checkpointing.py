"""A torch_checkpointing checkpoint folder as a ``SourceCheckpoint``, read like a DCP folder.

torch_checkpointing (meta-pytorch, the checkpointing library torchtitan 0.3 depends on) writes
one file per item and rank and ``metadata.pkl`` (:mod:`~ucformat.sources.torch_checkpointing_
metadata`). A rank's file holds that rank's value of the item: nested dicts and lists whose
leaves are DTensors (their local shards), plain tensors and Python values. Algorithm:

1. decode ``metadata.pkl`` (plain data, no global admitted) and check it;
2. open every rank's file of every item the metadata describes (``torch.save`` archives through
   the allow-list unpickler, DTensors as :class:`~ucformat.sources.safe_unpickle.DTensorRef`;
   safetensors files through :mod:`~ucformat.sources.safetensors_header`; JSON files), and the
   other items' rank-0 files ``<item>_0.pt`` (client state such as torchtitan's
   ``train_state``): no tensor byte is read;
3. flatten each value as DCP does (keys joined by dots, list indices where a list holds
   dicts or tensors), so the item names are the top-level keys: ``model.<fqn>``,
   ``optimizer.state.<fqn>.exp_avg``, ``train_state.step``; the DCP describer
   (:class:`~ucformat.sources.dcp.DcpDescriber`) then sorts them into weights, optimizer states,
   param groups and client state, with the same layouts and options as a DCP folder;
4. an array's fragments are every first-replica rank's local shard cut into runs of global
   flat elements (:func:`~ucformat.layout.placements.run_owners`: any placements on any mesh),
   each local tensor checked against the shape and dtype its placements give.

Non-tensor values (param-group hyper-parameters, client state) come from the lowest rank's
file. Nothing from the files is executed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ucformat.errors import LayoutMismatchError, NotACheckpointError, SourceNotFoundError
from ucformat.format.models import ScalarState
from ucformat.format.pyvalue import describe_type
from ucformat.layout.placements import local_intervals, run_owners
from ucformat.sources.base import ArraySource, SourceCheckpoint, SourceFragment, scalar_state
from ucformat.sources.dcp import DcpDescriber
from ucformat.sources.dcp_metadata import DcpBytes, DcpMetadata, DcpTensor
from ucformat.sources.reading import describing
from ucformat.sources.safe_unpickle import DTensorRef, PicklePolicy
from ucformat.sources.safetensors import SafetensorsTensor
from ucformat.sources.safetensors_header import read_header
from ucformat.sources.torch_checkpointing_metadata import (
    METADATA_NAME,
    TcMetadata,
    TcTensor,
    read_tc_metadata,
)
from ucformat.sources.torchfile import TensorRef, TorchFile, open_torch_file

__all__ = ["is_torch_checkpointing_folder", "read_torch_checkpointing"]

_RANK0_FILE = re.compile(r"^(.+)_0\.pt$")
_TENSORS = (TensorRef, DTensorRef, SafetensorsTensor)


def is_torch_checkpointing_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding torch_checkpointing's ``metadata.pkl``."""
    return (Path(path) / METADATA_NAME).is_file()


def read_torch_checkpointing(
    src: Path,
    *,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    policy: PicklePolicy | None = None,
    head_dim: int | None = None,
) -> SourceCheckpoint:
    """Open and describe the torch_checkpointing checkpoint in folder ``src``.

    ``model_key`` / ``optimizer_key``: the item (or dotted prefix) of the model weights and of
    the optimizer state, as for a DCP folder (default: ``model``, ``optimizer``); ``head_dim``
    as for a DCP folder (torchtitan's ``fuse_qkv``). The returned object holds open files;
    close it (or use it as a context manager).

    Raises:
        UCFormatError: missing or damaged files, a hostile pickle, an unknown layout.
    """
    folder = Path(src)
    reader = _Reader(folder, read_tc_metadata(folder), policy or PicklePolicy())
    with describing(folder, "the torch_checkpointing items", "torch_checkpointing", reader.close):
        reader.open_items()
        return reader.describe(model_key, optimizer_key, head_dim)


def _descend(value: Any) -> bool:
    """Whether a list is flattened further (it holds dicts or tensors: ``param_groups``) or is
    one value (``betas``, a group's ``params`` names), as DCP's flattening decides."""
    return any(
        isinstance(v, (Mapping, *_TENSORS)) or (isinstance(v, (list, tuple)) and _descend(v))
        for v in value
    )


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` as DCP flattens: dicts always, lists where they hold dicts or
    tensors."""
    if isinstance(value, Mapping) and value:
        for key, child in value.items():
            yield from _leaves(child, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)) and _descend(value):
        for index, child in enumerate(value):
            yield from _leaves(child, f"{prefix}.{index}")
    elif not isinstance(value, Mapping):
        yield prefix, value


def _dotted(item: str, path: tuple[str | int, ...]) -> str:
    return ".".join([item, *map(str, path)])


class _Reader(DcpDescriber):
    """Every rank's files of one checkpoint, as DCP-style flattened entries."""

    def __init__(self, folder: Path, metadata: TcMetadata, policy: PicklePolicy) -> None:
        self.folder, self.tc, self.policy = folder, metadata, policy
        self.handles: list[TorchFile] = []
        self.fds: list[int] = []
        self.files: list[str] = [METADATA_NAME]
        #: flattened key -> rank -> leaf.
        self.leaves: dict[str, dict[int, Any]] = {}
        #: flattened key -> the DTensor the metadata records.
        self.tensors: dict[str, TcTensor] = {}
        self.metadata = DcpMetadata({}, {}, metadata.version)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.close_descriptors()

    def close_descriptors(self) -> None:
        """Close the safetensors files' descriptors."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()

    # --- files ----------------------------------------------------------------------------------
    def _open(self, name: str, kind: str) -> Iterator[tuple[str, Any]]:
        """The leaves of one file (relative ``name``, serialization ``kind``), dotted keys."""
        path = self.folder / name
        if not path.is_file():
            raise SourceNotFoundError(
                f"{path}: missing; {METADATA_NAME} lists it. Copy the whole checkpoint folder."
            )
        self.files.append(name)
        if kind == "TorchSerialization":
            handle = open_torch_file(path, self.policy)
            self.handles.append(handle)
            return _leaves(handle.obj, "")
        if kind == "JsonSerialization":
            try:
                value = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise NotACheckpointError(f"{path}: not valid JSON ({str(exc)[:120]}).") from None
            return _leaves(value, "")
        header = read_header(path)  # SafetensorsSerialization: flattened dotted keys
        fd = os.open(path, os.O_RDONLY)
        self.fds.append(fd)
        return iter(
            (f".{key}", SafetensorsTensor(fd, path, key, entry, header.data_start))
            for key, entry in header.tensors.items()
        )

    def _add(self, item: str, rank: int, leaves: Iterator[tuple[str, Any]], where: str) -> None:
        seen: set[str] = set()
        for suffix, leaf in leaves:
            key = item + suffix
            if key in seen:
                raise NotACheckpointError(
                    f"{where}: two values flatten to '{key}'; rename one of the keys."
                )
            seen.add(key)
            self.leaves.setdefault(key, {})[rank] = leaf

    def open_items(self) -> None:
        """Open every file; flatten every value into :attr:`metadata`'s entries."""
        used = set()
        for item, info in self.tc.items.items():
            for rank in sorted(info.files):
                name = info.files[rank]
                used.add(name)
                self._add(item, rank, self._open(name, info.formats[rank]), str(self.folder / name))
            for path, tensor in info.tensors.items():
                self.tensors[_dotted(item, path)] = tensor
        for child in sorted(self.folder.iterdir(), key=lambda p: p.name):
            match = _RANK0_FILE.match(child.name)
            if match and child.name not in used and match.group(1) not in self.tc.items:
                self._add(match.group(1), 0, self._open(child.name, "TorchSerialization"),
                          str(child))  # fmt: skip
        entries: dict[str, DcpTensor | DcpBytes] = {}
        for key in self.leaves:
            known = self.tensors.get(key)
            entries[key] = DcpBytes() if known is None else DcpTensor(known.dtype, known.shape, ())
        for key in self.tensors:
            if key not in entries:
                raise NotACheckpointError(
                    f"{self.folder / METADATA_NAME}: lists '{key}', which no rank's file holds; "
                    "files from different saves are mixed."
                )
        self.metadata = DcpMetadata(entries, {}, self.tc.version)

    # --- entries --------------------------------------------------------------------------------
    def _first(self, key: str) -> Any:
        by_rank = self.leaves[key]
        return by_rank[min(by_rank)]

    def value(self, key: str) -> Any:
        """The value of a non-tensor entry, from the lowest rank holding it."""
        return self._first(key)

    def scalar(self, key: str) -> ScalarState:
        """A 0-d optimizer state (a 0-d tensor or DTensor, or a Python number)."""
        leaf = self._first(key)
        return scalar_state(leaf.local if isinstance(leaf, DTensorRef) else leaf, key)

    def _local(self, key: str, rank: int, tensor: TcTensor, coordinate: tuple[int, ...]) -> Any:
        """Rank ``rank``'s local tensor of ``key``, checked against its placements."""
        leaf = self.leaves[key].get(rank)
        local = leaf.local if isinstance(leaf, DTensorRef) else leaf
        where = f"{self.folder}: '{key}' of rank {rank}"
        if not isinstance(local, (TensorRef, SafetensorsTensor)):
            raise LayoutMismatchError(f"{where} holds {describe_type(leaf)}, not a tensor.")
        intervals = local_intervals(tensor.shape, tensor.mesh_shape, tensor.placements, coordinate)
        expected = tuple(sum(b - a for a, b in dim) for dim in intervals)
        shape = local.shape if isinstance(local, TensorRef) else local.entry.shape
        if tuple(shape) != expected or local.dtype_name != tensor.dtype:
            raise LayoutMismatchError(
                f"{where} is {local.dtype_name}{list(shape)}, but {METADATA_NAME} places "
                f"{tensor.dtype}{list(expected)} there; files from different saves are mixed."
            )
        return local

    def array(self, key: str) -> ArraySource:
        """A DTensor entry: every first-replica rank's local shard, as runs of the array."""
        tensor = self.tensors[key]
        array = ArraySource(tensor.shape, tensor.dtype)
        coordinates = dict(zip(tensor.mesh_ranks, _coordinates(tensor.mesh_shape), strict=True))
        locals_: dict[int, Any] = {}
        for owner, local_start in run_owners(
            tensor.shape, tensor.mesh_shape, tensor.placements, tensor.mesh_ranks
        ):
            if owner.rank not in locals_:
                locals_[owner.rank] = self._local(key, owner.rank, tensor, coordinates[owner.rank])
            array.fragments.append(
                SourceFragment(
                    locals_[owner.rank], local_start, owner.start, owner.stop - owner.start
                )
            )
        return array

    # --- provenance -----------------------------------------------------------------------------
    def checkpoint_files(self) -> tuple[list[str], str]:
        """``metadata.pkl`` and every file read."""
        return list(dict.fromkeys(self.files)), "torch-checkpointing"

    def world_size(self) -> int:
        """The world size ``metadata.pkl`` records."""
        return self.tc.world_size

    def mesh_shape(self) -> list[int] | None:
        """The mesh of the first sharded tensor."""
        for tensor in self.tensors.values():
            if any(p.kind != "replicate" for p in tensor.placements):
                return list(tensor.mesh_shape)
        return None


def _coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(c) for c in itertools.product(*(range(s) for s in mesh_shape))]
