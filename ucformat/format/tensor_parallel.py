"""The manifest's tensor-parallel description: how the source split each parameter over its
tensor-parallel ranks (docs/format.md, "Tensor-parallel layout").

Arrays always hold a parameter's full logical shape; this section only records where each
source rank's shard came from, so that a reader (ours or anyone's) can rebuild a rank's shard
at the source's layout, and so that ``inspect`` can say what the source was. The normative part
is ``shards``: per rank, the shard shape and its pieces, each a block addressed by offset and
strides in the logical tensor (``source``) and in the shard (``dest``), as DeepSpeed's affine
map describes them. ``kind``, ``dim``, ``widths`` and ``sub_params`` summarise the same geometry
in words when it is a plain split, and the writer checks that the two agree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ucformat.format.base import ManifestModel

__all__ = ["AffinePiece", "ParamSplit", "RankShard", "SubParam", "TensorParallelInfo"]


class AffinePiece(ManifestModel):
    """A block of elements: ``shard.as_strided(shape, dest_strides, dest_offset)`` equals
    ``logical.as_strided(shape, source_strides, source_offset)`` (both row-major, offsets and
    strides in elements)."""

    shape: list[int]
    source_offset: int = Field(ge=0)
    source_strides: list[int]
    dest_offset: int = Field(ge=0)
    dest_strides: list[int]


class RankShard(ManifestModel):
    """What one tensor-parallel rank held of a parameter."""

    shard_shape: list[int] = Field(description="Shape of the tensor the rank held.")
    pieces: list[AffinePiece] = Field(
        description="Blocks of the logical tensor that tile the shard exactly once."
    )


class SubParam(ManifestModel):
    """One sub-parameter of a fused parameter (e.g. q, k, v of a fused QKV), along ``dim``."""

    size: int = Field(ge=0, description="Its extent along the split dim in the logical tensor.")
    widths: list[int] = Field(description="Per tensor-parallel rank: its extent in that shard.")


class ParamSplit(ManifestModel):
    """How one parameter was spread over the tensor-parallel ranks.

    ``replicated``: every rank held the whole tensor (checked equal at convert time).
    ``split``: rank ``r`` held, for each sub-parameter in order, ``widths[r]`` consecutive
    indices of ``dim`` starting after the lower ranks' widths of that sub-parameter,
    concatenated on ``dim`` (one sub-parameter: a plain contiguous split).
    ``affine``: no such summary applies; only ``shards`` describes the layout.
    """

    kind: Literal["replicated", "split", "affine"]
    logical_shape: list[int] = Field(description="The parameter's full shape (its arrays').")
    dim: int | None = Field(default=None, ge=0, description="The split dim ('split' only).")
    widths: list[int] | None = Field(
        default=None, description="Per rank: the shard's extent along dim ('split' only)."
    )
    sub_params: list[SubParam] | None = Field(
        default=None, description="Fused sub-parameters along dim, in order ('split' only)."
    )
    vocab_size: int | None = Field(
        default=None, description="Vocabulary parameters: the original vocabulary size."
    )
    padded_vocab_size: int | None = Field(
        default=None, description="Vocabulary parameters: the rows the shards held in all."
    )
    shards: list[RankShard] = Field(description="Per tensor-parallel rank, in rank order.")


class TensorParallelInfo(ManifestModel):
    """The source's tensor-parallel layout (absent: no tensor parallelism)."""

    framework: Literal["deepspeed-autotp", "deepspeed-patterns"] = Field(
        description="What split the parameters: 'deepspeed-autotp' (DeepSpeed AutoTP), "
        "'deepspeed-patterns' (a DeepSpeed PipelineModule whose universal_checkpoint_info "
        "lists replicated and row-parallel parameters by name pattern)."
    )
    degree: int = Field(ge=1, description="Tensor-parallel ranks of the source.")
    params: dict[str, ParamSplit] = Field(
        description="fqn -> split, for every parameter of the store (tied owners only)."
    )

    @model_validator(mode="after")
    def _check_ranks(self) -> TensorParallelInfo:
        for name, split in self.params.items():
            if len(split.shards) != self.degree:
                raise ValueError(
                    f"tensor_parallel.params[{name!r}] has {len(split.shards)} shards, "
                    f"expected degree {self.degree}"
                )
            if split.widths is not None and len(split.widths) != self.degree:
                raise ValueError(f"tensor_parallel.params[{name!r}].widths: one per rank")
        return self
