"""``ucformat.megatron.load``: resume a live Megatron-Core job from a store, at any layout.

Called on every rank of the job, after the model and the optimizer are built (the same calls
Megatron-LM makes before its ``load_checkpoint``). Per rank:

1. describe what the rank holds as Megatron does for its own load
   (:func:`~ucformat.megatron.job.describe_job`: every ShardedTensor of the model chunks and of
   the optimizer in its model-space form), and resolve each to a stored array: its key and its
   place on the prepended axes (layer, expert) through ``manifest.megatron``
   (:func:`~ucformat.format.megatron_state.megatron_keys`), or, for a store from elsewhere, the
   parameter's TP=1 name and shape, which must match the store's (one
   :class:`~ucformat.errors.ModelMismatchError` line otherwise); the optimizer's param groups
   must match the store's by Megatron's group keys;
2. read exactly the box each ShardedTensor names (the runs of flat elements of the stored
   array), into new tensors (the model's own are its live parameters); of the distributed
   optimizer's state only the flat range this data-parallel rank's shard keeps
   (:func:`~ucformat.megatron.job.dp_needed`), into the buffers Megatron made for this load
   (the rest of each is left NaN, never read by Megatron). The reads are one
   :class:`~ucformat.read.batch.ReadBatch` read as every collective loader reads it
   (:func:`ucformat.read.shared.read_batch`): ``read="own"``, each rank its boxes; ``"once"``
   (or ``"auto"`` where ranks share chunks: data-parallel replicas of a TP x PP stage, norms
   every TP rank holds), each chunk once job-wide, then shared;
3. agree with every other rank that all reads succeeded (:func:`ucformat.collective.settle`),
   then hand the tensors to Megatron exactly as ``dist_checkpointing.load`` would: the common
   state Megatron keeps outside tensors (param groups, step; what ``export megatron`` writes to
   ``common.pt``) merged with them, factories merged back (SwiGLU halves), then each chunk's
   ``load_state_dict`` and the optimizer's.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.collective import NOTHING_LOADED, Group, settle
from ucformat.collective import group as ranks_group
from ucformat.errors import ModelMismatchError, UCFormatError, UnsupportedExportError
from ucformat.format.dtypes import itemsize
from ucformat.format.megatron_state import (
    common_step,
    group_identity,
    job_param_groups,
    megatron_keys,
    optimizer_common,
    store_state,
)
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE, VALUE_STATE
from ucformat.layout.boxes import Run, chunk_runs
from ucformat.megatron.job import (
    MegatronJob,
    describe_job,
    dp_needed,
    global_names,
    is_distributed,
    is_float16,
    model_key,
    sharded_values,
)
from ucformat.read.batch import Pending, ReadBatch
from ucformat.read.checkpoint import UniversalCheckpoint, open_checkpoint
from ucformat.read.model_match import match_model, refuse_mismatch
from ucformat.read.shared import JobReport, check_mode, read_batch
from ucformat.store.keys import StoreLike

__all__ = ["MegatronLoadReport", "load"]

_EXTRA_STATE = "_extra_state"
_HF_PREFIX = "model.layers."


@dataclass
class MegatronLoadReport(JobReport):
    """What :func:`load` did on this rank (and how the job read:
    :class:`~ucformat.read.shared.JobReport`)."""

    #: The iteration the store was saved at (Megatron-LM's ``iteration``).
    iteration: int = 0
    #: The client state saved with the checkpoint (Megatron-LM's args, scheduler, ...).
    client_state: dict[str, Any] = field(default_factory=dict)
    #: Bytes this rank fetched from the store (data, checksums, shard indexes).
    bytes_read: int = 0
    #: Bytes of values this rank needed (its boxes; its shard of the distributed optimizer's).
    bytes_needed: int = 0
    #: Read requests (each one GET on an object store).
    requests: int = 0
    #: ShardedTensors filled (model and optimizer).
    tensors: int = 0
    seconds: float = 0.0

    @property
    def read_amplification(self) -> float:
        """Bytes fetched from the store per byte this rank needed."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0


@dataclass
class _Part:
    """Of one ShardedTensor, what stored parameter ``name`` gives: the flat ``runs`` of its
    array ``state`` (compact: ``chunk_start`` is the position among the part's values) and
    where each goes in the ShardedTensor's local values (``positions``: start, length)."""

    name: str
    state: str
    runs: list[Run]
    positions: list[tuple[int, int]]


@dataclass
class _Target:
    """One ShardedTensor to fill from its parts' parameters (one, or several where its box spans
    a prepended axis: GroupedMLP's experts)."""

    sharded: Any
    parts: list[_Part]
    whole: bool
    value: torch.Tensor | None = None
    #: The parts' values, once their batch is read (:func:`_add_reads`).
    pending: list[Pending] = field(default_factory=list)


