"""Pure summaries of a manifest for ``ucformat inspect``: no tensor data is read."""

from __future__ import annotations

from dataclasses import dataclass, field

from ucformat.format.models import ArrayRef, CheckpointManifest, ParamEntry, PartitionState
from ucformat.format.pyvalue import decode_for_display
from ucformat.format.spec import FP32_STATE

__all__ = ["ParamRow", "StoreSummary", "format_bytes", "summarize"]


@dataclass(frozen=True)
class ParamRow:
    """One line of the parameter table."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str
    trainable: bool
    states: tuple[str, ...]
    nbytes: int
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class StoreSummary:
    """Everything ``inspect`` shows."""

    header: dict[str, str]
    params: tuple[ParamRow, ...]
    groups: tuple[tuple[int, int, str], ...]
    buffers: tuple[tuple[str, tuple[int, ...], str], ...]
    totals: dict[str, str]
    #: Per optimizer group index: its states kept once per ZeRO partition (format 3.1), as
    #: ``inspect`` lists them; only groups that have some.
    partition_states: dict[int, str] = field(default_factory=dict)


def format_bytes(count: int) -> str:
    """Human-readable byte count (binary units)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def summarize(manifest: CheckpointManifest) -> StoreSummary:
    """Build the rows and header lines shown by ``ucformat inspect``."""
    source, progress, optimizer = manifest.source, manifest.progress, manifest.optimizer
    header = {
        "format": f"{manifest.format} {manifest.format_version} ({manifest.created_by})",
        "source": f"DeepSpeed {source.framework_version}, ZeRO-{source.zero_stage}, "
        f"world size {source.world_size}, {source.train_dtype}, {source.optimizer_wrapper}"
        if source.framework == "deepspeed"
        else source.describe(),
        "source path": f"{source.path} (tag {source.tag})" if source.tag else source.path,
        "optimizer": "none" if optimizer is None else _optimizer_line(manifest),
        "progress": f"global_steps {progress.global_steps}, global_samples "
        f"{progress.global_samples}, skipped_steps {progress.skipped_steps}",
    }
    if manifest.megatron is not None:
        header["megatron"] = manifest.megatron.describe()
    tp = manifest.tensor_parallel
    if tp is not None:
        kinds = [split.kind for split in tp.params.values()]
        header["tensor parallel"] = (
            f"{tp.framework}, degree {tp.degree}: {kinds.count('split')} split, "
            f"{kinds.count('replicated')} replicated, {kinds.count('affine')} other "
            "(arrays hold full shapes)"
        )
    if source.pipeline is not None:
        header["pipeline"] = source.pipeline.describe()
    if progress.loss_scaler is not None:
        header["loss scaler"] = (
            f"{progress.loss_scaler.class_name} scale {progress.loss_scaler.cur_scale:g}"
        )
    if progress.lr_scheduler is not None:
        header["lr scheduler"] = str(decode_for_display(progress.lr_scheduler))
    client = manifest.client_state
    if client.values or client.unrepresentable:
        kept = ", ".join(client.values) or "-"
        dropped = ", ".join(f"{k} ({t})" for k, t in client.unrepresentable.items())
        header["client state"] = kept + (f"; not stored: {dropped}" if dropped else "")
    rows = tuple(
        ParamRow(
            name=name,
            shape=tuple(entry.shape),
            dtype=entry.dtype,
            group="frozen" if entry.group is None else str(entry.group),
            trainable=entry.requires_grad,
            states=(
                *(_state_label(s, r, entry) for s, r in entry.states.items()),
                *(_whole_label(s, r) for s, r in entry.whole_states.items()),
                *entry.scalars,
            ),
            nbytes=sum(
                ref.nbytes for ref in (*entry.states.values(), *entry.whole_states.values())
            ),
            aliases=tuple(entry.aliases),
        )
        for name, entry in manifest.params.items()
    )
    groups = tuple(
        (
            index,
            len(group.params),
            ", ".join(f"{k}={decode_for_display(v)}" for k, v in group.hyperparams.items()),
        )
        for index, group in enumerate(optimizer.groups if optimizer else [])
    )
    buffers = tuple(
        (name, tuple(entry.shape), entry.dtype) for name, entry in manifest.buffers.items()
    )
    per_partition = {
        index: "; ".join(_partition_label(k, s) for k, s in group.partition_states.items())
        for index, group in enumerate(optimizer.groups if optimizer else [])
        if group.partition_states
    }
    numel = sum(entry.numel for entry in manifest.params.values())
    stored = (
        sum(row.nbytes for row in rows)
        + sum(entry.array.nbytes for entry in manifest.buffers.values())
        + sum(
            s.array.nbytes
            for group in (optimizer.groups if optimizer else [])
            for s in group.partition_states.values()
        )
    )
    totals = {
        "params": f"{len(rows)} ({numel:,} elements), {len(manifest.tied)} tied aliases, "
        f"{len(buffers)} buffers",
        "stored": f"{format_bytes(stored)} uncompressed",
    }
    return StoreSummary(header, rows, groups, buffers, totals, per_partition)


def _optimizer_line(manifest: CheckpointManifest) -> str:
    """The optimizer, its elementwise states and scalars, and (format 3.1) the states it keeps
    whole per parameter or once per ZeRO partition, which do not reshard elementwise."""
    optimizer = manifest.optimizer
    assert optimizer is not None
    line = (
        f"{optimizer.name}, states {', '.join(optimizer.state_keys) or '-'}; "
        f"scalars {', '.join(optimizer.scalar_keys) or '-'}"
    )
    if optimizer.whole_keys:
        line += f"; whole per parameter: {', '.join(optimizer.whole_keys)}"
    held = [
        f"{key} (group {index})"
        for index, group in enumerate(optimizer.groups)
        for key in group.partition_states
    ]
    if held:
        line += f"; once per ZeRO partition: {', '.join(held)}"
    return line


def _shape_text(shape: list[int]) -> str:
    return "x".join(map(str, shape)) or "()"


def _whole_label(state: str, ref: ArrayRef) -> str:
    """A state kept whole in a shape of its own: ``row (whole 5)``, its dtype unless float32."""
    dtype = "" if ref.dtype == "float32" else f" {ref.dtype}"
    return f"{state} (whole {_shape_text(ref.shape)}{dtype})"


def _partition_label(state: str, held: PartitionState) -> str:
    """A state kept once per ZeRO partition: ``peak 1 x 2 partitions`` (`` (equal)`` when every
    partition holds the same bytes)."""
    dtype = "" if held.array.dtype == "float32" else f" {held.array.dtype}"
    same = " (equal)" if held.replicated else ""
    return f"{state} {_shape_text(held.shape)}{dtype} x {held.partitions} partitions{same}"


def _state_label(state: str, ref: ArrayRef, entry: ParamEntry) -> str:
    """A state as ``inspect`` lists it: its name, and its dtype unless float32.

    A frozen parameter's value is ``value`` in format 2; format 1 stored it under ``fp32`` in
    its own dtype, which the label says rather than let the name suggest float32.
    """
    if state == FP32_STATE and not entry.requires_grad:
        return f"fp32 ({ref.dtype} value, format-1 name)" if ref.dtype != "float32" else state
    return state if ref.dtype == "float32" else f"{state} ({ref.dtype})"
