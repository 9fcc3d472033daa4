"""``ucformat.torch.save`` from a plain single-process model, and back with ``ucformat.torch.load``.

(FSDP2 / HSDP saves, under torchrun, are in test_fsdp.py.) A model trained a few steps with a
torch optimizer is saved; a fresh model and optimizer (another seed) loaded from the store must
hold the same tensors bit for bit, and the next training steps must give the same losses as the
run that never stopped.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from tests.fixtures.models import BASE_LR, BETAS, EPS, build_model, loss_fn, make_batch
from tests.truth import assert_exact
from ucformat.errors import ModelMismatchError, StoreExistsError


def _run(name: str, seed: int, adamw: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, groups = build_model(name, seed=seed)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return model, cls(groups, lr=BASE_LR, betas=BETAS, eps=EPS, weight_decay=0.01)


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, name: str, steps: range
) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = make_batch(name, step)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("name", "adamw"), [("multi", True), ("ftb", False)])
def test_save_then_load_resumes_exactly(tmp_path: Path, name: str, adamw: bool) -> None:
    model, optimizer = _run(name, 1, adamw)
    _train(model, optimizer, name, range(3))
    report = uctorch.save(model, optimizer, tmp_path / "s", client_state={"iteration": 3})
    manifest = report.manifest
    assert report.committed and report.store == str(tmp_path / "s") and report.bytes_written > 0
    assert manifest.source.framework == "pytorch" and manifest.source.written_by == "save"
    assert manifest.source.world_size == 1 and manifest.source.mesh_shape is None
    assert ucformat.open(tmp_path / "s").manifest.digest == manifest.digest

    fresh, fresh_optimizer = _run(name, 2, adamw)
    report = uctorch.load(fresh, fresh_optimizer, tmp_path / "s")
    assert report.client_state == {"iteration": 3}
    assert report.bytes_read >= report.bytes_needed > 0
    for key, want in model.state_dict().items():
        assert_exact(fresh.state_dict()[key], want, key)
    want_state = optimizer.state_dict()
    got_state = fresh_optimizer.state_dict()
    for index, states in want_state["state"].items():
        for key, value in states.items():
            assert_exact(got_state["state"][index][key], value, f"{index}/{key}")
    assert got_state["param_groups"] == want_state["param_groups"]
    assert _train(fresh, fresh_optimizer, name, range(3, 6)) == _train(
        model, optimizer, name, range(3, 6)
    )


def test_save_refuses_an_existing_store_and_a_load_refuses_another_model(tmp_path: Path) -> None:
    model, optimizer = _run("simple", 1, True)
    _train(model, optimizer, "simple", range(1))
    uctorch.save(model, optimizer, tmp_path / "s")
    before = (tmp_path / "s" / "ucformat.json").read_bytes()
    with pytest.raises(StoreExistsError, match=r"already exists.*overwrite=True") as info:
        uctorch.save(model, optimizer, tmp_path / "s")
    assert "\n" not in str(info.value)
    assert (tmp_path / "s" / "ucformat.json").read_bytes() == before
    uctorch.save(model, optimizer, tmp_path / "s", overwrite=True)

    other, other_optimizer = _run("multi", 1, True)
    with pytest.raises(ModelMismatchError, match=r"fc1\.weight"):
        uctorch.load(other, other_optimizer, tmp_path / "s")


def test_save_async_keeps_the_state_at_the_call_and_records_the_scheduler(
    tmp_path: Path,
) -> None:
    """``save_async`` returns after the host copy: training goes on while the store is written,
    and the store holds the state at the call; the scheduler's ``state_dict`` comes back."""
    model, optimizer = _run("multi", 1, True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(3):
        _train(model, optimizer, "multi", range(step, step + 1))
        scheduler.step()
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_optimizer = copy.deepcopy(optimizer.state_dict())
    want_scheduler = scheduler.state_dict()
    handle = uctorch.save_async(model, optimizer, tmp_path / "a", scheduler=scheduler)
    _train(model, optimizer, "multi", range(3, 5))  # changes the live tensors meanwhile
    scheduler.step()
    report = handle.result(timeout=120)
    manifest = report.manifest
    assert report.host_copy_bytes > 0 and report.blocked_seconds <= report.seconds
    assert handle.done() and manifest.progress.lr_scheduler is not None
    assert ucformat.open(tmp_path / "a").manifest.digest == manifest.digest

    fresh, fresh_optimizer = _run("multi", 2, True)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=7, gamma=0.9)
    uctorch.load(fresh, fresh_optimizer, tmp_path / "a", scheduler=fresh_scheduler)
    for key, want in want_model.items():
        assert_exact(fresh.state_dict()[key], want, key)
    got = fresh_optimizer.state_dict()
    for index, states in want_optimizer["state"].items():
        for key, value in states.items():
            assert_exact(got["state"][index][key], value, f"{index}/{key}")
    assert fresh_scheduler.state_dict() == want_scheduler
    assert [g["lr"] for g in fresh_optimizer.param_groups] == [
        g["lr"] for g in want_optimizer["param_groups"]
    ]

    # a save waits for the pending async one; a store without a scheduler refuses to load one
    again = uctorch.save_async(model, optimizer, tmp_path / "b")
    uctorch.save(model, optimizer, tmp_path / "c")
    assert again.done()
    assert again.result().manifest.progress.lr_scheduler is None
    with pytest.raises(ModelMismatchError, match="no lr scheduler state"):
        uctorch.load(fresh, fresh_optimizer, tmp_path / "c", scheduler=fresh_scheduler)
    uctorch.load(fresh, fresh_optimizer, tmp_path / "c", scheduler=fresh_scheduler, strict=False)
    assert fresh_scheduler.state_dict() == want_scheduler