def _open(
    store: StoreLike | UniversalCheckpoint, group: Group | None = None
) -> UniversalCheckpoint:
    return store if isinstance(store, UniversalCheckpoint) else open_checkpoint(store, group)


def _clip(
    runs: list[Run], base: int, spans: list[tuple[int, int]] | None
) -> tuple[list[Run], list[tuple[int, int]]]:
    """``runs`` (local positions ``base + chunk_start``) inside ``spans`` (sorted, disjoint;
    all of them if None), compacted, with their local positions."""
    if spans is None:
        return runs, [(base + run.chunk_start, run.length) for run in runs]
    starts = [low for low, _ in spans]
    compact: list[Run] = []
    positions: list[tuple[int, int]] = []
    at = 0
    for run in runs:
        low_run = base + run.chunk_start
        high_run = low_run + run.length
        index = max(0, bisect.bisect_right(starts, low_run) - 1)
        while index < len(spans) and spans[index][0] < high_run:
            a, b = max(spans[index][0], low_run), min(spans[index][1], high_run)
            if a < b:
                compact.append(Run(run.start + a - low_run, at, b - a))
                positions.append((a, b - a))
                at += b - a
            index += 1
    return compact, positions


class _Resolver:
    """Which stored parameter a ShardedTensor's (key, index) is, and how many of the key's
    leading dims are axes of parameters (Megatron's layer and expert axes)."""

    def __init__(self, ckpt: UniversalCheckpoint, job: MegatronJob) -> None:
        manifest = ckpt.manifest
        self.manifest = manifest
        self.by_index: dict[tuple[str, tuple[int, ...]], str] = {}
        self.axes: dict[str, int] = {}
        if manifest.megatron is not None:
            keys = megatron_keys(manifest)
            self.by_index = dict(keys.by_index)
            self.axes = {key: len(axes) for key, axes in keys.axes.items()}
        else:
            self.by_index = {k: v[0] for k, v in global_names(job).items()}
        self.wanted: dict[str, tuple[int, ...]] = {}

    def axes_of(self, key: str, prepended: int) -> int:
        """Leading dims of ``key`` that index parameters (the prepended ones at least)."""
        return max(self.axes.get(key, 0), prepended)

    def resolve(self, key: str, index: tuple[int, ...], shape: tuple[int, ...]) -> str | None:
        name = self.by_index.get((key, index))
        label = name or f"{key}{list(index) if index else ''}"
        self.wanted[label] = shape
        return name if name in self.manifest.params else None

    def check(self) -> None:
        """Refuse (one line) what the store does not hold or holds in another shape."""
        stored = {n: tuple(e.shape) for n, e in self.manifest.params.items()}
        match = match_model(self.wanted, stored, not_here=set(stored))
        also = []
        hf_names = any(name.startswith(_HF_PREFIX) for name in stored)
        if match.missing and self.manifest.megatron is None and hf_names:
            also.append(
                "the store has Hugging Face Llama names (model.layers.<i>.self_attn...), and "
                "ucformat maps Megatron-Core names to Hugging Face only (export safetensors "
                "--names hf-llama), not back; load a store converted from Megatron-Core, or "
                "one saved with the model's own names"
            )
        refuse_mismatch(match, strict=True, also=also)


def _target(
    resolver: _Resolver, value: Any, spans: list[tuple[int, int]] | None, missing: set[str]
) -> _Target | None:
    """What to read for ShardedTensor ``value`` (None: the store cannot give it; recorded)."""
    key, state = model_key(value.key)
    stored = FP32_STATE if state is None else store_state(state)
    count = resolver.axes_of(key, value.prepend_axis_num)
    sizes = (*(1 for _ in range(value.prepend_axis_num)), *value.local_shape)
    offsets, shape = tuple(value.global_offset), tuple(value.global_shape)
    inner = math.prod(sizes[count:])
    parts = []
    for rank_index, at in enumerate(itertools.product(*(range(n) for n in sizes[:count]))):
        index = tuple(o + i for o, i in zip(offsets[:count], at, strict=True))
        name = resolver.resolve(key, index, shape[count:])
        if name is None or tuple(resolver.manifest.params[name].shape) != shape[count:]:
            return None
        states = resolver.manifest.params[name].states
        array = stored if stored in states else None
        if array is None and stored == FP32_STATE and VALUE_STATE in states:
            array = VALUE_STATE  # a parameter stored without optimizer state: its value
        if array is None:
            missing.add(f"{state or 'the weight'} of {name}")
            return None
        runs = chunk_runs(shape[count:], offsets[count:], sizes[count:])
        compact, positions = _clip(runs, rank_index * inner, spans)
        parts.append(_Part(name, array, compact, positions))
    return _Target(value, parts, whole=spans is None)


