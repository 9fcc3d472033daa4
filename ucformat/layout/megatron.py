"""Megatron-Core's parallel layout of a GPT checkpoint: which rank holds which box (pure).

A Megatron-Core ``torch_dist`` checkpoint stores each ShardedTensor key as one global tensor,
written box by box by the ranks that held it. These are Megatron-Core 0.16's rules, decided by
the key's module and parameter names (the last two components):

* **tensor parallel** (TP, degree ``T``): column-parallel weights split dim 0 (``linear_qkv``,
  ``linear_fc1``, the vocabulary of ``word_embeddings`` and ``output_layer``), row-parallel
  ones dim 1 (``linear_proj``, ``linear_fc2``); a column-parallel layer's bias splits with its
  output, a row-parallel layer's bias is whole; norms, routers and anything not listed are whole
  on every TP rank. A SwiGLU ``linear_fc1`` (gate rows, then up rows) splits each half on its
  own, so TP rank ``r`` holds its slice of the gate and its slice of the up projection.
  Megatron splits evenly: a split dim not divisible by ``T`` cannot be built at that ``T``;
* **pipeline parallel** (PP, ``P`` stages, ``V`` virtual stages each): the layers in ``P * V``
  model chunks of consecutive layers, ``L / (P * V)`` each, chunk ``c`` on pipeline rank
  ``c % P`` (interleaved); or Megatron's uneven stages (a given count on the first and/or the
  last stage, the rest evenly over the others); the embedding is on the first stage, the final
  norm and the output layer on the last;
* **expert parallel** (EP, ``E`` ranks): global expert ``x`` of ``X`` is on EP rank
  ``x // (X / E)``; the experts' own tensor parallelism ``ETP`` splits them as TP splits the
  dense layers (Megatron's default ``expert_tensor_parallel_size`` is ``T``);
* **ranks**: the world is the fewest ranks both grids fit, ``lcm(T, ETP * E) * P``; a dense
  position is ``rank = tp + T * (dp + D * pp)`` (Megatron's default order, TP fastest), an
  expert position ``rank = etp + ETP * (ep + E * (edp + EDP * pp))``. Of the ranks holding a
  box, the one with (expert) data-parallel rank 0 writes it, as Megatron's main replica does.

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ucformat.errors import UnsupportedExportError

__all__ = [
    "COLUMN_PARALLEL",
    "ROW_PARALLEL",
    "Box",
    "MegatronGrid",
    "expert_rank",
    "layer_stage",
    "split_dim",
    "stage_layers",
    "tp_boxes",
]

#: Modules whose weight (and bias) is split on dim 0 across TP ranks.
COLUMN_PARALLEL = frozenset({"linear_qkv", "linear_fc1", "word_embeddings", "output_layer"})
#: Modules whose weight is split on dim 1 (their bias is whole).
ROW_PARALLEL = frozenset({"linear_proj", "linear_fc2"})
#: Non-layer modules kept on the last pipeline stage (the rest: the first).
LAST_STAGE = ("decoder.final_layernorm.", "final_layernorm.", "output_layer.")


@dataclass(frozen=True)
class Box:
    """The part ``offsets``/``sizes`` of a parameter that TP rank ``tp_rank`` holds."""

    tp_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class MegatronGrid:
    """A Megatron job's parallel degrees: ``tp`` x ``pp`` x ``ep`` (the experts' own tensor
    parallelism ``etp``: None for the dense ``tp``, Megatron's default)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        flags = (("--tp", self.tp), ("--pp", self.pp), ("--ep", self.ep), ("--etp", self.etp))
        for flag, value in flags:
            if value is not None and value < 1:
                raise UnsupportedExportError(f"{flag} must be at least 1, got {value}.")

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel degree."""
        return self.etp or self.tp

    @property
    def world_size(self) -> int:
        """The fewest ranks that hold both grids: ``lcm(tp, etp * ep) * pp``."""
        return math.lcm(self.tp, self.expert_tp * self.ep) * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks of the dense part."""
        return self.world_size // (self.tp * self.pp)

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
        """The global rank of a dense position (TP fastest, then data parallel, then PP)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def expert_rank(self, etp_rank: int, ep_rank: int, pp_rank: int) -> int:
        """The global rank of an expert position with expert-data-parallel rank 0 (expert TP
        fastest, then EP, then expert data parallel, then PP)."""
        return etp_rank + self.expert_tp * ep_rank + self.world_size // self.pp * pp_rank


def split_dim(key: str) -> int | None:
    """The dim ``key``'s tensor is split on across TP ranks, or None (whole on every rank)."""
    parts = key.split(".")
    if len(parts) < 2:
        return None
    module, leaf = parts[-2], parts[-1]
    if module in COLUMN_PARALLEL and leaf in ("weight", "bias"):
        return 0
    if module in ROW_PARALLEL and leaf == "weight":
        return 1
    return None


