"""A live DeepSpeed engine described as a :class:`~ucformat.sources.base.SourceCheckpoint`.

What :mod:`ucformat.sources.deepspeed.checkpoint` reads from the files ``engine.save_checkpoint``
would write, taken from the engine itself, so that
:func:`~ucformat.write.plan.plan_convert` makes the
same plan and the same manifest (provenance aside). Every array's fragments are those of every
rank, computed with :mod:`ucformat.layout.partition` from the engine's parameter order and world
size (:mod:`ucformat.deepspeed.engine`): on this rank they point at its own tensors
(:class:`~ucformat.sources.live.MemoryTensor`), for the others they name the rank holding
them (:class:`~ucformat.sources.live.RemoteTensor`). What comes from where, as in the files:

* trainable parameters: every rank's fp32 partitions and optimizer states (0-d states such as
  ``step`` become scalars);
* frozen parameters: rank 0's whole tensors (ZeRO-1/2), every rank's piece (ZeRO-3);
* buffers, client state, scheduler and counters: rank 0's; loss scaler and clipping: this
  rank's wrapper (the same on every rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from math import prod
from typing import Any

import torch

from ucformat.deepspeed.engine import EngineView
from ucformat.format.dtypes import dtype_name
from ucformat.format.models import (
    ClientState,
    LossScaler,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.pyvalue import try_encode
from ucformat.format.spec import FP32_STATE
from ucformat.format.training_values import encode_exact
from ucformat.layout.partition import PerParamLayout
from ucformat.sources.base import (
    ArraySource,
    FragmentTensor,
    SourceCheckpoint,
    SourceFragment,
    SourceParam,
    frozen_param,
    split_state,
)
from ucformat.sources.deepspeed.checkpoint import _client_state, _optimizer_info
from ucformat.sources.deepspeed.states import FlatStates
from ucformat.sources.live import HostCopies, MemoryTensor, RemoteTensor
from ucformat.sources.unwrap import unwrap_names

__all__ = ["HostCopies", "describe_live"]


def state_dict_names(module: torch.nn.Module) -> Iterator[tuple[str, bool]]:
    """The keys ``module.state_dict()`` has, in its order, without building it: (name, is_param).

    Tied parameters appear under every name; non-persistent buffers are left out.
    """

    def walk(mod: torch.nn.Module, prefix: str) -> Iterator[tuple[str, bool]]:
        for name, param in mod._parameters.items():
            if param is not None:
                yield prefix + name, True
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield prefix + name, False
        for name, child in mod._modules.items():
            if child is not None:
                yield from walk(child, prefix + name + ".")

    yield from walk(module, "")


def _param_shape(param: torch.Tensor) -> tuple[int, ...]:
    shape = getattr(param, "ds_shape", None)
    return tuple(int(d) for d in (shape if shape is not None else param.shape))


def _tensor_for(rank: int, holder: int, local: torch.Tensor | None, dtype: str) -> FragmentTensor:
    if rank == holder:
        if local is None:
            raise RuntimeError("a local tensor is missing")
        return MemoryTensor.of(local, rank)
    return RemoteTensor(holder, dtype)


def describe_live(
    view: EngineView,
    *,
    rank: int,
    world_size: int,
    client_state: Mapping[str, Any] | None,
    location: str,
    tag: str | None,
    copies: HostCopies,
) -> SourceCheckpoint:
    """Describe the engine of ``view`` as the converter describes its saved checkpoint.

    Raises:
        LayoutMismatchError: an optimizer state tensor does not match its flat partition.
        UCFormatError: scheduler or loss-scaler state that the manifest cannot hold exactly.
    """
    engine, wrapper = view.engine, view.wrapper
    module: torch.nn.Module = engine.module
    order = {name: i for i, (name, _) in enumerate(state_dict_names(module))}
    flat = FlatStates(wrapper=type(wrapper).__name__)
    flat.param_groups = [dict(group) for group in view.base_optimizer.param_groups]
    if view.kind == "zero3":
        flat.sub_groups = len(view.targets)
    params_by_name = dict(module.named_parameters())
    for target, fp32 in zip(view.targets, view.fp32, strict=True):
        state = view.base_optimizer.state.get(view.state_key(target.index), {})
        where = f"flat group {target.index}: optimizer state"
        flat_states, scalars = split_state(state, where, fp32.numel())
        tensors: dict[str, torch.Tensor] = {FP32_STATE: fp32, **flat_states}
        local = {key: copies.host(value) for key, value in tensors.items()}
        dtypes = {key: dtype_name(value.dtype) for key, value in tensors.items()}
        for name in target.names:
            flat.groups[name] = target.group
            flat.scalars[name] = dict(scalars)
            shape = _param_shape(params_by_name[name])
            flat.arrays[name] = {key: ArraySource(shape, dtypes[key]) for key in tensors}
        for holder in range(world_size):
            for frag in target.layout.fragments(holder):
                for key in tensors:
                    tensor = _tensor_for(rank, holder, local.get(key), dtypes[key])
                    flat.arrays[frag.name][key].fragments.append(
                        SourceFragment(tensor, frag.partition_start, frag.param_start, frag.length)
                    )
    params: dict[str, SourceParam] = {}
    for name, arrays in flat.arrays.items():
        params[name] = SourceParam(
            shape=arrays[FP32_STATE].shape,
            dtype=dtype_name(params_by_name[name].dtype),
            requires_grad=True,
            group=flat.groups[name],
            arrays=arrays,
            scalars=flat.scalars.get(name, {}),
        )
    for name, param in params_by_name.items():
        if name not in params:
            params[name] = _frozen(view, name, param, rank, world_size, copies)
    params = dict(sorted(params.items(), key=lambda kv: order.get(kv[0], len(order))))
    buffers = _buffers(module, rank, copies)
    copies.wait()
    described = SourceCheckpoint(
        source=_source_info(view, world_size, location, tag),
        params=params,
        buffers=buffers,
        tied=_tied(module),
        optimizer=_optimizer_info(flat, engine.config),
        progress=_progress(view),
        client_state=_client(engine, client_state),
    )
    return unwrap_names(described)  # a compiled or checkpoint-wrapped module's own names


def _frozen(
    view: EngineView,
    name: str,
    param: torch.Tensor,
    rank: int,
    world_size: int,
    copies: HostCopies,
) -> SourceParam:
    """A parameter the optimizer does not own: rank 0's whole value, or ZeRO-3 pieces."""
    shape = _param_shape(param)
    ds_tensor = getattr(param, "ds_tensor", None)
    if view.kind == "zero3" and ds_tensor is not None:
        dtype = dtype_name(ds_tensor.dtype)
        array = ArraySource(shape, dtype)
        local = copies.host(ds_tensor)
        layout = PerParamLayout.build([(name, prod(shape))], world_size)
        for frag in layout.all_fragments():
            tensor = _tensor_for(rank, frag.rank, local, dtype)
            array.fragments.append(SourceFragment(tensor, 0, frag.param_start, frag.length))
    else:
        array = _whole(param, rank, copies)
    return frozen_param(array)


