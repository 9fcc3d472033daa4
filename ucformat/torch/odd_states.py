"""Optimizer states that are not elementwise (format 3.1), in a torch optimizer's terms.

A torch optimizer keeps its state per parameter. What the store may hold besides elementwise
states (docs/format.md §5.4), and where a torch optimizer takes it:

* a state kept **whole** per parameter (``ParamEntry.whole_states``: a 1-element tensor,
  Adafactor-style row and column factors) is such a per-parameter state: the optimizer of a
  plain model, which steps each parameter whole, takes it as saved. The optimizer of a sharded
  (DTensor) model steps each rank's shard of the parameter and has no place for a state of the
  whole one;
* a state kept once per **ZeRO partition** of a group (``OptimizerGroup.partition_states``)
  belongs to a flat partition of several parameters, not to any one of them: no torch optimizer
  takes it (a DeepSpeed ZeRO-1/2 engine partitioned the same way does:
  ``ucformat.deepspeed.load``).

:func:`odd_states_left_out` decides before anything is read: it raises in one line naming the
first such state (``strict``), or returns what is left out for the load's report.
"""

from __future__ import annotations

from ucformat.errors import UnsupportedCheckpointError
from ucformat.format.models import CheckpointManifest

__all__ = ["odd_states_left_out"]


def odd_states_left_out(
    manifest: CheckpointManifest, *, sharded: bool, strict: bool, names: set[str] | None = None
) -> list[str]:
    """The store's states a torch optimizer cannot take, described for a report.

    Args:
        manifest: the store's manifest.
        sharded: the target model's parameters are DTensors (each rank steps its shard).
        strict: raise instead of returning a non-empty list.
        names: only the whole states of these parameters count (default: every parameter).

    Raises:
        UnsupportedCheckpointError: ``strict`` and some state cannot be taken (one line naming
            it, what takes it, and ``strict=False``; nothing was loaded).
    """
    optimizer = manifest.optimizer
    if optimizer is None:
        return []
    left: list[tuple[str, str]] = []
    for index, group in enumerate(optimizer.groups):
        for key, held in sorted(group.partition_states.items()):
            left.append((
                f"optimizer group {index}'s state '{key}' (kept once per ZeRO partition, "
                f"{held.partitions} partitions, shape {held.shape})",
                "it belongs to a flat partition of the group, not to a parameter; a DeepSpeed "
                f"ZeRO-1/2 engine partitioning the group over {held.partitions} ranks takes it "
                "(ucformat.deepspeed.load)",
            ))  # fmt: skip
    if sharded:
        for name, entry in manifest.params.items():
            if names is not None and name not in names:
                continue
            for key, ref in sorted(entry.whole_states.items()):
                left.append((
                    f"param '{name}''s state '{key}' (kept whole, shape {ref.shape})",
                    "this model's optimizer steps each rank's shard of the parameter; a plain "
                    "model on one process or a ZeRO-0 DeepSpeed engine takes it",
                ))  # fmt: skip
    if left and strict:
        what, why = left[0]
        more = f" ({len(left) - 1} more such states)" if len(left) > 1 else ""
        raise UnsupportedCheckpointError(
            f"{what}{more} has no place in a torch optimizer's per-parameter state: {why}; "
            "pass strict=False to load the rest without it. Nothing was loaded."
        )
    return [what for what, _ in left]
