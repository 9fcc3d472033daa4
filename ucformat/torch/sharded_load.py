"""Load a store into a model whose parameters are DTensors (FSDP2, HSDP, TP, FSDP2 + TP).

What :func:`ucformat.torch.load` runs when the model holds DTensors. Per rank:

1. compare the model with the manifest (names, global shapes, buffers) and the optimizer's
   param groups with the stored ones, matched by the parameter names they hold; with
   ``strict=True`` any difference fails here, before anything changes;
2. read, into new tensors, exactly the runs of flat elements of every array this rank's local
   shards cover (:mod:`ucformat.torch.dtensor`: one run for a ``Shard(0)`` row block, one per
   row for a ``Shard(1)`` column block, any placements on any mesh): the fp32 weights and
   every optimizer state of each parameter, frozen parameters, buffers (whole: they are not
   sharded), as one :class:`~ucformat.read.batch.ReadBatch`. With ``read="once"`` (or
   ``"auto"`` where ranks share chunks: HSDP replicas, buffers, chunks cut by shards) the job
   reads each chunk once and shares it (:mod:`ucformat.read.shared`); with ``"own"`` each rank
   reads its runs, each chunk fetched once. A rank whose shard of a parameter is empty reads
   nothing for it;
3. agree with every other rank that all reads succeeded (one agreement), then write: local
   shards in place, optimizer states into the optimizer's tensors (or as new DTensors with the
   parameter's mesh and placements where the optimizer has none yet), ``step`` in the type the
   optimizer uses, hyper-parameters into the matched groups.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.collective import NOTHING_LOADED, settle
from ucformat.collective import group as ranks_group
from ucformat.errors import (
    ModelMismatchError,
    UCFormatError,
    UnsupportedExportError,
)
from ucformat.format.dtypes import itemsize
from ucformat.format.models import CheckpointManifest
from ucformat.format.names import model_named
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE, STEP_STATE
from ucformat.read.batch import Pending, ReadBatch
from ucformat.read.checkpoint import BUFFER_STATE, UniversalCheckpoint, scalar_value
from ucformat.read.model_match import match_model, refuse_mismatch
from ucformat.read.shared import read_batch
from ucformat.read.staging import wants_pinned
from ucformat.torch.dtensor import LocalShard, local_shard, persistent_buffers
from ucformat.torch.odd_states import odd_states_left_out
from ucformat.torch.optim_groups import merged_group, torch_step_tensor

__all__ = ["load_sharded"]


@dataclass
class _ParamRead:
    """What this rank read for one parameter (nothing is written until every rank is ready)."""

    name: str
    param: torch.Tensor
    shard: LocalShard
    fp32: Pending | None = None
    states: dict[str, Pending] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


def _check_model(
    manifest: CheckpointManifest,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    strict: bool,
    report: Any,
) -> None:
    """Raise :class:`ModelMismatchError` (before anything changes) naming what differs."""
    match = match_model(
        {n: t.shape for n, t in params.items()},
        {n: e.shape for n, e in manifest.params.items()},
        resolve=manifest.resolve,
    ) + match_model(
        {n: b.shape for n, b in buffers.items()},
        {n: e.shape for n, e in manifest.buffers.items()},
        label="buffer ",
    )
    report.missing, report.unexpected = match.missing, match.unexpected
    refuse_mismatch(match, strict=strict)


def _match_groups(
    manifest: CheckpointManifest,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    strict: bool,
) -> list[tuple[int, dict[str, Any]]]:
    """For each live param group: the stored group holding the same parameters, and the
    hyper-parameters it gets. Raises before anything changes if a group has no match."""
    if manifest.optimizer is None:
        raise UnsupportedExportError(
            "this store holds no optimizer state; pass optimizer=None to load the model only."
        )
    stored = {
        frozenset(group.params): index for index, group in enumerate(manifest.optimizer.groups)
    }
    matched = []
    for number, group in enumerate(optimizer.param_groups):
        members = [names.get(id(p), "?") for p in group["params"]]
        key = frozenset(manifest.resolve(n) for n in members)
        index = stored.get(key)
        if index is None:
            raise ModelMismatchError(
                f"the optimizer's param group {number} ({', '.join(members)}) matches no param "
                f"group of the checkpoint ({manifest.optimizer.name}, groups "
                f"{[g.params for g in manifest.optimizer.groups]}); build the optimizer with the "
                "training run's param groups. Nothing was loaded."
            )
        matched.append((index, merged_group(manifest, index, group, strict)))
    return matched


def _read_param(
    ckpt: UniversalCheckpoint, name: str, param: torch.Tensor, state_keys: list[str],
    batch: ReadBatch,
) -> tuple[_ParamRead, int]:  # fmt: skip
    """This rank's range of every array of ``name`` (added to ``batch``), and its bytes."""
    manifest = ckpt.manifest
    owner = manifest.resolve(name)
    entry = manifest.params[owner]
    shard = local_shard(name, param)
    read = _ParamRead(name, param, shard)
    runs = [(run.start, run.start + run.length, run.chunk_start) for run in shard.runs]
    # An empty shard (no runs) reads nothing and gives empty tensors; a shard on a CUDA device
    # is read into pinned host memory (its one host copy, then one DMA each).
    pin = wants_pinned(shard.local.device)
    read.fp32 = batch.runs(ckpt, owner, FP32_STATE, runs, pin=pin)
    needed = shard.numel * itemsize(ckpt.array_ref(owner, FP32_STATE).dtype)
    for key in state_keys:
        if key in entry.states:
            read.states[key] = batch.runs(ckpt, owner, key, runs, pin=pin)
            needed += shard.numel * itemsize(entry.states[key].dtype)
    if state_keys:
        read.scalars = {k: scalar_value(s) for k, s in entry.scalars.items()}
    return read, needed


