"""Read a DeepSpeed ZeRO-1/2/3 checkpoint into a :class:`~ucformat.sources.base.SourceCheckpoint`.

Needs neither DeepSpeed nor code execution: files are decoded by the restricted unpickler of
:mod:`ucformat.sources.safe_unpickle` and tensors stay on disk until the writer copies them.
Layout facts are those of DeepSpeed 0.19.8 (docs/format.md, "Sources").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from math import prod
from pathlib import Path
from typing import Any, cast

import numpy as np

from ucformat.errors import (
    LayoutMismatchError,
    NotACheckpointError,
    UnsupportedCheckpointError,
)
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.experts import ExpertLayout
from ucformat.format.models import (
    ClientState,
    LossScaler,
    OptimizerGroup,
    OptimizerInfo,
    SourceFile,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.pyvalue import encode, try_encode
from ucformat.format.spec import FP32_STATE
from ucformat.format.training_values import encode_client_state, encode_exact
from ucformat.layout.partition import PerParamLayout
from ucformat.sources.base import (
    ArraySource,
    PartitionSource,
    SourceCheckpoint,
    SourceFragment,
    SourceParam,
    frozen_param,
)
from ucformat.sources.deepspeed.autoep import AUTOEP_KEY, read_autoep_states, router_aliases
from ucformat.sources.deepspeed.experts import MOE_KEYS, read_moe_states
from ucformat.sources.deepspeed.files import (
    ZeroFiles,
    find_zero_files,
    locate_tag_folder,
    model_states_file,
    tensor_parallel_degree,
)
from ucformat.sources.deepspeed.positional import (
    PositionalOptimizer,
    decode_positional,
    loss_scale_config,
    module_weights,
    read_positional,
)
from ucformat.sources.deepspeed.states import (
    FlatStates,
    read_zero3_states,
    read_zero12_states,
)
from ucformat.sources.deepspeed.tensor_parallel import (
    find_tensor_parallel_files,
    merge_tensor_parallel,
)
from ucformat.sources.reading import describing
from ucformat.sources.safe_unpickle import PicklePolicy, StandIn
from ucformat.sources.torchfile import OpenedFiles, TensorRef, TorchFile, open_torch_file

__all__ = ["read_deepspeed_checkpoint"]

#: Top-level model-states keys DeepSpeed itself writes; every other key is client state.
DEEPSPEED_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
        "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
        "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
        "dp_world_size", "mp_world_size", "ds_config", "ds_version",
        "checkpoint_parallel_dimensions",
    }
)  # fmt: skip
_REQUIRED_KEYS = ("module", "param_shapes", "dp_world_size")


def read_deepspeed_checkpoint(
    src: Path,
    tag: str | None = None,
    policy: PicklePolicy | None = None,
    *,
    check_crc: bool = True,
) -> SourceCheckpoint:
    """Open and describe a DeepSpeed ZeRO checkpoint (tag folder or run folder with ``latest``).

    The returned object holds open file handles; close it (or use it as a context manager).
    With ``check_crc``, storage bytes are checksummed as they are read and
    :meth:`SourceCheckpoint.check_integrity` compares them with the files' zip CRC-32s.
    """
    folder, tag_name = locate_tag_folder(Path(src), tag)
    degree = tensor_parallel_degree(folder)
    try:
        by_rank = (
            find_tensor_parallel_files(folder, tag_name, degree)
            if degree > 1
            else [find_zero_files(folder, tag_name)]
        )
        files = by_rank[0]
    except UnsupportedCheckpointError:
        _check_model_file(folder, policy)  # a random .pt is "not DeepSpeed", not "unsupported"
        raise
    opened = OpenedFiles(policy, check_crc=check_crc)
    with describing(folder, "the shard files", "a supported DeepSpeed", opened.close):
        models = [opened.open(p) for p in files.model_files]
        optim = [opened.open(p) for p in files.optim_files]
        others = [
            ([opened.open(p) for p in f.model_files], [opened.open(p) for p in f.optim_files])
            for f in by_rank[1:]
        ]
        return _describe(files, models, optim, opened.handles, opened.open, others)


def _check_model_file(folder: Path, policy: PicklePolicy | None) -> None:
    """Raise NotACheckpointError if the folder's first model-states file is not DeepSpeed's."""
    for name in (model_states_file(), model_states_file(0)):
        if (folder / name).is_file():
            with open_torch_file(folder / name, policy) as handle:
                _model_meta(handle)
            return


def _model_meta(handle: TorchFile) -> Mapping[str, Any]:
    meta = handle.obj
    missing = [k for k in _REQUIRED_KEYS if not isinstance(meta, Mapping) or k not in meta]
    if missing or not isinstance(meta, Mapping):
        raise NotACheckpointError(
            f"{handle.path}: missing key(s) {', '.join(repr(k) for k in missing)}; not a "
            "DeepSpeed ZeRO model-states file."
        )
    return cast("Mapping[str, Any]", meta)


def _describe(
    files: ZeroFiles,
    models: list[TorchFile],
    optim: list[TorchFile],
    handles: list[TorchFile],
    opener: Callable[[Path], TorchFile],
    other_tp_ranks: Sequence[tuple[list[TorchFile], list[TorchFile]]] = (),
) -> SourceCheckpoint:
    meta = _model_meta(models[0])
    world_size = files.world_size
    experts: ExpertLayout | None = None
    positional = None
    autoep_tied: dict[str, str] = {}
    if meta.get(AUTOEP_KEY):  # AutoEP: experts in full arrays (sources/deepspeed/autoep.py)
        stage = _zero_stage(optim[0], files.per_rank_model_files)
        metas = [_model_meta(m) for m in models]
        flat = read_autoep_states(metas, optim, world_size, stage, models[0])
        autoep_tied = router_aliases(meta, list(flat.groups))
    elif files.experts is not None:  # native MoE: sources/deepspeed/experts.py
        if files.per_rank_model_files:
            raise UnsupportedCheckpointError(
                f"{files.folder}: a ZeRO-3 MoE checkpoint; ucformat reads MoE checkpoints at "
                "ZeRO-0/1/2 only."
            )
        moe = read_moe_states(
            meta, models[0], optim, files.experts, opener, _train_dtype(meta.get("ds_config"))
        )
        stage, flat, world_size, experts = moe.stage, moe.flat, moe.world_size, moe.layout
        positional = moe.positional
    elif not files.optim_files:  # ZeRO-0: the optimizer by position (.positional)
        if other_tp_ranks:
            raise UnsupportedCheckpointError(
                f"{files.folder}: ZeRO-0 with tensor parallelism (model-parallel files); ucformat "
                "reads AutoTP checkpoints trained with ZeRO 1-3."
            )
        return _describe_zero0(files, meta, models[0], handles)
    else:
        if int(meta["dp_world_size"]) != world_size:
            raise LayoutMismatchError(
                f"{models[0].path}: dp_world_size is {meta['dp_world_size']} but the folder has "
                f"{world_size} optimizer shards; files from different runs are mixed."
            )
        stage = _zero_stage(optim[0], files.per_rank_model_files)
        if stage == 3:
            flat = read_zero3_states(meta, optim, world_size)
        else:
            flat = read_zero12_states(meta, optim, world_size)
    tensor_parallel = None
    if other_tp_ranks:  # AutoTP: every rank's shards placed in full arrays
        ranks = [(meta, optim)] + [(_model_meta(m[0]), o) for m, o in other_tp_ranks]
        flat, tensor_parallel = merge_tensor_parallel(ranks, world_size, stage)
    module: Mapping[str, Any] = meta["module"]
    train_dtype = _train_dtype(meta.get("ds_config"))
    tied = {str(a): str(o) for a, o in (meta.get("shared_params") or {}).items()}
    tied = tied or autoep_tied  # AutoEP's router aliases (DeepSpeed records none)
    buffer_names = [str(n) for n in meta.get("buffer_names") or []]
    params = _trainable_params(flat, module, train_dtype)
    params.update(_frozen_params(meta, models, stage, world_size, set(params), tied, buffer_names))
    if tensor_parallel is not None and (len(params) > len(flat.groups) or buffer_names):
        raise UnsupportedCheckpointError(
            f"{files.folder}: frozen parameters or buffers in a tensor-parallel checkpoint; "
            "ucformat converts AutoTP checkpoints whose parameters are all trainable."
        )
    order = {name: i for i, name in enumerate(module)}
    params = dict(sorted(params.items(), key=lambda kv: order.get(kv[0], len(order))))
    buffers = {name: _whole(module[name], models[0], name) for name in buffer_names}
    optimizer_state = optim[0].obj.get("optimizer_state_dict") or {}  # none at ZeRO-0
    progress = _progress(meta, optimizer_state)
    if positional is not None and positional.loss_scale:  # ZeRO-0 MoE in fp16
        progress = _with_loss_scale(progress, positional)
    source = SourceInfo(
        framework_version=str(meta.get("ds_version", "unknown")),
        path=str(files.folder.resolve()),
        tag=files.tag,
        zero_stage=stage,
        world_size=world_size,
        train_dtype=train_dtype,  # type: ignore[arg-type]
        optimizer_wrapper=flat.wrapper,
        sub_groups=flat.sub_groups,
        files=[SourceFile(name=h.path.name, size=h.size) for h in handles],
        ds_config=_encode_or_none(meta.get("ds_config")),
    )
    return SourceCheckpoint(
        source=source,
        params=params,
        buffers=buffers,
        tied=tied,
        optimizer=_optimizer_info(flat, meta.get("ds_config")),
        progress=progress,
        client_state=_client_state(meta),
        files=handles,
        tensor_parallel=tensor_parallel,
        experts=experts,
        partition_states=partition_sources(flat),
    )


def _describe_zero0(
    files: ZeroFiles, meta: Mapping[str, Any], model: TorchFile, handles: list[TorchFile]
) -> SourceCheckpoint:
    """A ZeRO-0 checkpoint: names proven for the positional optimizer state (.positional)."""
    if meta.get("optimizer") is None:
        raise UnsupportedCheckpointError(
            f"{model.path}: no optimizer state at all (no *_optim_states.pt shards and no "
            "'optimizer' entry: saved by an engine without an optimizer); ucformat converts "
            "training checkpoints."
        )
    opt = decode_positional(meta["optimizer"], model)
    module: Mapping[str, Any] = meta["module"]
    train_dtype = _train_dtype(meta.get("ds_config"))
    buffer_names = [str(n) for n in meta.get("buffer_names") or []]
    weights, tied = module_weights(module, buffer_names)
    read = read_positional(opt, weights, train_dtype, model)
    params = _trainable_params(read.flat, module, train_dtype)
    for name in read.unplaced:
        params[name] = frozen_param(_whole(weights[name], model, name))
    order = {name: i for i, name in enumerate(module)}
    params = dict(sorted(params.items(), key=lambda kv: order.get(kv[0], len(order))))
    buffers = {name: _whole(module[name], model, name) for name in buffer_names}
    source = SourceInfo(
        framework_version=str(meta.get("ds_version", "unknown")),
        path=str(files.folder.resolve()),
        tag=files.tag,
        zero_stage=0,
        world_size=int(meta["dp_world_size"]),
        train_dtype=train_dtype,  # type: ignore[arg-type]
        optimizer_wrapper=opt.wrapper,
        files=[SourceFile(name=h.path.name, size=h.size) for h in handles],
        ds_config=_encode_or_none(meta.get("ds_config")),
    )
    progress = _progress(meta, {})
    if opt.loss_scale:
        progress = _with_loss_scale(progress, opt)
    return SourceCheckpoint(
        source=source,
        params=params,
        buffers=buffers,
        tied=tied,
        optimizer=_optimizer_info(read.flat, meta.get("ds_config")),
        progress=progress,
        client_state=_client_state(meta),
        files=handles,
    )


def _with_loss_scale(progress: TrainingProgress, opt: PositionalOptimizer) -> TrainingProgress:
    """``progress`` with a ZeRO-0 fp16 wrapper's loss scale and gradient clipping."""
    return progress.model_copy(
        update={
            "loss_scaler": loss_scale_config(opt.loss_scale),
            "dynamic_loss_scale": bool(opt.loss_scale.get("dynamic_loss_scale", False)),
            "clip_grad": opt.clip_grad,
        }
    )


