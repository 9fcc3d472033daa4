"""``ucformat.torch.save``: write a store from a live PyTorch model and optimizer.

Works for a plain model in one process and, collectively, for a model whose parameters are
DTensors (FSDP2, HSDP) under ``torch.distributed``. Every rank runs the same steps:

1. describe the model and the optimizer: every parameter (tied ones once), buffer, optimizer
   state and param group, with each rank's local shard (:mod:`ucformat.torch.dtensor`). The
   ranks exchange this small description once, so they all plan the same store;
2. plan the store with the converter's planner (:func:`ucformat.write.plan.plan_convert`). Each
   array is described by its owners' flat ranges (:func:`ucformat.layout.dtensor.owners`: one
   replica each), and chunked so shards end on owner boundaries where chunks stay large
   (:func:`~ucformat.layout.dtensor.aligned_chunking`);
3. give every store shard exactly one writer, the rank holding most of it
   (:func:`~ucformat.layout.dtensor.plan_unit_writes`); the pieces of a shard held by other
   ranks are sent to the writer (point-to-point, all at once);
4. rank 0 creates the store's metadata, then every rank writes its shards with the converter's
   writer (:func:`ucformat.write.execute.write_units`) straight from its local tensors;
5. the ranks agree that every rank succeeded; only then rank 0 commits the manifest. A failure
   anywhere leaves no committed store and raises on every rank.

The stored state has the converter's form: ``fp32`` (fp32 weights; frozen params in their own
dtype), one array per optimizer state (``exp_avg``, ``exp_avg_sq``, ...), the ``step`` scalar,
param groups with their hyper-parameters, so ``ucformat.deepspeed.load`` and
``ucformat.torch.load`` resume from it at any world size.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucformat.errors import SaveAbortedError, StoreExistsError, UCFormatError
from ucformat.format.dtypes import dtype_name, itemsize, numpy_storage_dtype, torch_to_storage
from ucformat.format.models import (
    CheckpointManifest,
    ClientState,
    OptimizerGroup,
    OptimizerInfo,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.names import model_name, model_named
from ucformat.format.pyvalue import encode, try_encode
from ucformat.format.spec import (
    FP32_STATE,
    VALUE_STATE,
    buffer_array_path,
    state_array_path,
)
from ucformat.layout.chunking import Chunking, ChunkPolicy
from ucformat.layout.dtensor import Owner, UnitWrite, aligned_chunking, owners, plan_unit_writes
from ucformat.sources.base import (
    ArraySource,
    SourceCheckpoint,
    SourceFragment,
    SourceParam,
    scalar_state,
)
from ucformat.store.arrays import array_from_manifest, create_arrays
from ucformat.store.keys import Store, StoreLike, open_store
from ucformat.store.lifecycle import discard_store, start_store
from ucformat.store.manifest_io import commit_manifest
from ucformat.torch.dtensor import (
    LocalShard,
    is_dtensor,
    local_shard,
    mesh_ranks,
    persistent_buffers,
    reshard,
)
from ucformat.write.execute import DEFAULT_WORKERS, write_units
from ucformat.write.plan import ConvertOptions, ConvertPlan, plan_convert

__all__ = ["save"]


class LiveTensor:
    """A fragment's tensor for the writer: this rank's local values, or (on a writer) the
    pieces other ranks sent it, addressed by flat element offset within the fragment."""

    def __init__(self, rank: int, dtype: str, local: np.ndarray | None) -> None:
        self.rank = rank
        self.dtype = dtype
        self._runs: list[tuple[int, np.ndarray]] = [] if local is None else [(0, local)]

    def add(self, start: int, values: np.ndarray) -> None:
        """Make elements ``[start, start + len(values))`` available (received from their owner)."""
        bisect.insort(self._runs, (start, values), key=lambda run: run[0])

    def _slice(self, start: int, stop: int) -> np.ndarray:
        index = bisect.bisect_right([s for s, _ in self._runs], start) - 1
        if index < 0:
            raise RuntimeError(f"elements [{start}, {stop}) of rank {self.rank} were not received")
        first, values = self._runs[index]
        if stop - first > len(values):
            raise RuntimeError(f"elements [{start}, {stop}) of rank {self.rank} were not received")
        return values[start - first : stop - first]

    @property
    def dtype_name(self) -> str:
        """The manifest's name of the values' dtype."""
        return self.dtype

    def is_contiguous(self) -> bool:
        """Always: the values are flat."""
        return True

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy flat elements ``[start, stop)`` into ``out``."""
        out[:] = self._slice(start, stop)

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Copy consecutive flat elements from ``start`` on into the byte ``views``."""
        item = itemsize(self.dtype)
        for view in views:
            count = len(view) // item
            view[:] = self._slice(start, start + count).view(np.uint8).data
            start += count

    def load(self) -> torch.Tensor:
        """Unused (the values are contiguous)."""
        raise NotImplementedError


@dataclass
class _Array:
    """One array to write: its path, owners and this rank's local values."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    holders: list[Owner]
    local: np.ndarray | None
    tensors: dict[int, LiveTensor] = field(default_factory=dict)

    def source(self) -> ArraySource:
        array = ArraySource(self.shape, self.dtype)
        for owner in self.holders:
            tensor = LiveTensor(
                owner.rank, self.dtype, self.local if owner.rank == _rank() else None
            )
            self.tensors[owner.start] = tensor
            array.fragments.append(SourceFragment(tensor, 0, owner.start, owner.stop - owner.start))
        return array


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _distributed() else 1