def _targets(ckpt: UniversalCheckpoint, job: MegatronJob, sharded: Any) -> list[_Target]:
    """Every ShardedTensor of the preprocessed request with what to read for it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    resolver = _Resolver(ckpt, job)
    needed = dp_needed(job)
    targets: list[_Target] = []
    missing_states: set[str] = set()
    for value in sharded_values(sharded):
        if isinstance(value, ShardedObject):
            if not value.key.endswith(_EXTRA_STATE):
                raise UnsupportedExportError(
                    f"the job asks for the object '{value.key}', which a store does not hold; "
                    "load the model and the optimizer only."
                )
            continue
        if not isinstance(value, ShardedTensor):
            continue
        data = value.data
        spans = needed.get(data.untyped_storage().data_ptr()) if data.is_contiguous() else None
        if spans is not None:  # the distributed optimizer keeps only these of this rank's
            start, stop = data.storage_offset(), data.storage_offset() + data.numel()
            spans = sorted((a - start, b - start) for a, b in spans if a < stop and b > start)
        target = _target(resolver, value, spans, missing_states)
        if target is not None:
            targets.append(target)
    resolver.check()
    if missing_states:
        shown = sorted(missing_states)
        raise ModelMismatchError(
            f"the store holds no {', '.join(shown[:3])}{' ...' if len(shown) > 3 else ''} that "
            "the optimizer keeps (is the store's optimizer Adam?); pass optimizer=None to load "
            f"the model only. {NOTHING_LOADED}"
        )
    return targets


def _add_reads(ckpt: UniversalCheckpoint, target: _Target, batch: ReadBatch) -> int:
    """Add ``target``'s parts to ``batch``; return the bytes they need."""
    needed = 0
    for part in target.parts:
        runs = [(run.start, run.start + run.length, run.chunk_start) for run in part.runs]
        target.pending.append(batch.runs(ckpt, part.name, part.state, runs))
        total = sum(run.length for run in part.runs)
        needed += total * itemsize(ckpt.array_ref(part.name, part.state).dtype)
    return needed


def _fill(target: _Target) -> None:
    """Put ``target``'s parts, read by their batch, into a new tensor (``target.value``)."""
    like = target.sharded.data
    if target.whole:  # a new tensor: the ShardedTensor's data may be the live parameter
        out = torch.empty(like.shape, dtype=like.dtype)  # row-major, whatever its strides
    else:  # the distributed optimizer's load buffer (contiguous): filled in place
        out = like
        out.fill_(math.nan)
    flat = out.view(-1)
    for part, pending in zip(target.parts, target.pending, strict=True):
        total = sum(run.length for run in part.runs)
        if not total:
            continue
        values = pending.value().to(out.dtype)
        first = part.positions[0][0]
        if all(a + n == b for (a, n), (b, _) in itertools.pairwise(part.positions)):
            flat[first : first + total] = values  # its local positions follow each other
        else:
            for (position, length), run in zip(part.positions, part.runs, strict=True):
                flat[position : position + length] = values[
                    run.chunk_start : run.chunk_start + length
                ]
    target.value = out


