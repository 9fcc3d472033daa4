"""Name the positions of an optimizer state saved by position only (DeepSpeed ZeRO stage 0).

Without ZeRO, DeepSpeed saves the torch optimizer's ``state_dict()`` whole: its param groups
list *positions* (0, 1, 2, ... in the order the optimizer was built, group after group) and its
state is keyed by position. The model states give names and shapes in *module* order. This
module derives which name each position holds, and proves it as far as the files allow.

Evidence, per position (a :class:`Slot`): the shape of its state or fp32 master (None when it
holds neither: a parameter the optimizer never stepped), and optionally a *key*: a digest of
its fp32 master rounded to the training dtype, which must equal the digest of the candidate's
16-bit module weight (:class:`Candidate`). Algorithm:

1. each slot's candidates are the names of its shape (and key, where both have one; and
   among the names its group may hold, where that is known);
2. a slot with one unclaimed candidate takes it; repeat until nothing changes;
3. slots left over come in classes of identical candidate sets (same shape, same values): the
   files cannot tell them apart. They are matched in module order (the order
   ``module.parameters()`` gives, the order DeepSpeed's own loader assumes when it restores
   by position) only when the class lies in one param group, has exactly as many candidates
   as slots, and every position of that group the evidence did decide holds its parameter in
   module order; otherwise the mapping is refused, naming the parameters;
4. candidates no slot takes are parameters outside the optimizer (frozen ones).

:func:`segment_flat` does the same for one flat fp32 tensor per group (``FP16_Optimizer``):
it walks the group's flat master from offset 0, taking at each offset the candidate whose
rounded values there digest to its weight's key.

Standard library only: the digests are computed by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

from ucformat.errors import LayoutMismatchError, UnsupportedCheckpointError

__all__ = ["Candidate", "Slot", "match_positions", "segment_flat"]

#: Names shown in a message before "and N more".
_SHOWN = 4


@dataclass(frozen=True)
class Slot:
    """One position of a positional optimizer state.

    Attributes:
        position: the optimizer's index of the parameter (``param_groups[g]['params']``).
        group: the param group listing it.
        shape: the shape of its state or master; None when it holds neither.
        key: digest of its master rounded to the training dtype; None without a master of
            another dtype (fp32 training: the module weight is the master).
        allowed: the only names its group can hold (e.g. an MoE expert group: the experts);
            None: any.
    """

    position: int
    group: int
    shape: tuple[int, ...] | None
    key: str | None = None
    allowed: frozenset[str] | None = None


@dataclass(frozen=True)
class Candidate:
    """A parameter of the module (module order is the order of the sequence given)."""

    name: str
    shape: tuple[int, ...]
    key: str | None = None


def _fits(slot: Slot, candidate: Candidate) -> bool:
    if slot.shape is not None and slot.shape != candidate.shape:
        return False
    if slot.allowed is not None and candidate.name not in slot.allowed:
        return False
    return slot.key is None or candidate.key is None or slot.key == candidate.key


def _listed(names: Sequence[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def match_positions(
    slots: Sequence[Slot], candidates: Sequence[Candidate], where: str
) -> dict[int, str]:
    """``{position: name}`` for every slot, proven by the slots' evidence (see the module doc).

    Candidates left out of the result are not in the optimizer.

    Raises:
        LayoutMismatchError: a slot fits no unclaimed candidate (the files contradict each
            other, or the model states lack a parameter the optimizer holds).
        UnsupportedCheckpointError: the files leave the mapping ambiguous (the message names
            the parameters that cannot be told apart).
    """
    order = {c.name: i for i, c in enumerate(candidates)}
    fits = {s.position: [c.name for c in candidates if _fits(s, c)] for s in slots}
    by_position = {s.position: s for s in slots}
    placed: dict[int, str] = {}
    claimed: set[str] = set()

    def live(position: int) -> list[str]:
        return [n for n in fits[position] if n not in claimed]

    def propagate() -> None:
        changed = True
        while changed:
            changed = False
            for slot in slots:
                if slot.position in placed:
                    continue
                names = live(slot.position)
                if not names:
                    raise LayoutMismatchError(
                        f"{where}: optimizer position {slot.position} (group {slot.group}"
                        f"{_shape_text(slot)}) fits no parameter of the model states that is "
                        "not already placed; the files do not belong together."
                    )
                if len(names) == 1:
                    placed[slot.position] = names[0]
                    claimed.add(names[0])
                    changed = True

    propagate()
    while len(placed) < len(slots):
        open_slots = [s for s in slots if s.position not in placed]
        shaped = [s for s in open_slots if s.shape is not None] or open_slots
        first = shaped[0]
        names = live(first.position)
        members = [s for s in shaped if live(s.position) == names]
        _tie_break(members, names, placed, order, by_position, where)
        for slot, name in zip(members, names, strict=False):
            placed[slot.position] = name
            claimed.add(name)
        propagate()
    return placed


def _shape_text(slot: Slot) -> str:
    return f", shape {list(slot.shape)}" if slot.shape is not None else ", no state"


def _tie_break(
    members: Sequence[Slot],
    names: Sequence[str],
    placed: dict[int, str],
    order: dict[str, int],
    by_position: dict[int, Slot],
    where: str,
) -> None:
    """Raise unless ``members`` may take ``names`` in module order (module doc, step 3)."""
    groups = sorted({s.group for s in members})
    shown = _listed(list(names))
    what = (
        f"{where}: optimizer positions {[s.position for s in members]} "
        f"(group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))}"
        f"{_shape_text(members[0])}) could each hold any of {shown}"
    )
    if len(groups) > 1:
        raise UnsupportedCheckpointError(
            f"{what}, and they are in different param groups, so which group trains which "
            "cannot be told from the files; save with ZeRO stage 1 or 2 (whose files name "
            "every parameter)."
        )
    if len(names) != len(members):
        raise UnsupportedCheckpointError(
            f"{what}, but only {len(members)} of those {len(names)} parameters are in the "
            "optimizer, and the files do not say which; save with ZeRO stage 1 or 2 (whose "
            "files name every parameter)."
        )
    group = groups[0]
    tentative = dict(placed)
    tentative.update({s.position: n for s, n in zip(members, names, strict=True)})
    decided = sorted((p, n) for p, n in tentative.items() if by_position[p].group == group)
    ranks = [order[n] for _, n in decided]
    late = next((i for i in range(len(ranks) - 1) if ranks[i] > ranks[i + 1]), None)
    if late is not None:
        raise UnsupportedCheckpointError(
            f"{what}; the files cannot tell them apart, and group {group} does not list its "
            f"parameters in module order ('{decided[late][1]}' before "
            f"'{decided[late + 1][1]}'), so module order cannot be assumed; save with ZeRO "
            "stage 1 or 2 (whose files name every parameter)."
        )


def segment_flat(
    group: int,
    length: int,
    candidates: Sequence[Candidate],
    key_at: Callable[[int, int], str],
    claimed: set[str],
    where: str,
) -> list[tuple[str, int]]:
    """Cut group ``group``'s flat fp32 master of ``length`` elements into parameters.

    ``key_at(offset, numel)`` digests ``numel`` master elements from ``offset`` rounded to the
    training dtype. At each offset the unclaimed candidates whose key matches there are the
    possible parameters; the first in module order is taken (several only when their weights
    are identical: then they are interchangeable by value). Names taken are added to
    ``claimed``.

    Returns:
        ``[(name, offset)]`` in flat order.

    Raises:
        LayoutMismatchError: no unclaimed parameter's weights match the master at an offset,
            or the parameters do not fill the flat tensor exactly.
    """
    out: list[tuple[str, int]] = []
    offset = 0
    while offset < length:
        keys: dict[int, str] = {}
        found = None
        for candidate in candidates:
            numel = prod(candidate.shape)
            if candidate.name in claimed or numel == 0 or offset + numel > length:
                continue
            if numel not in keys:
                keys[numel] = key_at(offset, numel)
            if candidate.key is not None and keys[numel] == candidate.key:
                found = candidate
                break
        if found is None:
            raise LayoutMismatchError(
                f"{where}: the fp32 master of param group {group} at element {offset} (of "
                f"{length}) does not round to the weights of any parameter not already placed; "
                "the files do not belong together."
            )
        out.append((found.name, offset))
        claimed.add(found.name)
        offset += prod(found.shape)
    return out
