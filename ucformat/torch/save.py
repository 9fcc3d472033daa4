"""``ucformat.torch.save`` / ``save_async``: write a store from a live PyTorch model.

Works for a plain model in one process and, collectively, for a model whose parameters are
DTensors (FSDP2, HSDP) under ``torch.distributed``. Every rank runs the same steps, with the
same write engine as ``ucformat.deepspeed.save`` (:mod:`ucformat.write.spread`):

1. describe the model, the optimizer and the lr scheduler as a
   :class:`~ucformat.sources.base.SourceCheckpoint` of in-memory fragments: every parameter
   (tied ones once), buffer, optimizer state and param group; each array's fragments are its
   owners' runs of flat elements (one replica each, any placements:
   :func:`ucformat.layout.placements.run_owners`; a ``Shard(0)`` shard is one run, a
   ``Shard(1)`` column block one per row), this rank's read from a
   :class:`~ucformat.sources.live.MemoryTensor` (its local shard, in host memory), the others'
   :class:`~ucformat.sources.live.RemoteTensor`;
2. plan the store with the converter's planner (:func:`ucformat.write.plan.plan_convert`),
   chunked so shards end on owner boundaries where chunks stay large
   (:func:`~ucformat.layout.chunking.aligned_chunking`);
3. give every store shard one writer by :mod:`ucformat.layout.ownership`'s rule (the rank
   holding most of it) and write: the bytes a writer lacks come over the bounded all-to-all
   exchange, rank 0 commits the manifest once every rank agreed
   (:func:`~ucformat.write.spread.write_spread`). A failure anywhere leaves no committed store
   and raises the same :class:`~ucformat.errors.CollectiveError` on every rank.

:func:`save_async` copies the local shards to host memory, then writes in a background thread.
The plan's layout is kept per model (:mod:`ucformat.write.live_save`): the next save of the same
model, optimizer state and sharding only binds the kept plan to the current tensors.

The stored state has the converter's form: ``fp32`` (fp32 weights; frozen params in their own
dtype), one array per optimizer state (``exp_avg``, ``exp_avg_sq``, ...), the ``step`` scalar,
param groups with their hyper-parameters, the lr scheduler's ``state_dict`` when one is given,
so ``ucformat.deepspeed.load`` and ``ucformat.torch.load`` resume from it at any world size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ucformat.collective import Group
from ucformat.format.dtypes import dtype_name, itemsize, torch_dtype
from ucformat.format.models import (
    OptimizerGroup,
    OptimizerInfo,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.names import model_name, model_named
from ucformat.format.pyvalue import encode
from ucformat.format.spec import (
    FP32_STATE,
    VALUE_STATE,
    buffer_array_path,
    state_array_path,
)
from ucformat.format.training_values import encode_client_state, encode_exact
from ucformat.layout.chunking import Chunking, aligned_chunking
from ucformat.sources.base import (
    ArraySource,
    FragmentTensor,
    SourceCheckpoint,
    SourceFragment,
    SourceParam,
    optimizer_steps,
    scalar_state,
)
from ucformat.sources.live import HostCopies, MemoryTensor, RemoteTensor
from ucformat.store.keys import StoreLike
from ucformat.sysio.collector import collection_paused
from ucformat.torch.dtensor import (
    LocalShard,
    is_dtensor,
    local_shard,
    mesh_ranks,
    persistent_buffers,
    reshard,
)
from ucformat.write import background
from ucformat.write.convert import convert_options
from ucformat.write.execute import DEFAULT_WORKERS
from ucformat.write.live_save import (
    LiveSave,
    LiveTarget,
    SaveReport,
    prepare_live_save,
    write_live_save,
)
from ucformat.write.plan import ConvertPlan, PlanLayout, plan_convert
from ucformat.write.spread import DEFAULT_EXCHANGE_BUDGET

__all__ = ["save", "save_async"]


@dataclass
class _Described:
    """The live state as the planner sees it, and what the plan needs besides."""

    source: SourceCheckpoint
    #: Array path -> the first rows of its owners (for the aligned chunking).
    rows: dict[str, list[int]]
    #: Array path -> (shape, dtype).
    shapes: dict[str, tuple[tuple[int, ...], str]]


def _array(
    shard: LocalShard,
    runs: list[tuple[Any, int]],
    tensor: torch.Tensor,
    dtype: str,
    ranks: Group,
    copies: HostCopies,
) -> tuple[ArraySource, list[int]]:
    """The array holding ``tensor`` (laid out like ``shard``, owned by ``runs``:
    ``shard.owners``) in ``dtype``: one fragment per owner run (this rank's runs read from its
    local values in host memory, the others' named), and the runs' first rows."""
    array = ArraySource(shard.shape, dtype)
    local: MemoryTensor | None = None
    for owner, at in runs:
        if owner.rank == ranks.rank:
            if local is None:
                local = MemoryTensor.of(copies.host(tensor, torch_dtype(dtype)), ranks.rank)
            data: FragmentTensor = local
        else:
            data = RemoteTensor(owner.rank, dtype)  # the same offset: the plans must agree
        array.fragments.append(SourceFragment(data, at, owner.start, owner.stop - owner.start))
    inner = math.prod(shard.shape[1:]) if shard.shape else 1
    return array, [owner.start // (inner or 1) for owner, _ in runs]


def _group_info(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[OptimizerGroup]:
    groups = []
    for members in optimizer.param_groups:
        hyper = {str(k): encode(v) for k, v in members.items() if k != "params"}
        groups.append(
            OptimizerGroup(params=[names[id(p)] for p in members["params"]], hyperparams=hyper)
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


def _describe(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    client_state: Mapping[str, Any] | None,
    location: str,
    ranks: Group,
    copies: HostCopies,
) -> _Described:
    """The live model, optimizer and scheduler as a source checkpoint (host copies, no I/O)."""
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
    rows: dict[str, list[int]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    out: dict[str, SourceParam] = {}
    mesh = None

    def add(
        path: str, shard: LocalShard, runs: list[tuple[Any, int]], tensor: torch.Tensor, dtype: str
    ) -> ArraySource:
        array, firsts = _array(shard, runs, tensor, dtype, ranks, copies)
        rows[path], shapes[path] = firsts, (shard.shape, dtype)
        return array

    for name, param in params.items():
        shard = local_shard(name, param)
        runs = shard.owners(mesh_ranks(shard))  # the same for the weight and every state
        if shard.mesh is not None and mesh is None:
            mesh = shard.mesh
        group_index = group_of.get(id(param))
        trainable = group_index is not None
        stored = "float32" if trainable and param.is_floating_point() else dtype_name(param.dtype)
        source = SourceParam(
            shape=shard.shape, dtype=dtype_name(param.dtype), requires_grad=param.requires_grad,
            group=group_index,
        )  # fmt: skip
        # Trainable: the fp32 master weight; frozen: the value in its own dtype (format 2).
        value_state = FP32_STATE if trainable else VALUE_STATE
        path = state_array_path(name, value_state)
        source.arrays[value_state] = add(path, shard, runs, shard.local, stored)
        state = optimizer.state.get(param, {}) if optimizer is not None and trainable else {}
        for key, value in sorted(state.items()):
            if (
                isinstance(value, torch.Tensor)
                and tuple(value.shape) == shard.shape
                and value.dim()
            ):
                local = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
                path = state_array_path(name, key)
                source.arrays[key] = add(path, shard, runs, local, dtype_name(value.dtype))
            else:
                source.scalars[key] = scalar_state(value, f"optimizer state '{key}' of '{name}'")
        out[name] = source
    buffers: dict[str, ArraySource] = {}
    for name, buffer in model_named(persistent_buffers(model).items(), "buffers").items():
        shard = local_shard(name, buffer)
        runs = shard.owners(mesh_ranks(shard))
        path = buffer_array_path(name)
        buffers[name] = add(path, shard, runs, shard.local, dtype_name(buffer.dtype))
    copies.wait()
    info = None
    if optimizer is not None:
        names = {id(p): model_name(n) for n, p in model.named_parameters()}
        opt_name, adam_w = _optimizer_name(optimizer)
        state_keys = sorted(
            {k for p in out.values() if p.group is not None for k in p.arrays if k != FP32_STATE}
        )
        scalar_keys = sorted({k for p in out.values() for k in p.scalars})
        info = OptimizerInfo(
            name=opt_name, adam_w_mode=adam_w, state_keys=state_keys, scalar_keys=scalar_keys,
            groups=_group_info(optimizer, names),
        )  # fmt: skip
    trainable_params = [p for p in model.parameters() if p.requires_grad] or list(
        model.parameters()
    )
    train_dtype = dtype_name(trainable_params[0].dtype) if trainable_params else "float32"
    lr_scheduler = (
        None if scheduler is None else encode_exact(scheduler.state_dict(), "lr_scheduler")
    )
    source_ckpt = SourceCheckpoint(
        source=SourceInfo(
            framework="pytorch",
            framework_version=torch.__version__.split("+")[0],
            written_by="save",
            checkpoint_format=None,
            path=location,
            tag="",
            world_size=ranks.world_size,
            train_dtype=train_dtype,  # type: ignore[arg-type]
            mesh_shape=list(mesh.shape) if mesh is not None else None,
            mesh_dim_names=list(mesh.mesh_dim_names)
            if mesh is not None and mesh.mesh_dim_names
            else None,
        ),
        params=out,
        buffers=buffers,
        tied=tied,
        optimizer=info,
        progress=TrainingProgress(global_steps=optimizer_steps(out), lr_scheduler=lr_scheduler),
        client_state=encode_client_state((client_state or {}).items()),
    )
    return _Described(source_ckpt, rows, shapes)


def _plan(
    described: _Described,
    chunk_bytes: int | None,
    shard_bytes: int | None,
    kept: PlanLayout | None = None,
) -> ConvertPlan:
    """The store's plan, with the converter's chunk policy and shards on owner boundaries
    (``kept``: the layout kept from the model's previous save)."""
    options = convert_options(chunk_bytes, shard_bytes)
    layouts: dict[str, Chunking] = {}
    for path, (shape, dtype) in described.shapes.items():
        if shape:
            layouts[path] = aligned_chunking(
                shape, itemsize(dtype), options.policy, described.rows[path]
            )
    return plan_convert(described.source, replace(options, layouts=layouts), kept)


def _prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: StoreLike,
    *,
    scheduler: Any,
    client_state: Mapping[str, Any] | None,
    chunk_bytes: int | None,
    shard_bytes: int | None,
    copy_all: bool,
) -> LiveSave:
    """Describe, plan and choose the writers; agree that every rank could (collective)."""
    reshard(model)

    def plan(target: LiveTarget, kept: PlanLayout | None) -> ConvertPlan:
        described = _describe(
            model, optimizer, scheduler, client_state, target.location, target.group,
            target.copies,
        )  # fmt: skip
        return _plan(described, chunk_bytes, shard_bytes, kept)

    return prepare_live_save(
        store, api="ucformat.torch.save", copy_all=copy_all, owner=model, plan=plan
    )


def save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: StoreLike,
    *,
    scheduler: Any = None,
    client_state: dict[str, Any] | None = None,
    overwrite: bool = False,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    workers: int = DEFAULT_WORKERS,
    exchange_budget: int = DEFAULT_EXCHANGE_BUDGET,
    fsync: bool = True,
) -> SaveReport:
    """Write a ucformat store from a live model and optimizer (FSDP2, HSDP, TP, plain).

    Under ``torch.distributed`` this is collective: call it on every rank with the same
    arguments. Each store shard is written by the rank holding most of it; the manifest is
    committed once every rank has succeeded. Waits first for this process's
    :func:`save_async` still running.

    Args:
        model: the model (DTensor parameters from ``fully_shard``, or plain tensors).
        optimizer: its optimizer (``torch.optim``), or None for weights only.
        store: a local path, an fsspec URL (``s3://...``), or a zarr ``Store``.
        scheduler: an lr scheduler whose ``state_dict()`` is kept (``ucformat.torch.load``
            restores it when given one).
        client_state: small extra state to keep with the checkpoint (JSON-like values).
        overwrite: replace an existing ucformat store at ``store``.
        chunk_bytes: inner chunk target (read granularity); default as ``ucformat convert``.
        shard_bytes: shard target (storage object size); default as ``ucformat convert``.
        workers: threads writing shards concurrently on each rank.
        exchange_budget: bytes of straddling shards a rank holds at a time during the exchange
            (rounds move half of it, so one round is written while the next is exchanged).
        fsync: make a local store durable (every object and directory fsynced before the
            commit, the manifest after it: docs/format.md §6), which ``dcp.save`` does not
            do; ``False`` leaves the writeback to the OS (faster where the disk is slower than
            memory; a power loss may then lose a committed store).

    Returns:
        This rank's :class:`~ucformat.write.live_save.SaveReport` (``.manifest``: the
        committed manifest).

    Raises:
        StoreExistsError: (one process) ``store`` exists and ``overwrite`` is not set.
        CollectiveError: (several ranks) some rank failed, the same error on every rank naming
            the ranks and their messages (an existing store: rank 0's StoreExistsError);
            nothing was committed.
        UnsupportedExportError: a DTensor with a ``Partial()`` placement.

    Example:
        >>> ucformat.torch.save(model, optimizer, "ckpt.ucf")  # doctest: +SKIP
    """
    started = time.perf_counter()
    background.wait_for_pending()
    with collection_paused():
        prepared = _prepare(
            model, optimizer, store, scheduler=scheduler, client_state=client_state,
            chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, copy_all=False,
        )  # fmt: skip
        return write_live_save(
            prepared, overwrite=overwrite, workers=workers, exchange_budget=exchange_budget,
            fsync=fsync, started=started,
        )  # fmt: skip


