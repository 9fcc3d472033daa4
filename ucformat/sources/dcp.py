"""Read a PyTorch Distributed Checkpoint folder into a ``SourceCheckpoint``.

What ``dcp.save(state, checkpoint_id=DIR)`` writes: ``DIR/.metadata`` (a pickle of DCP's
``Metadata``) and data files ``__<rank>_<n>.distcp``. Each stored item (a tensor chunk or a
``torch.save``d Python value) is a complete ``torch.save`` archive at a recorded byte range of a
data file. Algorithm:

1. decode ``.metadata`` under an allow-list (:mod:`~ucformat.sources.dcp_metadata`);
2. sort its flattened keys into model weights, optimizer states, param groups and the rest
   (:mod:`~ucformat.sources.dcp_layout`);
3. open each item's archive in place (no copy, no ``torch.load``) and turn every chunk, a box of
   the global tensor, into runs of global flat elements (:func:`~ucformat.layout.boxes.chunk_runs`):
   the fragments the converter's planner tiles each array with;
4. rebuild param groups: nested layouts list their members; flattened layouts give each FQN its
   hyper-parameters, and FQNs with identical hyper-parameters form one group, groups numbered in
   order of first appearance, members in saving order.

No tensor byte is read here except 0-d optimizer states (``step``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from ucformat.errors import (
    LayoutMismatchError,
    NotACheckpointError,
    SourceNotFoundError,
)
from ucformat.format.models import (
    ClientState,
    OptimizerGroup,
    OptimizerInfo,
    ScalarState,
    SourceFile,
    SourceInfo,
)
from ucformat.format.pyvalue import describe_type, encode
from ucformat.format.spec import FP32_STATE, VALUE_STATE
from ucformat.format.training_values import NotStored, encode_client_state
from ucformat.layout.boxes import chunk_runs
from ucformat.sources.base import (
    ArraySource,
    SourceCheckpoint,
    SourceFragment,
    SourceParam,
    scalar_state,
)
from ucformat.sources.dcp_layout import DcpLayout, split_layout
from ucformat.sources.dcp_metadata import (
    METADATA_NAME,
    DcpBytes,
    DcpChunk,
    DcpMetadata,
    DcpTensor,
    read_dcp_metadata,
)
from ucformat.sources.reading import describing
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.torchfile import TensorRef, TorchFile, open_embedded_torch_file
from ucformat.sources.torchtitan import fused_qkv_blocks, join_rows, training_progress

__all__ = ["BUFFER_NAMES", "DcpDescriber", "DcpItems", "is_dcp_folder", "read_dcp_checkpoint"]

#: Model entries outside every param group with these last names (or a non-float dtype) are
#: buffers; the others are frozen parameters (DCP does not record which is which).
BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})


def is_dcp_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a DCP ``.metadata`` file."""
    return (Path(path) / METADATA_NAME).is_file()


def read_dcp_checkpoint(
    src: Path,
    *,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    policy: PicklePolicy | None = None,
    metadata: DcpMetadata | None = None,
    head_dim: int | None = None,
) -> SourceCheckpoint:
    """Open and describe the DCP checkpoint in folder ``src``.

    Args:
        src: the folder ``dcp.save`` wrote (``checkpoint_id``).
        model_key: prefix of the model weights (default: ``model``, else the top level when the
            optimizer's FQNs are top-level keys, torchtitan's layout); ``.`` for the top level.
        optimizer_key: prefix of the optimizer state dict (default: ``optimizer`` or ``optim``).
        policy: extra pickle globals admitted as placeholders in non-tensor values.
        metadata: the decoded metadata, if the caller has it (several folders read as one,
            item paths relative to ``src``: :mod:`~ucformat.sources.accelerate`).
        head_dim: rejoin torchtitan's split ``fuse_qkv`` weights with heads of this many rows
            (:mod:`~ucformat.sources.torchtitan`); None refuses such a checkpoint.

    The returned object holds open file descriptors; close it (or use it as a context manager).

    Raises:
        UCFormatError: missing or damaged files, a hostile pickle, an unknown layout.
    """
    folder = Path(src)
    metadata = metadata or read_dcp_metadata(folder)
    reader = _Reader(folder, metadata, policy or PicklePolicy())
    with describing(folder, "the DCP items", "dcp.save", reader.close):
        return reader.describe(model_key, optimizer_key, head_dim)


