"""Megatron-Core checkpoint keys: what each key is, and the store's name of each parameter.

A ``torch_dist`` checkpoint's tensor keys are of three kinds (Megatron-Core 0.16.1):

* **weights**: ShardedTensor keys of the model (``embedding.word_embeddings.weight``,
  ``decoder.layers.self_attention.linear_qkv.weight``, ...). Megatron *prepends axes* to some:
  the transformer block prepends the **layer axis** (``decoder.layers.<rest>``: dim 0 runs over
  every layer of the model, whatever the pipeline split), and a MoE layer's experts the
  **expert axis** (``...mlp.experts.experts.<rest>``: the next dim runs over the global experts;
  SequentialMLP, GroupedMLP and TEGroupedMLP all save this one layout). A model with
  non-homogeneous layers (or ``singleton_local_shards``) saves ``decoder.layers.<L>.<rest>``
  per layer (and ``...experts.experts.<E>.<rest>`` per expert) instead: no axis;
* **per-parameter optimizer state**: ``[chained_<i>.]optimizer.state.<state>.<weight key>``
  with the weight's axes and shape (non-distributed optimizers; the distributed optimizer's
  ``fully_reshardable`` format);
* **distributed-optimizer buckets** (``dp_reshardable``):
  ``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(<param dtype>,
  <grad dtype>).bucket_idx_<k>.<state>``, flat, one per bucket and state.

**Names** (the naming contract, docs/megatron.md): a parameter is a weight key at one index of
its axes, named as the GPTModel names it at TP=1, PP=1, EP=1 with SequentialMLP experts: the
layer axis becomes ``decoder.layers.<global layer>.``, the expert axis
``mlp.experts.local_experts.<global expert>.``; every other key keeps its name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ucformat.format.megatron import EXPERT_AXIS, LAYER_AXIS

__all__ = [
    "LAYER_PREFIX",
    "BucketKey",
    "StateKey",
    "WeightKey",
    "is_weight_key",
    "parse_bucket_key",
    "parse_state_key",
    "parse_weight_key",
]

LAYER_PREFIX = "decoder.layers."
#: Where a SequentialMLP's sharded prefix ``<prefix>experts.`` meets its experts (``prefix`` is
#: the MoE layer's ``mlp.experts.``).
_EXPERTS = "experts.experts."
_STORE_EXPERTS = "experts.local_experts."
_STATE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.([^.]+)\.(.+)$")
_BUCKET = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
    r"dtype_\((.*)\)\.bucket_idx_(\d+)\.([^.]+)$"
)


def is_weight_key(key: str) -> bool:
    """A model key (not optimizer state, not a TE/extra-state object, not the RNG state)."""
    head = key.split(".", 1)[0]
    return (
        not key.startswith("optimizer.")
        and not (head.startswith("chained_") and ".optimizer." in key)
        and "_extra_state" not in key
        and not key.startswith("rng_state")
    )


@dataclass(frozen=True)
class WeightKey:
    """A weight key, its prepended axes and the fixed indices a per-layer key spells out."""

    key: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    #: Layer number / expert id written in the key itself (no axis for it), else None.
    layer: int | None
    expert: int | None
    #: The key with its layer and expert parts cut out: ``head`` + layer part + ``middle`` +
    #: expert part + ``tail``.
    head: str
    middle: str
    tail: str

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The shape of one parameter (the key's shape without its axes)."""
        return self.shape[len(self.axes) :]

    @property
    def has_experts(self) -> bool:
        """Whether the key holds MoE experts (an expert axis, or one expert)."""
        return EXPERT_AXIS in self.axes or self.expert is not None

    def indices(self) -> list[tuple[int, ...]]:
        """Every index on the key's axes, row-major."""
        out: list[tuple[int, ...]] = [()]
        for extent in self.shape[: len(self.axes)]:
            out = [(*index, i) for index in out for i in range(extent)]
        return out

    def at(self, index: tuple[int, ...]) -> tuple[int | None, int | None]:
        """(global layer, global expert) of the parameter at ``index`` on the axes."""
        values = dict(zip(self.axes, index, strict=True))
        return values.get(LAYER_AXIS, self.layer), values.get(EXPERT_AXIS, self.expert)

    def name(self, index: tuple[int, ...]) -> str:
        """The store's name of the parameter at ``index``."""
        layer, expert = self.at(index)
        name = self.head
        if layer is not None:
            name += f"{LAYER_PREFIX}{layer}."
        name += self.middle
        if expert is not None:
            name += f"{_STORE_EXPERTS}{expert}."
        return name + self.tail

    def numel(self) -> int:
        """Elements of one parameter."""
        return math.prod(self.param_shape)


def parse_weight_key(key: str, shape: tuple[int, ...]) -> WeightKey:
    """Split ``key`` into its axes and name parts (see the module docstring)."""
    if not key.startswith(LAYER_PREFIX):
        return WeightKey(key, shape, (), None, None, key, "", "")
    axes: list[str] = []
    layer = expert = None
    rest = key[len(LAYER_PREFIX) :]
    number, dot, after = rest.partition(".")
    if number.isdigit() and dot:
        layer, rest = int(number), after
    else:
        axes.append(LAYER_AXIS)
    at = rest.find(_EXPERTS)
    if at < 0 or (at > 0 and rest[at - 1] != "."):
        return WeightKey(key, shape, tuple(axes), layer, None, "", rest, "")
    middle, after = rest[:at], rest[at + len(_EXPERTS) :]
    number, dot, tail = after.partition(".")
    if number.isdigit() and dot:
        expert = int(number)
    else:
        tail = after
        axes.append(EXPERT_AXIS)
    return WeightKey(key, shape, tuple(axes), layer, expert, "", middle, tail)


@dataclass(frozen=True)
class StateKey:
    """``[chained_<i>.]optimizer.state.<state>.<weight key>``."""

    chained: int | None
    state: str
    weight: str


def parse_state_key(key: str) -> StateKey | None:
    """The parts of a per-parameter optimizer state key, None for any other key."""
    match = _STATE.match(key)
    if match is None:
        return None
    chained, state, weight = match.groups()
    return StateKey(int(chained) if chained is not None else None, state, weight)


@dataclass(frozen=True)
class BucketKey:
    """A ``dp_reshardable`` bucket tensor's key, parsed."""

    chained: int | None
    group: int
    buffer: int
    dtypes: str
    bucket: int
    state: str


def parse_bucket_key(key: str) -> BucketKey | None:
    """The parts of a distributed-optimizer bucket key, None for any other key."""
    match = _BUCKET.match(key)
    if match is None:
        return None
    chained, group, buffer, dtypes, bucket, state = match.groups()
    return BucketKey(
        int(chained) if chained is not None else None,
        int(group),
        int(buffer),
        dtypes,
        int(bucket),
        state,
    )
