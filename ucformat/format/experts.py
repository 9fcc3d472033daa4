"""Manifest models of expert-parallel (MoE) checkpoints: which parameters are experts.

Each expert parameter is stored as its own parameter entry under its *global* name (the name it
has in a model with ``ep_size`` 1, e.g.
``moe1.deepspeed_moe.experts.deepspeed_experts.3.up.weight``).
:class:`ExpertLayout` groups them by MoE layer, so tools can show and reshard them as one
``layer x experts x shape`` block, and records the expert-parallel layout the source ran with.
"""

from __future__ import annotations

from pydantic import Field

from ucformat.format.base import ManifestModel

__all__ = ["ExpertLayer", "ExpertLayout"]


class ExpertLayer(ManifestModel):
    """One MoE layer: ``num_experts`` experts, each with the same parameters ``params``."""

    layer: int = Field(ge=0, description="MoE layer index (DeepSpeed's layer_{L}_expert_* files).")
    prefix: str = Field(description="Name prefix before the global expert id.")
    num_experts: int = Field(ge=1)
    params: list[str] = Field(description="Per-expert parameter names after '<prefix>.<id>.'.")
    gate: str | None = Field(default=None, description="The layer's router weight, if stored.")


class ExpertLayout(ManifestModel):
    """The expert-parallel layout of the source and its MoE layers."""

    kind: str = Field(default="deepspeed-moe", description="Only 'deepspeed-moe' so far.")
    ep_size: int = Field(ge=1, description="Expert-parallel size the source ran with.")
    expert_group: str = Field(description="DeepSpeed expert group name, e.g. 'ep_size_2'.")
    data_before_expert: bool = Field(
        default=False, description="DeepSpeed's use_data_before_expert_parallelism rank order."
    )
    layers: list[ExpertLayer]

    def param_names(self) -> list[str]:
        """Every expert parameter's stored (global) name."""
        return [
            f"{layer.prefix}.{e}.{p}"
            for layer in self.layers
            for e in range(layer.num_experts)
            for p in layer.params
        ]
