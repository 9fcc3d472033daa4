"""``ucformat inspect`` for MoE stores: experts shown as groups, not one row per expert.

A store from an MoE run holds every expert parameter under its own global name (hundreds of
rows for a real model). :func:`group_experts` folds the rows of one (MoE layer, per-expert
parameter) into one row ``<prefix>.[0-N].<param>`` of shape ``experts x shape``, when all its
experts agree on shape, dtype, group and states (otherwise they stay as they are). Pure: no
tensor data is read.
"""

from __future__ import annotations

from dataclasses import replace

from ucformat.format.models import CheckpointManifest
from ucformat.format.summary import ParamRow, StoreSummary

__all__ = ["group_experts"]


def group_experts(summary: StoreSummary, manifest: CheckpointManifest) -> StoreSummary:
    """``summary`` with each MoE layer's expert rows folded into one row per parameter."""
    layout = manifest.experts
    if layout is None:
        return summary
    rows = {row.name: row for row in summary.params}
    folded: dict[str, ParamRow] = {}  # first member name -> its group row
    members: set[str] = set()
    for layer in layout.layers:
        for param in layer.params:
            names = [f"{layer.prefix}.{e}.{param}" for e in range(layer.num_experts)]
            group = [rows[n] for n in names if n in rows]
            if len(group) != len(names) or not _alike(group):
                continue
            first = group[0]
            folded[names[0]] = replace(
                first,
                name=f"{layer.prefix}.[0-{layer.num_experts - 1}].{param}",
                shape=(layer.num_experts, *first.shape),
                nbytes=sum(row.nbytes for row in group),
            )
            members.update(names)
    params = tuple(
        folded.get(row.name, row)
        for row in summary.params
        if row.name in folded or row.name not in members
    )
    header = dict(summary.header)
    counts = sorted({layer.num_experts for layer in layout.layers})
    header["experts"] = (
        f"{len(layout.layers)} MoE layers x {'/'.join(map(str, counts))} experts, "
        f"{len(members)} expert params stored under global ids; source ep_size {layout.ep_size} "
        f"({layout.expert_group})"
    )
    return replace(summary, header=header, params=params)


def _alike(rows: list[ParamRow]) -> bool:
    first = rows[0]
    return all(
        (r.shape, r.dtype, r.group, r.states, r.aliases)
        == (first.shape, first.dtype, first.group, first.states, ())
        for r in rows
    )
