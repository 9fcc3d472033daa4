"""DeepSpeed ``PipelineModule`` checkpoints with tensor parallelism (a ``model`` topology axis).

The files of a tag folder of a ``PipelineModule`` at ``pp`` stages x ``tp`` model ranks x
``dp`` replicas (DeepSpeed 0.19.8; docs/parallel.md, "Pipeline and tensor parallel"):

* ``mp_rank_{s * tp + t:02d}_model_states.pt`` per stage ``s`` and model rank ``t``
  (``param_shapes`` in shard shapes; ``checkpoint_parallel_dimensions`` says ``pp_degree`` and
  ``tp_degree``; the training script's ``client_state`` at the top level);
* ``[bf16_]zero_pp_rank_{d}_mp_rank_{s * tp + t:02d}_optim_states.pt``: that (stage, model
  rank)'s ZeRO-1 partitions over its ``dp`` replicas;
* ``layer_{i:02d}-model_{t:02d}-model_states.pt`` per layer and model rank (training-dtype
  weights; not needed: every parameter is trainable, buffers and frozen params are refused).

The files do not say along which dimension each tensor is split. Without hints, a parameter
whose copies on the stage's model ranks are byte-identical (every fp32 master, optimizer state
and scalar: plain layers, copied on every model rank) is replicated; any other is refused in
one line naming it (it is split along a dimension the files do not name). A training script
that records DeepSpeed's ``universal_checkpoint_info`` (Megatron-DeepSpeed does, as
``client_state``) lists the splits by name patterns: ``tp_replicated_parameter_patterns`` (whole on
every model rank), ``parameter_with_row_parallelism_patterns`` (split on dim 1), every other
parameter split on dim 0 (column-parallel), the same rule DeepSpeed's ``ds_to_universal``
applies. Algorithm: per stage, each model rank's shard shapes and those patterns become one
shard map per parameter (:mod:`ucformat.layout.tensor_parallel`), and the stage's ranks are
merged exactly as AutoTP ranks are (:mod:`.tensor_parallel`: fragments placed in the full
arrays, replicated params compared state by state across the model ranks). The stages are
then united by name by :mod:`.pipeline`. Pattern lists this reader cannot place (averaged,
vocabulary, sub-parameter layouts) are refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucformat.errors import LayoutMismatchError, SourceNotFoundError, UnsupportedCheckpointError
from ucformat.format.tensor_parallel import TensorParallelInfo
from ucformat.layout.tensor_parallel import Piece, split_pieces
from ucformat.sources.deepspeed.pipeline_files import LAYER_TP_FILE, MODEL_FILE, optimizer_shards
from ucformat.sources.deepspeed.states import FlatStates
from ucformat.sources.deepspeed.tensor_parallel import merge_tensor_parallel
from ucformat.sources.torchfile import TorchFile

__all__ = [
    "PipelineTPFiles",
    "find_pipeline_tp_files",
    "has_tp_layer_files",
    "merge_pipeline_tp",
]


#: The ``universal_checkpoint_info`` lists this reader applies.
REPLICATED = "tp_replicated_parameter_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
#: Lists whose layouts it does not place (refused when non-empty).
UNSUPPORTED = (
    "parameter_to_average_patterns",
    "vocabulary_parameter_patterns",
    "parameter_with_2_sub_params_cat_dim_0",
    "parameter_with_sub_params",
    "autotp_unsupported_parameter_patterns",
)


@dataclass(frozen=True)
class PipelineTPFiles:
    """The files of one pipeline x tensor-parallel checkpoint tag."""

    folder: Path
    tag: str
    #: Per stage, per model rank: its model-states file.
    model_files: tuple[tuple[Path, ...], ...]
    #: Per stage, per model rank, per data-parallel rank: its optimizer-states file.
    optim_files: tuple[tuple[tuple[Path, ...], ...], ...]
    #: One layer file (the first found), named in refusals.
    first_layer_file: Path

    @property
    def stages(self) -> int:
        """Pipeline stages."""
        return len(self.model_files)

    @property
    def degree(self) -> int:
        """Model (tensor-parallel) ranks per stage."""
        return len(self.model_files[0])

    @property
    def data_parallel(self) -> int:
        """Data-parallel replicas per (stage, model rank)."""
        return len(self.optim_files[0][0])


def has_tp_layer_files(folder: Path) -> bool:
    """Whether ``folder`` holds ``layer_XX-model_YY-model_states.pt`` files."""
    return any(LAYER_TP_FILE.match(p.name) for p in folder.iterdir())


def find_pipeline_tp_files(folder: Path, tag: str) -> PipelineTPFiles:
    """List and check the files of a pipeline x tensor-parallel tag folder (names only).

    Raises:
        SourceNotFoundError: a (stage, model rank)'s or a replica's file is missing.
        UnsupportedCheckpointError: no optimizer shards (ZeRO-0 in fp32).
        LayoutMismatchError: files from different runs are mixed.
    """
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    layer_names = [n for n in names if LAYER_TP_FILE.match(n)]
    degree = max(int(m["tp"]) for n in layer_names if (m := LAYER_TP_FILE.match(n))) + 1
    models = {int(m["mp"]): n for n in names if (m := MODEL_FILE.match(n))}
    ranks = max(models, default=-1) + 1
    if ranks == 0 or ranks % degree:
        raise LayoutMismatchError(
            f"{folder}: layer files of {degree} model ranks but {ranks} mp_rank_*_model_states.pt "
            f"files (expected stages x {degree}); files from different runs are mixed."
        )
    for mp in range(ranks):
        if mp not in models:
            raise SourceNotFoundError(
                f"{folder / f'mp_rank_{mp:02d}_model_states.pt'}: missing; the folder has "
                f"model states up to mp rank {ranks - 1}."
            )
    optim, dp = optimizer_shards(
        folder,
        names,
        ranks,
        none_found="pipeline x tensor-parallel checkpoint without *_optim_states.pt shards "
        "(ZeRO-0 in fp32); ucformat reads them trained with ZeRO-1.",
        layout=lambda dp: (
            f"one optimizer shard per (stage, model rank) and each of {dp} data-parallel ranks."
        ),
    )
    stages = ranks // degree
    return PipelineTPFiles(
        folder=folder,
        tag=tag,
        model_files=tuple(
            tuple(folder / models[s * degree + t] for t in range(degree)) for s in range(stages)
        ),
        optim_files=tuple(
            tuple(
                tuple(folder / optim[s * degree + t][r] for r in range(dp)) for t in range(degree)
            )
            for s in range(stages)
        ),
        first_layer_file=folder / layer_names[0],
    )


def merge_pipeline_tp(
    files: PipelineTPFiles,
    metas: Sequence[Sequence[Mapping[str, Any]]],
    optim: Sequence[Sequence[Sequence[TorchFile]]],
) -> tuple[list[FlatStates], TensorParallelInfo]:
    """Per stage, its model ranks' shards placed in full arrays; and the split of every
    parameter (``metas[s][t]``, ``optim[s][t][d]``: stage ``s``, model rank ``t``, replica ``d``).

    Raises:
        UnsupportedCheckpointError: without ``universal_checkpoint_info`` patterns, a parameter
            whose model-rank copies differ; patterns or parameters this reader cannot place.
        LayoutMismatchError: the ranks disagree (shapes, names, replicated values, steps).
    """
    hinted = _patterns(files, metas[0][0])
    stage_flats: list[FlatStates] = []
    params: dict[str, Any] = {}
    for s, (stage_metas, stage_optim) in enumerate(zip(metas, optim, strict=True)):
        _check_metas(files, s, stage_metas)
        shapes = [_param_shapes(meta, files, s, t) for t, meta in enumerate(stage_metas)]
        info = hinted if hinted is not None else _check_unhinted(files, s, shapes, stage_optim)
        for t, held in enumerate(shapes[1:], start=1):
            if set(held) != set(shapes[0]):
                raise LayoutMismatchError(
                    f"{files.model_files[s][t]}: other parameters than model rank 0 of stage {s} "
                    f"({sorted(set(held) ^ set(shapes[0]))[0]}); files from different runs are "
                    "mixed, or the topology's axes are not in pipe, data, model order."
                )
        affine = {
            f"^{re.escape(name)}$": _affine(name, [ranks[name] for ranks in shapes], info)
            for name in shapes[0]
        }
        synthetic = [
            {
                **meta,
                "checkpoint_parallel_dimensions": {"tp_degree": files.degree},
                "universal_checkpoint_info": {"affine_map": {"version": 1, "params": affine}},
            }
            for meta in stage_metas
        ]
        unhinted = None if hinted is not None else f"{files.first_layer_file} (no hints)"
        flat, split = merge_tensor_parallel(
            list(zip(synthetic, stage_optim, strict=True)), files.data_parallel, 1, unhinted
        )
        stage_flats.append(flat)
        for name, param in split.params.items():
            params.setdefault(name, param)
    return stage_flats, TensorParallelInfo(
        framework="deepspeed-patterns", degree=files.degree, params=params
    )


def _patterns(files: PipelineTPFiles, meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pattern lists of ``universal_checkpoint_info``; None when the model states carry
    none (then only replicated parameters are accepted: :func:`_check_unhinted`)."""
    info = meta.get("universal_checkpoint_info")
    where = f"{files.first_layer_file} (pp {files.stages} x tp {files.degree})"
    if not isinstance(info, Mapping) or not (info.get(REPLICATED) or info.get(ROW_PARALLEL)):
        return None
    for key in UNSUPPORTED:
        if info.get(key):
            raise UnsupportedCheckpointError(
                f"{where}: universal_checkpoint_info lists {key}; ucformat places replicated, "
                "row-parallel and column-parallel parameters only."
            )
    return info


