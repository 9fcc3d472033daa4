"""Live tensors as shards: where a (DTensor or plain) tensor's local values sit in the whole.

:func:`local_shard` describes one tensor of a live model or optimizer: its global shape, the
flat range of the whole tensor its local values hold on this rank
(:func:`ucformat.layout.dtensor.local_flat_range`), and how to rebuild a DTensor with the same
mesh and placements around new local values. A plain tensor is whole on every rank (replicated).

Supported placements: ``Shard(0)`` and ``Replicate()`` on any mesh (FSDP2's 1-D mesh, HSDP's
``(replicate, shard)`` mesh). Other placements raise :class:`UnsupportedExportError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ucformat.errors import UnsupportedExportError
from ucformat.layout.dtensor import local_flat_range

__all__ = [
    "LocalShard",
    "is_dtensor",
    "local_shard",
    "mesh_ranks",
    "persistent_buffers",
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
        start: first flat element of the whole tensor held here.
        stop: one past the last.
        local: the local values (a view of the live tensor: writing it writes the tensor).
        mesh: the DTensor's device mesh, None for a plain tensor.
        placements: the DTensor's placements (empty for a plain tensor).
        shard_dims: per mesh dim, 0 (``Shard(0)``) or None (``Replicate()``).
        coordinate: this rank's mesh coordinate (empty for a plain tensor).
    """

    shape: tuple[int, ...]
    start: int
    stop: int
    local: torch.Tensor
    mesh: Any = None
    placements: tuple[Any, ...] = ()
    shard_dims: tuple[int | None, ...] = ()
    coordinate: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        """Elements held here."""
        return self.stop - self.start

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's shape (``(1,)`` for a plain tensor, which every rank holds whole)."""
        return tuple(self.mesh.shape) if self.mesh is not None else (1,)

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


def _shard_dims(name: str, placements: tuple[Any, ...]) -> tuple[int | None, ...]:
    dims: list[int | None] = []
    for placement in placements:
        if placement.is_replicate():
            dims.append(None)
        elif (
            placement.is_shard()
            and getattr(placement, "dim", None) == 0
            and (type(placement).__name__ == "Shard")
        ):
            dims.append(0)
        else:
            raise UnsupportedExportError(
                f"'{name}' is a DTensor with placements {placements}; ucformat reads and writes "
                "Shard(0) and Replicate() placements (FSDP2, HSDP) only."
            )
    return tuple(dims)


def local_shard(name: str, tensor: torch.Tensor) -> LocalShard:
    """Describe this rank's part of ``tensor`` (a DTensor or a plain, replicated tensor).

    Raises:
        UnsupportedExportError: placements other than ``Shard(0)``/``Replicate()``, or this rank
            is not in the tensor's mesh.
    """
    if not is_dtensor(tensor):
        shape = tuple(tensor.shape)
        return LocalShard(shape, 0, math.prod(shape), tensor.detach())
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    placements = tuple(tensor.placements)  # type: ignore[attr-defined]
    dims = _shard_dims(name, placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedExportError(f"'{name}': this rank is not in the tensor's device mesh.")
    shape = tuple(tensor.shape)
    local = tensor.to_local().detach()  # type: ignore[attr-defined]
    start, stop = local_flat_range(shape, tuple(mesh.shape), dims, tuple(coordinate))
    if local.numel() != stop - start:
        raise UnsupportedExportError(
            f"'{name}': the local shard holds {local.numel()} elements, but Shard(0) of "
            f"{list(shape)} on mesh {tuple(mesh.shape)} at {tuple(coordinate)} holds "
            f"{stop - start}; padded or strided local shards are not supported."
        )
    return LocalShard(shape, start, stop, local, mesh, placements, dims, tuple(coordinate))


def mesh_ranks(shard: LocalShard) -> list[int]:
    """The global ranks of the shard's mesh, row-major (``[0]`` for a plain tensor)."""
    if shard.mesh is None:
        return [0]
    return [int(r) for r in shard.mesh.mesh.flatten().tolist()]


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
