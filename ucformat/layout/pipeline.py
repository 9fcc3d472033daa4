"""Pure naming and stage math of DeepSpeed ``PipelineModule`` parameters.

A ``PipelineModule`` registers layer ``i``'s module under the name ``str(i)`` and every tied
module (``TiedLayerSpec``) once under ``tied_modules.<key>``, on every stage that uses it. So a
parameter's name in a stage's module, ``"<i>.<local name>"`` or ``"tied_modules.<key>.<local
name>"``, is the same whatever the number of stages: the layer index plus the layer's own name.
ucformat keeps these names as the stored fqns. This module splits them and derives, from the
names each stage holds, which layers and tied keys it owned. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["TIED_PREFIX", "PipelineName", "layer_file_name", "parse_pipeline_name", "stage_owners"]

#: Prefix of a tied module's parameters in a ``PipelineModule``.
TIED_PREFIX = "tied_modules."


@dataclass(frozen=True)
class PipelineName:
    """A parsed pipeline fqn: ``layer`` (None for a tied module) or ``tied_key``, and ``local``
    (the name inside the layer's own module)."""

    layer: int | None
    tied_key: str | None
    local: str


def parse_pipeline_name(fqn: str) -> PipelineName | None:
    """Split ``fqn``; None if it is neither ``<int>.<name>`` nor ``tied_modules.<key>.<name>``.

    >>> parse_pipeline_name("3.weight")
    PipelineName(layer=3, tied_key=None, local='weight')
    >>> parse_pipeline_name("tied_modules.embed.weight").tied_key
    'embed'
    """
    if fqn.startswith(TIED_PREFIX):
        key, dot, local = fqn[len(TIED_PREFIX) :].partition(".")
        return PipelineName(None, key, local) if key and dot and local else None
    head, dot, local = fqn.partition(".")
    if not (dot and local and head.isdigit()):
        return None
    return PipelineName(int(head), None, local)


def layer_file_name(layer: int) -> str:
    """The file DeepSpeed writes for ``layer``'s module (no tensor parallelism)."""
    return f"layer_{layer:02d}-model_states.pt"


def stage_owners(stage_names: Sequence[Iterable[str]]) -> tuple[list[list[int]], list[list[str]]]:
    """Per stage: the sorted layer indices and the sorted tied keys its names mention.

    >>> stage_owners([["tied_modules.e.w", "1.w"], ["3.w", "3.b", "tied_modules.e.w"]])
    ([[1], [3]], [['e'], ['e']])
    """
    layers: list[list[int]] = []
    tied: list[list[str]] = []
    for names in stage_names:
        found_layers: set[int] = set()
        found_tied: set[str] = set()
        for name in names:
            parsed = parse_pipeline_name(name)
            if parsed is None:
                continue
            if parsed.layer is not None:
                found_layers.add(parsed.layer)
            elif parsed.tied_key is not None:
                found_tied.add(parsed.tied_key)
        layers.append(sorted(found_layers))
        tied.append(sorted(found_tied))
    return layers, tied
