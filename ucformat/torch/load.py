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
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.errors import ModelMismatchError, UnsupportedExportError
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.format.names import model_name
from ucformat.format.pyvalue import decode
from ucformat.format.spec import BUFFER_STATE, FP32_STATE, STEP_STATE, VALUE_STATE
from ucformat.read.checkpoint import UniversalCheckpoint, open_checkpoint, scalar_value
from ucformat.read.model_match import match_model, refuse_mismatch
from ucformat.store.keys import StoreLike
from ucformat.torch.dtensor import is_dtensor, reshard
from ucformat.torch.odd_states import odd_states_left_out
from ucformat.torch.optim_groups import merged_group, torch_group, torch_step_tensor

__all__ = ["TorchLoadReport", "load", "model_state_dict", "optimizer_state_dict", "state_dicts"]

_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass
class TorchLoadReport:
    """What :func:`load` did."""

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


def _open(store: StoreLike | UniversalCheckpoint) -> UniversalCheckpoint:
    return store if isinstance(store, UniversalCheckpoint) else open_checkpoint(store)


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
    manifest = ckpt.manifest
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in manifest.params:
        value = ckpt.read(name, FP32_STATE)
        out[name] = value.to(dtype) if dtype is not None and value.dtype in _FLOATING else value
    for alias, owner in manifest.tied.items():
        out[alias] = out[owner]
    for name in manifest.buffers:
        out[name] = ckpt.read(name, BUFFER_STATE)
    return out


def _param_state(ckpt: UniversalCheckpoint, name: str, torch_step: bool) -> dict[str, Any]:
    manifest = ckpt.manifest
    entry = manifest.params[manifest.resolve(name)]
    assert manifest.optimizer is not None
    state: dict[str, Any] = {}
    for key, scalar in entry.scalars.items():
        value = scalar_value(scalar)
        state[key] = torch_step_tensor(value) if key == STEP_STATE and torch_step else value
    for key in manifest.optimizer.state_keys:
        if key in entry.states:
            state[key] = ckpt.read(manifest.resolve(name), key)
    for key in entry.whole_states:  # format 3.1: a state in a shape of its own, as saved
        state[key] = ckpt.read(manifest.resolve(name), key)
    return state


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
    index = 0
    for number, group in enumerate(manifest.optimizer.groups):
        ids = []
        for name in group.params:
            state[index] = _param_state(ckpt, name, torch_step)
            ids.append(index)
            index += 1
        groups.append({**torch_group(manifest, number), "params": ids})
    return {"state": state, "param_groups": groups}


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
    model: torch.nn.Module, saved: dict[str, torch.Tensor], strict: bool, report: TorchLoadReport
) -> None:
    live = model.state_dict()
    match = match_model(
        {k: v.shape for k, v in live.items()}, {k: v.shape for k, v in saved.items()}
    )
    report.missing, report.unexpected = match.missing, match.unexpected
    refuse_mismatch(match, strict=strict)


def _live_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): model_name(name) for name, p in model.named_parameters()}


def _live_keys(model: torch.nn.Module, saved: OrderedDict[str, torch.Tensor]) -> None:
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
) -> TorchLoadReport:
    """Load a store into a PyTorch model and (optionally) optimizer.

    A plain model (no DTensor parameters) is loaded in this process. A model whose parameters
    are DTensors (FSDP2 ``fully_shard`` on a 1-D mesh, HSDP on a ``(replicate, shard)`` mesh,
    tensor parallel ``parallelize_module``, FSDP2 + TP on a ``(dp, tp)`` mesh: any ``Shard(d)``,
    ``_StridedShard`` and ``Replicate()`` placements) is loaded collectively: call it on every
    rank; each rank reads only the runs of flat elements its local shards cover (one per row
    for a ``Shard(1)`` column block), of the weights and of every optimizer state, and
    optimizer states the optimizer does not hold yet are created as DTensors with the
    parameter's mesh and placements; param groups are matched to the stored ones by the names
    of the parameters they hold (docs/fsdp2.md, docs/tensor-parallel.md).

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

    Raises:
        ModelMismatchError: the model or the optimizer's groups do not match the store.
        UnsupportedExportError: an optimizer was given but the store holds no optimizer state,
            or a DTensor has a ``Partial()`` placement.
        UnsupportedCheckpointError: ``strict`` and the store holds optimizer states the
            optimizer has no place for (kept once per ZeRO partition; kept whole, into a sharded
            model): one line, nothing loaded.
        CollectiveError: (DTensor models) some rank could not read its part; nothing was
            loaded on this rank.

    Example:
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> ucformat.torch.load(model, optimizer, "ckpt.ucf")  # doctest: +SKIP
    """
    ckpt = _open(store)
    before, requests_before = ckpt.stats.bytes_read, ckpt.stats.requests
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

        load_sharded(model, optimizer, ckpt, strict, report)
        _restore_scheduler(scheduler, scheduler_state)
        return report
    started, before = time.perf_counter(), ckpt.stats.bytes_read
    saved = model_state_dict(ckpt)
    _live_keys(model, saved)  # a checkpoint-wrapped or compiled model's names (format/names.py)
    _check_model(model, saved, strict, report)
    optimizer_sd = None
    if optimizer is not None:
        names = _live_names(model)
        live_groups = _check_optimizer(manifest, optimizer, names)
        report.skipped = odd_states_left_out(manifest, sharded=False, strict=strict)
        torch_step = type(optimizer).__module__.startswith("torch.optim")
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        for number, (members, live) in enumerate(
            zip(live_groups, optimizer.param_groups, strict=True)
        ):
            ids = []
            for name in members:
                state[index] = _param_state(ckpt, name, torch_step)
                ids.append(index)
                index += 1
            groups.append({**merged_group(manifest, number, live, strict), "params": ids})
        optimizer_sd = {"state": state, "param_groups": groups}
    model.load_state_dict(saved, strict=strict)
    if optimizer_sd is not None and optimizer is not None:
        optimizer.load_state_dict(optimizer_sd)
    _restore_scheduler(scheduler, scheduler_state)
    report.client_state = {k: decode(v) for k, v in manifest.client_state.values.items()}
    report.bytes_read = ckpt.stats.bytes_read - before
    report.bytes_needed = sum(
        ref.nbytes for ref in _arrays_read(manifest, optimizer_sd is not None)
    )
    report.seconds = time.perf_counter() - started
    report.requests = ckpt.stats.requests - requests_before
    return report


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
