"""Optimizer states that are not elementwise (format 3.1), loaded where the target allows it.

A store may hold two kinds (docs/format.md §5.4):

* ``whole_states`` of a parameter: a tensor in a shape of its own that the optimizer keeps per
  parameter (a 1-element tensor, Adafactor-style row and column factors). A target takes it
  only where its optimizer steps that parameter on its own, whole: a ZeRO-0 engine with a bare
  optimizer or ``FP16_UnfusedOptimizer``. A ZeRO partition or ``FP16_Optimizer``'s flat group
  has no place for it.
* ``partition_states`` of an optimizer group: one tensor per flat ZeRO-1/2 partition (row ``p``
  of the stored array). A ZeRO-1/2 target takes partition ``p`` on its rank ``p`` when it
  partitions the group the same way (the same members in the same order over as many ranks);
  a state equal on every partition (``replicated``) goes to every rank of any ZeRO-1/2 target.

And one kind the *target* keeps apart: an elementwise state of the store that the engine holds
as whole copies of the parameters a partition touches (DeepSpeed's Muon ``momentum_buffer`` at
ZeRO-1/2, :attr:`~ucformat.deepspeed.engine.EngineView.whole_copies`). Any ZeRO-1/2 layout takes
it: the rank's buffer is each touched parameter's whole array, end to end in flat order.

Everything else is refused before anything is read, in one line naming the parameter or group,
the state, and the layout that would take it. Plans are data (:class:`OddState`); reading fills
new tensors; writing puts them into the optimizer's state after the elementwise ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ucformat.deepspeed.engine import EngineView
from ucformat.errors import UnsupportedCheckpointError
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.layout.partition import PartitionedFlatLayout
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.read.partitions import ReadTally

__all__ = ["OddState", "plan_odd_states", "read_odd_states", "write_odd_states"]

#: What to do instead, said in every refusal of a whole state.
_WHOLE_TARGETS = (
    "a ZeRO-0 engine whose optimizer steps each parameter whole (fp32, or fp16/bf16 with a "
    "non-fused optimizer), or a plain model"
)


@dataclass(frozen=True)
class OddState:
    """One non-elementwise state this rank loads into the optimizer state ``key`` of flat target
    ``target``: the arrays ``refs`` (row ``row`` of each, or all of it when None); with
    ``flat``, flattened and laid end to end (whole copies)."""

    target: int
    key: str
    refs: tuple[ArrayRef, ...]
    row: int | None
    flat: bool = False


def plan_odd_states(view: EngineView, manifest: CheckpointManifest) -> list[OddState]:
    """What this rank loads of the store's non-elementwise states.

    Raises:
        UnsupportedCheckpointError: the target's layout cannot take a state.
    """
    plans: list[OddState] = []
    per_param = view.holds_whole_params()
    for target in view.targets:
        for name in target.names:
            entry = manifest.params.get(manifest.resolve(name))
            if entry is None or not entry.whole_states:
                continue
            if not per_param or len(target.names) != 1:
                key, ref = next(iter(entry.whole_states.items()))
                raise UnsupportedCheckpointError(
                    f"param '{name}': the store keeps its optimizer state '{key}' whole (shape "
                    f"{ref.shape}, not elementwise), and this engine's optimizer "
                    f"({type(view.wrapper).__name__}) does not step '{name}' whole; load it "
                    f"into {_WHOLE_TARGETS}."
                )
            plans += [OddState(target.index, k, (r,), None) for k, r in entry.whole_states.items()]
    plans += _whole_copy_plans(view, manifest)
    groups = manifest.optimizer.groups if manifest.optimizer is not None else []
    for g, group in enumerate(groups):
        for key, state in group.partition_states.items():
            plans.append(_partition_plan(view, g, group.params, key, state.partitions,
                                         state.replicated, state.array))  # fmt: skip
    return plans


def _whole_copy_plans(view: EngineView, manifest: CheckpointManifest) -> list[OddState]:
    """The states this rank's targets keep as whole copies of the parameters their partitions
    touch: each touched parameter's whole array, in flat order. A key the store holds for none
    of them is left to the optimizer (it starts it afresh); for only some, refused."""
    plans: list[OddState] = []
    for target in view.targets:
        keys = view.whole_copies.get(target.index, frozenset())
        touched = list(dict.fromkeys(f.name for f in target.layout.fragments(target.rank)))
        for key in sorted(keys):
            refs = [_elementwise_ref(manifest, name, key) for name in touched]
            if not any(refs):
                continue
            lacking = [name for name, ref in zip(touched, refs, strict=True) if ref is None]
            if lacking:
                raise UnsupportedCheckpointError(
                    f"param '{lacking[0]}': this engine's optimizer "
                    f"({type(view.base_optimizer).__name__}) keeps '{key}' as one whole copy of "
                    f"every parameter its partition touches, and the store holds '{key}' for "
                    f"{', '.join(n for n in touched if n not in lacking)} but not for "
                    f"{', '.join(lacking)}; load it into an engine whose optimizer groups hold "
                    "the same parameters as the store's."
                )
            whole = tuple(ref for ref in refs if ref is not None)
            plans.append(OddState(target.index, key, whole, None, flat=True))
    return plans


def _elementwise_ref(manifest: CheckpointManifest, name: str, key: str) -> ArrayRef | None:
    entry = manifest.params.get(manifest.resolve(name))
    return entry.states.get(key) if entry is not None else None


def _partition_plan(
    view: EngineView,
    g: int,
    members: Sequence[str],
    key: str,
    partitions: int,
    replicated: bool,
    ref: ArrayRef,
) -> OddState:
    target = next((t for t in view.targets if t.index == g), None)
    layout = target.layout if target is not None else None
    what = (
        f"optimizer group {g}'s state '{key}' is kept once per ZeRO partition (shape "
        f"{ref.shape[1:]}, not elementwise)"
    )
    if target is None or not isinstance(layout, PartitionedFlatLayout) or view.kind == "zero3":
        raise UnsupportedCheckpointError(
            f"{what}, and this engine ({type(view.wrapper).__name__}) has no ZeRO-1/2 "
            f"partition of group {g}; load it into a ZeRO-1/2 engine with {partitions} "
            "ranks and the same param groups."
        )
    if replicated:
        return OddState(target.index, key, (ref,), 0)
    if layout.world_size != partitions or target.names != list(members):
        raise UnsupportedCheckpointError(
            f"{what} and differs between the source's {partitions} partitions, which this "
            f"engine does not have (it partitions group {g} over {layout.world_size} ranks"
            f"{'' if target.names == list(members) else ', with other members'}); load it at "
            f"the source's layout: ZeRO-1/2, {partitions} ranks, the same param groups."
        )
    return OddState(target.index, key, (ref,), target.rank)


def read_odd_states(
    ckpt: UniversalCheckpoint, plans: Sequence[OddState], tally: ReadTally
) -> list[torch.Tensor]:
    """Each plan's tensor, read now into a new tensor (its row of a partition state; whole
    copies end to end)."""
    values: list[torch.Tensor] = []
    for plan in plans:
        pieces = []
        for ref in plan.refs:
            whole = ckpt.read_array(ref)
            pieces.append(whole if plan.row is None else whole[plan.row].clone())
            tally.bytes_needed += pieces[-1].numel() * pieces[-1].element_size()
            tally.note(ref, 0, ref.nbytes // max(1, whole.element_size()))
        values.append(torch.cat([p.reshape(-1) for p in pieces]) if plan.flat else pieces[0])
    return values


def write_odd_states(
    view: EngineView, plans: Sequence[OddState], values: Sequence[torch.Tensor]
) -> None:
    """Put each value into its target's optimizer state (after the elementwise ones)."""
    optimizer = view.base_optimizer
    for plan, value in zip(plans, values, strict=True):
        key = view.state_key(plan.target)
        optimizer.state[key][plan.key] = value.to(key.device)
