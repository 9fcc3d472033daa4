"""``ucformat.deepspeed.load``: resume a DeepSpeed engine from a ucformat store.

Call it on every rank after ``deepspeed.initialize``, at any world size and ZeRO stage::

    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=...)
    report = ucformat.deepspeed.load(engine, "ckpt.ucf")

Algorithm (per rank):

1. open the store and compare the engine's parameters with the manifest (names, shapes,
   trainable or frozen); with ``strict=True`` any difference fails here, before anything changes;
2. compute the rank's flat partitions from the engine's parameter order and world size
   (:mod:`ucformat.layout.partition`): the ranges of ``fp32`` and of every optimizer state it
   needs (frozen params and buffers: what the rank holds). ``read="own"``: read exactly those
   (no collective), checked in place or into new tensors. ``read="once"`` (or ``"auto"`` where
   ranks share chunks: tensor-parallel replicas, chunks cut by partitions): the job reads every
   chunk once and shares it (:mod:`ucformat.read.shared`), into new tensors;
3. only then write into the engine: fp32 partitions, optimizer state and step, param-group
   hyper-parameters, frozen params, buffers, lr scheduler, loss scaler, counters; finally the
   training-dtype weights are refreshed from fp32 (ZeRO-1/2 all-gathers them, as DeepSpeed does;
   ZeRO-3 releases every gathered parameter before writing and gathers the persistent ones
   afterwards, as DeepSpeed's own ``load_checkpoint`` does, so the engine looks the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.collective import NOTHING_LOADED, Group, agree, group, settle
from ucformat.deepspeed.engine import EngineView, describe_engine, restore_loss_scaler
from ucformat.deepspeed.experts import autoep_shard_maps, held_elsewhere
from ucformat.deepspeed.odd_states import plan_odd_states, read_odd_states, write_odd_states
from ucformat.deepspeed.pipeline import other_stage_names, tied_store_names
from ucformat.deepspeed.pipeline_tp import pipeline_shard_maps
from ucformat.deepspeed.tensor_parallel import logical_fragments, shard_maps
from ucformat.deepspeed.unpartitioned import describe_unpartitioned, is_unpartitioned
from ucformat.errors import ModelMismatchError, UCFormatError
from ucformat.format.models import CheckpointManifest
from ucformat.format.names import model_named
from ucformat.format.pyvalue import decode
from ucformat.format.spec import BUFFER_STATE, FP32_STATE, STEP_STATE
from ucformat.layout.partition import Fragment
from ucformat.read.batch import Pending, ReadBatch, add_need
from ucformat.read.checkpoint import UniversalCheckpoint, open_checkpoint, scalar_value
from ucformat.read.model_match import match_model, refuse_mismatch
from ucformat.read.partitions import (
    FlatTarget,
    ReadTally,
    batch_flat_state,
    can_fill_in_place,
    fill_flat_state,
    rank_fragments,
    read_flat_state,
)
from ucformat.read.shared import JobReport, ReadOutcome, check_mode, plan_reads, read_planned
from ucformat.read.staging import wants_pinned
from ucformat.store.keys import StoreLike

__all__ = ["LoadReport", "load"]


@dataclass
class LoadReport(JobReport):
    """What :func:`load` did on this rank (and how the job read:
    :class:`~ucformat.read.shared.JobReport`)."""

    restored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_needed: int = 0
    #: Read requests this rank made to the store (each one GET on an object store).
    requests: int = 0
    #: What :mod:`ucformat.layout.reads` predicts for this rank's ranges (bytes, requests);
    #: ``bytes_read`` and ``requests`` equal them for uncompressed stores.
    planned_bytes: int = 0
    planned_requests: int = 0
    seconds: float = 0.0
    client_state: dict[str, Any] = field(default_factory=dict)
    #: True when the fp32 partitions were checked in place, then read straight into the
    #: engine's tensors (optimizer states too, where the optimizer already holds them); False
    #: when they went through new tensors (docs/loading.md, "How a rank reads only its
    #: partition").
    read_in_place: bool = False

    @property
    def read_amplification(self) -> float:
        """Bytes fetched from the store per byte this rank needed."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0