def _zero_stage(first_optim: TorchFile, per_rank_model_files: bool) -> int:
    osd = (
        first_optim.obj.get("optimizer_state_dict")
        if isinstance(first_optim.obj, Mapping)
        else None
    )
    if not isinstance(osd, Mapping):
        raise NotACheckpointError(
            f"{first_optim.path}: missing key 'optimizer_state_dict'; not a DeepSpeed ZeRO "
            "optimizer shard."
        )
    stage = int(osd.get("zero_stage", 1))  # BF16_Optimizer files carry none: stage 1
    if (stage == 3) != per_rank_model_files:
        raise LayoutMismatchError(
            f"{first_optim.path}: zero_stage is {stage}, but the model-states files are "
            f"{'per rank (ZeRO-3)' if per_rank_model_files else 'single (ZeRO-1/2)'}; files "
            "from different runs are mixed."
        )
    if stage not in (1, 2, 3):
        raise NotACheckpointError(f"{first_optim.path}: unknown zero_stage {stage}.")
    return stage


def _train_dtype(ds_config: Any) -> str:
    config = ds_config if isinstance(ds_config, Mapping) else {}
    for key, name in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled"):
            return name
    return "float32"


def _trainable_params(
    flat: FlatStates, module: Mapping[str, Any], train_dtype: str
) -> dict[str, SourceParam]:
    params: dict[str, SourceParam] = {}
    for name, group in flat.groups.items():
        arrays = flat.arrays.get(name, {})
        if FP32_STATE not in arrays:
            raise LayoutMismatchError(f"param '{name}': no shard holds any of its fp32 values.")
        placeholder = module.get(name)
        dtype = placeholder.dtype_name if isinstance(placeholder, TensorRef) else train_dtype
        params[name] = SourceParam(
            shape=arrays[FP32_STATE].shape,
            dtype=dtype,
            requires_grad=True,
            group=group,
            arrays=arrays,
            scalars=flat.scalars.get(name, {}),
            whole=flat.whole.get(name, {}),
        )
    return params


