"""A live DeepSpeed AutoTP engine's tensor-parallel shards, and its partitions in full arrays.

An AutoTP engine's parameters are this rank's *shards*; its ZeRO partitions are flat ranges of
those shards. A ucformat store holds every parameter in its full (logical) shape, so the loader
sends each partition fragment through the rank's shard map (:mod:`ucformat.layout.tensor_parallel`)
and reads the logical flat runs it lands on: each rank reads only its tensor-parallel slice of
its ZeRO partition, whatever split (or none) the store's source used.

The shard maps come from what DeepSpeed itself attaches to the model for its universal
checkpoints (``module.universal_checkpoint_info``: the affine map of every parameter at the
engine's tp degree); a layout DeepSpeed marks unsupported, or a scaled piece, is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ucformat.errors import UnsupportedCheckpointError
from ucformat.layout.partition import Fragment
from ucformat.layout.tensor_parallel import Piece, ShardMap

__all__ = ["logical_fragments", "shard_maps"]


def shard_maps(engine: Any) -> dict[str, ShardMap] | None:
    """Per parameter fqn, this rank's shard map; None for an engine without tensor parallelism.

    Raises:
        UnsupportedCheckpointError: DeepSpeed marks a layout unsupported, a piece is scaled,
            or a parameter has no affine map.
    """
    size = engine.autotp_size() if hasattr(engine, "autotp_size") else 1
    info = getattr(engine.module, "universal_checkpoint_info", None)
    if not size or size <= 1 or not isinstance(info, Mapping):
        return None
    from deepspeed.utils import groups

    rank = int(groups.get_tensor_model_parallel_rank())
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    if unsupported:
        pattern, reason = next(iter(unsupported.items()))
        raise UnsupportedCheckpointError(
            f"the engine's AutoTP layout of {pattern} is one DeepSpeed marks unsupported "
            f"({reason}); ucformat cannot load into it."
        )
    maps: Mapping[str, Any] = (info.get("affine_map") or {}).get("params") or {}
    out: dict[str, ShardMap] = {}
    for name, param in engine.module.named_parameters():
        hits = [p for p in maps if re.match(p, name)]
        if len(hits) != 1:
            raise UnsupportedCheckpointError(
                f"engine param '{name}': {len(hits)} AutoTP affine map patterns match it; "
                "expected exactly one (DeepSpeed >= 0.19.8 attaches them)."
            )
        raw = maps[hits[0]]
        entry = raw["ranks"].get(rank, raw["ranks"].get(str(rank)))
        pieces = [_piece(name, p) for p in entry["pieces"]]
        shard = ShardMap.build(
            raw["logical_shape"], entry["shard_shape"], pieces, f"engine param '{name}'"
        )
        local = list(getattr(param, "ds_shape", None) or param.shape)  # ZeRO-3: ds_shape
        if list(shard.shard_shape) != local:
            raise UnsupportedCheckpointError(
                f"engine param '{name}' has shape {local} but its affine map says "
                f"{list(shard.shard_shape)} for tp rank {rank}."
            )
        out[name] = shard
    return out


def _piece(name: str, raw: Mapping[str, Any]) -> Piece:
    if float(raw.get("scale", 1.0)) != 1.0:
        raise UnsupportedCheckpointError(
            f"engine param '{name}' holds a scaled piece (scale {raw['scale']}); ucformat "
            "does not load rescaled shards."
        )
    (src, src_strides), (dst, dst_strides) = raw["source"], raw["dest"]
    return Piece(
        tuple(int(d) for d in raw["shape"]),
        int(src),
        tuple(int(s) for s in src_strides),
        int(dst),
        tuple(int(s) for s in dst_strides),
    )


def logical_fragments(
    fragments: Sequence[Fragment], maps: Mapping[str, ShardMap] | None
) -> list[Fragment]:
    """``fragments`` (flat ranges of shards) as fragments of the full arrays, in order."""
    if maps is None:
        return list(fragments)
    out: list[Fragment] = []
    for frag in fragments:
        shard = maps.get(frag.name)
        if shard is None:
            out.append(frag)
            continue
        for run in shard.translate(frag.param_start, frag.length):
            out.append(
                Fragment(
                    frag.name,
                    frag.rank,
                    run.logical_start,
                    frag.partition_start + run.shard_start,
                    run.length,
                )
            )
    return out