def load(
    engine: Any,
    store: StoreLike | UniversalCheckpoint,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_extras: bool = True,
    strict: bool = True,
    read: str = "auto",
) -> LoadReport:
    """Load a ucformat store into a DeepSpeed ZeRO engine on this rank.

    Args:
        engine: the ``DeepSpeedEngine`` returned by ``deepspeed.initialize``.
        store: a store path/URL/``Store``, or an already opened checkpoint.
        load_optimizer_states: also restore optimizer states, step and hyper-parameters
            (``False`` reads no optimizer arrays).
        load_lr_scheduler_states: restore the lr scheduler's state.
        load_module_extras: restore frozen parameters and buffers.
        strict: fail (before modifying anything) when the engine's parameters differ from the
            store's; ``False`` loads the intersection and lists the rest in the report.
        read: ``"once"``: every chunk is fetched from storage by one rank and shared over the
            job's process group; ``"own"``: every rank reads its own ranges (checked in place
            where it can, no collective before the agreement); ``"auto"`` (default): once
            where the ranks share chunks (docs/loading.md, "Read once"). The engine ends the
            same bit for bit either way.

    Returns:
        A :class:`LoadReport`, including the client state saved with the checkpoint.

    Raises:
        ModelMismatchError: the models differ and ``strict`` is set.
        UCFormatError: the store is incomplete, corrupt or unsupported (on the rank that met
            the problem; nothing was written on any rank).
        CollectiveError: some rank could not read its part (every rank raises it, naming
            the ranks and their errors); nothing was written on any rank.
    """
    started = time.perf_counter()
    check_mode(read)
    shared = group() if read != "own" else None  # the manifest read once for the job
    ckpt = store if isinstance(store, UniversalCheckpoint) else open_checkpoint(store, shared)
    before, requests_before = ckpt.stats.bytes_read, ckpt.stats.requests
    manifest = ckpt.manifest
    report = LoadReport()
    refusal: UCFormatError | None = None
    try:  # what the engine holds, and whether the store fits it: nothing changes yet
        view = _describe_target(engine, manifest)
        trainable = {name for t in view.targets for name in t.names}
        frozen = _frozen_params(view, trainable, load_module_extras)
        buffers = _buffers(engine) if load_module_extras else {}
        _compare_models(
            view, manifest, trainable, frozen, buffers, report, load_optimizer_states, strict
        )
        odd = plan_odd_states(view, manifest) if load_optimizer_states else []
    except UCFormatError as exc:
        refusal = exc
    # a refusal on some ranks only (another stage's or expert rank's parameters) must not
    # leave the others waiting in the read agreement below
    settle_refusal(refusal, group().operation(), ckpt.where)

    tally = ReadTally()
    state_keys = (
        manifest.optimizer.state_keys if (load_optimizer_states and manifest.optimizer) else []
    )

    odd_values: list[torch.Tensor] = []

    def read_everything() -> tuple[list[_FlatRead], dict[str, torch.Tensor], dict[str, Any]]:
        parts = _read_partitions(ckpt, view, _layout(ckpt, view, state_keys), state_keys, tally)
        frozen_values = {
            name: _read_frozen(ckpt, view, name, param, tally)
            for name, param in frozen.items()
            if _has(manifest, name)
        }
        buffer_values = {
            name: ckpt.read(name, BUFFER_STATE) for name in buffers if name in manifest.buffers
        }
        tally.bytes_needed += sum(v.numel() * v.element_size() for v in buffer_values.values())
        for name, value in buffer_values.items():
            tally.note(ckpt.array_ref(name, BUFFER_STATE), 0, value.numel())
        odd_values.extend(read_odd_states(ckpt, odd, tally))  # states not elementwise (3.1)
        return parts, frozen_values, buffer_values

    ranks = group().operation()
    plan = None
    layout: _Layout = []
    if read != "own" and ranks.distributed:  # the job plans its reads together
        failure: BaseException | None = None
        try:
            layout = _layout(ckpt, view, state_keys)
            needs = _needs(ckpt, view, layout, frozen, buffers)
        except (UCFormatError, OSError) as exc:
            failure = exc
        settle(failure, ranks, ckpt.where, undone=NOTHING_LOADED)
        plan = plan_reads(ckpt, needs, ranks, read=read)
    outcome = ReadOutcome()
    failure = None
    if plan is not None and plan.stats.mode == "once":
        batch = ReadBatch()
        staged = None
        try:
            staged = _batch_everything(ckpt, view, layout, frozen, buffers, batch, tally)
        except (UCFormatError, OSError, ValueError) as exc:  # still read and send for the others
            failure, batch = exc, ReadBatch()
        outcome = read_planned(ckpt, plan, batch, ranks)
        failure = failure or outcome.failure
        if failure is None and staged is not None:
            parts, frozen_values, buffer_values = staged.values()
        if failure is None and odd:  # states not elementwise (3.1): whole, by their holders
            try:
                odd_values.extend(read_odd_states(ckpt, odd, tally))
            except (UCFormatError, OSError) as exc:
                failure = exc
    else:
        try:
            parts, frozen_values, buffer_values = read_everything()
        except (UCFormatError, OSError) as exc:
            failure = exc
        if plan is not None:
            outcome.stats = plan.stats
    # a rank that cannot read makes every rank stop here, before anything is written
    settle(failure, ranks, ckpt.where, undone=NOTHING_LOADED)
    report.read_in_place = all(part.fp32 is None for part in parts)

    # --- nothing above modified the engine; from here on, write ------------------------------
    with torch.no_grad():
        view.release_gathered()
        for part in parts:
            part.write(ckpt, tally)
        report.restored.append("fp32 master weights")
        if state_keys:
            _restore_optimizer(view, manifest, [part.states for part in parts], report)
        if odd:
            write_odd_states(view, odd, odd_values)
            report.restored.append(f"{len(odd)} optimizer states that are not elementwise")
        for name, value in frozen_values.items():
            _write_frozen(view, frozen[name], value)
        for name, value in buffer_values.items():
            buffers[name].copy_(value.to(buffers[name].dtype))
        if frozen_values or buffer_values:
            report.restored.append(
                f"{len(frozen_values)} frozen params, {len(buffer_values)} buffers"
            )
        view.sync_low_precision()
        view.regather_persistent()
        report.restored.append("training-dtype weights (from fp32)")
    _restore_progress(view, manifest, load_optimizer_states, load_lr_scheduler_states, report)
    report.client_state = {k: decode(v) for k, v in manifest.client_state.values.items()}
    report.bytes_read = ckpt.stats.bytes_read - before
    report.requests = ckpt.stats.requests - requests_before
    planned = outcome.planned or tally.planned()
    report.planned_bytes, report.planned_requests = planned.total, planned.requests
    report.bytes_needed = tally.bytes_needed
    report.record(outcome, ranks, report.bytes_read, report.requests, report.bytes_needed)
    report.seconds = time.perf_counter() - started
    return report