def _frozen_params(
    meta: Mapping[str, Any],
    models: Sequence[TorchFile],
    stage: int,
    world_size: int,
    trainable: set[str],
    tied: Mapping[str, str],
    buffer_names: Sequence[str],
) -> dict[str, SourceParam]:
    shapes = meta.get("frozen_param_shapes")
    fragments = meta.get("frozen_param_fragments")
    module: Mapping[str, Any] = meta["module"]
    frozen: dict[str, SourceParam] = {}
    if stage == 1 or shapes is None:
        if stage == 3:
            return frozen  # exclude_frozen_parameters: nothing saved
        skip = trainable | set(tied) | set(buffer_names)
        for name, value in module.items():
            if name not in skip and isinstance(value, TensorRef):
                frozen[name] = frozen_param(_whole(value, models[0], name))
        return frozen
    for name, shape in shapes.items():
        dims = tuple(int(d) for d in shape)
        if stage == 2:
            if fragments is None:
                raise NotACheckpointError(
                    f"{models[0].path}: has 'frozen_param_shapes' but no "
                    "'frozen_param_fragments'; not a DeepSpeed ZeRO-2 model-states file."
                )
            frozen[name] = frozen_param(_whole(fragments[name], models[0], name, dims))
            continue
        layout = PerParamLayout.build([(name, prod(dims))], world_size)
        pieces = [h.obj["frozen_param_fragments"][name] for h in models]
        array = ArraySource(dims, pieces[0].dtype_name)
        for frag in layout.all_fragments():
            array.fragments.append(
                SourceFragment(pieces[frag.rank], 0, frag.param_start, frag.length)
            )
        frozen[name] = frozen_param(array)
    return frozen


