"""``ucformat.torch``: a store as plain, single-process PyTorch state.

Resume a model and a ``torch.optim`` optimizer without DeepSpeed::

    model, groups = build_model(), make_param_groups(model)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    report = ucformat.torch.load(model, optimizer, "ckpt.ucf")

or take the state dicts and do it yourself::

    state = ucformat.torch.state_dicts("ckpt.ucf")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])

The dicts are in torch's own ``state_dict()`` format, as an unsharded run would hold them:

* ``model``: every parameter (fp32 master weights; frozen parameters upcast losslessly to
  fp32, or everything cast to ``dtype``), tied aliases sharing their owner's tensor, persistent
  buffers in their own dtype;
* ``optimizer``: ``state`` keyed by integer parameter ids numbered across the param groups in
  order, each with the per-parameter ``step`` (a 0-d float32 tensor, as torch's Adam keeps it,
  whatever type DeepSpeed's optimizer used), ``exp_avg`` and ``exp_avg_sq`` in the parameter's
  shape; ``param_groups`` with the hyper-parameters saved in the store. A DeepSpeed FusedAdam
  store is given torch ``Adam``/``AdamW`` group keys (``decoupled_weight_decay`` is FusedAdam's
  ``adam_w_mode``). States the optimizer kept whole in a shape of their own (format 3.1: a
  1-element tensor, Adafactor-style factors) are in each parameter's state as saved; states kept
  once per ZeRO partition fit no parameter and are refused (:mod:`ucformat.torch.odd_states`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.collective import NOTHING_LOADED, Group, settle
from ucformat.collective import group as ranks_group
from ucformat.errors import ModelMismatchError, UnsupportedExportError
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.format.names import model_name
from ucformat.format.pyvalue import decode
from ucformat.format.spec import BUFFER_STATE, FP32_STATE, STEP_STATE, VALUE_STATE
from ucformat.read.batch import Pending, ReadBatch, read_own
from ucformat.read.checkpoint import UniversalCheckpoint, open_checkpoint, scalar_value
from ucformat.read.model_match import match_model, refuse_mismatch
from ucformat.read.shared import JobReport, ReadOutcome, check_mode, read_batch
from ucformat.store.keys import StoreLike
from ucformat.torch.dtensor import is_dtensor, reshard
from ucformat.torch.odd_states import odd_states_left_out
from ucformat.torch.optim_groups import merged_group, torch_group, torch_step_tensor

__all__ = ["TorchLoadReport", "load", "model_state_dict", "optimizer_state_dict", "state_dicts"]

_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass
class TorchLoadReport(JobReport):
    """What :func:`load` did (and how the job read: :class:`~ucformat.read.shared.JobReport`)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    #: The client state saved with the checkpoint (keys with an exact JSON form).
    client_state: dict[str, Any] = field(default_factory=dict)
    #: Bytes this rank fetched from the store (data, checksums, shard indexes).
    bytes_read: int = 0
    #: Read requests (each one GET on an object store).
    requests: int = 0
    #: Bytes of values this rank needed (its local shards of every array it read).
    bytes_needed: int = 0
    seconds: float = 0.0
    #: Optimizer states of the store left out (``strict=False``): those a torch optimizer has
    #: no place for (:mod:`ucformat.torch.odd_states`).
    skipped: list[str] = field(default_factory=list)

    @property
    def read_amplification(self) -> float:
        """Bytes fetched from the store per byte this rank needed."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0


def _open(
    store: StoreLike | UniversalCheckpoint, group: Group | None = None
) -> UniversalCheckpoint:
    return store if isinstance(store, UniversalCheckpoint) else open_checkpoint(store, group)


def model_state_dict(
    store: StoreLike | UniversalCheckpoint, *, dtype: torch.dtype | None = None
) -> OrderedDict[str, torch.Tensor]:
    """The model's ``state_dict()``: parameters, tied aliases, buffers.

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        dtype: cast floating parameters to this dtype (default: fp32 master weights; frozen
            parameters upcast to fp32). Buffers always keep their own dtype.
    """
    ckpt = _open(store)
    batch = ReadBatch()
    pending = _model_reads(ckpt, batch)
    read_own(ckpt, batch)
    return _model_values(ckpt.manifest, pending, dtype)


def _model_reads(ckpt: UniversalCheckpoint, batch: ReadBatch) -> dict[str, Pending]:
    """Every parameter's weights and every buffer, added to ``batch``."""
    manifest = ckpt.manifest
    pending = {name: batch.whole(ckpt, name, FP32_STATE) for name in manifest.params}
    pending.update((name, batch.whole(ckpt, name, BUFFER_STATE)) for name in manifest.buffers)
    return pending


