"""A load refused before any read (``ucformat.deepspeed.load``'s ``settle_refusal``), ranks
played by threads sharing one store: a refusal on some ranks never leaves the others waiting."""

from __future__ import annotations

from tests.unit.test_collective import _run
from ucformat.collective import Group
from ucformat.errors import CollectiveError, ModelMismatchError


def _settle(failure: Exception | None, group: Group) -> str:
    from ucformat.deepspeed.load import settle_refusal

    settle_refusal(failure, group, "ckpt.ucf: ucformat.deepspeed.load")  # type: ignore[arg-type]
    return "went on"


def test_a_refusal_on_rank_0_only_stops_every_rank_with_one_error() -> None:
    def step(group: Group) -> str:
        refused = ModelMismatchError("param 'x': other shape") if group.rank == 0 else None
        return _settle(refused, group)

    results = _run(3, step)
    assert all(isinstance(r, CollectiveError) for r in results), results
    assert len({str(r) for r in results}) == 1
    assert "failed on rank 0 of 3: ModelMismatchError: param 'x': other shape" in str(results[0])
    assert "Nothing was loaded on any rank." in str(results[0])


def test_the_same_refusal_everywhere_is_raised_as_it_is() -> None:
    results = _run(2, lambda g: _settle(ModelMismatchError("the model does not match"), g))
    assert all(type(r) is ModelMismatchError for r in results)


def test_no_refusal_goes_on() -> None:
    assert _run(2, lambda g: _settle(None, g)) == ["went on", "went on"]