def _whole(
    value: Any, handle: TorchFile, name: str, shape: tuple[int, ...] | None = None
) -> ArraySource:
    if not isinstance(value, TensorRef):
        raise LayoutMismatchError(f"{handle.path}: '{name}' is not a tensor.")
    dims = value.shape if shape is None else shape
    if prod(dims) != value.numel:
        raise LayoutMismatchError(
            f"{handle.path}: '{name}' has {value.numel} elements, expected shape {dims}."
        )
    array = ArraySource(dims, value.dtype_name)
    if value.numel:
        array.fragments.append(SourceFragment(value, 0, 0, value.numel))
    return array


def _optimizer_info(flat: FlatStates, ds_config: Any) -> OptimizerInfo:
    groups: list[OptimizerGroup] = []
    members: dict[int, list[str]] = {}
    for name, group in flat.groups.items():
        members.setdefault(group, []).append(name)
    count = max(len(flat.param_groups), max(members, default=-1) + 1)
    for index in range(count):
        raw = flat.param_groups[index] if index < len(flat.param_groups) else {}
        hyper = {str(k): encode(v) for k, v in raw.items() if k != "params"}
        groups.append(OptimizerGroup(params=members.get(index, []), hyperparams=hyper))
    state_keys = sorted({k for a in flat.arrays.values() for k in a if k != FP32_STATE})
    scalar_keys = sorted({k for s in flat.scalars.values() for k in s})
    whole_keys = sorted({k for w in flat.whole.values() for k in w})
    clash = sorted(set(state_keys) & set(whole_keys))
    if clash:
        raise UnsupportedCheckpointError(
            f"optimizer state '{clash[0]}' has the parameter's shape for some parameters and "
            "another for others; ucformat keeps a state key either elementwise or whole."
        )
    name, adam_w = _optimizer_name(ds_config, flat.param_groups[0] if flat.param_groups else {})
    return OptimizerInfo(
        name=name,
        adam_w_mode=adam_w,
        state_keys=state_keys,
        scalar_keys=scalar_keys,
        groups=groups,
        whole_keys=whole_keys,
    )