def _describe_target(engine: Any, manifest: CheckpointManifest) -> EngineView:
    """The engine's flat partitions under the store's names (a ZeRO-0 pipeline store's tied
    parameters: :func:`ucformat.deepspeed.pipeline.tied_store_names`), with its shard maps."""
    renames = tied_store_names(engine.module, manifest.params)
    view = (
        describe_unpartitioned(engine, renames)
        if is_unpartitioned(engine)
        else describe_engine(engine, renames)
    )
    view.shard_maps = (
        shard_maps(engine) or pipeline_shard_maps(engine, manifest) or autoep_shard_maps(engine)
    )
    return view


def settle_refusal(failure: UCFormatError | None, ranks: Group, where: str) -> None:
    """Agree on the refusal of a load before anything is read: a rank that refused makes every
    rank stop. When every rank refused with the same message it is raised as it is (the same
    model everywhere); otherwise every rank raises one :class:`CollectiveError` naming them."""
    if failure is not None and not ranks.distributed:
        raise failure
    error = agree(failure, ranks, where, undone=NOTHING_LOADED)
    if error is None:
        return
    everyone = set(error.failures) == set(range(ranks.world_size))
    if failure is not None and everyone and len(set(error.failures.values())) == 1:
        raise failure
    raise error from failure


@dataclass
class _FlatRead:
    """One flat partition of this rank: what is read straight into the engine, what was staged.

    Attributes:
        fp32: the fp32 values read into a new tensor, or None when they go straight into
            ``live`` (checked in place already; read by :meth:`write`).
        states: the optimizer state tensors the optimizer gets: new tensors already read, or
            its own tensors, filled by :meth:`write` (their keys in ``in_place``).
    """

    target: FlatTarget
    live: torch.Tensor
    fragments: list[Fragment]
    #: Per optimizer state key: the fragments of parameters the store holds it for.
    with_state: dict[str, list[Fragment]]
    fp32: torch.Tensor | None = None
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    in_place: list[str] = field(default_factory=list)

    def write(self, ckpt: UniversalCheckpoint, tally: ReadTally) -> None:
        """Put the values into the engine's tensors."""
        if self.fp32 is None:
            fill_flat_state(
                ckpt, self.target, self.fragments, FP32_STATE, tally, self.live, keep_gaps=True
            )
        else:
            self.live.data.copy_(self.fp32.to(self.live.dtype))
        for key in self.in_place:
            fill_flat_state(
                ckpt,
                self.target,
                self.with_state[key],
                key,
                tally,
                self.states[key],
                keep_gaps=False,
            )