def _whole(tensor: torch.Tensor, rank: int, copies: HostCopies) -> ArraySource:
    """An array filled by rank 0's value of ``tensor``."""
    dtype = dtype_name(tensor.dtype)
    array = ArraySource(tuple(int(d) for d in tensor.shape), dtype)
    if tensor.numel():
        local = copies.host(tensor) if rank == 0 else None
        array.fragments.append(
            SourceFragment(_tensor_for(rank, 0, local, dtype), 0, 0, tensor.numel())
        )
    return array


def _buffers(module: torch.nn.Module, rank: int, copies: HostCopies) -> dict[str, ArraySource]:
    named = dict(module.named_buffers(remove_duplicate=False))
    return {
        name: _whole(named[name], rank, copies)
        for name, is_param in state_dict_names(module)
        if not is_param and name in named
    }


def _tied(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: owner}``: every later name of a parameter registered under several names."""
    owners: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = owners.setdefault(id(param), name)
        if owner != name:
            tied[name] = owner
    return tied


def _train_dtype(engine: Any) -> str:
    if engine.bfloat16_enabled():
        return "bfloat16"
    return "float16" if engine.fp16_enabled() else "float32"


def _source_info(view: EngineView, world_size: int, location: str, tag: str | None) -> SourceInfo:
    import deepspeed

    engine = view.engine
    ok, config = try_encode(engine.config)
    return SourceInfo(
        framework="deepspeed",
        framework_version=str(deepspeed.__version__),
        written_by="save",
        checkpoint_format=None,
        path=location,
        tag=tag or f"global_step{int(engine.global_steps)}",
        zero_stage=view.stage,
        world_size=world_size,
        train_dtype=_train_dtype(engine),  # type: ignore[arg-type]
        optimizer_wrapper=type(view.wrapper).__name__,
        sub_groups=len(view.targets) if view.kind == "zero3" else None,
        ds_config=config if ok else None,
    )


def _progress(view: EngineView) -> TrainingProgress:
    """Counters, scheduler, and the wrapper's loss-scaler and clipping state.

    The same fields the wrapper's ``state_dict()`` saves: ZeRO-1/2 all four, ZeRO-3 no
    ``clip_grad``, BF16_Optimizer only ``clip_grad``.
    """
    engine, wrapper = view.engine, view.wrapper
    scheduler = engine.lr_scheduler
    scaler = getattr(wrapper, "loss_scaler", None) if view.kind != "bf16" else None
    loss_scaler = None
    if scaler is not None:
        attributes = {k: v for k, v in vars(scaler).items() if not k.startswith("_")}
        loss_scaler = LossScaler(
            class_name=type(scaler).__name__,
            dynamic=bool(attributes.get("dynamic", False)),
            cur_scale=float(attributes.get("cur_scale", 1.0)),
            attributes={k: encode_exact(v, "loss_scaler") for k, v in attributes.items()},
        )
    with_scale = view.kind in ("zero12", "zero3")
    clip = getattr(wrapper, "clip_grad", None) if view.kind != "zero3" else None
    return TrainingProgress(
        global_steps=int(engine.global_steps or 0),
        global_samples=int(engine.global_samples or 0),
        skipped_steps=int(engine.skipped_steps or 0),
        lr_scheduler=encode_exact(scheduler.state_dict(), "lr_scheduler") if scheduler else None,
        loss_scaler=loss_scaler,
        dynamic_loss_scale=_flag(wrapper, "dynamic_loss_scale") if with_scale else None,
        overflow=_flag(wrapper, "overflow") if with_scale else None,
        clip_grad=float(clip) if isinstance(clip, (int, float)) else None,
    )


def _flag(wrapper: Any, name: str) -> bool | None:
    value = getattr(wrapper, name, None)
    return bool(value) if value is not None else None


def _client(engine: Any, client_state: Mapping[str, Any] | None) -> ClientState:
    """Client state as the converter reads it from the model-states file DeepSpeed writes."""
    meta: dict[str, Any] = {"data_sampler": None, "random_ltd": None}
    loader = getattr(engine, "training_dataloader", None)
    curriculum = getattr(engine, "curriculum_learning_enabled", lambda: False)
    if loader is not None and curriculum():
        meta["data_sampler"] = loader.data_sampler.state_dict()
    if getattr(engine, "random_ltd_enabled", lambda: False)():
        meta["random_ltd"] = engine.random_ltd_scheduler.state_dict()
    meta.update(client_state or {})
    return _client_state(meta)