def _optimizer_state(ckpt: UniversalCheckpoint, job: MegatronJob) -> Any:
    """The optimizer's common state (param groups, step), one entry per inner optimizer, each
    group the store's group of the same Megatron identity as the live one, in the live order."""
    manifest = ckpt.manifest
    step = common_step(manifest)
    expert_parallel = any(
        group.get("is_expert_parallel") for inner in job.inners for group in inner.param_groups
    )
    entries = []
    for index, inner in enumerate(job.inners):
        distributed = is_distributed(inner)
        stored = {
            group_identity(g): g
            for g in job_param_groups(
                manifest, distributed=distributed, expert_parallel=expert_parallel
            )
        }
        groups = []
        for number, live in enumerate(inner.param_groups):
            identity = group_identity(live)
            if identity not in stored:
                raise ModelMismatchError(
                    f"the optimizer's param group {number} (optimizer {index}; Megatron group "
                    f"keys {identity}) matches none of the store's ({sorted(map(str, stored))}); "
                    f"build the optimizer with the training run's settings. {NOTHING_LOADED}"
                )
            groups.append(dict(stored[identity]))
        common_step_value = None
        if step is not None and not distributed:
            common_step_value = torch.tensor(float(step), dtype=torch.float32)
        entries.append(
            optimizer_common(
                groups, distributed=distributed, float16=is_float16(inner), step=common_step_value
            )
        )
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def load(
    model: Any,
    optimizer: Any,
    store: StoreLike | UniversalCheckpoint,
    *,
    scheduler: Any = None,
    read: str = "auto",
) -> MegatronLoadReport:
    """Load a store into a live Megatron-Core model (and optimizer), on every rank of the job.

    Each rank reads only the boxes its own ``sharded_state_dict()`` names, at any TP x PP x EP x
    DP, from a store converted from any Megatron-Core checkpoint (or holding the model's TP=1
    names and shapes). See the module docstring and docs/megatron.md.

    Args:
        model: the model (a ``GPTModel``, wrapped or not) or its list of virtual-pipeline chunks.
        optimizer: the optimizer ``get_megatron_optimizer`` built (distributed or not), or None
            for the model only.
        store: a store path/URL/``Store`` or an opened checkpoint.
        scheduler: Megatron's ``OptimizerParamScheduler``, given the stored
            ``opt_param_scheduler`` state when the store holds it.
        read: ``"once"``: every chunk is fetched from storage by one rank and shared over the
            job's process group; ``"own"``: every rank reads its own boxes (no collective
            before the agreement); ``"auto"`` (default): once where the ranks share chunks
            (docs/loading.md, "Read once"). The job ends the same bit for bit either way.

    Raises:
        ModelMismatchError: the model's names or shapes, or the optimizer's param groups, differ
            from the store's (nothing was loaded).
        UnsupportedExportError: an optimizer was given but the store holds no optimizer state.
        CollectiveError: some rank could not read its part (nothing was loaded on any rank).

    Example:
        >>> report = ucformat.megatron.load(model, optimizer, "ckpt.ucf")  # doctest: +SKIP
        >>> iteration = report.iteration  # doctest: +SKIP
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factory_merges,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    started = time.perf_counter()
    check_mode(read)
    ckpt = _open(store, ranks_group() if read != "own" else None)
    manifest = ckpt.manifest
    before, requests_before = ckpt.stats.bytes_read, ckpt.stats.requests
    if optimizer is not None and manifest.optimizer is None:
        why = manifest.megatron.optimizer_note if manifest.megatron else ""
        raise UnsupportedExportError(
            f"{ckpt.where}: this store holds no optimizer state{f' ({why})' if why else ''}; "
            f"pass optimizer=None to load the model only. {NOTHING_LOADED}"
        )
    job = describe_job(model, optimizer)
    report = MegatronLoadReport(iteration=manifest.progress.global_steps)
    failure: BaseException | None = None
    targets: list[_Target] = []
    common: dict[str, Any] = {}
    batch = ReadBatch()
    try:
        sharded, nonpersistent, factories = load_preprocess(job.request)
        sharded, _ = extract_sharded_base(sharded)
        targets = _targets(ckpt, job, sharded)
        if optimizer is not None:
            common["optimizer"] = _optimizer_state(ckpt, job)
        for target in targets:
            report.bytes_needed += _add_reads(ckpt, target, batch)
    except (UCFormatError, OSError) as exc:  # still take part in the job's reads
        failure, batch, targets = exc, ReadBatch(), []
    ranks = ranks_group().operation()
    outcome = read_batch(ckpt, batch, ranks, read=read)
    failure = failure or outcome.failure
    if failure is None:
        for target in targets:
            _fill(target)

    def forget_dummy_states() -> None:
        for inner in job.dummy_states:
            inner.optimizer.state.clear()

    settle(failure, ranks, ckpt.where, undone=NOTHING_LOADED, cleanup=forget_dummy_states)

    # --- nothing above changed the model or the optimizer's values; from here on, write -------
    values = {id(t.sharded): t.value for t in targets}

    def loaded(value: Any) -> Any:
        if isinstance(value, ShardedTensor):
            return values[id(value)]
        if isinstance(value, ShardedObject):
            return None  # _extra_state: Megatron's local layers' value (and TE's without fp8)
        return value

    dict_list_map_inplace(loaded, sharded)
    merge(common, nonpersistent)
    merge(common, sharded)
    apply_factory_merges(common, factories)
    for index, chunk in enumerate(job.chunks):
        chunk.load_state_dict(common["model" if len(job.chunks) == 1 else f"model{index}"])
    if optimizer is not None:
        optimizer.load_state_dict(common["optimizer"])
    client = {k: decode(v) for k, v in manifest.client_state.values.items()}
    if scheduler is not None and isinstance(client.get("opt_param_scheduler"), dict):
        scheduler.load_state_dict(client["opt_param_scheduler"])
    report.client_state = client
    report.tensors = len(targets)
    report.bytes_read = ckpt.stats.bytes_read - before
    report.requests = ckpt.stats.requests - requests_before
    report.record(outcome, ranks, report.bytes_read, report.requests, report.bytes_needed)
    report.seconds = time.perf_counter() - started
    return report
