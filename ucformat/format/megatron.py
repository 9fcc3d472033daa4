"""Manifest models of a store converted from a Megatron-Core ``torch_dist`` checkpoint.

Optional (absent: the store did not come from Megatron-Core). They record what the arrays alone
do not say and what an exporter or a tensor-parallel loader needs (docs/format.md, "Megatron-Core
sources"):

* per parameter, the checkpoint key it came from, its index on Megatron's prepended layer axis,
  and the boxes each source rank held (Megatron's ShardedTensor global offsets);
* fused parameters as Megatron defines them: ``linear_qkv`` (per query group, the group's query
  heads then one key head then one value head, along dim 0) and SwiGLU ``linear_fc1`` (the gate
  half, then the up half, along dim 0);
* which distributed-optimizer checkpoint format the source used and whether its state is in the
  store.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue

from ucformat.format.base import ManifestModel

__all__ = [
    "MegatronChunk",
    "MegatronFused",
    "MegatronLayout",
    "MegatronParam",
]


class MegatronChunk(ManifestModel):
    """A box of the parameter one source rank wrote (in the parameter's own coordinates)."""

    rank: int = Field(ge=0, description="The rank whose data file holds the box.")
    offsets: list[int]
    sizes: list[int]


class MegatronFused(ManifestModel):
    """How a fused parameter's dim 0 splits into its parts (all at TP=1, the stored shape).

    ``qkv``: ``num_query_groups`` blocks of ``(heads_per_group + 2) * head_dim`` rows, each the
    group's ``heads_per_group`` query heads, then its key head, then its value head (each
    ``head_dim`` rows). ``gate_up``: ``sizes[0]`` rows of the gate projection, then ``sizes[1]``
    rows of the up projection. ``known`` is false when the checkpoint does not say the head
    counts (no training ``args``): the parts are then not recorded and exporters refuse to split.
    """

    kind: Literal["qkv", "gate_up"]
    dim: int = 0
    parts: list[str] = Field(description="Part names in order: ['q', 'k', 'v'] or ['gate', 'up'].")
    known: bool = True
    num_query_groups: int | None = None
    heads_per_group: int | None = None
    head_dim: int | None = None
    sizes: list[int] | None = Field(default=None, description="gate_up: rows of each half.")


class MegatronParam(ManifestModel):
    """Where one stored parameter came from."""

    key: str = Field(description="The ShardedTensor key in the checkpoint.")
    layer: int | None = Field(
        default=None, description="Index on the key's prepended layer axis; None if it has none."
    )
    chunks: list[MegatronChunk] = Field(default_factory=list)
    fused: MegatronFused | None = None


class MegatronLayout(ManifestModel):
    """A Megatron-Core ``dist_checkpointing`` source (``manifest.megatron``)."""

    sharded_backend: str = Field(description="metadata.json's sharded_backend ('torch_dist').")
    sharded_backend_version: int | None = None
    num_layers: int | None = Field(default=None, description="Length of the layer axis.")
    optimizer_sharding: str | None = Field(
        default=None,
        description="The distributed optimizer's checkpoint format "
        "('fully_reshardable', 'dp_reshardable', ...); None if the checkpoint has no optimizer.",
    )
    optimizer_stored: bool = Field(
        description="Whether the store holds the optimizer state (only reshardable formats)."
    )
    optimizer_note: str = Field(default="", description="Why the optimizer state is not stored.")
    model_args: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="The model's shape arguments from the checkpoint's training args "
        "(Megatron-LM names: num_layers, num_attention_heads, num_query_groups, kv_channels, ...).",
    )
    params: dict[str, MegatronParam] = Field(default_factory=dict)

    def describe(self) -> str:
        """One line for ``ucformat inspect``."""
        layers = f"{self.num_layers} layers" if self.num_layers is not None else "no layer axis"
        if self.optimizer_stored:
            optim = f"optimizer {self.optimizer_sharding} (stored)"
        elif self.optimizer_sharding is None:
            optim = "no optimizer state"
        else:
            optim = f"optimizer {self.optimizer_sharding}: model only ({self.optimizer_note})"
        fused = sorted({p.fused.kind for p in self.params.values() if p.fused})
        parts = ", ".join(fused) if fused else "none"
        version = f" v{self.sharded_backend_version}" if self.sharded_backend_version else ""
        return f"{self.sharded_backend}{version}, {layers}, fused {parts}, {optim}"