def tp_boxes(
    name: str,
    shape: tuple[int, ...],
    dim: int | None,
    tp: int,
    halves: tuple[int, ...] = (),
) -> list[Box]:
    """The box each TP rank holds of a parameter of ``shape`` split on ``dim``.

    ``halves``: the row counts of the parts of a fused dim 0 that Megatron splits one by one
    (SwiGLU ``linear_fc1``: gate, up); a rank then holds one box per part, at any ``tp``
    (Megatron's SwiGLU factory writes the halves apart even at TP=1). A whole parameter
    (``dim`` None) is one box of TP rank 0.

    Raises:
        UnsupportedExportError: the split dim (or a part) is not divisible by ``tp``.
    """
    full = tuple(0 for _ in shape)
    if dim is None or (tp == 1 and not halves):
        return [Box(0, full, shape)]
    if dim >= len(shape):
        raise UnsupportedExportError(
            f"'{name}' has shape {list(shape)}; Megatron splits it on dim {dim} across TP ranks."
        )
    parts = halves if dim == 0 and halves else (shape[dim],)
    if sum(parts) != shape[dim]:
        raise UnsupportedExportError(
            f"'{name}': parts of {list(parts)} rows do not add up to dim 0 of {list(shape)}."
        )
    for part in parts:
        if part % tp:
            raise UnsupportedExportError(
                f"'{name}': dim {dim} ({'part of ' if len(parts) > 1 else ''}{part}) is not "
                f"divisible by --tp {tp}; Megatron-Core splits it evenly across TP ranks."
            )
    boxes = []
    for rank in range(tp):
        start = 0
        for part in parts:
            width = part // tp
            offsets = tuple(start + rank * width if d == dim else 0 for d in range(len(shape)))
            sizes = tuple(width if d == dim else shape[d] for d in range(len(shape)))
            boxes.append(Box(rank, offsets, sizes))
            start += part
    return boxes


def stage_layers(
    num_layers: int,
    pp: int,
    first: int | None = None,
    last: int | None = None,
    vpp: int = 1,
) -> list[int]:
    """Layers per model chunk, in layer order: ``pp * vpp`` chunks, chunk ``c`` on pipeline
    rank ``c % pp`` (Megatron's interleaved virtual stages); ``first`` layers on the first chunk
    and ``last`` on the last when given (Megatron's uneven stages, without virtual stages), the
    rest split evenly over the other chunks.

    Raises:
        UnsupportedExportError: the layers do not split so.
    """
    chunks = pp * vpp
    ends = (first is not None) + (last is not None)
    if ends and vpp > 1:
        raise UnsupportedExportError(
            "uneven first/last pipeline stages with virtual stages are not written; give one "
            "of them."
        )
    rest = num_layers - (first or 0) - (last or 0)
    middle = chunks - ends
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        given = f" with {first} on the first and {last} on the last stage" if ends else ""
        virtual = f" x {vpp} virtual stages" if vpp > 1 else ""
        raise UnsupportedExportError(
            f"{num_layers} layers do not split evenly into --pp {pp}{virtual} stages{given}; "
            "choose stages that divide them, or give the first/last stage's layer counts."
        )
    even = rest // middle if middle else 0
    sizes = [even] * chunks
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def layer_stage(layer: int | None, key: str, sizes: list[int], pp: int) -> int:
    """The pipeline rank holding ``key`` (of transformer layer ``layer``, or a non-layer key),
    the model chunks holding ``sizes`` layers each (:func:`stage_layers`)."""
    if layer is None:
        return pp - 1 if key.startswith(LAST_STAGE) else 0
    start = 0
    for chunk, count in enumerate(sizes):
        if layer < start + count:
            return chunk % pp
        start += count
    raise UnsupportedExportError(f"{key}: layer {layer} is past the {start} layers of the stages.")


def expert_rank(expert: int, num_experts: int, ep: int) -> int:
    """The EP rank holding global expert ``expert`` of ``num_experts``.

    Raises:
        UnsupportedExportError: ``num_experts`` is not divisible by ``ep``.
    """
    if num_experts % ep:
        raise UnsupportedExportError(
            f"{num_experts} experts do not split evenly into --ep {ep} ranks; choose an --ep "
            "that divides the expert count."
        )
    return expert // (num_experts // ep)
