"""Which stored parameters a ``PipelineEngine`` stage holds, and which belong to other stages.

A store converted from a pipeline (or from a plain model with the same names) holds every
layer's parameters under ``<layer>.<local name>`` and ``tied_modules.<key>.<local name>``
(:mod:`ucformat.layout.pipeline`). A stage of a ``PipelineModule`` at any number of stages
builds layers ``[_local_start, _local_stop)`` and the tied modules those layers use; the
loader compares and reads only those names, so each stage reads only its own layers' ranges
and the others' names are neither missing nor unexpected. A plain module holds everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ucformat.layout.pipeline import parse_pipeline_name

__all__ = ["other_stage_names", "tied_store_names"]


def other_stage_names(module: Any, stored: Iterable[str]) -> set[str]:
    """The names of ``stored`` that another stage of ``module``'s pipeline holds.

    Empty unless ``module`` is a ``PipelineModule`` cut into more than one stage. A name of a
    layer outside the pipeline, or of a tied key no layer uses, is not another stage's: the
    loader reports it as not in the model.
    """
    specs = getattr(module, "_layer_specs", None)
    start, stop = getattr(module, "_local_start", None), getattr(module, "_local_stop", None)
    if specs is None or start is None or stop is None:
        return set()
    local_tied = set(getattr(module, "tied_modules", {}) or {})
    all_tied = {spec.key for spec in specs if type(spec).__name__ == "TiedLayerSpec"}
    others: set[str] = set()
    for name in stored:
        parsed = parse_pipeline_name(name)
        if parsed is None:
            continue
        if parsed.layer is not None:
            if 0 <= parsed.layer < len(specs) and not start <= parsed.layer < stop:
                others.add(name)
        elif parsed.tied_key in all_tied and parsed.tied_key not in local_tied:
            others.add(name)
    return others


def tied_store_names(module: Any, stored: Iterable[str]) -> dict[str, str]:
    """``{engine name: stored name}`` for tied parameters a store keeps under a layer's name.

    A ZeRO-0 pipeline checkpoint never saves a tied module's key, so its store names the tied
    parameters after the layer of the module's first use (``"0.weight"``, :mod:`ucformat.
    sources.deepspeed.pipeline_zero0`). A ``PipelineModule`` names them
    ``tied_modules.<key>.<local>``: each such name the store lacks maps to
    ``"<first index of key>.<local>"`` where the store has that. Empty for other modules.
    """
    specs = getattr(module, "_layer_specs", None)
    if specs is None:
        return {}
    names = set(stored)
    first: dict[str, int] = {}
    for index, spec in enumerate(specs):
        if type(spec).__name__ == "TiedLayerSpec":
            first.setdefault(spec.key, index)
    renames: dict[str, str] = {}
    for name, _ in module.named_parameters():
        parsed = parse_pipeline_name(name)
        if parsed is None or parsed.tied_key not in first or name in names:
            continue
        layer_name = f"{first[parsed.tied_key]}.{parsed.local}"
        if layer_name in names:
            renames[name] = layer_name
    return renames
