"""Manifest models of a store converted from a Megatron-Core ``torch_dist`` checkpoint.

Optional (absent: the store did not come from Megatron-Core). They record what the arrays alone
do not say and what an exporter or a tensor-parallel loader needs (docs/format.md, "Megatron-Core
sources"):

* per parameter, the checkpoint key it came from, the axes Megatron prepends to that key (the
  layer axis, the expert axis) and the parameter's indices on them (global layer number, global
  expert id), whether the expert optimizer held it, and the boxes each source rank wrote
  (Megatron's ShardedTensor global offsets);
* fused parameters as Megatron defines them: ``linear_qkv`` (per query group, the group's query
  heads then one key head then one value head, along dim 0) and SwiGLU ``linear_fc1`` (the gate
  half, then the up half, along dim 0);
* the parallel layout the source ran with (format 3.1), which optimizers Megatron chained
  (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) and the
  distributed optimizer's checkpoint format, and whether the optimizer state is in the store.

Store names follow one contract whatever the saving layout (docs/megatron.md, "Names"): the
checkpoint key with its layer axis as ``decoder.layers.<global layer>.`` and its expert axis as
``mlp.experts.local_experts.<global expert>.``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue

from ucformat.format.base import ManifestModel

__all__ = [
    "EXPERT_AXIS",
    "LAYER_AXIS",
    "MegatronChunk",
    "MegatronFused",
    "MegatronLayout",
    "MegatronParallel",
    "MegatronParam",
]

#: Names of the axes Megatron prepends to a ShardedTensor key (``MegatronParam.axes``).
LAYER_AXIS = "layer"
EXPERT_AXIS = "expert"


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
        default=None,
        description="Global layer number (0-based): the index on the key's layer axis, or the "
        "number in a per-layer key (decoder.layers.<L>.*); None outside the layer stack.",
    )
    axes: list[Literal["layer", "expert"]] = Field(
        default_factory=list,
        exclude_if=lambda value: not value,
        description="(3.1) The axes Megatron prepends to the key, in order; the parameter is the "
        "key's tensor at index (layer, expert) on them. Absent: 'layer' if layer is set, else "
        "none (format 3.0 stores).",
    )
    expert: int | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="(3.1) Global expert id of an MoE expert's parameter.",
    )
    expert_parallel: bool = Field(
        default=False,
        exclude_if=lambda value: not value,
        description="(3.1) Held by the expert-parallel optimizer and buffers (Megatron's "
        "allreduce=False parameters: the experts).",
    )
    chunks: list[MegatronChunk] = Field(default_factory=list)
    fused: MegatronFused | None = None


class MegatronParallel(ManifestModel):
    """(3.1) The parallel layout a Megatron-Core source was saved at."""

    tensor: int = Field(ge=1, description="Tensor-parallel size.")
    pipeline: int = Field(ge=1, description="Pipeline-parallel size.")
    virtual_pipeline: int = Field(
        default=1, ge=1, description="Model chunks per pipeline rank (interleaved schedule)."
    )
    expert: int = Field(default=1, ge=1, description="Expert-parallel size.")
    expert_tensor: int = Field(default=1, ge=1, description="Expert tensor-parallel size.")
    data: int | None = Field(default=None, ge=1, description="Data-parallel size, if known.")
    pipeline_layers: list[list[list[int]]] | None = Field(
        default=None,
        description="Per pipeline rank, its model chunks in order, each [first global layer, "
        "layer count]; None where the checkpoint does not show it (only the dp_reshardable "
        "buckets prove which rank held which layers).",
    )


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
    optimizers: list[str] = Field(
        default_factory=list,
        exclude_if=lambda value: not value,
        description="(3.1) The optimizers Megatron chained, in order (ChainedOptimizer's "
        "chained_optimizers): 'FP32Optimizer', 'Float16OptimizerWithFloat16Params' or "
        "'DistributedOptimizer'; the second of an MoE model holds the expert parameters.",
    )
    chained_prefix: bool = Field(
        default=False,
        exclude_if=lambda value: not value,
        description="(3.1) Whether the optimizer's keys carry 'chained_<i>.' prefixes.",
    )
    parallel: MegatronParallel | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="(3.1) The parallel layout the source was saved at.",
    )
    num_experts: int | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="(3.1) Experts per MoE layer; None for a dense model.",
    )
    model_args: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="The model's shape arguments from the checkpoint's training args "
        "(Megatron-LM names: num_layers, num_attention_heads, num_query_groups, kv_channels, ...).",
    )
    params: dict[str, MegatronParam] = Field(default_factory=dict)

    def has_minor_3_1_members(self) -> bool:
        """Whether this section holds a member format 3.1 added (the store is then 3.1)."""
        return bool(
            self.optimizers
            or self.chained_prefix
            or self.parallel is not None
            or self.num_experts is not None
            or any(
                p.axes or p.expert is not None or p.expert_parallel for p in self.params.values()
            )
        )

    def describe(self) -> str:
        """One line for ``ucformat inspect``."""
        layers = f"{self.num_layers} layers" if self.num_layers is not None else "no layer axis"
        kinds = "+".join(dict.fromkeys(self.optimizers))
        what = " ".join(part for part in (kinds, self.optimizer_sharding) if part)
        if self.optimizer_stored:
            optim = f"optimizer {what} (stored)"
        elif not what:
            optim = "no optimizer state"
        else:
            optim = f"optimizer {what}: model only ({self.optimizer_note})"
        fused = sorted({p.fused.kind for p in self.params.values() if p.fused})
        parts = ", ".join(fused) if fused else "none"
        version = f" v{self.sharded_backend_version}" if self.sharded_backend_version else ""
        experts = f", {self.num_experts} experts" if self.num_experts else ""
        parallel = ""
        if self.parallel is not None:
            p = self.parallel
            parallel = f", saved at tp{p.tensor} pp{p.pipeline}"
            parallel += f" vpp{p.virtual_pipeline}" if p.virtual_pipeline > 1 else ""
            if self.num_experts:
                parallel += f" ep{p.expert} etp{p.expert_tensor}"
            parallel += f" dp{p.data}" if p.data else ""
        return (
            f"{self.sharded_backend}{version}, {layers}{experts}, fused {parts}{parallel}, {optim}"
        )
