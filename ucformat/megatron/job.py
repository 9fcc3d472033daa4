"""A live Megatron-Core job as the loader sees it: the sharded state dict it asks for.

A Megatron job describes what each rank holds the way it does for its own
``dist_checkpointing.load`` (Megatron-LM's ``load_checkpoint``): every model chunk's
``sharded_state_dict()`` under ``model`` (``model<i>`` for virtual pipeline chunks) and the
optimizer's ``sharded_state_dict(model, is_loading=True)`` under ``optimizer``, with the content
metadata of :func:`~ucformat.format.megatron_state.content_metadata` (the distributed optimizer
in its ``fully_reshardable`` form: model-space tensors; no ``chained_<i>.`` prefixes). Each
ShardedTensor names a box of a global tensor; its data is where the value goes.

Two things are read off the live job beyond that:

* :func:`dp_needed`: the distributed optimizer asks every data-parallel rank for whole
  (TP-local) tensors of optimizer state, then keeps of each only the flat range its own shard
  holds (``param_range_map["param"]`` of the parameter in its buffers' ranges, as
  ``load_parameter_state_from_fully_reshardable`` cuts it). Those ranges, per parameter found by
  identity (a ShardedTensor's ``data`` is the model parameter; a factory's ``build_fn`` is shared
  with the optimizer's copy), are recorded on the storage of the tensor that will receive them,
  so the reader fetches only them;
* :func:`global_names`: each model ShardedTensor's parameter under the name the same model has
  at TP=1, PP=1, EP=1 (``decoder.layers.<global layer>``, ``local_experts.<global expert>``), for
  stores that record no Megatron keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.format.megatron_state import OPTIMIZER_STATE_PREFIX, content_metadata

__all__ = [
    "MegatronJob",
    "describe_job",
    "dp_needed",
    "global_names",
    "model_key",
    "sharded_values",
]

_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(\.local_experts\.)(\d+)\.")


@dataclass
class MegatronJob:
    """One rank's model chunks and optimizer, and the sharded state dict they ask for.

    Attributes:
        chunks: the model chunks, unwrapped (DDP, Float16Module).
        inners: the optimizer's own optimizers (a ChainedOptimizer's, in order); empty if none.
        request: ``{"model" | "model<i>": ..., "optimizer": ...}`` as the job builds it to load.
        metadata: the content metadata the request was built with.
        dummy_states: inner optimizers whose state was created to build the request.
    """

    chunks: list[torch.nn.Module]
    inners: list[Any]
    request: dict[str, Any]
    metadata: dict[str, Any]
    dummy_states: list[Any] = field(default_factory=list)

    @property
    def chained(self) -> bool:
        """The optimizer's state dict has one entry per inner optimizer (more than one)."""
        return len(self.inners) > 1

    def optimizer_part(self, index: int) -> Any:
        """The request's optimizer entry of inner optimizer ``index``."""
        part = self.request["optimizer"]
        return part[index] if self.chained else part


def _distributed_classes() -> tuple[type, ...]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (DistributedOptimizer,)


def is_distributed(inner: Any) -> bool:
    """Whether ``inner`` is Megatron's distributed optimizer."""
    return isinstance(inner, _distributed_classes())


def is_float16(inner: Any) -> bool:
    """Whether ``inner`` is ``Float16OptimizerWithFloat16Params`` (it keeps fp32 masters)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return isinstance(inner, Float16OptimizerWithFloat16Params)


def _inners(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def _give_state(inner: Any) -> bool:
    """Give a fresh distributed optimizer over torch's Adam its state (zero-lr dummy step).

    Megatron-Core's distributed optimizer without Apex or Transformer Engine reads the step from
    existing Adam state to describe itself; a fresh one has none. Megatron's own
    ``_init_optimizer_states_with_dummy_values`` creates it; with every lr at 0 the step moves
    no master weight. Every value is replaced by the load. Returns whether state was created.
    """
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True) or len(inner.optimizer.state):
        return False
    groups = inner.optimizer.param_groups
    rates = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 0.0
    try:
        inner._init_optimizer_states_with_dummy_values()
    finally:
        for group, rate in zip(groups, rates, strict=True):
            group["lr"] = rate
    return True


def describe_job(model: Any, optimizer: Any) -> MegatronJob:
    """Build the sharded state dict ``model`` (a module or a list of chunks) and ``optimizer``
    (a Megatron optimizer, or None) ask for, as Megatron-LM's load does."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model if isinstance(model, list) else [model])
    inners = _inners(optimizer)
    distributed = any(is_distributed(inner) for inner in inners)
    metadata = content_metadata(distributed)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    request: dict[str, Any] = {}
    for index, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{index}"
        request[key] = chunk.sharded_state_dict(metadata=metadata)
    dummy = [inner for inner in inners if is_distributed(inner) and _give_state(inner)]
    if optimizer is not None:
        request["optimizer"] = optimizer.sharded_state_dict(
            request, is_loading=True, metadata=metadata
        )
    return MegatronJob(list(chunks), inners, request, metadata, dummy)


