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

__all__ = ["other_stage_names"]


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
