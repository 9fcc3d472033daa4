"""DeepSpeed AutoTP checkpoints: every tensor-parallel rank's ZeRO shards placed in full arrays.

An AutoTP checkpoint holds, per tensor-parallel rank ``t``, the files of an ordinary ZeRO
checkpoint (``mp_rank_{t:02d}_model_states.pt`` and one optimizer file per data-parallel rank)
whose ``param_shapes`` are that rank's *shard* shapes. The model states also carry what DeepSpeed
records for its own ``ds_to_universal``: ``checkpoint_parallel_dimensions`` and
``universal_checkpoint_info`` (version 0.4) with an *affine map* per parameter (its logical shape
and, per rank, the pieces of it that make the shard; :mod:`ucformat.layout.tensor_parallel`).

Algorithm: describe each rank's shards as ZeRO fragments (:mod:`.states`, shard coordinates),
then send each fragment through that rank's shard map into the full (logical) array. A
replicated parameter comes from rank 0 and is compared, state by state, with every other rank's
copy (bytes read here; a difference is an error naming the parameter). A layout DeepSpeed itself
marks unsupported, pieces held by some ranks only, or scaled pieces are refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from ucformat.errors import LayoutMismatchError, SourceNotFoundError, UnsupportedCheckpointError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.tensor_parallel import (
    AffinePiece,
    ParamSplit,
    RankShard,
    SubParam,
    TensorParallelInfo,
)
from ucformat.layout.tensor_parallel import Piece, ShardMap, split_pieces
from ucformat.sources.base import ArraySource, SourceFragment
from ucformat.sources.deepspeed.files import (
    ZeroFiles,
    find_zero_files,
    model_states_file,
    optim_states_file,
)
from ucformat.sources.deepspeed.states import FlatStates, read_zero3_states, read_zero12_states
from ucformat.sources.torchfile import TorchFile

__all__ = ["find_tensor_parallel_files", "merge_tensor_parallel", "place_shards", "rank_shards"]

#: The affine-map encoding this reader understands (DeepSpeed's AFFINE_MAP_FORMAT_VERSION).
AFFINE_MAP_VERSION = 1


def find_tensor_parallel_files(folder: Path, tag: str, degree: int) -> list[ZeroFiles]:
    """Each tensor-parallel rank's ZeRO files, checked to form one checkpoint.

    Raises:
        SourceNotFoundError: a rank lacks a file its peers have.
        LayoutMismatchError: the ranks' files disagree on the ZeRO stage.
    """
    by_rank = [find_zero_files(folder, tag, t) for t in range(degree)]
    dp = max(f.world_size for f in by_rank)
    for t, files in enumerate(by_rank):
        if files.world_size != dp:
            have = {p.name for p in files.optim_files}
            prefix = files.optim_files[0].name.partition("zero_pp_rank")[0]
            missing = next(
                optim_states_file(r, prefix, t)
                for r in range(dp)
                if optim_states_file(r, prefix, t) not in have
            )
            raise SourceNotFoundError(
                f"{folder / missing}: missing; the other tensor-parallel ranks have {dp} "
                "data-parallel optimizer shards each."
            )
        if files.per_rank_model_files != by_rank[0].per_rank_model_files:
            raise LayoutMismatchError(
                f"{folder / model_states_file(None, t)}: tensor-parallel ranks 0 and {t} were "
                "saved at different ZeRO stages; files from different runs are mixed."
            )
    return by_rank


def merge_tensor_parallel(
    ranks: Sequence[tuple[Mapping[str, Any], Sequence[TorchFile]]],
    world_size: int,
    stage: int,
    unhinted: str | None = None,
) -> tuple[FlatStates, TensorParallelInfo]:
    """Full-shape arrays of an AutoTP checkpoint from its ``ranks`` (per tensor-parallel rank:
    its model-states metadata and its optimizer files), and the manifest's description.

    ``unhinted`` (where to say it, in a refusal): the affine map was made up because the files
    carry no hints, every parameter taken for replicated; copies that differ are then refused
    as a split the files do not name (:class:`UnsupportedCheckpointError`), not as diverged.

    Raises:
        UnsupportedCheckpointError: a layout this reader (or DeepSpeed) cannot place.
        LayoutMismatchError: the ranks disagree (shapes, groups, replicated values, steps).
    """
    meta = ranks[0][0]
    degree = len(ranks)
    info = _uc_info(meta, degree)
    maps = _affine_maps(info)
    flats = [
        (read_zero3_states if stage == 3 else read_zero12_states)(m, optim, world_size)
        for m, optim in ranks
    ]
    first = flats[0]
    odd = sorted({k for f in flats for held in f.partition.values() for k in held})
    if odd:
        raise UnsupportedCheckpointError(
            f"optimizer states kept once per partition ({odd}) with tensor parallelism; "
            "ucformat keeps such states for data-parallel ZeRO-1/2 only."
        )
    for t, flat in enumerate(flats[1:], start=1):
        if flat.groups != first.groups:
            raise LayoutMismatchError(
                f"tensor-parallel rank {t} holds other parameters or groups than rank 0; "
                "files from different runs are mixed."
            )
    merged = FlatStates(
        wrapper=first.wrapper, groups=dict(first.groups), param_groups=first.param_groups
    )
    merged.sub_groups = first.sub_groups
    splits: dict[str, ParamSplit] = {}
    vocab = {p for p in info.get("vocabulary_parameter_patterns") or []}
    widths_by_pattern = info.get("sub_param_shard_widths") or {}
    for name in first.groups:
        pattern, raw = _match(maps, name)
        logical = tuple(int(d) for d in raw["logical_shape"])
        shards = rank_shards(raw, degree, name)
        replicated = _is_replicated(shards, logical, degree, name)
        shard_maps = [
            ShardMap.build(logical, shape, pieces, f"param '{name}' tp rank {t}")
            for t, (shape, pieces) in enumerate(shards)
        ]
        merged.arrays[name] = {}
        for state, arrays in _states_by_rank(flats, name).items():
            for t, array in enumerate(arrays):
                if array.shape != shard_maps[t].shard_shape:
                    raise LayoutMismatchError(
                        f"param '{name}': tp rank {t} holds shape {list(array.shape)} but the "
                        f"affine map says {list(shard_maps[t].shard_shape)}."
                    )
            if replicated:
                _check_replicas(name, state, arrays, unhinted)
                merged.arrays[name][state] = ArraySource(
                    logical, arrays[0].dtype, list(arrays[0].fragments)
                )
            else:
                merged.arrays[name][state] = place_shards(logical, arrays, shard_maps)
        merged.scalars[name] = _scalars(flats, name)
        splits[name] = _describe_split(
            name, logical, shards, replicated, widths_by_pattern.get(pattern),
            info.get("original_vocab_size") if pattern in vocab else None,
        )  # fmt: skip
    return merged, TensorParallelInfo(framework="deepspeed-autotp", degree=degree, params=splits)


def _uc_info(meta: Mapping[str, Any], degree: int) -> Mapping[str, Any]:
    dims = meta.get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("pp_degree", 1)) != 1:
        raise UnsupportedCheckpointError(
            f"pipeline degree {dims['pp_degree']} with tensor parallelism: ucformat converts "
            "AutoTP checkpoints without pipeline parallelism only."
        )
    if int(dims.get("tp_degree", degree)) != degree:
        raise LayoutMismatchError(
            f"checkpoint_parallel_dimensions says tp_degree {dims['tp_degree']} but the folder "
            f"has {degree} model-parallel ranks' files; files from different runs are mixed."
        )
    info = meta.get("universal_checkpoint_info")
    if not isinstance(info, Mapping) or "affine_map" not in info:
        raise UnsupportedCheckpointError(
            f"model-parallel files (tp {degree}) without an AutoTP affine map in "
            "universal_checkpoint_info; ucformat converts DeepSpeed AutoTP checkpoints "
            "(DeepSpeed >= 0.19.8) only."
        )
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    if unsupported:
        pattern, reason = next(iter(unsupported.items()))
        raise UnsupportedCheckpointError(
            f"DeepSpeed marks {len(unsupported)} parameter layout(s) unsupported for universal "
            f"checkpoints (e.g. {pattern}: {reason}); ucformat cannot place them either."
        )
    return info


def _affine_maps(info: Mapping[str, Any]) -> Mapping[str, Any]:
    section = info["affine_map"]
    version = int(section.get("version", AFFINE_MAP_VERSION))
    if version > AFFINE_MAP_VERSION:
        raise UnsupportedCheckpointError(
            f"AutoTP affine map version {version}; ucformat reads version "
            f"{AFFINE_MAP_VERSION}. Upgrade ucformat."
        )
    params: Mapping[str, Any] = section.get("params") or {}
    return params


def _match(maps: Mapping[str, Any], name: str) -> tuple[str, Mapping[str, Any]]:
    hits = [p for p in maps if re.match(p, name)]
    if len(hits) != 1:
        raise UnsupportedCheckpointError(
            f"param '{name}': {'no' if not hits else len(hits)} AutoTP affine map pattern(s) "
            "match it; expected exactly one."
        )
    return hits[0], maps[hits[0]]


def rank_shards(
    raw: Mapping[str, Any], degree: int, name: str
) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """Per rank ``0 .. degree - 1``: the shard shape and pieces of one affine-map entry (DeepSpeed's
    encoding: ``ranks`` keyed by int or str, pieces ``shape``, ``source``, ``dest``)."""
    ranks = raw["ranks"]
    out: list[tuple[tuple[int, ...], list[Piece]]] = []
    for t in range(degree):
        entry = ranks.get(t, ranks.get(str(t)))
        if entry is None:
            raise LayoutMismatchError(f"param '{name}': the affine map has no tp rank {t}.")
        pieces: list[Piece] = []
        for piece in entry["pieces"]:
            if float(piece.get("scale", 1.0)) != 1.0:
                raise UnsupportedCheckpointError(
                    f"param '{name}': tp rank {t} holds a scaled piece (scale "
                    f"{piece['scale']}); ucformat does not convert rescaled shards."
                )
            (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
            pieces.append(
                Piece(
                    tuple(int(d) for d in piece["shape"]),
                    int(src),
                    tuple(int(s) for s in src_strides),
                    int(dst),
                    tuple(int(s) for s in dst_strides),
                )
            )
        out.append((tuple(int(d) for d in entry["shard_shape"]), pieces))
    return out


def _is_replicated(
    shards: Sequence[tuple[tuple[int, ...], Sequence[Piece]]],
    logical: tuple[int, ...],
    degree: int,
    name: str,
) -> bool:
    whole = [
        shape == logical and sum(p.numel for p in pieces) == prod(logical)
        for shape, pieces in shards
    ]
    if all(whole):
        return True
    held = sum(sum(p.numel for p in pieces) for _, pieces in shards)
    if held != prod(logical):
        raise UnsupportedCheckpointError(
            f"param '{name}': its {degree} tp shards hold {held} elements of a "
            f"{prod(logical)}-element tensor (partly replicated); ucformat converts split or "
            "fully replicated parameters only."
        )
    return False


def _states_by_rank(flats: Sequence[FlatStates], name: str) -> dict[str, list[ArraySource]]:
    keys = set(flats[0].arrays.get(name, {}))
    for t, flat in enumerate(flats):
        if set(flat.arrays.get(name, {})) != keys:
            raise LayoutMismatchError(
                f"param '{name}': tp rank {t} holds states {sorted(flat.arrays.get(name, {}))}, "
                f"rank 0 {sorted(keys)}."
            )
    return {key: [flat.arrays[name][key] for flat in flats] for key in sorted(keys)}


def place_shards(
    logical: tuple[int, ...], arrays: Sequence[ArraySource], maps: Sequence[ShardMap]
) -> ArraySource:
    """The full array of ``logical`` shape from each rank's shard ``arrays[t]`` through its
    ``maps[t]``."""
    out = ArraySource(logical, arrays[0].dtype)
    for array, shard_map in zip(arrays, maps, strict=True):
        for frag in array.fragments:
            for run in shard_map.translate(frag.start, frag.length):
                out.fragments.append(
                    SourceFragment(
                        frag.tensor, frag.tensor_start + run.shard_start, run.logical_start,
                        run.length,
                    )
                )  # fmt: skip
    out.fragments.sort(key=lambda f: f.start)
    return out


def _values(array: ArraySource) -> np.ndarray:
    out = np.zeros(array.numel, dtype=numpy_storage_dtype(array.dtype))
    for frag in array.fragments:
        frag.tensor.read_into(
            out[frag.start : frag.start + frag.length],
            frag.tensor_start,
            frag.tensor_start + frag.length,
        )
    return out


def _check_replicas(
    name: str, state: str, arrays: Sequence[ArraySource], unhinted: str | None = None
) -> None:
    reference = _values(arrays[0]).view(np.uint8)
    for t, array in enumerate(arrays[1:], start=1):
        if array.dtype != arrays[0].dtype or not np.array_equal(
            _values(array).view(np.uint8), reference
        ):
            if unhinted is not None:
                raise UnsupportedCheckpointError(
                    f"{unhinted}: param '{name}': its '{state}' differs between model ranks 0 "
                    f"and {t}, so it is split along a dimension the files do not name (or the "
                    "copies diverged), and the model states carry no universal_checkpoint_info "
                    "saying which; save with client_state={'universal_checkpoint_info': {...}} "
                    "(docs/parallel.md)."
                )
            raise LayoutMismatchError(
                f"param '{name}' is tensor-parallel replicated, but its '{state}' on tp rank {t} "
                "differs from rank 0's; the checkpoint is inconsistent (ranks diverged)."
            )


def _scalars(flats: Sequence[FlatStates], name: str) -> Any:
    first = flats[0].scalars.get(name, {})
    for t, flat in enumerate(flats[1:], start=1):
        if flat.scalars.get(name, {}) != first:
            raise LayoutMismatchError(
                f"param '{name}': optimizer scalars differ between tp rank {t} and rank 0; "
                "shards from different steps are mixed."
            )
    return dict(first)


def _describe_split(
    name: str,
    logical: tuple[int, ...],
    shards: Sequence[tuple[tuple[int, ...], Sequence[Piece]]],
    replicated: bool,
    sub_widths: Sequence[Sequence[int]] | None,
    vocab_size: Any,
) -> ParamSplit:
    ranks = [
        RankShard(
            shard_shape=list(shape),
            pieces=[
                AffinePiece(
                    shape=list(p.shape),
                    source_offset=p.source_offset,
                    source_strides=list(p.source_strides),
                    dest_offset=p.dest_offset,
                    dest_strides=list(p.dest_strides),
                )
                for p in pieces
            ],
        )
        for shape, pieces in shards
    ]
    base: dict[str, Any] = {"logical_shape": list(logical), "shards": ranks}
    if replicated:
        return ParamSplit(kind="replicated", **base)
    dims = {
        d
        for shape, _ in shards
        for d, (a, b) in enumerate(zip(shape, logical, strict=True))
        if a != b
    }
    dim = dims.pop() if len(dims) == 1 else None
    if dim is None:
        return ParamSplit(kind="affine", **base)
    widths = [shape[dim] for shape, _ in shards]
    subs = [list(w) for w in sub_widths] if sub_widths else [widths]
    expected = [
        ShardMap.build(logical, shape, pieces, name).runs
        for (shape, _), pieces in zip(shards, split_pieces(logical, dim, subs), strict=True)
    ]
    actual = [ShardMap.build(logical, shape, pieces, name).runs for shape, pieces in shards]
    if expected != actual:
        return ParamSplit(kind="affine", **base)
    if vocab_size is not None and int(vocab_size) != logical[dim]:
        raise UnsupportedCheckpointError(
            f"param '{name}': padded vocabulary ({logical[dim]} rows for {vocab_size} tokens); "
            "ucformat does not convert padded vocabulary shards yet."
        )
    return ParamSplit(
        kind="split",
        dim=dim,
        widths=widths,
        sub_params=[SubParam(size=sum(w), widths=list(w)) for w in subs] if sub_widths else None,
        vocab_size=int(vocab_size) if vocab_size is not None else None,
        padded_vocab_size=logical[dim] if vocab_size is not None else None,
        **base,
    )