def _check_unhinted(
    files: PipelineTPFiles,
    stage: int,
    shapes: Sequence[Mapping[str, tuple[int, ...]]],
    optim: Sequence[Sequence[TorchFile]],
) -> Mapping[str, Any]:
    """Without ``universal_checkpoint_info``: every parameter of the stage must be the same on
    every model rank (plain layers, copied: replicated); the pattern list that says so.

    The copies are compared byte for byte (every fp32 master, optimizer state and scalar) by
    the merge; a parameter whose model ranks hold other shapes is split along a dimension the
    files do not name, and is refused here.

    Raises:
        UnsupportedCheckpointError: a parameter's shapes differ between model ranks.
    """
    where = f"{files.first_layer_file} (pp {files.stages} x tp {files.degree})"
    for name, shape in shapes[0].items():
        held = [ranks.get(name) for ranks in shapes]
        if any(other != shape for other in held):
            raise UnsupportedCheckpointError(
                f"{where}: param '{name}' has shapes {[list(h or ()) for h in held]} on the "
                f"model ranks of stage {stage}, so it is split along a dimension the files do not "
                "name, and the model states carry no universal_checkpoint_info saying which; "
                "save with client_state={'universal_checkpoint_info': {...}} "
                "(docs/parallel.md)."
            )
    del optim
    return {REPLICATED: [f"^{re.escape(name)}$" for name in shapes[0]]}


