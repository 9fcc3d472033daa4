"""The shard geometry of an AutoTP export at tp ``T``, from the split rules a manifest records.

Every parameter of the store gets, per target tp rank, a :class:`ShardMap` (which full-array
elements make the rank's shard), chosen in this order:

- ``T == 1``: the whole tensor (no rule needed; any store, with or without a ``tensor_parallel``
  section);
- the *rules* (the store's own ``tensor_parallel`` section, or another store's given as
  ``--tp-layout``) recorded at degree ``T``: the recorded shards, exactly as the source held them;
- rules at another degree: ``replicated`` stays whole on every rank; ``split`` on ``dim`` is cut
  again by the near-even rule (:mod:`ucformat.layout.tensor_parallel_recut`), per sub-parameter,
  once the recorded widths are checked to follow that rule.

Why that is exact. DeepSpeed's AutoTP chooses widths by one of three rules: near-even; whole
key-value heads (attention projections, when their rows divide by the model's kv-head count
``H``: rank ``r`` gets ``H // T + (r < H % T)`` heads); multiples of ``tp_grain_size``. Neither
``H`` nor the grain is in the checkpoint. Recorded widths that are near-even but *unequal*
(e.g. a vocabulary of 97 rows at tp 2: 49 + 48) come from the near-even rule only (the others
give multiples of a head or grain), so any degree follows it. *Equal* widths at degree ``T``
(``T`` divides the heads or grains) fit all three, and all three give equal widths again at every
divisor of ``T`` (tp 2 → 1, tp 4 → 2): exact there; at other degrees they part (2 kv heads at
tp 4: 2 ranks get a head, 2 get none), so that is refused. A source run with
``tp_grain_size`` > 1 (read from its DeepSpeed config) re-cuts only even widths, to divisors.

Refused, one line naming the parameter: no rules and ``T > 1``; a parameter the rules do not list
or list with another shape; an ``affine`` split (no rule recorded); widths that do not follow the
near-even rule (head- or grain-granular splits); equal widths at a ``T`` that does not divide the
recorded degree; a padded vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

from ucformat.errors import UnsupportedExportError
from ucformat.format.models import ParamEntry
from ucformat.format.tensor_parallel import AffinePiece, ParamSplit, TensorParallelInfo
from ucformat.layout.tensor_parallel import Piece, ShardMap
from ucformat.layout.tensor_parallel_recut import near_even, recut_split, whole_pieces

__all__ = ["target_shard_maps", "tp_grain_size"]


def tp_grain_size(ds_config: object) -> int:
    """The ``tp_grain_size`` a DeepSpeed config sets for AutoTP (1: unset, DeepSpeed's default)."""
    section = ds_config.get("tensor_parallel") if isinstance(ds_config, dict) else None
    if not isinstance(section, dict):
        return 1
    inner = section.get("tensor_parallel")
    for where in (section, inner if isinstance(inner, dict) else {}):
        value = where.get("tp_grain_size")
        if isinstance(value, int) and value > 1:
            return value
    return 1


def target_shard_maps(
    params: Mapping[str, ParamEntry],
    rules: TensorParallelInfo | None,
    tp: int,
    where: str,
    grain: int = 1,
) -> list[dict[str, ShardMap]]:
    """Per target tp rank, every parameter's shard map (``where`` names the rules' store,
    ``grain`` the ``tp_grain_size`` its source ran with).

    Raises:
        UnsupportedExportError: the rules cannot cut some parameter exactly at ``tp``.
    """
    out: list[dict[str, ShardMap]] = [{} for _ in range(tp)]
    for name, entry in params.items():
        shards = _shards(name, entry.shape, rules, tp, where, grain)
        for rank, (shape, pieces) in enumerate(shards):
            out[rank][name] = ShardMap.build(entry.shape, shape, pieces, f"param '{name}'")
    return out


def _shards(
    name: str,
    shape: list[int],
    rules: TensorParallelInfo | None,
    tp: int,
    where: str,
    grain: int,
) -> list[tuple[tuple[int, ...], list[Piece]]]:
    whole = (tuple(shape), whole_pieces(shape))
    if tp == 1:
        return [whole]
    if rules is None:
        raise UnsupportedExportError(
            f"{where} records no tensor-parallel split, so the AutoTP shards at tp {tp} are "
            "unknown; pass --tp-layout with a store converted from an AutoTP run of the same "
            "model, or load the store with ucformat.deepspeed.load."
        )
    split = rules.params.get(name)
    if split is None or split.logical_shape != shape:
        found = "does not list it" if split is None else f"lists shape {split.logical_shape}"
        raise UnsupportedExportError(
            f"param '{name}' (shape {shape}): the tensor-parallel layout of {where} {found}; "
            "pass --tp-layout with a store of the same model."
        )
    if rules.degree == tp:
        return [(tuple(s.shard_shape), [_piece(p) for p in s.pieces]) for s in split.shards]
    if split.kind == "replicated":
        return [whole] * tp
    return _recut(name, split, rules.degree, tp, grain)


def _recut(
    name: str, split: ParamSplit, degree: int, tp: int, grain: int
) -> list[tuple[tuple[int, ...], list[Piece]]]:
    cannot = f"param '{name}': cannot re-cut its tp {degree} split for tp {tp}"
    if split.kind != "split" or split.dim is None or split.widths is None:
        raise UnsupportedExportError(
            f"{cannot}: the store records its pieces only (no split dim and widths); export at "
            f"tp {degree}, or load with ucformat.deepspeed.load."
        )
    if split.padded_vocab_size is not None and split.padded_vocab_size != split.vocab_size:
        raise UnsupportedExportError(
            f"{cannot}: a padded vocabulary ({split.padded_vocab_size} rows for "
            f"{split.vocab_size} tokens) pads per degree; export at tp {degree}."
        )
    subs = (
        [(s.size, s.widths) for s in split.sub_params]
        if split.sub_params
        else [(split.logical_shape[split.dim], split.widths)]
    )
    for index, (size, widths) in enumerate(subs):
        which = f" (sub-parameter {index})" if split.sub_params else ""
        if not near_even(size, widths):
            raise UnsupportedExportError(
                f"{cannot}: its widths {widths}{which} of {size} are not the near-even split "
                f"(head- or grain-granular), so the widths at tp {tp} are unknown; export at "
                f"tp {degree}, or load with ucformat.deepspeed.load."
            )
        if (len(set(widths)) == 1 or grain > 1) and degree % tp:
            what = "even widths" if len(set(widths)) == 1 else f"widths (tp_grain_size {grain})"
            raise UnsupportedExportError(
                f"{cannot}: its {what} {widths}{which} follow DeepSpeed's near-even, "
                f"whole-kv-head and tp_grain_size rules alike, which differ at tp {tp} (not a "
                f"divisor of {degree}); pass --tp-layout with a store converted at tp {tp}, or "
                "load with ucformat.deepspeed.load."
            )
        if len(set(widths)) > 1 and grain > 1:
            raise UnsupportedExportError(
                f"{cannot}: its uneven widths {widths}{which} were cut with tp_grain_size "
                f"{grain}, whose remainder rule ucformat does not re-cut; export at tp {degree}."
            )
    return recut_split(split.logical_shape, split.dim, [size for size, _ in subs], tp)


def _piece(raw: AffinePiece) -> Piece:
    return Piece(
        tuple(raw.shape),
        raw.source_offset,
        tuple(raw.source_strides),
        raw.dest_offset,
        tuple(raw.dest_strides),
    )
