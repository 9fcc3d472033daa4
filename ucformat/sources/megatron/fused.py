"""Megatron's fused weights, described from the training args: ``linear_qkv`` and SwiGLU ``fc1``.

Megatron stores ``self_attention.linear_qkv`` at its TP=1 layout: per query group, the group's
query heads, then its key head, then its value head along dim 0; and a SwiGLU ``linear_fc1``
(dense MLP, shared experts, every expert) as the whole gate projection, then the whole up
projection. The head counts come from Megatron-LM's ``args``; without them ``linear_qkv`` is
recorded as fused but not splittable (``known`` false), and ``fc1`` is gated when it has twice
the rows of its ``fc2``'s columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucformat.errors import LayoutMismatchError
from ucformat.format.megatron import MegatronFused

__all__ = ["describe_fused"]

_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_FC1 = ("linear_fc1.weight", "linear_fc1.bias")


def describe_fused(
    name: str,
    shape: tuple[int, ...],
    args: Mapping[str, Any],
    fc2_columns: int | None,
    where: str,
) -> MegatronFused | None:
    """The fused layout of parameter ``name`` (store name) of ``shape``, None if not fused.

    Args:
        fc2_columns: the columns of the ``linear_fc2.weight`` beside a ``linear_fc1``, if any.
        where: the checkpoint, for messages.

    Raises:
        LayoutMismatchError: the args' head counts do not fit the ``linear_qkv`` rows, or a
            gated ``fc1`` has an odd number of rows.
    """
    if name.endswith(_QKV):
        return _qkv(name, shape, args, where)
    if not name.endswith(_FC1):
        return None
    swiglu = args.get("swiglu")
    gated = (
        swiglu if swiglu is not None else (fc2_columns is not None and shape[0] == 2 * fc2_columns)
    )
    if not gated:
        return None
    if shape[0] % 2:
        raise LayoutMismatchError(f"{where}: SwiGLU '{name}' has {shape[0]} rows, not gate + up.")
    half = shape[0] // 2
    return MegatronFused(kind="gate_up", parts=["gate", "up"], sizes=[half, half])


def _qkv(name: str, shape: tuple[int, ...], args: Mapping[str, Any], where: str) -> MegatronFused:
    heads = args.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        return MegatronFused(kind="qkv", parts=["q", "k", "v"], known=False)
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    groups = groups if isinstance(groups, int) and groups > 0 else heads
    head_dim = args.get("kv_channels") or args.get("hidden_size", 0) // heads
    if heads % groups or groups * (heads // groups + 2) * head_dim != shape[0]:
        raise LayoutMismatchError(
            f"{where}: '{name}' has {shape[0]} rows; the training args ({heads} heads, {groups} "
            f"query groups, head size {head_dim}) call for "
            f"{groups * (heads // max(groups, 1) + 2) * head_dim}."
        )
    return MegatronFused(
        kind="qkv",
        parts=["q", "k", "v"],
        num_query_groups=groups,
        heads_per_group=heads // groups,
        head_dim=head_dim,
    )