#: Per flat target: the target, its live fp32 partition, the fragments the rank holds of the
#: store's parameters, and per optimizer state key those of them the store holds it for.
_Layout = list[tuple[FlatTarget, torch.Tensor, list[Fragment], dict[str, list[Fragment]]]]


def _layout(ckpt: UniversalCheckpoint, view: EngineView, state_keys: list[str]) -> _Layout:
    """The rank's fragments, per flat target (nothing read)."""
    manifest = ckpt.manifest
    out: _Layout = []
    for target, live in zip(view.targets, view.fp32, strict=True):
        fragments = logical_fragments(
            rank_fragments(target, (n for n in target.names if _has(manifest, n))),
            view.shard_maps,
        )
        with_state = {  # a key some parameters lack (e.g. a vector's only): those that have it
            key: [f for f in fragments if _has_states(manifest, f.name, [key])]
            for key in _held_keys(manifest, target, state_keys)
            if key not in view.whole_copies.get(target.index, ())  # Muon's: .odd_states
        }
        out.append((target, live, fragments, with_state))
    return out


def _read_partitions(
    ckpt: UniversalCheckpoint,
    view: EngineView,
    layout: _Layout,
    state_keys: list[str],
    tally: ReadTally,
) -> list[_FlatRead]:
    """Check, or read into new tensors, everything of the rank's flat partitions (no writes).

    A state goes straight into the engine's tensor when :func:`can_fill_in_place` vouches for it
    (local uncompressed store, every chunk of its ranges present and checksummed in place, a
    destination of the stored dtype: on a CUDA device it is filled later through two pinned
    host windows); anything else is read into a new tensor now (pinned for a CUDA engine).
    """
    parts: list[_FlatRead] = []
    for target, live, fragments, with_state in layout:
        part = _FlatRead(target, live, fragments, with_state)
        pin = wants_pinned(live.device)  # a CUDA engine: read into pinned host memory
        if not can_fill_in_place(ckpt, target, fragments, FP32_STATE, live):
            part.fp32 = read_flat_state(
                ckpt, target, fragments, FP32_STATE, tally, torch.float32, base=live, pin=pin
            )
        existing = _live_states(view, target.index, state_keys)
        for key in with_state:
            if can_fill_in_place(ckpt, target, with_state[key], key, existing.get(key)):
                part.states[key] = existing[key]
                part.in_place.append(key)
            else:
                part.states[key] = read_flat_state(
                    ckpt, target, with_state[key], key, tally, pin=pin
                )
        parts.append(part)
    return parts