def sharded_values(tree: Any) -> Iterator[Any]:
    """Every leaf of a nested dict/list state dict."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from sharded_values(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from sharded_values(value)
    else:
        yield tree


def model_key(key: str) -> tuple[str, str | None]:
    """``(model key, optimizer state)`` of a ShardedTensor key (state None: a model tensor)."""
    if not key.startswith(OPTIMIZER_STATE_PREFIX):
        return key, None
    state, _, rest = key[len(OPTIMIZER_STATE_PREFIX) :].partition(".")
    return rest, state


def _model_tensors(job: MegatronJob) -> Iterator[Any]:
    for key, part in job.request.items():
        if key != "optimizer":
            yield from sharded_values(part)


def dp_needed(job: MegatronJob) -> dict[int, list[tuple[int, int]]]:
    """Storage data pointer -> the element ranges (in that storage) this rank's distributed
    optimizers keep of the state tensors the request names (see the module docstring)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    params: dict[tuple[str, tuple[int, ...]], Any] = {}
    factories: dict[int, Any] = {}
    for value in _model_tensors(job):
        if isinstance(value, ShardedTensor):
            params[(value.key, tuple(value.global_offset))] = value.data
        elif isinstance(value, ShardedTensorFactory):
            factories[id(value.build_fn)] = value.data
    needed: dict[int, list[tuple[int, int]]] = {}
    for index, inner in enumerate(job.inners):
        if not is_distributed(inner):
            continue
        ranges: dict[int, Any] = {}
        for buffer_ranges in inner.gbuf_ranges:
            for buckets in buffer_ranges.values():
                for bucket in buckets:
                    for param, param_ranges in bucket["param_map"].items():
                        ranges[id(param)] = param_ranges["param"]
        for value in sharded_values(job.optimizer_part(index).get("param_state", {})):
            if isinstance(value, ShardedTensor):
                param = params.get((model_key(value.key)[0], tuple(value.global_offset)))
            elif isinstance(value, ShardedTensorFactory):
                param = factories.get(id(value.build_fn))
            else:
                continue
            data = value.data
            kept = ranges.get(id(param)) if param is not None else None
            start = data.storage_offset()
            spans = needed.setdefault(data.untyped_storage().data_ptr(), [])
            if kept is not None:
                spans.append((start + kept.start, start + kept.end))
    return needed


def _globalize(name: str, key: str, index: tuple[int, ...]) -> str:
    if index and key.startswith("decoder.layers."):
        name = _LAYER.sub(lambda m: f"{m.group(1)}decoder.layers.{index[0]}.", name, count=1)
    if len(index) > 1:
        name = _EXPERT.sub(lambda m: f"{m.group(1)}{index[1]}.", name, count=1)
    return name


def global_names(
    job: MegatronJob,
) -> dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]]:
    """``(key, index on the prepended axes)`` -> (the parameter's TP=1 name, its TP=1 shape)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    names = {id(p): n for chunk in job.chunks for n, p in chunk.named_parameters()}
    out: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]] = {}
    for value in _model_tensors(job):
        if isinstance(value, ShardedTensorFactory):
            built = [v for v in sharded_values(value.build()) if isinstance(v, ShardedTensor)]
            if not built:
                continue
            described, param = built[0], value.data
        elif isinstance(value, ShardedTensor):
            described, param = value, value.data
        else:
            continue
        name = names.get(id(param))
        if name is None:
            continue
        prepend = described.prepend_axis_num
        index = tuple(described.global_offset[:prepend])
        shape = tuple(described.global_shape[prepend:])
        out[(described.key, index)] = (_globalize(name, described.key, index), shape)
    return out