class DcpDescriber:
    """Describes a checkpoint whose entries are DCP's flattened keys (:class:`DcpMetadata`).

    Subclasses give the entries' values: :meth:`array` (a tensor entry as an array and its
    fragments), :meth:`value` (a non-tensor entry's Python value), :meth:`scalar` (a 0-d
    optimizer state), and :meth:`source_info`'s inputs; :meth:`describe` sorts the keys into
    weights, optimizer states, param groups and client state (:mod:`~ucformat.sources.dcp_layout`)
    and builds the checkpoint. DCP folders (:class:`DcpItems`) and torch_checkpointing folders
    (:mod:`~ucformat.sources.torch_checkpointing`) are read this way.
    """

    folder: Path
    metadata: DcpMetadata
    #: Every item file opened so far (checked by ``check_integrity``, closed by ``close``).
    handles: list[TorchFile]

    def array(self, key: str) -> ArraySource:
        """A tensor entry as an array whose fragments tile it."""
        raise NotImplementedError

    def value(self, key: str) -> Any:
        """The Python value of a non-tensor entry (decoded by the allow-list unpickler)."""
        raise NotImplementedError

    def scalar(self, key: str) -> ScalarState:
        """A 0-d optimizer state (0-d tensor entry, or a Python number)."""
        raise NotImplementedError

    def close_descriptors(self) -> None:
        """Release what the item handles share (called after every handle is closed)."""

    def checkpoint_files(self) -> tuple[list[str], str]:
        """The names of the files read (relative to the folder) and the format's name."""
        raise NotImplementedError

    # --- the checkpoint -----------------------------------------------------------------------
    def describe(
        self, model_key: str | None, optimizer_key: str | None, head_dim: int | None = None
    ) -> SourceCheckpoint:
        """The checkpoint, its keys sorted by :func:`~ucformat.sources.dcp_layout.split_layout`
        (``head_dim``: see :func:`read_dcp_checkpoint`)."""
        entries = self.metadata.entries
        tensors = {k for k, v in entries.items() if isinstance(v, DcpTensor)}
        layout = split_layout(
            list(entries),
            tensors,
            str(self.folder),
            model_key=model_key,
            optimizer_key=optimizer_key,
            head_dim=head_dim,
        )
        groups = self._groups(layout) if layout.optimizer_key else []
        member = {name: index for index, group in enumerate(groups) for name in group.params}
        params: dict[str, SourceParam] = {}
        buffers: dict[str, ArraySource] = {}
        fused = {part: owner for owner, parts in layout.fused.items() for part in parts}
        for name, key in layout.params.items():
            if name in fused:  # rejoined where its first part was saved
                if fused[name] not in params:
                    params[fused[name]] = self._fused_param(layout, fused[name], member)
                continue
            entry = entries[key]
            assert isinstance(entry, DcpTensor)
            group = member.get(name)
            states = layout.states.get(name, {})
            if group is None and states:
                raise LayoutMismatchError(
                    f"{self.folder}: '{name}' has optimizer state but is in no param group."
                )
            if group is None and _is_buffer(name, entry.dtype):
                buffers[name] = self.array(key)
                continue
            trainable = group is not None or layout.optimizer_key is None
            param = SourceParam(
                shape=entry.shape,
                dtype=entry.dtype,
                requires_grad=trainable,
                group=group,
                # a frozen parameter's value is stored as it is (format 2, docs/format.md §2.1)
                arrays={(FP32_STATE if trainable else VALUE_STATE): self.array(key)},
            )
            for state, state_key in states.items():
                self._add_state(param, name, state, state_key)
            params[name] = param
        client_state = self._client_state(layout.other)
        return SourceCheckpoint(
            source=self._source_info(params),
            params=params,
            buffers=buffers,
            tied={},
            optimizer=_optimizer_info(params, groups) if layout.optimizer_key else None,
            progress=training_progress(client_state.values, params),
            client_state=client_state,
            files=list(self.handles),
            closers=[self.close_descriptors],
        )

    def _fused_param(self, layout: DcpLayout, owner: str, member: dict[str, int]) -> SourceParam:
        """The fused parameter ``owner`` (torchtitan's ``wqkv``): its split weights' fragments
        moved to their rows of the fused array, its own optimizer state."""
        parts = [self.array(layout.params[part]) for part in layout.fused[owner]]
        assert layout.head_dim is not None
        where = f"{self.folder}: '{owner}'"
        shape, blocks = fused_qkv_blocks([p.shape for p in parts], layout.head_dim, where)
        if len({p.dtype for p in parts}) != 1:
            raise LayoutMismatchError(f"{where}: its split weights have different dtypes.")
        param = SourceParam(
            shape=shape,
            dtype=parts[0].dtype,
            requires_grad=True,
            group=member.get(owner),
            arrays={FP32_STATE: join_rows(parts, shape, blocks)},
        )
        for state, state_key in layout.states.get(owner, {}).items():
            self._add_state(param, owner, state, state_key)
        return param

    def _add_state(self, param: SourceParam, name: str, state: str, key: str) -> None:
        entry = self.metadata.entries[key]
        if isinstance(entry, DcpBytes) or not entry.shape:
            param.scalars[state] = self.scalar(key)
        elif entry.shape == param.shape:
            param.arrays[state] = self.array(key)
        else:
            raise LayoutMismatchError(
                f"{self.folder}: optimizer state '{state}' of '{name}' has shape "
                f"{list(entry.shape)}, the parameter {list(param.shape)}."
            )

    def _groups(self, layout: DcpLayout) -> list[OptimizerGroup]:
        if layout.nested:
            return [self._nested_group(layout, index) for index in sorted(layout.groups, key=int)]
        groups: list[OptimizerGroup] = []
        by_identity: dict[str, int] = {}
        for name, keys in layout.groups.items():
            hyper = {hp: encode(self.value(key)) for hp, key in keys.items()}
            identity = json.dumps(hyper, sort_keys=True)
            if identity not in by_identity:
                by_identity[identity] = len(groups)
                groups.append(OptimizerGroup(params=[], hyperparams=hyper))
            groups[by_identity[identity]].params.append(name)
        return groups

    def _nested_group(self, layout: DcpLayout, index: str) -> OptimizerGroup:
        keys = layout.groups[index]
        if "params" not in keys:
            raise NotACheckpointError(f"{self.folder}: param group {index} has no 'params' list.")
        members = self.value(keys["params"])
        if not isinstance(members, list) or not all(m in layout.params for m in members):
            raise NotACheckpointError(
                f"{self.folder}: param group {index} lists {str(members)[:120]}, not FQNs of the "
                "model's weights; save the optimizer with get_optimizer_state_dict."
            )
        hyper = {hp: encode(self.value(key)) for hp, key in keys.items() if hp != "params"}
        return OptimizerGroup(params=list(members), hyperparams=hyper)

    def _client_state(self, keys: list[str]) -> ClientState:
        return encode_client_state((key, self._client_value(key)) for key in keys)

    def _client_value(self, key: str) -> Any:
        entry = self.metadata.entries[key]
        if isinstance(entry, DcpTensor):
            return NotStored(f"tensor {entry.dtype}{list(entry.shape)}")
        return self.value(key)

    def _source_info(self, params: dict[str, SourceParam]) -> SourceInfo:
        floats = Counter(p.dtype for p in params.values() if p.dtype in _FLOATING)
        names, checkpoint_format = self.checkpoint_files()
        train = floats.most_common(1)[0][0] if floats else "float32"
        return self.source_info(names, checkpoint_format=checkpoint_format, train_dtype=train)

    def source_info(
        self,
        names: list[str],
        *,
        checkpoint_format: str,
        train_dtype: str,
        optimizer_wrapper: str = "",
    ) -> SourceInfo:
        """The provenance of a folder written by ``dcp.save``: its files ``names`` (sizes read
        now), its world size, the format built on DCP."""
        return SourceInfo(
            framework="pytorch",
            framework_version="unknown",
            written_by="convert",
            checkpoint_format=checkpoint_format,
            path=str(self.folder.resolve()),
            tag="",
            world_size=self.world_size(),
            train_dtype=train_dtype,  # type: ignore[arg-type]
            optimizer_wrapper=optimizer_wrapper,
            mesh_shape=self.mesh_shape(),
            files=[SourceFile(name=n, size=(self.folder / n).stat().st_size) for n in names],
        )

    def world_size(self) -> int:
        """The ranks that wrote the checkpoint."""
        return self.metadata.world_size

    def mesh_shape(self) -> list[int] | None:
        """The device mesh of sharded parameters, where the checkpoint records it (DCP: no)."""
        return None