def _model_values(
    manifest: CheckpointManifest, pending: dict[str, Pending], dtype: torch.dtype | None
) -> OrderedDict[str, torch.Tensor]:
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in manifest.params:
        value = pending[name].value()
        out[name] = value.to(dtype) if dtype is not None and value.dtype in _FLOATING else value
    for alias, owner in manifest.tied.items():
        out[alias] = out[owner]
    for name in manifest.buffers:
        out[name] = pending[name].value()
    return out


def _param_state(
    ckpt: UniversalCheckpoint, name: str, torch_step: bool, batch: ReadBatch
) -> dict[str, Any]:
    """The optimizer state of ``name``: scalars now, arrays as :class:`Pending` reads of
    ``batch`` (:func:`_resolved` once it is read)."""
    manifest = ckpt.manifest
    entry = manifest.params[manifest.resolve(name)]
    assert manifest.optimizer is not None
    state: dict[str, Any] = {}
    for key, scalar in entry.scalars.items():
        value = scalar_value(scalar)
        state[key] = torch_step_tensor(value) if key == STEP_STATE and torch_step else value
    for key in manifest.optimizer.state_keys:
        if key in entry.states:
            state[key] = batch.whole(ckpt, manifest.resolve(name), key)
    for key in entry.whole_states:  # format 3.1: a state in a shape of its own, as saved
        state[key] = batch.whole(ckpt, manifest.resolve(name), key)
    return state