def _set_state(state: dict[str, Any], key: str, read: _ParamRead, values: torch.Tensor) -> None:
    """Put ``values`` (this rank's flat range) into the optimizer state ``key``."""
    existing = state.get(key)
    local_shape = read.shard.local.shape
    if existing is not None and isinstance(existing, torch.Tensor):
        target = existing.to_local() if hasattr(existing, "to_local") else existing
        if target.shape == local_shape:
            target.copy_(values.reshape(local_shape).to(target.dtype))
            return
    state[key] = read.shard.like(values.reshape(local_shape).to(read.shard.local.device))


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ckpt: UniversalCheckpoint,
    strict: bool,
    report: Any,
    read_mode: str = "auto",
) -> None:
    """Fill ``model`` (DTensor parameters) and ``optimizer`` from ``ckpt``; fill ``report``."""
    started = time.perf_counter()
    before, requests_before = ckpt.stats.bytes_read, ckpt.stats.requests
    manifest = ckpt.manifest
    params = model_named(model.named_parameters(), "the model's parameters")  # format/names.py
    buffers = model_named(persistent_buffers(model).items(), "buffers")
    _check_model(manifest, params, buffers, strict, report)
    names = {id(p): n for n, p in params.items()}
    groups = _match_groups(manifest, optimizer, names, strict) if optimizer is not None else []
    state_keys = list(manifest.optimizer.state_keys) if optimizer and manifest.optimizer else []
    trainable = {
        names[id(p)] for g in (optimizer.param_groups if optimizer else []) for p in g["params"]
    }
    if optimizer is not None:  # states kept whole or per ZeRO partition fit no shard
        owners = {manifest.resolve(name) for name in trainable}
        report.skipped = odd_states_left_out(manifest, sharded=True, strict=strict, names=owners)

    reads: list[_ParamRead] = []
    pending_buffers: dict[str, Pending] = {}
    needed = 0
    batch = ReadBatch()
    failure: BaseException | None = None
    try:
        for name, param in params.items():
            if manifest.resolve(name) not in manifest.params:
                continue
            keys = state_keys if name in trainable else []
            read, count = _read_param(ckpt, name, param, keys, batch)
            reads.append(read)
            needed += count
        for name in buffers:
            if name in manifest.buffers:
                pending_buffers[name] = batch.whole(ckpt, name, BUFFER_STATE)
                needed += manifest.buffers[name].array.nbytes
    except (UCFormatError, OSError) as exc:  # still take part in the job's reads
        failure, batch = exc, ReadBatch()
    group = ranks_group().operation()
    outcome = read_batch(ckpt, batch, group, read=read_mode)
    settle(failure or outcome.failure, group, ckpt.where, undone=NOTHING_LOADED)
    buffer_values = {name: pending.value() for name, pending in pending_buffers.items()}

    # --- nothing above modified the model or the optimizer; from here on, write ---------------
    torch_step = optimizer is not None and type(optimizer).__module__.startswith("torch.optim")
    with torch.no_grad():
        for read in reads:
            local = read.shard.local
            if read.fp32 is not None and local.numel():
                local.copy_(read.fp32.value().reshape(local.shape).to(local.dtype))
            if optimizer is None or read.name not in trainable:
                continue
            state = optimizer.state[read.param]
            for key, values in read.states.items():
                _set_state(state, key, read, values.value())
            for key, value in read.scalars.items():
                state[key] = torch_step_tensor(value) if key == STEP_STATE and torch_step else value
        for name, value in buffer_values.items():
            buffers[name].copy_(value.to(buffers[name].dtype))
    if optimizer is not None:
        for live, (_, merged) in zip(optimizer.param_groups, groups, strict=True):
            live.update(merged)
    report.client_state = {k: decode(v) for k, v in manifest.client_state.values.items()}
    report.bytes_read = ckpt.stats.bytes_read - before
    report.bytes_needed = needed
    report.requests = ckpt.stats.requests - requests_before
    report.record(outcome, group, report.bytes_read, report.requests, needed)
    report.seconds = time.perf_counter() - started
