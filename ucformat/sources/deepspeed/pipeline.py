"""Read a DeepSpeed ``PipelineModule`` checkpoint (ZeRO-0/1, any pp x dp) as one source.

The files of a pipeline tag folder (DeepSpeed 0.19.8; docs/parallel.md, "Pipeline parallel"):

* ``mp_rank_{s:02d}_model_states.pt`` per stage ``s`` (``module`` is None; ``param_shapes``
  names the stage's trainable params by their ``PipelineModule`` names);
* ``[bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt`` per stage and data-parallel rank
  ``d``: stage ``s``'s ZeRO partitions over its ``dp`` replicas (ZeRO-1 in fp32, fp16 or bf16,
  or ``BF16_Optimizer`` at ZeRO-0), the layout every other ZeRO-1 checkpoint has (ZeRO-0 in
  fp32 or fp16 writes none and is refused: :mod:`.pipeline_zero0`);
* ``layer_{i:02d}-model_states.pt`` per layer with a ``state_dict`` (the layer's own names):
  the training-dtype weights, buffers and frozen params. A tied layer's second use (a
  ``forward_fn``) has no file.

Algorithm: each stage is read with the ZeRO-1/2 reader of :mod:`.states` over its own dp files;
the names are already the same at every pp (:mod:`ucformat.layout.pipeline`), so the stages'
parameters are united by name. A name on several stages must be a tied module's; its arrays
(fp32 master, Adam moments) and scalars are compared byte for byte and kept once. Layer files
provide buffers and frozen params only. Like :mod:`.checkpoint`, nothing is executed from the
pickles and tensor bytes stay on disk (except tied params', read for the comparison).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ucformat.errors import (
    LayoutMismatchError,
    NotACheckpointError,
    SourceNotFoundError,
    UCFormatError,
    UnsupportedCheckpointError,
)
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.models import SourceFile, SourceInfo, TrainingProgress
from ucformat.format.pipeline import PipelineLayout, PipelineStage
from ucformat.format.tensor_parallel import TensorParallelInfo
from ucformat.layout.pipeline import TIED_PREFIX, parse_pipeline_name, stage_owners
from ucformat.sources.base import ArraySource, SourceCheckpoint, SourceParam, frozen_param
from ucformat.sources.deepspeed.checkpoint import (
    _client_state,
    _encode_or_none,
    _model_meta,
    _optimizer_info,
    _progress,
    _train_dtype,
    _trainable_params,
    _whole,
    _zero_stage,
)
from ucformat.sources.deepspeed.files import locate_tag_folder
from ucformat.sources.deepspeed.pipeline_files import (
    LAYER_FILE,
    LAYER_TP_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    optimizer_shards,
)
from ucformat.sources.deepspeed.pipeline_tp import (
    find_pipeline_tp_files,
    has_tp_layer_files,
    merge_pipeline_tp,
)
from ucformat.sources.deepspeed.pipeline_zero0 import read_zero0_stages
from ucformat.sources.deepspeed.states import FlatStates, read_zero12_states
from ucformat.sources.reading import describing
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.torchfile import OpenedFiles, TensorRef, TorchFile

__all__ = ["PipelineFiles", "find_pipeline_files", "is_pipeline_folder", "read_pipeline_checkpoint"]


@dataclass(frozen=True)
class PipelineFiles:
    """The files of one pipeline checkpoint tag."""

    folder: Path
    tag: str
    #: Per stage: its model-states file.
    model_files: tuple[Path, ...]
    #: Per stage, per data-parallel rank: its optimizer-states file.
    optim_files: tuple[tuple[Path, ...], ...]
    #: Layer index -> its layer file.
    layer_files: dict[int, Path]

    @property
    def data_parallel(self) -> int:
        """Data-parallel replicas per stage, as the optimizer shards show (0 at ZeRO-0: the
        model states' ``dp_world_size`` says)."""
        return len(self.optim_files[0])


def is_pipeline_folder(src: Path, tag: str | None = None) -> bool:
    """Whether ``src`` (a tag folder, or a run folder with ``latest``) holds layer files."""
    try:
        folder, _ = locate_tag_folder(Path(src), tag)
    except UCFormatError:
        return False
    return any(LAYER_FILE.match(p.name) or LAYER_TP_FILE.match(p.name) for p in folder.iterdir())


def find_pipeline_files(folder: Path, tag: str) -> PipelineFiles:
    """List and check the files of a pipeline tag folder (names only; nothing is opened).

    ZeRO-0 (no optimizer shards: each stage keeps its optimizer whole in its model states) gives
    ``optim_files`` of no shard per stage.

    Raises:
        UnsupportedCheckpointError: tensor-parallel layer files.
        SourceNotFoundError: a stage's or a rank's file is missing.
        LayoutMismatchError: files from different runs are mixed.
    """
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    tp_files = [n for n in names if LAYER_TP_FILE.match(n)]
    if tp_files:
        raise UnsupportedCheckpointError(
            f"{folder / tp_files[0]}: pipeline layer files split by tensor parallelism "
            "(layer_*-model_*-model_states.pt); list them with find_pipeline_tp_files "
            "(read_pipeline_checkpoint does), not as a pipeline without tensor parallelism."
        )
    models = {int(m["mp"]): n for n in names if (m := MODEL_FILE.match(n))}
    if not models:
        raise NotACheckpointError(
            f"{folder}: layer files but no mp_rank_*_model_states.pt; not a complete DeepSpeed "
            "pipeline checkpoint."
        )
    stages = max(models) + 1
    for stage in range(stages):
        if stage not in models:
            raise SourceNotFoundError(
                f"{folder / f'mp_rank_{stage:02d}_model_states.pt'}: missing; the folder has "
                f"model states up to pipeline stage {stages - 1}."
            )
    layers = {int(m["layer"]): folder / n for n in names if (m := LAYER_FILE.match(n))}
    if not any(OPTIM_FILE.match(n) for n in names):  # ZeRO-0: by position (.pipeline_zero0)
        return PipelineFiles(
            folder=folder,
            tag=tag,
            model_files=tuple(folder / models[s] for s in range(stages)),
            optim_files=tuple(() for _ in range(stages)),
            layer_files=layers,
        )
    optim, dp = optimizer_shards(
        folder,
        names,
        stages,
        none_found="pipeline checkpoint without *_optim_states.pt shards.",
        layout=lambda dp: (
            f"a pipeline of {stages} stages x {dp} data-parallel ranks has one "
            "optimizer shard per stage and rank."
        ),
    )
    return PipelineFiles(
        folder=folder,
        tag=tag,
        model_files=tuple(folder / models[s] for s in range(stages)),
        optim_files=tuple(tuple(folder / optim[s][r] for r in range(dp)) for s in range(stages)),
        layer_files=layers,
    )


def read_pipeline_checkpoint(
    src: Path,
    tag: str | None = None,
    policy: PicklePolicy | None = None,
    *,
    check_crc: bool = True,
) -> SourceCheckpoint:
    """Open and describe a DeepSpeed pipeline checkpoint (tag folder or run folder).

    The returned object holds open file handles; close it (or use it as a context manager).

    Raises:
        LayoutMismatchError: a tied param differs between the stages that hold it (the message
            names it), or the stages disagree (steps, optimizer groups, layout).
        UnsupportedCheckpointError: ZeRO-0 stages whose positions the files leave ambiguous
            (:mod:`.pipeline_zero0`).
        UCFormatError: as :func:`find_pipeline_files`, or damaged files.
    """
    folder, tag_name = locate_tag_folder(Path(src), tag)
    if has_tp_layer_files(folder):  # layer_XX-model_YY: tensor parallel (.pipeline_tp)
        return _read_tensor_parallel(folder, tag_name, policy, check_crc)
    files = find_pipeline_files(folder, tag_name)
    opened = OpenedFiles(policy, check_crc=check_crc)
    with describing(folder, "the pipeline files", "a supported DeepSpeed", opened.close):
        models = [opened.open(p) for p in files.model_files]
        optim = [[opened.open(p) for p in stage] for stage in files.optim_files]
        layers = {index: opened.open(p) for index, p in sorted(files.layer_files.items())}
        return _describe(files, models, optim, layers, opened.handles)


def _read_tensor_parallel(
    folder: Path, tag: str, policy: PicklePolicy | None, check_crc: bool
) -> SourceCheckpoint:
    tp_files = find_pipeline_tp_files(folder, tag)
    opened = OpenedFiles(policy, check_crc=check_crc)
    with describing(folder, "the pipeline files", "a supported DeepSpeed", opened.close):
        models = [[opened.open(p) for p in stage] for stage in tp_files.model_files]
        optim = [
            [[opened.open(p) for p in ranks] for ranks in stage] for stage in tp_files.optim_files
        ]
        metas = [[_model_meta(h) for h in stage] for stage in models]
        flats, tensor_parallel = merge_pipeline_tp(tp_files, metas, optim)
        files = PipelineFiles(
            folder=folder,
            tag=tag,
            model_files=tuple(stage[0] for stage in tp_files.model_files),
            optim_files=tuple(stage[0] for stage in tp_files.optim_files),
            layer_files={},
        )
        return _assemble(
            files, [m[0] for m in metas], flats, [stage[0][0] for stage in optim], {},
            opened.handles, zero_stage=_zero_stage(optim[0][0][0], False),
            progress=_progress(metas[0][0], optim[0][0][0].obj["optimizer_state_dict"]),
            dp=files.data_parallel, tensor_parallel=tensor_parallel,
        )  # fmt: skip


def _check_stage_meta(
    files: PipelineFiles, metas: Sequence[Mapping[str, Any]], models: Sequence[TorchFile]
) -> None:
    stages, dp = len(metas), files.data_parallel or int(metas[0]["dp_world_size"])
    for meta, handle in zip(metas, models, strict=True):
        dims = meta.get("checkpoint_parallel_dimensions") or {}
        if int(dims.get("tp_degree", 1)) != 1:
            raise UnsupportedCheckpointError(
                f"{handle.path}: tp_degree is {dims['tp_degree']}; ucformat reads pipelines "
                "without tensor parallelism only."
            )
        if int(dims.get("pp_degree", stages)) != stages:
            raise LayoutMismatchError(
                f"{handle.path}: pp_degree is {dims['pp_degree']} but the folder has {stages} "
                "stages' model-states files; files from different runs are mixed."
            )
        if int(meta["dp_world_size"]) != dp:
            raise LayoutMismatchError(
                f"{handle.path}: dp_world_size is {meta['dp_world_size']} but the folder has "
                f"{dp} optimizer shards per stage; files from different runs are mixed."
            )
        if meta.get("global_steps") != metas[0].get("global_steps"):
            raise LayoutMismatchError(
                f"{handle.path}: global_steps is {meta.get('global_steps')} but "
                f"{metas[0].get('global_steps')} on stage 0; stages from different steps are "
                "mixed."
            )


def _describe(
    files: PipelineFiles,
    models: list[TorchFile],
    optim: list[list[TorchFile]],
    layers: dict[int, TorchFile],
    handles: list[TorchFile],
) -> SourceCheckpoint:
    metas = [_model_meta(handle) for handle in models]
    _check_stage_meta(files, metas, models)
    dp = files.data_parallel
    if not dp:  # ZeRO-0: each stage's optimizer by position in its model states
        train_dtype = _train_dtype(metas[0].get("ds_config"))
        stages = read_zero0_stages(metas, models, layers, train_dtype)
        progress = _progress(metas[0], {})
        if stages.loss_scaler is not None:
            progress = progress.model_copy(
                update={
                    "loss_scaler": stages.loss_scaler,
                    "dynamic_loss_scale": stages.loss_scaler.dynamic,
                    "clip_grad": stages.clip_grad,
                }
            )
        return _assemble(
            files, metas, stages.flats, models, layers, handles,
            zero_stage=0, progress=progress, dp=int(metas[0]["dp_world_size"]),
        )  # fmt: skip
    flats = [
        read_zero12_states(_with_param_shapes(meta, shards, layers), shards, dp)
        for meta, shards in zip(metas, optim, strict=True)
    ]
    return _assemble(
        files, metas, flats, [shards[0] for shards in optim], layers, handles,
        zero_stage=_zero_stage(optim[0][0], False),
        progress=_progress(metas[0], optim[0][0].obj["optimizer_state_dict"]), dp=dp,
    )  # fmt: skip


def _assemble(
    files: PipelineFiles,
    metas: Sequence[Mapping[str, Any]],
    flats: Sequence[FlatStates],
    first_files: Sequence[TorchFile],
    layers: dict[int, TorchFile],
    handles: list[TorchFile],
    *,
    zero_stage: int,
    progress: TrainingProgress,
    dp: int,
    tensor_parallel: TensorParallelInfo | None = None,
) -> SourceCheckpoint:
    """The source of the stages' ``flats`` (``first_files[s]``: the file that holds stage
    ``s``'s optimizer state, named in messages)."""
    merged = _merge_stages(flats, first_files, layer_ties=zero_stage == 0)
    train_dtype = _train_dtype(metas[0].get("ds_config"))
    params = _trainable_params(merged, {}, train_dtype)
    buffer_names = [str(n) for meta in metas for n in meta.get("buffer_names") or []]
    buffers: dict[str, ArraySource] = {}
    frozen = _layer_state(layers, params, set(buffer_names), buffers)
    params.update(frozen)
    params = dict(sorted(params.items(), key=lambda kv: _order(kv[0])))
    missing = [name for name in buffer_names if name not in buffers]
    if missing:
        raise SourceNotFoundError(
            f"{files.folder}: buffer '{missing[0]}' is in buffer_names but in no layer file."
        )
    stage_names = [
        [*map(str, flat.groups), *(meta.get("buffer_names") or [])]
        for flat, meta in zip(flats, metas, strict=True)
    ]
    pipeline = _layout(stage_names, list(frozen), dp)
    tied = {str(a): str(o) for meta in metas for a, o in (meta.get("shared_params") or {}).items()}
    source = SourceInfo(
        framework_version=str(metas[0].get("ds_version", "unknown")),
        path=str(files.folder.resolve()),
        tag=files.tag,
        zero_stage=zero_stage,
        world_size=dp,
        train_dtype=train_dtype,  # type: ignore[arg-type]
        optimizer_wrapper=merged.wrapper,
        files=[SourceFile(name=h.path.name, size=h.size) for h in handles],
        ds_config=_encode_or_none(metas[0].get("ds_config")),
        pipeline=pipeline,
    )
    return SourceCheckpoint(
        source=source,
        params=params,
        buffers={name: buffers[name] for name in sorted(buffers, key=_order)},
        tied=tied,
        optimizer=_optimizer_info(merged, metas[0].get("ds_config")),
        progress=progress,
        client_state=_client_state(metas[0]),
        files=handles,
        tensor_parallel=tensor_parallel,
    )


def _order(name: str) -> tuple[int, int, str]:
    """Module order of a one-stage ``PipelineModule``: tied modules first, then by layer."""
    parsed = parse_pipeline_name(name)
    if parsed is None or parsed.layer is None:
        return (0, 0, "")
    return (1, parsed.layer, "")


def _merge_stages(
    flats: Sequence[FlatStates], first_shards: Sequence[TorchFile], *, layer_ties: bool = False
) -> FlatStates:
    """Unite the stages' params by name; a name on two stages must be a tied module's, equal
    (``layer_ties``, ZeRO-0: a tied module is named by the layer of its first use)."""
    merged = FlatStates(wrapper=flats[0].wrapper, param_groups=flats[0].param_groups)
    holder: dict[str, int] = {}
    for stage, flat in enumerate(flats):
        shard = first_shards[stage]
        if flat.partition:
            raise UnsupportedCheckpointError(
                f"{shard.path}: optimizer states kept once per partition "
                f"({sorted({k for held in flat.partition.values() for k in held})}) in a "
                "pipeline stage; ucformat keeps such states for data-parallel ZeRO-1/2 only."
            )
        merged.whole.update(flat.whole)
        if flat.wrapper != merged.wrapper:
            raise LayoutMismatchError(
                f"{shard.path}: written by {flat.wrapper}, stage 0 by {merged.wrapper}; files "
                "from different runs are mixed."
            )
        _check_groups(flat.param_groups, merged.param_groups, shard)
        for name, group in flat.groups.items():
            if name not in holder:
                holder[name] = stage
                merged.groups[name] = group
                merged.arrays[name] = flat.arrays.get(name, {})
                merged.scalars[name] = flat.scalars.get(name, {})
                continue
            parsed = parse_pipeline_name(name)
            if parsed is None or (parsed.tied_key is None and not layer_ties):
                raise LayoutMismatchError(
                    f"{shard.path}: param '{name}' is trained on pipeline stages "
                    f"{holder[name]} and {stage} but is not a tied module's; files from "
                    "different runs are mixed."
                )
            _check_tied_copy(name, merged, flat, holder[name], stage)
    return merged


def _check_groups(
    groups: Sequence[Mapping[str, Any]], first: Sequence[Mapping[str, Any]], shard: TorchFile
) -> None:
    def hyper(group: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    if len(groups) != len(first) or any(
        hyper(a) != hyper(b) for a, b in zip(groups, first, strict=False)
    ):
        raise LayoutMismatchError(
            f"{shard.path}: optimizer param groups differ from stage 0's; ucformat needs the "
            "same groups (hyper-parameters) on every pipeline stage."
        )


def _check_tied_copy(
    name: str, merged: FlatStates, flat: FlatStates, first: int, stage: int
) -> None:
    """Raise unless stage ``stage``'s copy of tied ``name`` equals stage ``first``'s."""
    kept, other = merged.arrays[name], flat.arrays.get(name, {})
    where = f"tied param '{name}'"
    if sorted(kept) != sorted(other) or merged.groups[name] != flat.groups[name]:
        raise LayoutMismatchError(
            f"{where}: stage {first} holds states {sorted(kept)} in group {merged.groups[name]}, "
            f"stage {stage} {sorted(other)} in group {flat.groups[name]}; the copies of a tied "
            "module must be trained together."
        )
    for key, array in kept.items():
        if array.shape != other[key].shape or not np.array_equal(
            _values(array), _values(other[key])
        ):
            raise LayoutMismatchError(
                f"{where}: its '{key}' differs between pipeline stages {first} and {stage}; "
                "the copies of a tied module must be equal (DeepSpeed keeps only the "
                "TiedLayerSpec's tied_weight_attr params in step, 'weight' by default)."
            )
    if merged.scalars[name] != flat.scalars.get(name, {}):
        raise LayoutMismatchError(
            f"{where}: its optimizer scalars differ between pipeline stages {first} and {stage}."
        )


def _values(array: ArraySource) -> np.ndarray:
    """The flat storage values of ``array`` (small: tied params only)."""
    out = np.zeros(array.numel, dtype=numpy_storage_dtype(array.dtype))
    for frag in array.fragments:
        piece = np.empty(frag.length, dtype=out.dtype)
        frag.tensor.read_into(piece, frag.tensor_start, frag.tensor_start + frag.length)
        out[frag.start : frag.start + frag.length] = piece
    return out


def _with_param_shapes(
    meta: Mapping[str, Any], shards: Sequence[TorchFile], layers: Mapping[int, TorchFile]
) -> Mapping[str, Any]:
    """``meta``, with ``param_shapes`` rebuilt where DeepSpeed wrote None (``BF16_Optimizer``
    at ZeRO-0): each group's names in flat order from the shards' ``param_slice_mappings``
    (ordered by rank, then start), their shapes from the layer files."""
    if meta.get("param_shapes") is not None:
        return meta
    groups: list[list[str]] = []
    for rank, shard in enumerate(shards):
        mappings = shard.obj["optimizer_state_dict"]["param_slice_mappings"]
        for g, mapping in enumerate(mappings):
            if g == len(groups):
                groups.append([])
            ordered = sorted(mapping.items(), key=lambda kv: int(kv[1].attributes()["start"]))
            groups[g].extend(str(n) for n, _ in ordered if str(n) not in groups[g])
        del rank
    known = {name for names in groups for name in names}
    shapes: dict[str, tuple[int, ...]] = {}
    for index, handle in layers.items():
        tensors = _tensors(handle)
        prefix = _layer_prefix(index, tensors, {n: None for n in known}, set(), _tied_locals(known))
        for local, value in tensors.items():
            shapes.setdefault(prefix + local, value.shape)
    param_shapes = []
    for names in groups:
        absent = [n for n in names if n not in shapes]
        if absent:
            raise UnsupportedCheckpointError(
                f"{shards[0].path}: no param_shapes in the model states and no layer file holds "
                f"'{absent[0]}'; its shape is unknown."
            )
        param_shapes.append({n: shapes[n] for n in names})
    return {**meta, "param_shapes": param_shapes}


def _tensors(handle: TorchFile) -> dict[str, TensorRef]:
    state = handle.obj
    if not isinstance(state, Mapping):
        raise NotACheckpointError(f"{handle.path}: not a layer state dict.")
    return {str(k): v for k, v in state.items() if isinstance(v, TensorRef)}


def _tied_locals(names: Iterable[str]) -> dict[str, set[str]]:
    tied: dict[str, set[str]] = {}
    for name in names:
        parsed = parse_pipeline_name(name)
        if parsed is not None and parsed.tied_key is not None:
            tied.setdefault(parsed.tied_key, set()).add(parsed.local)
    return tied


def _layer_state(
    layers: Mapping[int, TorchFile],
    params: Mapping[str, SourceParam],
    buffer_names: set[str],
    buffers: dict[str, ArraySource],
) -> dict[str, SourceParam]:
    """Buffers (into ``buffers``) and frozen params from the layer files."""
    tied_locals = _tied_locals(params)
    shapes = {name: param.shape for name, param in params.items()}
    frozen: dict[str, SourceParam] = {}
    for index, handle in layers.items():
        tensors = _tensors(handle)
        prefix = _layer_prefix(index, tensors, shapes, buffer_names, tied_locals)
        for local, value in tensors.items():
            name = prefix + local
            if name in params:
                continue
            if name in buffer_names:
                buffers.setdefault(name, _whole(value, handle, name))
            elif name not in frozen:
                frozen[name] = frozen_param(_whole(value, handle, name))
    return frozen


def _layer_prefix(
    index: int,
    tensors: Mapping[str, TensorRef],
    shapes: Mapping[str, tuple[int, ...] | None],
    buffer_names: set[str],
    tied_locals: Mapping[str, set[str]],
) -> str:
    """``"<index>."``, or ``"tied_modules.<key>."`` for a tied module's layer file (no
    ``<index>.`` name is known and the file holds exactly that module's trainable names)."""
    own = f"{index}."
    if any(own + local in shapes or own + local in buffer_names for local in tensors):
        return own
    for key, locals_ in sorted(tied_locals.items()):
        prefix = f"{TIED_PREFIX}{key}."
        if locals_ <= set(tensors) and all(
            shapes[prefix + local] in (None, tensors[local].shape) for local in locals_
        ):
            return prefix
    return own


def _layout(stage_names: Sequence[Sequence[str]], frozen: Sequence[str], dp: int) -> PipelineLayout:
    layers, tied = stage_owners(stage_names)
    for name in frozen:  # a layer with frozen params only: the last stage starting before it
        parsed = parse_pipeline_name(name)
        if parsed is None or parsed.layer is None or any(parsed.layer in s for s in layers):
            continue
        owner = max((s for s, ls in enumerate(layers) if ls and ls[0] <= parsed.layer), default=0)
        layers[owner] = sorted({*layers[owner], parsed.layer})
    return PipelineLayout(
        stages=[PipelineStage(layers=ls, tied=ts) for ls, ts in zip(layers, tied, strict=True)],
        data_parallel=dp,
    )