def _resolved(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {
        index: {k: v.value() if isinstance(v, Pending) else v for k, v in values.items()}
        for index, values in state.items()
    }


def optimizer_state_dict(
    store: StoreLike | UniversalCheckpoint, *, torch_step: bool = True, strict: bool = True
) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` in torch's format (see the module docstring).

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        torch_step: give ``step`` as torch's Adam keeps it (0-d float32 tensor); ``False``
            keeps the stored type (an int for DeepSpeed's FusedAdam).
        strict: refuse a store with states kept once per ZeRO partition (no parameter's);
            ``False`` leaves them out.

    Raises:
        UnsupportedExportError: the store holds no optimizer state.
        UnsupportedCheckpointError: ``strict`` and the store keeps states per ZeRO partition.
    """
    ckpt = _open(store)
    manifest = ckpt.manifest
    if manifest.optimizer is None:
        raise UnsupportedExportError(
            "this store holds no optimizer state; load the model only (optimizer=None)."
        )
    odd_states_left_out(manifest, sharded=False, strict=strict)
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    batch = ReadBatch()
    index = 0
    for number, group in enumerate(manifest.optimizer.groups):
        ids = []
        for name in group.params:
            state[index] = _param_state(ckpt, name, torch_step, batch)
            ids.append(index)
            index += 1
        groups.append({**torch_group(manifest, number), "params": ids})
    read_own(ckpt, batch)
    return {"state": _resolved(state), "param_groups": groups}


def state_dicts(
    store: StoreLike | UniversalCheckpoint,
    *,
    dtype: torch.dtype | None = None,
    optimizer: bool = True,
) -> dict[str, Any]:
    """``{"model": model state dict, "optimizer": optimizer state dict or None}``.

    Example:
        >>> state = ucformat.torch.state_dicts("ckpt.ucf")  # doctest: +SKIP
        >>> model.load_state_dict(state["model"])  # doctest: +SKIP
    """
    ckpt = _open(store)
    with_optimizer = optimizer and ckpt.manifest.optimizer is not None
    return {
        "model": model_state_dict(ckpt, dtype=dtype),
        "optimizer": optimizer_state_dict(ckpt) if with_optimizer else None,
    }


# --- load into a live model and optimizer ----------------------------------------------------
def _check_model(
    model: torch.nn.Module, saved: Mapping[str, Any], strict: bool, report: TorchLoadReport
) -> None:
    """Compare the model's state dict with ``saved`` (names to shapes)."""
    live = model.state_dict()
    match = match_model({k: v.shape for k, v in live.items()}, saved)
    report.missing, report.unexpected = match.missing, match.unexpected
    refuse_mismatch(match, strict=strict)


def _live_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): model_name(name) for name, p in model.named_parameters()}


def _live_keys(model: torch.nn.Module, saved: OrderedDict[str, Any]) -> None:
    """Rename ``saved``'s entries to the live model's names (wrapper components included)."""
    live = {model_name(key): key for key in model.state_dict()}
    renamed = [(live.get(model_name(key), key), value) for key, value in saved.items()]
    saved.clear()
    saved.update(renamed)


def _check_optimizer(
    manifest: CheckpointManifest, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> list[list[str]]:
    """Member names of each live group; raise if the groups differ from the store's."""
    if manifest.optimizer is None:
        raise UnsupportedExportError(
            "this store holds no optimizer state; pass optimizer=None to load the model only."
        )
    live = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
    stored = [group.params for group in manifest.optimizer.groups]
    resolved = [[manifest.resolve(n) for n in g] for g in live]
    if [sorted(g) for g in resolved] != [sorted(g) for g in stored]:
        raise ModelMismatchError(
            f"the optimizer's param groups do not match the checkpoint's: the optimizer has "
            f"{[len(g) for g in live]} params per group, the store {[len(g) for g in stored]} "
            f"({manifest.optimizer.name}); build the optimizer with the training run's param "
            "groups. Nothing was loaded."
        )
    return live


def load(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: StoreLike | UniversalCheckpoint,
    *,
    strict: bool = True,
    scheduler: Any = None,
    read: str = "auto",
) -> TorchLoadReport:
    """Load a store into a PyTorch model and (optionally) optimizer.

    A model whose parameters are DTensors (FSDP2 ``fully_shard`` on a 1-D mesh, HSDP on a
    ``(replicate, shard)`` mesh, tensor parallel ``parallelize_module``, FSDP2 + TP on a
    ``(dp, tp)`` mesh: any ``Shard(d)``, ``_StridedShard`` and ``Replicate()`` placements) is
    loaded collectively: call it on every rank; each rank needs only the runs of flat elements
    its local shards cover (one per row for a ``Shard(1)`` column block), of the weights and of
    every optimizer state, and optimizer states the optimizer does not hold yet are created as
    DTensors with the parameter's mesh and placements; param groups are matched to the stored
    ones by the names of the parameters they hold (docs/fsdp2.md, docs/tensor-parallel.md).
    A plain model (every rank holds all of it) is loaded in this process, or, under
    ``torch.distributed`` with more than one rank and ``read`` other than ``"own"``,
    collectively too: call it on every rank.

    The model gets every parameter (from fp32, cast by ``load_state_dict`` to the model's
    dtype), tied aliases and buffers. The optimizer (built over the same param groups as the
    training run, in any order within a group) gets per-parameter state and the step, and its
    groups get the stored hyper-parameters for every key they have.

    Args:
        model: the model to fill.
        optimizer: a ``torch.optim`` optimizer over ``model``'s parameters, or None.
        store: a store path/URL/``Store`` or an opened checkpoint.
        strict: fail (before changing anything) on missing/unexpected names or an optimizer
            whose weight-decay mode differs from the store's.
        scheduler: an lr scheduler to restore from the state ``ucformat.torch.save(...,
            scheduler=)`` (or DeepSpeed) recorded; a store without one is refused (before
            anything changes) unless ``strict=False``.
        read: how the ranks of a collective load read the store (docs/loading.md, "Read
            once"): ``"once"``: every chunk is fetched from storage by one rank and shared
            over the job's process group; ``"own"``: every rank reads all it needs itself;
            ``"auto"`` (default): once where ranks share chunks (replicas, chunks cut by
            shards), else own. The loaded state is the same bit for bit.

    Raises:
        ModelMismatchError: the model or the optimizer's groups do not match the store.
        UnsupportedExportError: an optimizer was given but the store holds no optimizer state,
            or a DTensor has a ``Partial()`` placement.
        UnsupportedCheckpointError: ``strict`` and the store holds optimizer states the
            optimizer has no place for (kept once per ZeRO partition; kept whole, into a sharded
            model): one line, nothing loaded.
        CollectiveError: (collective loads) some rank could not read its part; nothing was
            loaded on any rank.

    Example:
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> ucformat.torch.load(model, optimizer, "ckpt.ucf")  # doctest: +SKIP
    """
    check_mode(read)
    ckpt = _open(store, ranks_group() if read != "own" else None)
    manifest = ckpt.manifest
    report = TorchLoadReport()
    reshard(model)  # FSDP2 modules left unsharded by an evaluation forward
    scheduler_state = manifest.progress.lr_scheduler if scheduler is not None else None
    if scheduler is not None and scheduler_state is None and strict:
        raise ModelMismatchError(
            f"{ckpt.where}: a scheduler was given but the store holds no lr scheduler state; "
            "pass scheduler=None, or strict=False to leave it as it is. Nothing was loaded."
        )
    if any(is_dtensor(p) for p in model.parameters()):
        from ucformat.torch.sharded_load import load_sharded

        load_sharded(model, optimizer, ckpt, strict, report, read)
    else:
        _load_plain(model, optimizer, ckpt, strict, report, read)
    _restore_scheduler(scheduler, scheduler_state)
    return report


def _load_plain(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ckpt: UniversalCheckpoint,
    strict: bool,
    report: TorchLoadReport,
    read: str,
) -> None:
    """Fill a model of plain tensors (whole on every rank) and its optimizer."""
    started = time.perf_counter()
    before, requests_before = ckpt.stats.bytes_read, ckpt.stats.requests
    manifest = ckpt.manifest
    shapes: OrderedDict[str, Any] = OrderedDict(
        (name, torch.Size(entry.shape)) for name, entry in manifest.params.items()
    )
    shapes.update((alias, shapes[owner]) for alias, owner in manifest.tied.items())
    shapes.update((name, torch.Size(b.array.shape)) for name, b in manifest.buffers.items())
    _live_keys(model, shapes)  # a checkpoint-wrapped or compiled model's names (format/names.py)
    _check_model(model, shapes, strict, report)
    batch = ReadBatch()
    weights = _model_reads(ckpt, batch)
    optimizer_state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        names = _live_names(model)
        live_groups = _check_optimizer(manifest, optimizer, names)
        report.skipped = odd_states_left_out(manifest, sharded=False, strict=strict)
        torch_step = type(optimizer).__module__.startswith("torch.optim")
        index = 0
        for number, (members, live) in enumerate(
            zip(live_groups, optimizer.param_groups, strict=True)
        ):
            ids = []
            for name in members:
                optimizer_state[index] = _param_state(ckpt, name, torch_step, batch)
                ids.append(index)
                index += 1
            groups.append({**merged_group(manifest, number, live, strict), "params": ids})
    group: Group | None = ranks_group().operation() if read != "own" else None
    outcome = ReadOutcome()
    if group is not None and group.distributed:
        outcome = read_batch(ckpt, batch, group, read=read)
        settle(outcome.failure, group, ckpt.where, undone=NOTHING_LOADED)
    else:
        read_own(ckpt, batch)
    saved = _model_values(manifest, weights, None)
    _live_keys(model, saved)
    model.load_state_dict(saved, strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict({"state": _resolved(optimizer_state), "param_groups": groups})
    report.client_state = {k: decode(v) for k, v in manifest.client_state.values.items()}
    report.bytes_read = ckpt.stats.bytes_read - before
    report.bytes_needed = sum(ref.nbytes for ref in _arrays_read(manifest, optimizer is not None))
    report.requests = ckpt.stats.requests - requests_before
    report.record(outcome, group, report.bytes_read, report.requests, report.bytes_needed)
    report.seconds = time.perf_counter() - started


def _restore_scheduler(scheduler: Any, state: Any) -> None:
    """Give ``scheduler`` the stored state (nothing when either is None)."""
    if scheduler is not None and state is not None:
        scheduler.load_state_dict(decode(state))


def _arrays_read(manifest: CheckpointManifest, with_optimizer: bool) -> list[ArrayRef]:
    """Every array a plain load reads whole."""
    keys = set(manifest.optimizer.state_keys) if with_optimizer and manifest.optimizer else set()
    refs = [buffer.array for buffer in manifest.buffers.values()]
    for entry in manifest.params.values():
        refs += [
            ref
            for key, ref in entry.states.items()
            if key in (FP32_STATE, VALUE_STATE) or key in keys
        ]
        refs += list(entry.whole_states.values()) if keys else []
    return refs
