"""Wrapper components (``_checkpoint_wrapped_module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``)
never reach a store's names, and a wrapped model loads a store by its own names.

In-process: ``checkpoint_wrapper`` and ``torch.compile`` (dynamo disabled: nothing compiles, the
names are a compiled module's) with ``ucformat.torch.save``/``load``, and stock ``dcp.save`` of a
wrapped model's raw ``state_dict()`` converted. Under torchrun (W=2, one launch,
tests/fixtures/_names_worker.py): DeepSpeed engines of compiled and checkpoint-wrapped models
(live save and converted ``save_checkpoint``) and FSDP1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ucformat
import ucformat.torch as uctorch
from tests.conftest import deepspeed_available
from tests.fixtures.make_fixtures import FIXTURES_DIR, launch_jobs
from tests.fixtures.models import BASE_LR, BETAS, EPS, build_model, loss_fn, make_batch
from tests.truth import assert_exact
from ucformat.errors import InvalidNameError
from ucformat.format.names import WRAPPER_COMPONENTS, model_name, model_named

WRAPS = ("checkpoint", "compile")


@pytest.fixture(autouse=True)
def _no_compilation() -> Iterator[None]:
    """A compiled module runs eagerly (its names are what matter; compiling takes long)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def _wrapped(how: str, seed: int) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(model to call, its plain inner model, optimizer)."""
    model, groups = build_model("multi", seed=seed)
    optimizer = torch.optim.AdamW(groups, lr=BASE_LR, betas=BETAS, eps=EPS)
    if how == "compile":
        return torch.compile(model), model, optimizer  # type: ignore[return-value]
    model.a = checkpoint_wrapper(model.a)  # type: ignore[assignment]
    model.b = checkpoint_wrapper(model.b)  # type: ignore[assignment]
    return model, model, optimizer


def _train(model: torch.nn.Module, optimizer: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = make_batch("multi", step)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _stored_names(store: Path) -> list[str]:
    manifest = ucformat.open(store).manifest
    return [*manifest.params, *manifest.buffers, *manifest.tied]


def test_model_name_rule() -> None:
    assert model_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )
    assert model_name("_orig_mod.layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert model_name("module.w") == "module.w"  # DDP's prefix is not a wrapper component
    assert model_name("x_orig_mod.w") == "x_orig_mod.w"
    with pytest.raises(InvalidNameError, match="rename one of the modules"):
        model_named([("a._orig_mod.w", 1), ("a.w", 2)])


@pytest.mark.parametrize("how", WRAPS)
def test_wrapped_model_saves_model_names_and_resumes(tmp_path: Path, how: str) -> None:
    model, inner, optimizer = _wrapped(how, 1)
    names = [n for n, _ in model.named_parameters()]
    assert any(set(n.split(".")) & WRAPPER_COMPONENTS for n in names), names  # not void
    _train(model, optimizer, range(3))
    uctorch.save(model, optimizer, tmp_path / "s")
    stored = _stored_names(tmp_path / "s")
    assert sorted(stored) == sorted(model_name(n) for n in inner.state_dict())
    want_loss = _train(model, optimizer, range(3, 4))

    # into a wrapped model of the same kind, and into the plain model
    for target in ("wrapped", "plain"):
        if target == "wrapped":
            fresh, fresh_inner, fresh_opt = _wrapped(how, 2)
        else:
            fresh, groups = build_model("multi", seed=2)
            fresh_inner, fresh_opt = fresh, torch.optim.AdamW(groups, lr=BASE_LR, eps=EPS)
        uctorch.load(fresh, fresh_opt, tmp_path / "s")
        assert _train(fresh, fresh_opt, range(3, 4)) == want_loss, target
        got = {model_name(k): v for k, v in fresh_inner.state_dict().items()}
        for key, value in inner.state_dict().items():
            assert_exact(got[model_name(key)], value, key)


def test_plain_store_loads_into_a_wrapped_model(tmp_path: Path) -> None:
    model, groups = build_model("multi", seed=1)
    optimizer = torch.optim.AdamW(groups, lr=BASE_LR, betas=BETAS, eps=EPS)
    _train(model, optimizer, range(2))
    uctorch.save(model, optimizer, tmp_path / "s")
    for how in WRAPS:
        fresh, inner, fresh_opt = _wrapped(how, 3)
        report = uctorch.load(fresh, fresh_opt, tmp_path / "s")
        assert report.missing == [] and report.unexpected == []
        for key, value in model.state_dict().items():
            assert_exact(inner.state_dict()[key] if how == "compile" else
                         {model_name(k): v for k, v in inner.state_dict().items()}[key],
                         value, key)  # fmt: skip


@pytest.mark.parametrize("how", WRAPS)
def test_dcp_of_a_raw_wrapped_state_dict_converts_to_model_names(tmp_path: Path, how: str) -> None:
    """``dcp.save`` of a wrapped model's own names (``named_parameters()``; a compiled module's
    ``state_dict()`` has them too, a checkpoint wrapper's hook strips its own) keeps the wrapper
    components; convert drops them, and the store loads into the plain model."""
    model, _, optimizer = _wrapped(how, 1)
    _train(model, optimizer, range(2))
    raw = {name: param.detach() for name, param in model.named_parameters()}
    assert any(set(k.split(".")) & WRAPPER_COMPONENTS for k in raw)
    dcp.save({"model": raw}, checkpoint_id=str(tmp_path / "dcp"))
    ucformat.convert(tmp_path / "dcp", tmp_path / "s")
    assert sorted(_stored_names(tmp_path / "s")) == sorted(model_name(k) for k in raw)
    plain, _ = build_model("multi", seed=5)
    uctorch.load(plain, None, tmp_path / "s")
    for key, value in raw.items():
        assert_exact(plain.state_dict()[model_name(key)], value, key)


@pytest.mark.deepspeed
@pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")
def test_wrapped_deepspeed_engines_and_fsdp1_under_torchrun(tmp_path: Path) -> None:
    jobs = []
    for name, extra in (("ds-compile", {"kind": "ds", "wrap": "compile"}),
                        ("ds-checkpoint", {"kind": "ds", "wrap": "checkpoint"}),
                        ("fsdp1", {"kind": "fsdp1"})):  # fmt: skip
        (tmp_path / name).mkdir()
        jobs.append(
            {"name": name, "dir": str(tmp_path / name), "result": str(tmp_path / f"{name}.json"),
             **extra}
        )  # fmt: skip
    launch_jobs(FIXTURES_DIR / "_names_worker.py", 2, jobs, tmp_path / "_launch", "names", 900.0)
    failures = {j["name"]: json.loads(Path(j["result"]).read_text())["failures"] for j in jobs}
    assert failures == {j["name"]: [] for j in jobs}