class _Reader(DcpDescriber):
    """Opens items of one DCP checkpoint on shared per-file descriptors."""

    def __init__(self, folder: Path, metadata: DcpMetadata, policy: PicklePolicy) -> None:
        self.folder, self.metadata, self.policy = folder, metadata, policy
        self.fds: dict[str, int] = {}
        self.handles: list[TorchFile] = []
        for name in metadata.data_files:
            path = folder / name
            if not path.is_file():
                self.close()
                raise SourceNotFoundError(
                    f"{path}: missing; {METADATA_NAME} lists items in it. Copy the whole "
                    "checkpoint folder."
                )
            self.fds[name] = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.close_descriptors()

    def checkpoint_files(self) -> tuple[list[str], str]:
        """``.metadata`` (one per merged folder) and every data file."""
        folders = sorted({n.rpartition("/")[0] for n in self.metadata.data_files}) or [""]
        metadata_files = [f"{d}/{METADATA_NAME}" if d else METADATA_NAME for d in folders]
        return [*metadata_files, *self.metadata.data_files], "torch-dcp"

    def close_descriptors(self) -> None:
        """Close the data files' descriptors (after every item handle is closed)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    # --- items --------------------------------------------------------------------------------
    def open_item(self, key: str, offsets: tuple[int, ...] | None) -> TorchFile:
        """The ``torch.save`` archive of one item (a chunk at ``offsets``, or a bytes value)."""
        return self._open(key, offsets)

    def _open(self, key: str, offsets: tuple[int, ...] | None) -> TorchFile:
        item = self.metadata.items.get((key, offsets))
        if item is None:
            what = "value" if offsets is None else f"chunk at {list(offsets)}"
            raise LayoutMismatchError(
                f"{self.folder / METADATA_NAME}: '{key}' lists a {what} that no storage entry "
                "holds; the metadata is damaged."
            )
        handle = open_embedded_torch_file(
            self.fds[item.relative_path],
            self.folder / item.relative_path,
            item.offset,
            item.length,
            self.policy,
        )
        self.handles.append(handle)
        return handle

    def value(self, key: str) -> Any:
        """The Python value of a bytes entry (decoded by the allow-list unpickler)."""
        return self._open(key, None).obj

    def array(self, key: str) -> ArraySource:
        """A tensor entry as an array whose fragments are its chunks' runs."""
        entry = self.metadata.entries[key]
        if not isinstance(entry, DcpTensor):
            raise LayoutMismatchError(f"{self.folder}: '{key}' is not a tensor entry.")
        array = ArraySource(entry.shape, entry.dtype)
        for chunk in entry.chunks:
            runs = chunk_runs(entry.shape, chunk.offsets, chunk.sizes)
            if not runs:
                continue
            tensor = self.chunk_tensor(key, entry, chunk)
            array.fragments.extend(
                SourceFragment(tensor, run.chunk_start, run.start, run.length) for run in runs
            )
        return array

    def chunk_tensor(self, key: str, entry: DcpTensor, chunk: DcpChunk) -> TensorRef:
        """The tensor of one chunk of entry ``key``, checked against what the metadata says."""
        handle = self._open(key, chunk.offsets)
        tensor = handle.obj
        if not isinstance(tensor, TensorRef):
            raise LayoutMismatchError(
                f"{handle.path}: the item of '{key}' holds {describe_type(tensor)}, not a tensor."
            )
        if tensor.shape != chunk.sizes or tensor.dtype_name != entry.dtype:
            raise LayoutMismatchError(
                f"{handle.path}: the chunk of '{key}' at {list(chunk.offsets)} is "
                f"{tensor.dtype_name}{list(tensor.shape)}, but {METADATA_NAME} says "
                f"{entry.dtype}{list(chunk.sizes)}; files from different saves are mixed."
            )
        return tensor

    def scalar(self, key: str) -> ScalarState:
        """A 0-d optimizer state (tensor entry of shape ``()``, or a Python number)."""
        entry = self.metadata.entries[key]
        if isinstance(entry, DcpBytes):
            return scalar_state(self.value(key), key)
        if len(entry.chunks) != 1:
            raise LayoutMismatchError(f"{self.folder}: 0-d '{key}' has {len(entry.chunks)} chunks.")
        return scalar_state(self._open(key, entry.chunks[0].offsets).obj, key)