def _comm_device() -> torch.device:
    import torch.distributed as dist

    if _distributed() and dist.get_backend() != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _flat_storage(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """This rank's values of ``tensor`` as a flat CPU array of the stored dtype."""
    from ucformat.format.dtypes import torch_dtype

    values = tensor.detach().to("cpu", torch_dtype(dtype)).contiguous().reshape(-1)
    return torch_to_storage(values)


def _array(path: str, shard: LocalShard, tensor: torch.Tensor, dtype: str) -> _Array:
    """The array ``path`` holding ``tensor`` (laid out like ``shard``) in ``dtype``."""
    holders = owners(shard.shape, shard.mesh_shape, shard.shard_dims or (None,), mesh_ranks(shard))
    mine = any(o.rank == _rank() for o in holders)
    return _Array(path, shard.shape, dtype, holders, _flat_storage(tensor, dtype) if mine else None)


def _group_info(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[OptimizerGroup]:
    groups = []
    for group in optimizer.param_groups:
        hyper = {str(k): encode(v) for k, v in group.items() if k != "params"}
        groups.append(
            OptimizerGroup(params=[names[id(p)] for p in group["params"]], hyperparams=hyper)
        )
    return groups


def _optimizer_name(optimizer: torch.optim.Optimizer) -> tuple[str, bool | None]:
    cls = type(optimizer)
    name = (
        f"torch.optim.{cls.__name__}"
        if cls.__module__.startswith("torch.optim")
        else (f"{cls.__module__}.{cls.__qualname__}")
    )
    first = optimizer.param_groups[0] if optimizer.param_groups else {}
    if "decoupled_weight_decay" in first:
        return name, bool(first["decoupled_weight_decay"])
    if cls.__name__ == "AdamW":
        return name, True
    if cls.__name__ == "Adam":
        return name, False
    return name, None


#: Params, buffers, every array, tied names and the first DTensor's mesh.
_Description = tuple[dict[str, SourceParam], dict[str, _Array], list[_Array], dict[str, str], Any]


def _describe(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> _Description:
    """Params, buffers, arrays and tied names of the live model (no I/O)."""
    params = model_named(model.named_parameters(), "the model's parameters")  # format/names.py
    tied: dict[str, str] = {}
    by_id = {id(p): n for n, p in params.items()}
    for name, param in model.named_parameters(remove_duplicate=False):
        if model_name(name) not in params:
            tied[model_name(name)] = by_id[id(param)]
    group_of: dict[int, int] = {}
    if optimizer is not None:
        for index, members in enumerate(optimizer.param_groups):
            for param in members["params"]:
                group_of[id(param)] = index
    arrays: list[_Array] = []
    out: dict[str, SourceParam] = {}
    mesh = None
    for name, param in params.items():
        shard = local_shard(name, param)
        if shard.mesh is not None and mesh is None:
            mesh = shard.mesh
        group = group_of.get(id(param))
        trainable = group is not None
        stored = "float32" if trainable and param.is_floating_point() else dtype_name(param.dtype)
        source = SourceParam(
            shape=shard.shape, dtype=dtype_name(param.dtype), requires_grad=param.requires_grad,
            group=group,
        )  # fmt: skip
        # Trainable: the fp32 master weight; frozen: the value in its own dtype (format 2).
        value_state = FP32_STATE if trainable else VALUE_STATE
        fp32 = _array(state_array_path(name, value_state), shard, shard.local, stored)
        arrays.append(fp32)
        source.arrays[value_state] = fp32.source()
        state = optimizer.state.get(param, {}) if optimizer is not None and trainable else {}
        for key, value in sorted(state.items()):
            if (
                isinstance(value, torch.Tensor)
                and tuple(value.shape) == shard.shape
                and value.dim()
            ):
                local = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
                item = _array(state_array_path(name, key), shard, local, dtype_name(value.dtype))
                arrays.append(item)
                source.arrays[key] = item.source()
            else:
                source.scalars[key] = scalar_state(value, f"optimizer state '{key}' of '{name}'")
        out[name] = source
    buffers: dict[str, _Array] = {}
    for name, buffer in model_named(persistent_buffers(model).items(), "buffers").items():
        shard = local_shard(name, buffer)
        item = _array(buffer_array_path(name), shard, shard.local, dtype_name(buffer.dtype))
        buffers[name] = item
        arrays.append(item)
    return out, buffers, arrays, tied, mesh


def _agree(failure: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed (the failing rank re-raises its own error)."""
    failed: list[Any] = [None]
    if _distributed():
        import torch.distributed as dist

        failed = [None] * dist.get_world_size()
        note = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(failed, note)
    if failure is not None:
        raise failure
    bad = [(rank, note) for rank, note in enumerate(failed) if note is not None]
    if bad:
        rank, note = bad[0]
        raise SaveAbortedError(f"{what}: rank {rank} failed ({note}); nothing was committed.")


def _exchange(plan: list[tuple[_Array, UnitWrite]]) -> None:
    """Send every piece a writer needs from its owner (non-blocking, all at once)."""
    if not _distributed():
        return
    import torch.distributed as dist

    me, device = _rank(), _comm_device()
    ops = []
    received: list[tuple[LiveTensor, int, torch.Tensor, str]] = []
    tag = 0
    for array, unit in plan:
        for piece in unit.transfers:
            tag += 1
            owner = max((o for o in array.holders if o.start <= piece.start), key=lambda o: o.start)
            offset = piece.start - owner.start
            if piece.rank == me and array.local is not None:
                piece_values = array.local[offset : offset + piece.stop - piece.start]
                values = torch.from_numpy(piece_values.view(np.uint8))  # bytes: any dtype
                ops.append(dist.P2POp(dist.isend, values.to(device), unit.writer, tag=tag))
            elif unit.writer == me:
                count = piece.stop - piece.start
                buffer = torch.empty(
                    count * itemsize(array.dtype), dtype=torch.uint8, device=device
                )
                ops.append(dist.P2POp(dist.irecv, buffer, piece.rank, tag=tag))
                received.append((array.tensors[owner.start], offset, buffer, array.dtype))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for tensor, offset, buffer, dtype in received:
        tensor.add(offset, buffer.cpu().numpy().view(numpy_storage_dtype(dtype)))


def save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: StoreLike,
    *,
    client_state: dict[str, Any] | None = None,
    overwrite: bool = False,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    workers: int = DEFAULT_WORKERS,
) -> CheckpointManifest:
    """Write a ucformat store from a live model and optimizer (FSDP2, HSDP or plain).

    Under ``torch.distributed`` this is collective: call it on every rank with the same
    arguments. Each rank writes the store shards its local shards cover; the manifest is
    committed once every rank has succeeded.

    Args:
        model: the model (DTensor parameters from ``fully_shard``, or plain tensors).
        optimizer: its optimizer (``torch.optim``), or None for weights only.
        store: a local path, an fsspec URL, or a zarr ``Store``.
        client_state: small extra state to keep with the checkpoint (JSON-like values).
        overwrite: replace an existing ucformat store at ``store``.
        chunk_bytes: inner chunk target (read granularity); default 64 KiB.
        shard_bytes: shard target (storage object size); default 16 MiB.
        workers: threads writing shards concurrently on each rank.

    Returns:
        The committed manifest.

    Raises:
        StoreExistsError: ``store`` exists and ``overwrite`` is not set (on every rank: rank 0
            raises it, the others :class:`SaveAbortedError` naming it).
        SaveAbortedError: another rank failed; nothing was committed.
        UnsupportedExportError: a DTensor with placements other than Shard(0)/Replicate().

    Example:
        >>> ucformat.torch.save(model, optimizer, "ckpt.ucf")  # doctest: +SKIP
    """
    where = str(store)
    failure: BaseException | None = None
    reshard(model)
    try:  # 1-2: describe and plan (local work only)
        params, buffers, arrays, tied, mesh = _describe(model, optimizer)
    except (UCFormatError, ValueError, TypeError) as exc:
        failure = exc
    _agree(failure, where)
    _check_same_everywhere(params, arrays)
    try:
        plan = _plan(
            model, optimizer, store, client_state, (chunk_bytes, shard_bytes),
            (params, buffers, arrays, tied, mesh),
        )  # fmt: skip
        by_path = {a.path: a for a in arrays}
        writes = [
            (array, plan_unit_writes([(unit.flat_start, unit.flat_stop)], array.holders)[0])
            for unit in plan.units
            for array in [by_path[plan.arrays[unit.array].path]]
        ]
    except (UCFormatError, ValueError, TypeError) as exc:
        failure = exc
    _agree(failure, where)
    zstore: Store | None = None
    created = False
    if _rank() == 0:  # 4: the store's metadata, by one rank
        try:
            zstore = open_store(store, read_only=False)
            try:  # the destination emptied, the root group written (uncommitted)
                created = start_store(zstore, overwrite)
            except StoreExistsError as exc:  # the API's option, not the CLI's
                raise StoreExistsError(str(exc).replace("--overwrite", "overwrite=True")) from None
            create_arrays(zstore, plan.arrays)
        except (UCFormatError, OSError) as exc:
            failure = exc
    _agree(failure, where)
    try:  # 3-4: pieces to their writers, then every rank writes its shards
        _exchange(writes)
        if zstore is None:
            zstore = open_store(store, read_only=False)
        opened = [array_from_manifest(zstore, ref) for ref in plan.arrays]
        me = _rank()
        mine = [unit for unit, (_, w) in zip(plan.units, writes, strict=True) if w.writer == me]
        write_units(plan, opened, mine, workers=workers)
    except (UCFormatError, OSError, RuntimeError) as exc:
        failure = exc
    committed = plan.manifest
    try:  # 5: commit once everyone succeeded
        _agree(failure, where)
        if _rank() == 0:
            try:
                assert zstore is not None
                committed = commit_manifest(zstore, plan.manifest)
            except (UCFormatError, OSError) as exc:
                failure = exc
        _agree(failure, where)
    except BaseException:
        if _rank() == 0 and zstore is not None:
            discard_store(zstore, created)
        raise
    return committed


def _plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: StoreLike,
    client_state: dict[str, Any] | None,
    targets: tuple[int | None, int | None],
    described: _Description,
) -> ConvertPlan:
    params, buffers, arrays, tied, mesh = described
    chunk_bytes, shard_bytes = targets
    default = ChunkPolicy()
    chunk = chunk_bytes or default.chunk_bytes
    policy = ChunkPolicy(chunk, shard_bytes or max(default.shard_bytes, chunk))
    layouts: dict[str, Chunking] = {}
    for array in arrays:
        if array.shape:
            inner = math.prod(array.shape[1:]) or 1
            rows = [o.start // inner for o in array.holders]
            layouts[array.path] = aligned_chunking(array.shape, itemsize(array.dtype), policy, rows)
    info = None
    if optimizer is not None:
        names = {id(p): model_name(n) for n, p in model.named_parameters()}
        name, adam_w = _optimizer_name(optimizer)
        state_keys = sorted(
            {k for p in params.values() if p.group is not None for k in p.arrays if k != FP32_STATE}
        )
        scalar_keys = sorted({k for p in params.values() for k in p.scalars})
        info = OptimizerInfo(
            name=name, adam_w_mode=adam_w, state_keys=state_keys, scalar_keys=scalar_keys,
            groups=_group_info(optimizer, names),
        )  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
    train_dtype = dtype_name(trainable[0].dtype) if trainable else "float32"
    steps = [s.value for p in params.values() for k, s in p.scalars.items() if k == "step"]
    values: dict[str, Any] = {}
    unrepresentable: dict[str, str] = {}
    for key, value in (client_state or {}).items():
        ok, encoded = try_encode(value)
        if ok:
            values[str(key)] = encoded
        else:
            unrepresentable[str(key)] = str(encoded)
    source = SourceCheckpoint(
        source=SourceInfo(
            framework="pytorch",
            framework_version=torch.__version__.split("+")[0],
            written_by="save",
            checkpoint_format=None,
            path=str(store),
            tag="",
            world_size=_world(),
            train_dtype=train_dtype,  # type: ignore[arg-type]
            mesh_shape=list(mesh.shape) if mesh is not None else None,
            mesh_dim_names=list(mesh.mesh_dim_names)
            if mesh is not None and mesh.mesh_dim_names
            else None,
        ),
        params=params,
        buffers={name: array.source() for name, array in buffers.items()},
        tied=tied,
        optimizer=info,
        progress=TrainingProgress(global_steps=int(max(steps, default=0))),
        client_state=ClientState(values=values, unrepresentable=unrepresentable),
    )
    return plan_convert(source, ConvertOptions(policy=policy, layouts=layouts))


def _check_same_everywhere(params: dict[str, SourceParam], arrays: list[_Array]) -> None:
    """Every rank must plan the same store: compare a digest of the description."""
    if not _distributed():
        return
    import torch.distributed as dist

    summary = [
        repr((a.path, a.shape, a.dtype, [(o.rank, o.start, o.stop) for o in a.holders]))
        for a in arrays
    ]
    summary += [f"{name}: {p.scalars!r}" for name, p in params.items()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, "\n".join(summary))
    if any(other != everyone[0] for other in everyone):
        raise SaveAbortedError(
            "the ranks describe different models or optimizer states (names, shapes, "
            "optimizer state keys or steps differ); every rank must call save with the same "
            "sharded model. Nothing was written."
        )
