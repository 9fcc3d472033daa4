"""The one model-vs-store match: does a target model have the store's names and shapes?

Every loader (``ucformat.deepspeed.load``, ``ucformat.torch.load`` into a plain or a DTensor
model) describes its target as ``name -> shape`` (the full, logical shape) and calls
:func:`match_model` against the store's ``name -> shape``; :func:`refuse_mismatch` then decides,
before anything changes:

* a shape that differs is always refused (no ``strict`` makes a resized layer loadable);
* a name missing from the store, a stored name the model lacks, and the caller's own findings
  (``also``: an optimizer state the store does not hold, ...) are refused under ``strict``, and
  returned as skipped otherwise.

The refusal is one :class:`~ucformat.errors.ModelMismatchError` in one shape::

    the model does not match the checkpoint: missing from the store: a, b; not in the model: c;
    different shapes: d (model [4, 8], store [4, 16]). Nothing was loaded; <what to do>.

Pure: names and shapes in, findings out (no torch, no store).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ucformat.errors import ModelMismatchError

__all__ = ["ModelMatch", "match_model", "refuse_mismatch"]

MISMATCH = "the model does not match the checkpoint"


@dataclass(frozen=True)
class ModelMatch:
    """What differs between a model and a store (each list sorted by name)."""

    #: The model's names the store does not hold.
    missing: list[str] = field(default_factory=list)
    #: The store's names the model does not have.
    unexpected: list[str] = field(default_factory=list)
    #: ``"name (model [..], store [..])"`` for every shared name whose shapes differ.
    shapes: list[str] = field(default_factory=list)

    def __add__(self, other: ModelMatch) -> ModelMatch:
        return ModelMatch(
            self.missing + other.missing,
            self.unexpected + other.unexpected,
            self.shapes + other.shapes,
        )

    def problems(self) -> list[str]:
        """The findings as message parts: missing, unexpected, shapes."""
        parts = []
        if self.missing:
            parts.append(f"missing from the store: {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"not in the model: {', '.join(self.unexpected)}")
        if self.shapes:
            parts.append(f"different shapes: {', '.join(self.shapes)}")
        return parts


def match_model(
    model: Mapping[str, Sequence[int]],
    stored: Mapping[str, Sequence[int]],
    *,
    resolve: Callable[[str], str] | None = None,
    not_here: Collection[str] = (),
    label: str = "",
) -> ModelMatch:
    """Compare a model's ``name -> shape`` with a store's.

    Args:
        model: the target's names and full shapes.
        stored: the store's names and shapes.
        resolve: maps a model name to the stored name it reads (tied aliases); default: itself.
        not_here: stored names this target is not meant to hold (another pipeline stage's,
            another expert-parallel rank's experts): never reported as unexpected.
        label: put before each name in ``shapes`` (``"buffer "``).
    """
    to_store = resolve or (lambda name: name)
    found = {name: to_store(name) for name in model}
    missing = sorted(name for name, key in found.items() if key not in stored)
    unexpected = sorted(set(stored) - set(found.values()) - set(not_here))
    shapes = [
        f"{label}{name} (model {list(model[name])}, store {list(stored[key])})"
        for name, key in sorted(found.items())
        if key in stored and list(model[name]) != list(stored[key])
    ]
    return ModelMatch(missing, unexpected, shapes)


def refuse_mismatch(match: ModelMatch, *, strict: bool, also: Sequence[str] = ()) -> list[str]:
    """Raise :class:`ModelMismatchError` where the model cannot be loaded; else what is skipped.

    Args:
        match: the names and shapes compared (:func:`match_model`).
        strict: refuse names that differ (and ``also``), not only shapes.
        also: the caller's further findings, as message parts.

    Returns:
        Every problem found (empty where the model matches): ``strict=False`` loads past them.
    """
    problems = [*match.problems(), *also]
    if match.shapes or (strict and problems):
        advice = (
            "fix the model (a shape that differs is refused even with strict=False)."
            if match.shapes
            else "fix the model, or pass strict=False to load the matching parameters only."
        )
        raise ModelMismatchError(f"{MISMATCH}: {'; '.join(problems)}. Nothing was loaded; {advice}")
    return problems