def _check_metas(files: PipelineTPFiles, stage: int, metas: Sequence[Mapping[str, Any]]) -> None:
    for t, meta in enumerate(metas):
        path = files.model_files[stage][t]
        dims = meta.get("checkpoint_parallel_dimensions") or {}
        for key, want in (("pp_degree", files.stages), ("tp_degree", files.degree)):
            if int(dims.get(key, want)) != want:
                raise LayoutMismatchError(
                    f"{path}: {key} is {dims[key]} but the folder's files make {want}; files "
                    "from different runs are mixed."
                )
        if int(meta["dp_world_size"]) != files.data_parallel:
            raise LayoutMismatchError(
                f"{path}: dp_world_size is {meta['dp_world_size']} but the folder has "
                f"{files.data_parallel} optimizer shards per rank; files from different runs "
                "are mixed."
            )
        if meta.get("buffer_names") or meta.get("frozen_param_shapes"):
            raise UnsupportedCheckpointError(
                f"{path}: buffers or frozen parameters in a pipeline with tensor parallelism; "
                "ucformat converts those whose parameters are all trainable."
            )


def _param_shapes(
    meta: Mapping[str, Any], files: PipelineTPFiles, stage: int, rank: int
) -> dict[str, tuple[int, ...]]:
    groups = meta.get("param_shapes")
    if not groups:
        raise UnsupportedCheckpointError(
            f"{files.model_files[stage][rank]}: no param_shapes; ucformat reads pipelines with "
            "tensor parallelism trained with ZeRO-1."
        )
    return {str(n): tuple(int(d) for d in s) for group in groups for n, s in group.items()}


def _matches(patterns: Sequence[str], name: str) -> bool:
    return any(re.match(p, name) for p in patterns)


def _affine(
    name: str, shards: Sequence[tuple[int, ...]], info: Mapping[str, Any]
) -> dict[str, Any]:
    """The affine-map entry (:mod:`.tensor_parallel`'s encoding) of ``name`` from its ranks'
    shard shapes and the pattern lists."""
    replicated = _matches(info.get(REPLICATED) or [], name)
    row = _matches(info.get(ROW_PARALLEL) or [], name)
    if replicated and row:
        raise UnsupportedCheckpointError(
            f"param '{name}' matches both {REPLICATED} and {ROW_PARALLEL}; expected one."
        )
    first = shards[0]
    if replicated:
        if any(shape != first for shape in shards):
            raise LayoutMismatchError(
                f"param '{name}' is listed as tensor-parallel replicated but its model ranks hold "
                f"shapes {[list(s) for s in shards]}."
            )
        logical = first
        pieces = [[_whole(first)] for _ in shards]
    else:
        dim = 1 if row else 0
        if len(first) <= dim or any(
            len(s) != len(first) or s[:dim] + s[dim + 1 :] != first[:dim] + first[dim + 1 :]
            for s in shards
        ):
            raise LayoutMismatchError(
                f"param '{name}': model ranks hold shapes {[list(s) for s in shards]}, not a split "
                f"on dim {dim} ({'row' if row else 'column'}-parallel by the patterns)."
            )
        widths = [s[dim] for s in shards]
        logical = (*first[:dim], sum(widths), *first[dim + 1 :])
        pieces = split_pieces(logical, dim, [widths])
    return {
        "logical_shape": list(logical),
        "ranks": {
            t: {"shard_shape": list(shape), "pieces": [_encode(p) for p in rank_pieces]}
            for t, (shape, rank_pieces) in enumerate(zip(shards, pieces, strict=True))
        },
    }


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out: list[int] = []
    step = 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def _whole(shape: tuple[int, ...]) -> Piece:
    return Piece(shape, 0, _strides(shape), 0, _strides(shape))


def _encode(piece: Piece) -> dict[str, Any]:
    return {
        "shape": list(piece.shape),
        "source": [piece.source_offset, list(piece.source_strides)],
        "dest": [piece.dest_offset, list(piece.dest_strides)],
    }