def partition_sources(flat: FlatStates) -> dict[int, dict[str, PartitionSource]]:
    """Each group's states kept once per partition, stacked one row per rank, and whether all
    rows are equal (read now: such states are small)."""
    out: dict[int, dict[str, PartitionSource]] = {}
    for g, held in sorted(flat.partition.items()):
        for key, tensors in held.items():
            first = tensors[0]
            if any(t.shape != first.shape or t.dtype_name != first.dtype_name for t in tensors):
                raise UnsupportedCheckpointError(
                    f"{first.file.path}: optimizer state '{key}' of group {g} has different "
                    "shapes or dtypes on different ranks; ucformat keeps a per-partition state "
                    "of one shape."
                )
            array = ArraySource((len(tensors), *first.shape), first.dtype_name)
            values = []
            for rank, tensor in enumerate(tensors):
                if tensor.numel:
                    array.fragments.append(
                        SourceFragment(tensor, 0, rank * tensor.numel, tensor.numel)
                    )
                out_values = np.empty(tensor.numel, numpy_storage_dtype(tensor.dtype_name))
                tensor.read_into(out_values, 0, tensor.numel)
                values.append(out_values.tobytes())
            replicated = len(set(values)) == 1
            out.setdefault(g, {})[key] = PartitionSource(array, replicated)
    return out


def _optimizer_name(ds_config: Any, group: Mapping[str, Any]) -> tuple[str, bool | None]:
    config = ds_config if isinstance(ds_config, Mapping) else {}
    section = config.get("optimizer")
    if isinstance(section, Mapping) and "type" in section:
        kind = str(section["type"])
        options = section.get("params") or {}
        if kind.lower() not in ("adam", "adamw"):
            return kind, None
        adam_w = bool(options.get("adam_w_mode", True)) or kind.lower() == "adamw"
        if options.get("torch_adam"):
            return ("torch.optim.AdamW" if adam_w else "torch.optim.Adam"), adam_w
        offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
        if isinstance(offload, Mapping) and offload.get("device") in ("cpu", "nvme"):
            return "deepspeed.ops.adam.DeepSpeedCPUAdam", adam_w
        return "deepspeed.ops.adam.FusedAdam", adam_w
    if "decoupled_weight_decay" in group:
        adam_w = bool(group["decoupled_weight_decay"])
        return ("torch.optim.AdamW" if adam_w else "torch.optim.Adam"), adam_w
    if {"amsgrad", "foreach", "betas"} <= set(group):
        return "torch.optim.Adam", False
    if {"bias_correction", "betas"} <= set(group):
        return "deepspeed.ops.adam.FusedAdam", None
    return "unknown", None


def _progress(meta: Mapping[str, Any], optimizer_state: Mapping[str, Any]) -> TrainingProgress:
    scaler = optimizer_state.get("loss_scaler")
    clip = optimizer_state.get("clip_grad")
    return TrainingProgress(
        global_steps=int(meta.get("global_steps") or 0),
        global_samples=int(meta.get("global_samples") or 0),
        skipped_steps=int(meta.get("skipped_steps") or 0),
        lr_scheduler=encode_exact(meta.get("lr_scheduler"), "lr_scheduler"),
        loss_scaler=_loss_scaler(scaler) if isinstance(scaler, StandIn) else None,
        dynamic_loss_scale=_optional_bool(optimizer_state.get("dynamic_loss_scale")),
        overflow=_optional_bool(optimizer_state.get("overflow")),
        clip_grad=float(clip) if isinstance(clip, (int, float)) else None,
    )


def _optional_bool(value: Any) -> bool | None:
    return bool(value) if value is not None else None


def _loss_scaler(scaler: StandIn) -> LossScaler:
    attributes = {str(k): encode_exact(v, "loss_scaler") for k, v in scaler.attributes().items()}
    return LossScaler(
        class_name=type(scaler).ucformat_qualname.rpartition(".")[2],
        dynamic=bool(scaler.attributes().get("dynamic", False)),
        cur_scale=float(scaler.attributes().get("cur_scale", 1.0)),
        attributes=attributes,
    )


def _encode_or_none(value: Any) -> Any:
    ok, encoded = try_encode(value)
    return encoded if ok else None


def _client_state(meta: Mapping[str, Any]) -> ClientState:
    """The client's keys of a model-states file, then DeepSpeed's sampler and random-LTD state."""
    own = [(k, v) for k, v in meta.items() if k not in DEEPSPEED_KEYS and k not in MOE_KEYS]
    kept = ("data_sampler", "random_ltd")
    extra = [(f"deepspeed.{k}", meta[k]) for k in kept if meta.get(k) is not None]
    return encode_client_state([*own, *extra])
