"""A live DeepSpeed ``PipelineEngine`` with tensor parallelism (a ``model`` topology axis): this
rank's shard map of each of its stage's parameters, from the store's own split.

A ``PipelineModule`` whose layers are column- or row-parallel over the model-parallel group
holds, on each model rank, a shard of each such parameter; DeepSpeed attaches no description
of the split to it. The store records the split its source used (``tensor_parallel``:
replicated, or split on one dim). This rank's shard of that parameter at the engine's own
tp degree is then the same split with the engine's widths (the store's own widths at the
same degree, equal widths otherwise), checked against the engine parameter's shape; the
loader reads its ZeRO partition through that map (:mod:`.tensor_parallel`).
"""

from __future__ import annotations

from typing import Any

from ucformat.errors import ModelMismatchError, UnsupportedCheckpointError
from ucformat.format.models import CheckpointManifest
from ucformat.layout.tensor_parallel import Piece, ShardMap, split_pieces

__all__ = ["pipeline_shard_maps"]


def pipeline_shard_maps(engine: Any, manifest: CheckpointManifest) -> dict[str, ShardMap] | None:
    """Per parameter fqn, this rank's shard map; None unless ``engine`` is a pipeline engine
    with more than one model rank per stage.

    Raises:
        UnsupportedCheckpointError: the store records no split for a parameter (or one that
            cannot be cut at the engine's tp degree).
        ModelMismatchError: the engine's shard shape is not the split's at its tp degree.
    """
    grid = getattr(engine, "grid", None)
    if grid is None or not hasattr(grid, "get_slice_parallel_world_size"):
        return None
    size = int(grid.get_slice_parallel_world_size())
    if size <= 1:
        return None
    rank = int(grid.get_slice_parallel_rank())
    tp = manifest.tensor_parallel
    out: dict[str, ShardMap] = {}
    for name, param in engine.module.named_parameters():
        split = tp.params.get(name) if tp is not None else None
        if split is None:
            raise UnsupportedCheckpointError(
                f"engine param '{name}': the pipeline engine has {size} model ranks per stage "
                "but the store records no tensor-parallel split for it; ucformat loads such "
                "engines from stores of pipeline x tensor-parallel sources only."
            )
        local = tuple(int(d) for d in param.shape)
        logical = tuple(int(d) for d in split.logical_shape)
        pieces: list[Piece]
        if split.kind == "replicated":
            pieces = [Piece(logical, 0, _strides(logical), 0, _strides(logical))]
        elif split.kind == "split" and split.dim is not None and not split.sub_params:
            dim = split.dim
            widths = (
                list(split.widths)
                if tp is not None and tp.degree == size and split.widths
                else [logical[dim] // size] * size
            )
            if sum(widths) != logical[dim]:
                raise ModelMismatchError(
                    f"engine param '{name}': {logical[dim]} rows on dim {dim} do not split "
                    f"evenly over {size} model ranks."
                )
            pieces = split_pieces(logical, dim, [widths])[rank]
        else:
            raise UnsupportedCheckpointError(
                f"engine param '{name}': the store's split is '{split.kind}'; ucformat cuts "
                "replicated or one-dim splits for pipeline engines only."
            )
        shard = ShardMap.build(logical, _shard_shape(pieces, logical), pieces, name)
        if tuple(shard.shard_shape) != local:
            raise ModelMismatchError(
                f"engine param '{name}' has shape {list(local)} on model rank {rank} but the "
                f"store's split gives {list(shard.shard_shape)} at tp {size}."
            )
        out[name] = shard
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    step = 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def _shard_shape(pieces: list[Piece], logical: tuple[int, ...]) -> tuple[int, ...]:
    """The shard a rank's pieces make: the logical shape with the split dim's extent summed."""
    if len(pieces) == 1:
        return pieces[0].shape
    dims = [d for d in range(len(logical)) if any(p.shape[d] != logical[d] for p in pieces)]
    shape = list(pieces[0].shape)
    for d in dims:
        shape[d] = sum(p.shape[d] for p in pieces)
    return tuple(shape)
