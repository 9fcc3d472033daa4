"""``ucformat.torch.save`` from a plain single-process model, and back with ``ucformat.torch.load``.

(FSDP2 / HSDP saves, under torchrun, are in test_fsdp.py.) A model trained a few steps with a
torch optimizer is saved; a fresh model and optimizer (another seed) loaded from the store must
hold the same tensors bit for bit, and the next training steps must give the same losses as the
run that never stopped.
"""

from __future__ import annotations

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
    manifest = uctorch.save(model, optimizer, tmp_path / "s", client_state={"iteration": 3})
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
