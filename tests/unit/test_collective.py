"""ucformat's one agreement (``ucformat.collective``) between ranks played by threads.

The ranks share an in-process key-value store (torch's ``HashStore``, what the rendezvous store
is to real ranks); each thread is one rank calling :func:`agree` as a distributed save does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from ucformat.collective import TIMEOUT_ENV, Group, agree, settle
from ucformat.errors import CollectiveError, DistributedWriteError, LoadAbortedError


def _groups(world: int) -> list[Group]:
    store = dist.PrefixStore("test", dist.HashStore())  # type: ignore[attr-defined]
    return [Group(object(), rank, world, store).operation() for rank in range(world)]


def _run(world: int, step: Any) -> list[Any]:
    """``step(group)`` on every rank at once; each rank's result (or the error it raised)."""
    groups = _groups(world)
    out: list[Any] = [None] * world

    def rank(index: int) -> None:
        try:
            out[index] = step(groups[index])
        except Exception as exc:
            out[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def test_every_rank_gets_the_same_error_naming_every_failing_rank() -> None:
    def step(group: Group) -> Any:
        failure = OSError(28, f"disk {group.rank} full") if group.rank in (1, 2) else None
        assert agree(None, group, "s") is None  # a round where all succeed
        return agree(failure, group, "dst: save")

    errors = _run(3, step)
    assert all(isinstance(e, CollectiveError) for e in errors)
    assert len({str(e) for e in errors}) == 1
    message = str(errors[0])
    assert message.startswith("dst: save: failed on ranks 1, 2 of 3: rank 1: OSError:")
    assert "disk 2 full" in message and "\n" not in message
    assert errors[0].rank == 1 and sorted(errors[0].failures) == [1, 2]


def test_plans_that_differ_count_as_failures() -> None:
    errors = _run(2, lambda g: agree(None, g, "x", extra="a" if g.rank == 0 else "b"))
    assert all(isinstance(e, CollectiveError) and e.rank == 1 for e in errors)
    assert "plan differs from rank 0's" in str(errors[0])


def test_a_rank_that_does_not_answer_is_named_and_a_late_one_learns_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "1")

    def step(group: Group) -> Any:
        if group.rank == 2:
            time.sleep(2.5)  # past the others' deadline: must not go on alone
        return agree(None, group, "dst")

    started = time.perf_counter()
    errors = _run(3, step)
    assert time.perf_counter() - started < 20
    assert all(isinstance(e, CollectiveError) and e.missing == (2,) for e in errors)
    assert "rank 2 of 3 did not answer within 1 s" in str(errors[0])


def test_settle_raises_the_own_error_alone_and_the_old_names_are_the_one_type() -> None:
    alone = Group(None, 0, 1)
    settle(None, alone, "x")
    with pytest.raises(OSError, match="full"):
        settle(OSError("full"), alone, "x")
    assert DistributedWriteError is CollectiveError and LoadAbortedError is CollectiveError
    cleaned: list[int] = []
    errors = _run(2, lambda g: settle(ValueError("bad") if g.rank else None, g, "x",
                                      cleanup=lambda: cleaned.append(1)))  # fmt: skip
    assert all(isinstance(e, CollectiveError) for e in errors) and cleaned == [1, 1]
    assert isinstance(errors[1].__cause__, ValueError)


def test_every_collective_goes_through_collective_py() -> None:
    """No module but ``ucformat/collective.py`` calls a torch.distributed collective, and the two
    torch loaders do not import each other (their shared helpers live in optim_groups)."""
    import ast
    from pathlib import Path

    import ucformat

    collectives = {
        "all_gather_object", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
        "broadcast_object_list", "barrier", "monitored_barrier", "batch_isend_irecv",
        "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "new_group",
        "reduce_scatter", "scatter", "gather",
    }  # fmt: skip
    root = Path(ucformat.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "collective.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in collectives:
                base = node.value
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                if name in ("dist", "distributed"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}: {node.attr}")
    assert offenders == []

    def imported(path: Path) -> set[str]:
        return {
            node.module
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
        }

    assert "ucformat.torch.load" not in imported(root / "torch" / "sharded_load.py")
    assert "ucformat.torch.sharded_load" in imported(root / "torch" / "load.py")  # one way