def save_async(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: StoreLike,
    *,
    scheduler: Any = None,
    client_state: dict[str, Any] | None = None,
    overwrite: bool = False,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    workers: int = DEFAULT_WORKERS,
    exchange_budget: int = DEFAULT_EXCHANGE_BUDGET,
    fsync: bool = True,
) -> background.SaveHandle[SaveReport]:
    """Like :func:`save`, but return once this rank's state is copied to host memory.

    First waits for this process's previous ``save_async``. Then, in the calling thread: the
    plan is made and every local shard this rank holds (weights, optimizer states, buffers) is
    copied to host memory (pinned when it lives on a GPU). The writing, the exchange of
    straddling shards and the commit happen in a background thread, on ucformat's private gloo
    group, while training goes on: the next ``optimizer.step()`` does not change what is saved.
    Call ``handle.result()`` before ``torch.distributed.destroy_process_group``.

    Returns:
        A handle; ``result()`` gives the :class:`~ucformat.write.live_save.SaveReport` or
        raises the error.

    Raises:
        CollectiveError: a rank could not describe or copy its state (nothing was written).
    """
    started = time.perf_counter()
    background.wait_for_pending()
    with collection_paused():
        prepared = _prepare(
            model, optimizer, store, scheduler=scheduler, client_state=client_state,
            chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, copy_all=True,
        )  # fmt: skip
    blocked = time.perf_counter() - started
    return background.start(
        lambda: write_live_save(
            prepared,
            overwrite=overwrite,
            workers=workers,
            exchange_budget=exchange_budget,
            fsync=fsync,
            started=started,
            blocked=blocked,
        )
    )
