"""``ucformat export dcp``: a PyTorch Distributed Checkpoint that stock ``dcp.load`` reads.

The folder holds what ``dcp.save`` itself writes for ``{"model": get_model_state_dict(m),
"optimizer": get_optimizer_state_dict(m, opt, options)}``::

    out/__<rank>_0.distcp   one per rank of --world-size: torch.save archives back to back
    out/.metadata           a pickle of DCP's own Metadata dataclasses, written last

Keys (``--layout flat``, ``StateDictOptions(flatten_optimizer_state_dict=True)``, torchtitan's)::

    model.<fqn>                          fp32 master weight (frozen: stored value), buffers
    optimizer.state.<fqn>.<state>        exp_avg, exp_avg_sq (fp32), step (0-d tensor)
    optimizer.param_groups.<fqn>.<hp>    every hyper-parameter of the fqn's group

``--layout nested`` (``get_optimizer_state_dict`` without options) writes the same state keys
and ``optimizer.param_groups.<i>.<hp>`` with ``optimizer.param_groups.<i>.params`` (FQNs).

Algorithm:

1. **Plan** (pure, manifest only): every key, and for each tensor its chunks: FSDP2's dim-0
   split at ``world_size`` (:func:`~ucformat.layout.boxes.row_chunks`), each rank's rows cut
   into pieces of at most ``piece_bytes``; rank ``r``'s pieces go to ``__r_0.distcp``,
   non-tensor values to ``__0_0.distcp``. A stock ``dcp.load`` reshards any chunking, so the
   checkpoint loads at every world size.
2. **Execute** (:func:`write_dcp_files`, also the writer of ``export megatron``): one data
   file at a time, each piece (a box of the DCP tensor: its values are a box of one store
   array) read with ``read_runs`` (a dim-0 piece is one flat range), ``torch.save``d and
   appended; its byte range recorded. Peak memory is about two pieces. ``.metadata`` is
   pickled from ``torch.distributed.checkpoint.metadata``'s own classes and moved in last, as
   DCP commits: everything is written into the destination's staging folder and committed by
   the one destination lifecycle (``export/destination.py``: fsync, then the swap).

torch's Adam/AdamW expect every hyper-parameter key in each group and a tensor ``step``: for a
store from another optimizer (DeepSpeed's FusedAdam) missing keys get torch's defaults
(``decoupled_weight_decay`` from the store's AdamW mode) and integer steps become float32
tensors; the result's notes say so.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Literal

import torch

from ucformat.errors import UnsupportedExportError
from ucformat.export.common import (
    ExportHooks,
    ExportResult,
    Stopwatch,
    open_store_arg,
)
from ucformat.export.dcp_metadata import dcp_metadata
from ucformat.export.destination import file_writes, prepare_destination, transactional
from ucformat.export.url_target import export_to_url, is_url
from ucformat.format.dtypes import itemsize, torch_dtype
from ucformat.format.models import CheckpointManifest, ScalarState
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE
from ucformat.format.summary import format_bytes
from ucformat.layout.boxes import chunk_runs, row_chunks
from ucformat.read.checkpoint import BUFFER_STATE, UniversalCheckpoint
from ucformat.store.keys import StoreLike

__all__ = [
    "DcpPiece",
    "DcpPlan",
    "DcpTensorItem",
    "DcpValueItem",
    "export_dcp",
    "plan_dcp",
    "write_dcp_files",
]

METADATA_NAME = ".metadata"
DEFAULT_PIECE_BYTES = 64 * 2**20
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})
#: torch.optim.Adam/AdamW's param-group keys and defaults (torch 2.x), for stores of others.
_TORCH_ADAM_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
Layout = Literal["flat", "nested"]
KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class DcpPiece:
    """One chunk DCP writes: the box ``offsets``/``sizes`` of the DCP tensor, written by ``rank``
    into ``__<rank>_0.distcp``; its values are the box of array ``state`` of store parameter
    ``name`` at ``source`` (offsets in the array's own shape) whose sizes are ``sizes`` without
    the leading dims the DCP tensor prepends (Megatron-Core's layer axis). A 0-d tensor is one
    piece with empty offsets and sizes."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    name: str
    state: str
    source: tuple[int, ...]

    @property
    def source_sizes(self) -> tuple[int, ...]:
        """The box's sizes in the store array (the prepended dims dropped)."""
        return self.sizes[len(self.sizes) - len(self.source) :]

    @property
    def row_start(self) -> int:
        """First row of dim 0 (0 for a 0-d tensor)."""
        return self.offsets[0] if self.offsets else 0

    @property
    def row_stop(self) -> int:
        """Row after the last of dim 0 (1 for a 0-d tensor)."""
        return self.offsets[0] + self.sizes[0] if self.offsets else 1


@dataclass(frozen=True)
class DcpTensorItem:
    """One tensor key: its global shape and dtype, and the pieces it is cut into."""

    key: str
    path: KeyPath
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[DcpPiece, ...]
    scalar: ScalarState | None = None

    @property
    def row_elements(self) -> int:
        """Elements per row of dim 0 (1 for a 0-d tensor)."""
        return prod(self.shape[1:]) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Payload bytes."""
        return prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class DcpValueItem:
    """One non-tensor key (a hyper-parameter, a ``params`` list): its Python value."""

    key: str
    path: KeyPath
    value: Any


@dataclass(frozen=True)
class DcpPlan:
    """Every key in saving order, the data files, and what cannot be carried exactly."""

    tensors: tuple[DcpTensorItem, ...]
    values: tuple[DcpValueItem, ...]
    world_size: int
    layout: Layout
    notes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Tensor payload bytes."""
        return sum(item.nbytes for item in self.tensors)

    @property
    def filenames(self) -> list[str]:
        """Files in writing order (``.metadata`` last)."""
        return [*(f"__{rank}_0.distcp" for rank in range(self.world_size)), METADATA_NAME]


def _step_scalar(scalar: ScalarState) -> ScalarState:
    if scalar.kind == "tensor":
        return scalar
    return ScalarState(kind="tensor", value=float(scalar.value), dtype="float32")


def plan_dcp(
    manifest: CheckpointManifest,
    *,
    world_size: int,
    layout: Layout = "flat",
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> DcpPlan:
    """Plan a DCP export from the manifest alone (see the module docstring)."""
    if world_size < 1:
        raise UnsupportedExportError(f"--world-size must be at least 1, got {world_size}.")
    if layout not in ("flat", "nested"):
        raise UnsupportedExportError(f"layout {layout!r}; expected 'flat' or 'nested'.")
    notes: list[str] = []
    tensors: list[DcpTensorItem] = []

    def add(key: str, path: KeyPath, name: str, state: str, shape: tuple[int, ...], dtype: str,
            scalar: ScalarState | None = None) -> None:  # fmt: skip
        elements = max(1, piece_bytes // itemsize(dtype))
        rows = [(c.rank, c.row_start, c.row_stop) for c in row_chunks(shape, world_size, elements)]
        if not rows and shape:  # an empty tensor: one empty chunk, as DCP writes it
            rows = [(0, 0, shape[0])]
        pieces = tuple(_row_piece(shape, rank, a, b, name, state) for rank, a, b in rows)
        tensors.append(DcpTensorItem(key, path, shape, dtype, pieces, scalar))

    aliases: dict[str, list[str]] = {}
    for alias, owner in manifest.tied.items():
        aliases.setdefault(owner, []).append(alias)
    for name, entry in manifest.params.items():
        dtype = "float32" if entry.dtype in _FLOATING else entry.dtype
        for key in (name, *aliases.get(name, [])):
            add(f"model.{key}", ("model", key), name, FP32_STATE, tuple(entry.shape), dtype)
    for name, buffer in manifest.buffers.items():
        add(f"model.{name}", ("model", name), name, BUFFER_STATE, tuple(buffer.shape), buffer.dtype)
    values: list[DcpValueItem] = []
    optimizer = manifest.optimizer
    if optimizer is None:
        notes.append("the store has no optimizer state: only 'model' is written")
        return DcpPlan(tuple(tensors), (), world_size, layout, tuple(notes))
    converted_steps = False
    for group in optimizer.groups:
        for name in group.params:
            entry = manifest.params[name]
            for state in entry.states:
                if state != FP32_STATE:
                    key, path = _state_key(name, state, layout)
                    add(key, path, name, state, tuple(entry.shape), entry.states[state].dtype)
            for state, scalar in entry.scalars.items():
                tensor = _step_scalar(scalar)
                converted_steps |= tensor is not scalar
                key, path = _state_key(name, state, layout)
                add(key, path, name, state, (), tensor.dtype or "float32", tensor)
    filled: set[str] = set()
    for index, group in enumerate(optimizer.groups):
        hyper = {k: decode(v) for k, v in group.hyperparams.items()}
        for hp, default in _torch_defaults(optimizer.adam_w_mode).items():
            if hp not in hyper:
                hyper[hp] = default
                filled.add(hp)
        if layout == "nested":
            for hp, value in hyper.items():
                values.append(_value(("param_groups", index, hp), value))
            values.append(_value(("param_groups", index, "params"), list(group.params)))
        else:
            for name in group.params:
                for hp, value in hyper.items():
                    values.append(_value((f"param_groups.{name}.{hp}",), value))
    if filled:
        notes.append(
            f"param groups lacked torch Adam's keys {', '.join(sorted(filled))}: written with "
            "torch's defaults"
        )
    if converted_steps:
        notes.append("integer optimizer steps written as float32 tensors (torch Adam's type)")
    frozen = [n for n, e in manifest.params.items() if e.group is None]
    if frozen:
        notes.append(f"frozen params have no optimizer entries: {', '.join(frozen)}")
    return DcpPlan(tuple(tensors), tuple(values), world_size, layout, tuple(notes))


def _row_piece(
    shape: tuple[int, ...], rank: int, start: int, stop: int, name: str, state: str
) -> DcpPiece:
    """Rows ``[start, stop)`` of a tensor of ``shape`` as a piece (0-d: the value)."""
    if not shape:
        return DcpPiece(rank, (), (), name, state, ())
    offsets = (start, *(0 for _ in shape[1:]))
    return DcpPiece(rank, offsets, (stop - start, *shape[1:]), name, state, offsets)


def _torch_defaults(adam_w_mode: bool | None) -> dict[str, Any]:
    return {**_TORCH_ADAM_DEFAULTS, "decoupled_weight_decay": bool(adam_w_mode)}


def _state_key(name: str, state: str, layout: Layout) -> tuple[str, KeyPath]:
    if layout == "nested":
        return f"optimizer.state.{name}.{state}", ("optimizer", "state", name, state)
    return f"optimizer.state.{name}.{state}", ("optimizer", f"state.{name}.{state}")


def _value(path: KeyPath, value: Any) -> DcpValueItem:
    full: KeyPath = ("optimizer", *path)
    return DcpValueItem(".".join(str(p) for p in full), full, value)


# --- execution ------------------------------------------------------------------------------


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _piece_tensor(ckpt: UniversalCheckpoint, item: DcpTensorItem, piece: DcpPiece) -> torch.Tensor:
    target = torch_dtype(item.dtype)
    if item.scalar is not None:
        return torch.tensor(item.scalar.value, dtype=target)
    ref = ckpt.array_ref(piece.name, piece.state)
    runs = chunk_runs(tuple(ref.shape), piece.source, piece.source_sizes)
    values = ckpt.read_runs(piece.name, piece.state, runs)
    return values.to(target).reshape(piece.sizes)


def _write_data_file(
    ckpt: UniversalCheckpoint,
    folder: Path,
    tensors: tuple[DcpTensorItem, ...],
    values: tuple[DcpValueItem, ...],
    rank: int,
    hooks: ExportHooks,
) -> dict[tuple[str, int], tuple[str, int, int]]:
    """Write ``__<rank>_0.distcp``; return ``(key, piece index) -> (file, offset, length)``."""
    name = f"__{rank}_0.distcp"
    where: dict[tuple[str, int], tuple[str, int, int]] = {}
    with file_writes(folder / name), open(folder / name, "wb") as handle:
        for item in tensors:
            for index, piece in enumerate(item.pieces):
                if piece.rank != rank:
                    continue
                tensor = _piece_tensor(ckpt, item, piece)
                data = _saved(tensor)
                where[(item.key, index)] = (name, handle.tell(), len(data))
                handle.write(data)
                hooks.advance(tensor.numel() * tensor.element_size())
        if rank == 0:
            for value in values:
                data = _saved(value.value)
                where[(value.key, -1)] = (name, handle.tell(), len(data))
                handle.write(data)
    return where


def write_dcp_files(
    ckpt: UniversalCheckpoint,
    folder: Path,
    tensors: tuple[DcpTensorItem, ...],
    values: tuple[DcpValueItem, ...],
    world_size: int,
    checkpoint_id: str | Path,
    hooks: ExportHooks,
) -> None:
    """Write ``__<rank>_0.distcp`` for every rank, then ``.metadata``, into ``folder`` (a
    staging folder: its commit moves ``.metadata`` in last).

    Each piece goes into its writer rank's file; non-tensor values into rank 0's.
    """
    where: dict[tuple[str, int], tuple[str, int, int]] = {}
    for rank in range(world_size):
        where.update(_write_data_file(ckpt, folder, tensors, values, rank, hooks))
    metadata = pickle.dumps(dcp_metadata(tensors, values, where, checkpoint_id))
    with file_writes(folder / METADATA_NAME):
        (folder / METADATA_NAME).write_bytes(metadata)


def _owned(name: str) -> bool:
    return name == METADATA_NAME or bool(_DATA_FILE.match(name))


@transactional
def export_dcp(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    world_size: int | None = None,
    layout: Layout = "flat",
    overwrite: bool = False,
    dry_run: bool = False,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    hooks: ExportHooks | None = None,
) -> ExportResult:
    """Write the store as a PyTorch Distributed Checkpoint folder.

    Load it into an FSDP2 (or plain) model at any world size with stock DCP::

        options = StateDictOptions(flatten_optimizer_state_dict=True)  # --layout flat
        state = {"model": get_model_state_dict(model),
                 "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
        dcp.load(state, checkpoint_id=out)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        out: destination folder (created; must be empty unless ``overwrite``), or a URL
            (``s3://bucket/prefix``: written to a local staging folder, then uploaded, the
            ``.metadata`` file last).
        world_size: ranks whose FSDP2 shards the data files hold (default: the source's).
        layout: ``"flat"`` (``flatten_optimizer_state_dict=True``) or ``"nested"``.
        overwrite: replace an earlier DCP export in ``out`` (other files are kept).
        dry_run: plan only; write nothing.
        piece_bytes: largest chunk; bounds the memory used (default 64 MiB).
        hooks: progress callbacks.

    Example:
        >>> ucformat.export.export_dcp("ckpt.ucf", "dcp/", world_size=8)  # doctest: +SKIP
    """
    hooks = hooks or ExportHooks()
    ckpt = open_store_arg(store)
    if is_url(out):  # staged in a local folder, then uploaded (the metadata last)
        return export_to_url(
            str(out),
            lambda folder: _export_dcp(
                ckpt, folder, str(out), world_size, layout, overwrite, dry_run, piece_bytes, hooks
            ),
            owned=_owned,
            overwrite=overwrite,
            dry_run=dry_run,
            last=(METADATA_NAME,),
        )
    return _export_dcp(
        ckpt, Path(out), Path(out), world_size, layout, overwrite, dry_run, piece_bytes, hooks
    )


def _export_dcp(
    ckpt: UniversalCheckpoint,
    folder: Path,
    checkpoint_id: str | Path,
    world_size: int | None,
    layout: Layout,
    overwrite: bool,
    dry_run: bool,
    piece_bytes: int,
    hooks: ExportHooks,
) -> ExportResult:
    """:func:`export_dcp` into the local ``folder`` (``checkpoint_id``: what the metadata names)."""
    clock = Stopwatch()
    ranks = world_size or ckpt.manifest.source.world_size
    plan = plan_dcp(ckpt.manifest, world_size=ranks, layout=layout, piece_bytes=piece_bytes)
    staged = prepare_destination(
        folder, overwrite=overwrite, owned=_owned, dry_run=dry_run, last=(METADATA_NAME,)
    )
    hooks.plan(plan.nbytes)
    if not dry_run:
        write_dcp_files(ckpt, staged, plan.tensors, plan.values, ranks, checkpoint_id, hooks)
    verb = "would write" if dry_run else "wrote"
    summary = (
        f"{verb} {len(plan.tensors)} tensors and {len(plan.values)} values "
        f"({format_bytes(plan.nbytes)}, {plan.layout} optimizer layout) as a DCP checkpoint for "
        f"{ranks} rank(s) to {folder} in {clock.seconds:.2f}s"
    )
    return ExportResult(
        "dcp", folder, plan.filenames, plan.nbytes, dry_run, clock.seconds, summary,
        list(plan.notes),
    )  # fmt: skip
