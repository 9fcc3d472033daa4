"""Megatron-Core weights as store parameters: one parameter per index of a key's axes.

A weight key's tensor has Megatron's prepended axes (:mod:`.keys`); the store holds one
parameter per index on them (a layer, a layer's expert), of the key's shape without the axes,
named by the naming contract. Each DCP chunk of the key is a box of the global tensor; the chunks
whose axis range holds the index give that parameter's fragments: the runs of their box without
the axis dims, skipping the rows of the other indices the chunk holds
(:func:`subarray`). The same applies to a per-parameter optimizer state key, which has its
weight's axes and shape.

Parameters are ordered as the GPTModel orders them at TP=1: keys before the layer stack, then
layer by layer (within a layer the keys in saving order, a run of expert keys expert by
expert), then the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ucformat.format.megatron import LAYER_AXIS, MegatronChunk
from ucformat.layout.boxes import chunk_runs
from ucformat.sources.base import ArraySource, SourceFragment
from ucformat.sources.dcp_metadata import DcpTensor
from ucformat.sources.megatron.files import MegatronFiles
from ucformat.sources.megatron.keys import WeightKey

__all__ = ["ParamSlot", "chunk_boxes", "order_params", "subarray"]


@dataclass(frozen=True)
class ParamSlot:
    """One store parameter: its name, the weight key and the index on the key's axes."""

    name: str
    weight: WeightKey
    index: tuple[int, ...]

    @property
    def layer(self) -> int | None:
        """The global layer number."""
        return self.weight.at(self.index)[0]

    @property
    def expert(self) -> int | None:
        """The global expert id."""
        return self.weight.at(self.index)[1]


def _holds(offsets: Iterable[int], sizes: Iterable[int], index: tuple[int, ...]) -> bool:
    return all(o <= i < o + s for i, o, s in zip(index, offsets, sizes, strict=False))


def subarray(files: MegatronFiles, key: str, index: tuple[int, ...]) -> ArraySource:
    """Entry ``key`` at ``index`` on its first ``len(index)`` dims, as an array of fragments."""
    entry = files.tensor(key)
    depth = len(index)
    inner = entry.shape[depth:]
    array = ArraySource(inner, entry.dtype)
    for chunk in entry.chunks:
        if not _holds(chunk.offsets, chunk.sizes, index):
            continue
        rows = [i - o for i, o in zip(index, chunk.offsets, strict=False)]
        skip = sum(r * math.prod(chunk.sizes[d + 1 :]) for d, r in enumerate(rows))
        runs = chunk_runs(inner, chunk.offsets[depth:], chunk.sizes[depth:])
        if not runs:
            continue
        tensor = files.items.chunk_tensor(key, entry, chunk)
        array.fragments.extend(
            SourceFragment(tensor, skip + run.chunk_start, run.start, run.length) for run in runs
        )
    return array


def chunk_boxes(
    files: MegatronFiles, entry: DcpTensor, key: str, index: tuple[int, ...]
) -> list[MegatronChunk]:
    """The boxes of the parameter at ``index`` each rank wrote, in the parameter's coordinates."""
    depth = len(index)
    boxes = [
        MegatronChunk(
            rank=files.writer(key, chunk),
            offsets=list(chunk.offsets[depth:]),
            sizes=list(chunk.sizes[depth:]),
        )
        for chunk in entry.chunks
        if _holds(chunk.offsets, chunk.sizes, index)
    ]
    return sorted(boxes, key=lambda b: (b.rank, b.offsets))


def order_params(weights: list[WeightKey]) -> list[ParamSlot]:
    """Every parameter of ``weights`` (saving order), in the TP=1 module order."""
    stacked = [w for w in weights if w.axes or w.layer is not None]
    first = weights.index(stacked[0]) if stacked else len(weights)
    position = {w.key: i for i, w in enumerate(weights)}
    slots: list[tuple[tuple[int, ...], ParamSlot]] = []
    for weight in weights:
        for index in weight.indices():
            layer, expert = weight.at(index)
            order: tuple[int, ...]
            if layer is None:
                order = (0 if position[weight.key] < first else 2, position[weight.key])
            elif expert is None:
                order = (1, layer, position[weight.key], 0, 0)
            else:  # a run of expert keys, expert by expert, at its first key's place
                block = _expert_block(weights, weight)
                order = (1, layer, position[block], expert, position[weight.key])
            slots.append((order, ParamSlot(weight.name(index), weight, index)))
    slots.sort(key=lambda item: item[0])
    return [slot for _, slot in slots]


def _expert_block(weights: list[WeightKey], weight: WeightKey) -> str:
    """The first key of the run of consecutive expert keys ``weight`` is in."""
    at = weights.index(weight)
    while (
        at > 0
        and weights[at - 1].has_experts
        and weights[at - 1].layer == weight.layer
        and ((LAYER_AXIS in weights[at - 1].axes) == (LAYER_AXIS in weight.axes))
    ):
        at -= 1
    return weights[at].key
