"""Manifest models of a pipeline-parallel source: how its layers were cut into stages.

A DeepSpeed ``PipelineModule`` checkpoint is converted into one store whose parameter names do
not depend on the pipeline (docs/format.md, "Pipeline-parallel sources"); these models only
record where the state came from, so a reader can report it and a loader can tell which stage
held what. They are referenced from :class:`ucformat.format.models.SourceInfo` by its optional
``pipeline`` field (absent: not a pipeline source).
"""

from __future__ import annotations

from pydantic import Field

from ucformat.format.base import ManifestModel

__all__ = ["PipelineLayout", "PipelineStage"]


class PipelineStage(ManifestModel):
    """What one pipeline stage held."""

    layers: list[int] = Field(
        description="Indices of the layers with state (parameters or buffers) on this stage, "
        "ascending; layers without state (functions) are not listed."
    )
    tied: list[str] = Field(
        default_factory=list, description="Keys of the tied modules (TiedLayerSpec) it held."
    )


class PipelineLayout(ManifestModel):
    """The pipeline a store's state was trained with."""

    stages: list[PipelineStage] = Field(min_length=1, description="One entry per stage.")
    data_parallel: int = Field(ge=1, description="Data-parallel replicas of each stage.")
    partition_method: str | None = Field(
        default=None,
        description="PipelineModule partition_method ('parameters', 'uniform', 'type:...'); "
        "None when the checkpoint does not record it (DeepSpeed's files do not).",
    )

    @property
    def num_stages(self) -> int:
        """Pipeline-parallel degree."""
        return len(self.stages)

    def describe(self) -> str:
        """One line for ``inspect``, e.g. ``2 stages x dp 1: [0-1], [3-5] + tied embed``.

        >>> PipelineLayout(stages=[PipelineStage(layers=[0, 1]), PipelineStage(layers=[3, 4, 5],
        ...     tied=["embed"])], data_parallel=1).describe()
        '2 stages x dp 1; layers per stage: [0-1], [3-5] + tied embed'
        """
        parts = []
        for stage in self.stages:
            layers = stage.layers
            text = f"[{layers[0]}-{layers[-1]}]" if len(layers) > 1 else str(layers or "[]")
            if layers and layers != list(range(layers[0], layers[-1] + 1)):
                text = "[" + ",".join(map(str, layers)) + "]"
            parts.append(text + (" + tied " + ",".join(stage.tied) if stage.tied else ""))
        method = f", partition {self.partition_method}" if self.partition_method else ""
        return (
            f"{self.num_stages} stages x dp {self.data_parallel}{method}; layers per stage: "
            + ", ".join(parts)
        )