def _frozen_range(view: EngineView, param: torch.Tensor, numel: int) -> tuple[int, int, bool]:
    """The flat range of a frozen param this rank holds, and whether it is a ZeRO-3 piece
    (else the whole parameter)."""
    ds_tensor = getattr(param, "ds_tensor", None)
    if view.kind == "zero3" and ds_tensor is not None:
        piece = int(ds_tensor.ds_numel)
        rank = torch.distributed.get_rank(group=view.wrapper._get_param_partition_group(param))
        return min(rank * piece, numel), min((rank + 1) * piece, numel), True
    return 0, numel, False


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _needs(
    ckpt: UniversalCheckpoint,
    view: EngineView,
    layout: _Layout,
    frozen: dict[str, torch.nn.Parameter],
    buffers: dict[str, torch.Tensor],
) -> dict[str, list[tuple[int, int]]]:
    """Per stored array path, every flat range this rank reads of it (what
    :func:`_batch_everything` reads, and what the own reads read)."""
    manifest = ckpt.manifest
    needs: dict[str, list[tuple[int, int]]] = {}

    def add(name: str, state: str, start: int, stop: int) -> None:
        add_need(needs, ckpt.array_ref(name, state), start, stop)

    for _, _, fragments, with_state in layout:
        for fragment in fragments:
            add(fragment.name, FP32_STATE, fragment.param_start, fragment.param_stop)
        for key, holders in with_state.items():
            for fragment in holders:
                add(fragment.name, key, fragment.param_start, fragment.param_stop)
    for name, param in frozen.items():
        if _has(manifest, name):
            owner = manifest.resolve(name)
            start, stop, _ = _frozen_range(view, param, _numel(manifest.params[owner].shape))
            add(owner, FP32_STATE, start, stop)
    for name in buffers:
        if name in manifest.buffers:
            add(name, BUFFER_STATE, 0, _numel(manifest.buffers[name].array.shape))
    return needs


@dataclass
class _Staged:
    """Everything of the rank, as reads of a :class:`ReadBatch` (``once``)."""

    parts: list[tuple[_FlatRead, Callable[[], torch.Tensor], dict[str, Callable[[], torch.Tensor]]]]
    frozen: dict[str, Pending]
    buffers: dict[str, Pending]

    def values(self) -> tuple[list[_FlatRead], dict[str, torch.Tensor], dict[str, Any]]:
        """The values, once the batch has been read."""
        parts = []
        for part, fp32, states in self.parts:
            part.fp32 = fp32()
            part.states = {key: finish() for key, finish in states.items()}
            parts.append(part)
        frozen = {name: pending.value() for name, pending in self.frozen.items()}
        return parts, frozen, {name: pending.value() for name, pending in self.buffers.items()}


def _batch_everything(
    ckpt: UniversalCheckpoint,
    view: EngineView,
    layout: _Layout,
    frozen: dict[str, torch.nn.Parameter],
    buffers: dict[str, torch.Tensor],
    batch: ReadBatch,
    tally: ReadTally,
) -> _Staged:
    """What the own reads read, as reads of ``batch`` into new tensors (``once``)."""
    manifest = ckpt.manifest
    parts = []
    for target, live, fragments, with_state in layout:
        part = _FlatRead(target, live, fragments, with_state)
        pin = wants_pinned(live.device)  # a CUDA engine: read into pinned host memory
        fp32 = batch_flat_state(
            ckpt, target, fragments, FP32_STATE, batch, tally, torch.float32, base=live, pin=pin
        )
        states = {
            key: batch_flat_state(ckpt, target, holders, key, batch, tally, pin=pin)
            for key, holders in with_state.items()
        }
        parts.append((part, fp32, states))
    staged_frozen: dict[str, Pending] = {}
    for name, param in frozen.items():
        if _has(manifest, name):
            owner = manifest.resolve(name)
            shape = manifest.params[owner].shape
            start, stop, piece = _frozen_range(view, param, _numel(shape))
            pending = batch.runs(ckpt, owner, FP32_STATE, [(start, stop, 0)])
            if not piece:
                pending.shape = tuple(shape)
            staged_frozen[name] = pending
            tally.bytes_needed += (stop - start) * 4
    staged_buffers = {
        name: batch.whole(ckpt, name, BUFFER_STATE) for name in buffers if name in manifest.buffers
    }
    tally.bytes_needed += sum(manifest.buffers[n].array.nbytes for n in staged_buffers)
    return _Staged(parts, staged_frozen, staged_buffers)


def _live_states(view: EngineView, index: int, keys: list[str]) -> dict[str, torch.Tensor]:
    """The optimizer's existing state tensors of flat group ``index`` (those it has), flat."""
    state = view.base_optimizer.state.get(view.state_key(index), {})
    return {key: state[key].reshape(-1) for key in keys if isinstance(state.get(key), torch.Tensor)}


def _held_keys(
    manifest: CheckpointManifest, target: FlatTarget, state_keys: list[str]
) -> list[str]:
    """The optimizer state keys some member of the flat group ``target`` has in the store (the
    optimizer gets no other key for this group)."""
    return [k for k in state_keys if any(_has_states(manifest, n, [k]) for n in target.names)]


