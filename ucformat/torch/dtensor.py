"""Live tensors as shards: where a (DTensor or plain) tensor's local values sit in the whole.

:func:`local_shard` describes one tensor of a live model or optimizer: its global shape, the
global index intervals its local values hold per dim on this rank and the runs of global flat
elements they cover, in local order (:mod:`ucformat.layout.placements`), and how to rebuild a
DTensor with the same mesh and placements around new local values. A plain tensor is whole on
every rank (replicated).

Supported placements, on meshes of any number of dims: ``Replicate()``, ``Shard(d)`` for any
``d`` (FSDP2, HSDP, tensor parallel's colwise and rowwise) and ``_StridedShard(d, sf)`` (FSDP2
on top of tensor parallelism). ``Partial()`` (pending reductions) raises
:class:`UnsupportedExportError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ucformat.errors import UnsupportedExportError
from ucformat.layout.boxes import Run
from ucformat.layout.placements import (
    Placement,
    local_box,
    local_intervals,
    local_numel,
    local_runs,
    run_owners,
)

__all__ = [
    "LocalShard",
    "is_dtensor",
    "local_shard",
    "mesh_ranks",
    "persistent_buffers",
    "placement_of",
    "reshard",
]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


@dataclass(frozen=True)
class LocalShard:
    """This rank's part of one tensor.

    Attributes:
        shape: the global shape.
        local: the local values (a view of the live tensor: writing it writes the tensor).
        runs: the runs of global flat elements the local values hold, in local order
            (``Run.chunk_start`` is the offset in the local flattening).
        intervals: per tensor dim, the global index intervals held (in order).
        mesh: the DTensor's device mesh, None for a plain tensor.
        placements: the DTensor's placements (empty for a plain tensor).
        layout: the placements as :class:`~ucformat.layout.placements.Placement` (pure data).
        coordinate: this rank's mesh coordinate (empty for a plain tensor).
    """

    shape: tuple[int, ...]
    local: torch.Tensor
    runs: tuple[Run, ...]
    intervals: tuple[tuple[tuple[int, int], ...], ...]
    mesh: Any = None
    placements: tuple[Any, ...] = ()
    layout: tuple[Placement, ...] = ()
    coordinate: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        """Elements held here."""
        return sum(run.length for run in self.runs)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's shape (``(1,)`` for a plain tensor, which every rank holds whole)."""
        return tuple(self.mesh.shape) if self.mesh is not None else (1,)

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(offsets, sizes)`` of the local shard in the global tensor, or None if it is not
        one box (some ``_StridedShard`` layouts)."""
        return local_box(self.intervals)

    @property
    def flat_range(self) -> tuple[int, int] | None:
        """``[start, stop)`` when the local shard is one run of flat elements (``Shard(0)``,
        replicated, empty), else None."""
        if not self.runs:
            return 0, 0
        if len(self.runs) == 1:
            return self.runs[0].start, self.runs[0].start + self.runs[0].length
        return None

    def owners(self, ranks: list[int]) -> list[tuple[Any, int]]:
        """Every first-replica run of the whole mesh: ``(Owner, local_start)`` in flat order
        (:func:`ucformat.layout.placements.run_owners`); ``ranks`` as :func:`mesh_ranks`."""
        layout = self.layout or (Placement("replicate"),)
        return run_owners(self.shape, self.mesh_shape, layout, ranks)

    def like(self, local: torch.Tensor) -> torch.Tensor:
        """A tensor laid out as this one holding ``local`` (a DTensor on the same mesh)."""
        if self.mesh is None:
            return local.reshape(self.shape)
        from torch.distributed.tensor import DTensor

        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        return DTensor.from_local(
            local.reshape(self.local.shape),
            self.mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(self.shape),
            stride=stride,
        )


def placement_of(name: str, placement: Any) -> Placement:
    """A torch placement as pure data.

    Raises:
        UnsupportedExportError: ``Partial()`` or an unknown placement.
    """
    kind = type(placement).__name__
    if kind == "_StridedShard" or kind == "StridedShard":
        return Placement("strided", int(placement.dim), int(placement.split_factor))
    if placement.is_replicate():
        return Placement("replicate")
    if placement.is_shard():
        return Placement("shard", int(placement.dim))
    raise UnsupportedExportError(
        f"'{name}' is a DTensor with placement {placement}; ucformat reads and writes "
        "Replicate(), Shard(d) and _StridedShard placements: redistribute it to one of them "
        "(e.g. Partial -> Replicate) first."
    )


def local_shard(name: str, tensor: torch.Tensor) -> LocalShard:
    """Describe this rank's part of ``tensor`` (a DTensor or a plain, replicated tensor).

    Raises:
        UnsupportedExportError: a ``Partial()`` placement, this rank is not in the tensor's
            mesh, or the local values do not have the shape the placements give.
    """
    shape = tuple(tensor.shape)
    if not is_dtensor(tensor):
        whole = tuple(((0, n),) if n else () for n in shape)
        runs = tuple(local_runs(shape, whole))
        return LocalShard(shape, tensor.detach(), runs, whole)
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    placements = tuple(tensor.placements)  # type: ignore[attr-defined]
    layout = tuple(placement_of(name, p) for p in placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedExportError(f"'{name}': this rank is not in the tensor's device mesh.")
    local = tensor.to_local().detach()  # type: ignore[attr-defined]
    intervals = local_intervals(shape, tuple(mesh.shape), layout, tuple(coordinate))
    expected = tuple(sum(b - a for a, b in d) for d in intervals)
    if local.numel() != local_numel(intervals) or (local.numel() and local.shape != expected):
        raise UnsupportedExportError(
            f"'{name}': the local shard has shape {list(local.shape)}, but "
            f"{[p.describe() for p in layout]} of {list(shape)} on mesh {tuple(mesh.shape)} at "
            f"{tuple(coordinate)} gives {list(expected)}; padded local shards are not supported."
        )
    runs = tuple(local_runs(shape, intervals))
    return LocalShard(shape, local, runs, intervals, mesh, placements, layout, tuple(coordinate))


def mesh_ranks(shard: LocalShard) -> list[int]:
    """The global ranks of the shard's mesh, row-major (``[0]`` for a plain tensor).

    A sub-mesh (FSDP2's ``dp`` mesh inside a ``(dp, tp)`` mesh) is one of several identical
    copies, one per index of the other dims; every rank names the same one: the copy at index
    0 of the other dims, so that all ranks agree on who holds (and writes) what.
    """
    if shard.mesh is None:
        return [0]
    mesh = shard.mesh
    own = [int(r) for r in mesh.mesh.flatten().tolist()]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or root.mesh.numel() == len(own) or not names or not root_names:
        return own
    if any(name not in root_names for name in names):
        return own  # a flattened or renamed sub-mesh: its own ranks
    index = tuple(slice(None) if name in names else 0 for name in root_names)
    kept = [name for name in root_names if name in names]
    ranks = root.mesh[index].permute([kept.index(name) for name in names])
    return [int(r) for r in ranks.flatten().tolist()]


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` holds, by name, without calling ``state_dict()`` (FSDP2's
    state-dict hooks reshard parameters, which must not happen inside a save or a load)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=True):
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in module.named_buffers(recurse=False):
            if name not in skip and buffer is not None:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def reshard(model: torch.nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state.

    After a forward without backward (evaluation), a root module keeps its parameters
    unsharded: ``named_parameters()`` then gives plain tensors, not the optimizer's DTensors.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