#: The item opener, for readers of formats built on DCP (Megatron-Core ``torch_dist``):
#: ``DcpItems(folder, metadata, policy)``, then ``array(key)``, ``value(key)``, ``open_item``,
#: ``chunk_tensor``, ``source_info``.
DcpItems = _Reader


def _is_buffer(name: str, dtype: str) -> bool:
    return dtype not in _FLOATING or name.rpartition(".")[2] in BUFFER_NAMES


def _optimizer_info(params: dict[str, SourceParam], groups: list[OptimizerGroup]) -> OptimizerInfo:
    state_keys = sorted(
        {k for p in params.values() for k in p.arrays if k not in (FP32_STATE, VALUE_STATE)}
    )
    scalar_keys = sorted({k for p in params.values() for k in p.scalars})
    first = groups[0].hyperparams if groups else {}
    name, adam_w = "unknown", None
    if "decoupled_weight_decay" in first:
        adam_w = bool(first["decoupled_weight_decay"])
        name = "torch.optim.AdamW" if adam_w else "torch.optim.Adam"
    elif {"amsgrad", "betas"} <= set(first):
        name, adam_w = "torch.optim.Adam", False
    return OptimizerInfo(
        name=name, adam_w_mode=adam_w, state_keys=state_keys, scalar_keys=scalar_keys, groups=groups
    )