def _has(manifest: CheckpointManifest, name: str) -> bool:
    return manifest.resolve(name) in manifest.params


def _has_states(manifest: CheckpointManifest, name: str, keys: list[str]) -> bool:
    entry = manifest.params.get(manifest.resolve(name))
    return entry is not None and all(k in entry.states for k in keys)


def _frozen_params(
    view: EngineView, trainable: set[str], enabled: bool
) -> dict[str, torch.nn.Parameter]:
    if not enabled:
        return {}
    return {n: p for n, p in view.named_parameters() if n not in trainable}


def _buffers(engine: Any) -> dict[str, torch.Tensor]:
    persistent = set(engine.module.state_dict(keep_vars=True))
    named = ((n, b) for n, b in engine.module.named_buffers() if n in persistent)
    return model_named(named, "buffers")  # the names the store holds (format/names.py)


def _param_shape(param: torch.Tensor) -> tuple[int, ...]:
    shape = getattr(param, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(param.shape)


def _compare_models(
    view: EngineView,
    manifest: CheckpointManifest,
    trainable: set[str],
    frozen: dict[str, torch.nn.Parameter],
    buffers: dict[str, torch.Tensor],
    report: LoadReport,
    with_optimizer: bool,
    strict: bool,
) -> None:
    params = dict(view.named_parameters())
    logical = {n: m.logical_shape for n, m in (view.shard_maps or {}).items()}
    wanted = {n: list(logical.get(n, _param_shape(params[n]))) for n in trainable | set(frozen)}
    stored = {n: e.shape for n, e in manifest.params.items()}
    not_here = other_stage_names(view.engine.module, manifest.params) - set(wanted)
    not_here |= held_elsewhere(view.engine, manifest, set(wanted))  # other EP ranks' experts
    match = match_model(wanted, stored, resolve=manifest.resolve, not_here=not_here)
    report.missing, report.unexpected = match.missing, match.unexpected
    also: list[str] = []
    if with_optimizer:
        bare = sorted(
            n
            for n in trainable
            if _has(manifest, n) and manifest.params[manifest.resolve(n)].group is None
        )
        if bare:
            also.append(
                f"trainable in the model but stored without optimizer state: {', '.join(bare)}"
            )
    missing_buffers = sorted(set(buffers) - set(manifest.buffers))
    if missing_buffers:
        also.append(f"buffers missing from the store: {', '.join(missing_buffers)}")
    report.skipped.extend(refuse_mismatch(match, strict=strict, also=also))


def _read_frozen(
    ckpt: UniversalCheckpoint, view: EngineView, name: str, param: torch.Tensor, tally: ReadTally
) -> torch.Tensor:
    """This rank's share of a frozen param: the whole tensor, or its ZeRO-3 piece."""
    owner = ckpt.manifest.resolve(name)
    ds_tensor = getattr(param, "ds_tensor", None)
    if view.kind == "zero3" and ds_tensor is not None:
        # DeepSpeed sets ds_numel on ZeRO-3 params; torch's stubs cannot know it
        numel = int(param.ds_numel)  # type: ignore[attr-defined]
        piece = int(ds_tensor.ds_numel)
        rank = torch.distributed.get_rank(group=view.wrapper._get_param_partition_group(param))
        start, stop = min(rank * piece, numel), min((rank + 1) * piece, numel)
        values = ckpt.read_range(owner, FP32_STATE, start, stop)
        tally.bytes_needed += (stop - start) * 4
        tally.note(ckpt.array_ref(owner, FP32_STATE), start, stop)
        return values
    value: torch.Tensor = ckpt.read(owner, FP32_STATE)
    tally.bytes_needed += value.numel() * 4
    tally.note(ckpt.array_ref(owner, FP32_STATE), 0, value.numel())
    return value


def _write_frozen(view: EngineView, param: torch.nn.Parameter, value: torch.Tensor) -> None:
    ds_tensor = getattr(param, "ds_tensor", None)
    if view.kind == "zero3" and ds_tensor is not None:
        flat = ds_tensor.data.view(-1)
        flat.zero_()
        flat[: value.numel()].copy_(value.to(flat.dtype))
        return
    param.data.copy_(value.reshape(param.shape).to(param.dtype))


def _target_step(optimizer: torch.optim.Optimizer, value: Any) -> Any:
    """The step in the type the target optimizer expects (torch: float32 tensor; else int).

    DeepSpeed's Muon steps every group that keeps a step with its auxiliary Adam (a torch
    AdamW with ``"torch_adam": true``); without one, inline with an int step.
    """
    stepper = getattr(optimizer, "aux_optimizer", None) or optimizer
    wants_tensor = type(stepper).__module__.startswith("torch.optim")
    if wants_tensor:
        return value.clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    return int(value.item()) if isinstance(value, torch.Tensor) else value


def _restore_optimizer(
    view: EngineView,
    manifest: CheckpointManifest,
    optim_parts: list[dict[str, torch.Tensor]],
    report: LoadReport,
) -> None:
    optimizer = view.base_optimizer
    for target, states in zip(view.targets, optim_parts, strict=True):
        key = view.state_key(target.index)
        state = optimizer.state[key]
        state.clear()
        for name, value in states.items():
            state[name] = value.to(key.device).reshape(key.shape)  # ZeRO-0: param-shaped
        steps = {
            repr(scalar_value(manifest.params[manifest.resolve(n)].scalars[STEP_STATE]))
            for n in target.names
            if _has(manifest, n) and STEP_STATE in manifest.params[manifest.resolve(n)].scalars
        }
        if len(steps) > 1:
            raise ModelMismatchError(
                f"flat group {target.index} mixes parameters saved at different optimizer steps "
                f"({sorted(steps)}); it cannot hold one step."
            )
        member = next((n for n in target.names if _has(manifest, n)), None)
        scalars = manifest.params[manifest.resolve(member)].scalars if member else {}
        for name, scalar in scalars.items():
            value = scalar_value(scalar)
            state[name] = _target_step(optimizer, value) if name == STEP_STATE else value
    groups = manifest.optimizer.groups if manifest.optimizer else []
    if len(groups) != len(optimizer.param_groups):
        report.skipped.append(
            f"param-group hyper-parameters: the store has {len(groups)} groups, the engine "
            f"{len(optimizer.param_groups)}"
        )
    else:
        stored_class = manifest.optimizer.name.rpartition(".")[2] if manifest.optimizer else ""
        same_class = stored_class == type(optimizer).__name__
        for live, saved in zip(optimizer.param_groups, groups, strict=True):
            for name, hyper in saved.hyperparams.items():
                if name not in _GROUP_IDENTITY and (same_class or name in live):
                    live[name] = decode(hyper)
        report.restored.append("param-group hyper-parameters")
    view.relink_optimizer_state()
    keys = ", ".join(manifest.optimizer.state_keys) if manifest.optimizer else ""
    report.restored.append(f"optimizer states ({keys}) and step")


#: Param-group keys that say which group it is, not how it trains ('name' and 'moe': DeepSpeed
#: MoE groups, e.g. 'ep_size_2'): the engine's own values stay.
_GROUP_IDENTITY = frozenset({"params", "name", "moe"})


def _restore_progress(
    view: EngineView,
    manifest: CheckpointManifest,
    with_optimizer: bool,
    with_scheduler: bool,
    report: LoadReport,
) -> None:
    engine, wrapper, progress = view.engine, view.wrapper, manifest.progress
    engine.global_steps = progress.global_steps
    engine.global_samples = progress.global_samples
    engine.skipped_steps = progress.skipped_steps
    report.restored.append("global_steps, global_samples, skipped_steps")
    if with_scheduler and progress.lr_scheduler is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(decode(progress.lr_scheduler))
        report.restored.append("lr scheduler")
    if not with_optimizer:
        return
    scaler = view.scaler()
    saved = progress.loss_scaler
    if scaler is not None and saved is not None:
        restored = restore_loss_scaler(scaler, saved)
        if restored:
            report.restored.append(f"loss scaler ({restored}, scale {saved.cur_scale:g})")
        else:
            report.skipped.append(
                f"loss scaler: stored {saved.class_name}, engine uses {type(scaler).__name__}"
            )
    for name in ("dynamic_loss_scale", "overflow", "clip_grad"):
        value = getattr(progress, name)
        if value is not None and hasattr(wrapper, name):
            setattr(wrapper, name, value)