def test_save_async_failure_is_raised_by_result(tmp_path: Path) -> None:
    model, optimizer = _run("simple", 1, True)
    _train(model, optimizer, "simple", range(1))
    uctorch.save(model, optimizer, tmp_path / "s")
    handle = uctorch.save_async(model, optimizer, tmp_path / "s")  # exists: refused in the thread
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        handle.result(timeout=120)


def _objects(store: Path) -> dict[str, bytes]:
    """Every object of a store but its manifest, by key."""
    return {
        path.relative_to(store).as_posix(): path.read_bytes()
        for path in store.rglob("*")
        if path.is_file() and path.name != "ucformat.json"
    }


def test_a_models_plan_is_kept_and_its_saves_equal_fresh_ones(tmp_path: Path) -> None:
    """A model's second save takes the plan its first save made (``plan_kept``) and writes
    what a save planned anew writes (a twin holding the same state); another optimizer
    state changes the layout, and the save plans anew."""
    model, optimizer = _run("ftb", 1, False)
    _train(model, optimizer, "ftb", range(2))
    assert not uctorch.save(model, optimizer, tmp_path / "first", fsync=False).plan_kept
    _train(model, optimizer, "ftb", range(2, 3))
    kept = uctorch.save(model, optimizer, tmp_path / "kept", fsync=False)
    assert kept.plan_kept
    twin, twin_optimizer = _run("ftb", 2, False)
    twin.load_state_dict(model.state_dict())
    twin_optimizer.load_state_dict(optimizer.state_dict())
    fresh = uctorch.save(twin, twin_optimizer, tmp_path / "fresh", fsync=False)
    assert not fresh.plan_kept
    assert _objects(tmp_path / "kept") == _objects(tmp_path / "fresh")
    a, b = (r.manifest.model_dump(mode="json") for r in (kept, fresh))
    assert {k: v for k, v in a.items() if k not in ("source", "digest")} == {
        k: v for k, v in b.items() if k not in ("source", "digest")
    }
    assert ucformat.verify(tmp_path / "kept").ok
    handle = uctorch.save_async(
        model, optimizer, tmp_path / "async", fsync=False
    )  # host copies, kept plan
    _train(model, optimizer, "ftb", range(3, 4))  # the live tensors change meanwhile
    assert handle.result(timeout=120).plan_kept
    assert _objects(tmp_path / "async") == _objects(tmp_path / "fresh")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, sgd, "ftb", range(4, 5))
    assert not uctorch.save(
        model, sgd, tmp_path / "sgd", fsync=False
    ).plan_kept  # momentum_buffer: anew
