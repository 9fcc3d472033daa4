"""ucformat.sources.dcp_layout: which flattened DCP keys are weights, states, param groups."""

from __future__ import annotations

import pytest

from ucformat.errors import NotACheckpointError
from ucformat.sources.dcp_layout import split_layout

WEIGHTS = ["a.weight", "a.bias", "0.weight"]


def _flat(prefix: str) -> list[str]:
    keys = []
    for name in WEIGHTS:
        keys += [f"{prefix}state.{name}.step", f"{prefix}state.{name}.exp_avg"]
    for name in WEIGHTS:
        keys += [f"{prefix}param_groups.{name}.lr", f"{prefix}param_groups.{name}.betas"]
    return keys


def test_model_and_flattened_optimizer() -> None:
    model = [f"model.{n}" for n in WEIGHTS]
    keys = [*model, *_flat("optimizer."), "epoch"]
    layout = split_layout(keys, set(model) | {k for k in keys if "exp_avg" in k}, "d")
    assert (layout.model_key, layout.optimizer_key, layout.nested) == ("model", "optimizer", False)
    assert layout.params == {n: f"model.{n}" for n in WEIGHTS}
    assert layout.states["0.weight"] == {
        "step": "optimizer.state.0.weight.step",
        "exp_avg": "optimizer.state.0.weight.exp_avg",
    }
    assert list(layout.groups) == WEIGHTS and set(layout.groups["a.bias"]) == {"lr", "betas"}
    assert layout.other == ["epoch"]


def test_model_and_nested_optim() -> None:
    model = [f"model.{n}" for n in WEIGHTS]
    groups = ["optim.param_groups.0.lr", "optim.param_groups.0.params", "optim.param_groups.1.lr"]
    keys = [*model, "optim.state.a.weight.exp_avg", *groups]
    layout = split_layout(keys, set(model), "d")
    assert (layout.optimizer_key, layout.nested) == ("optim", True)
    assert layout.groups == {
        "0": {"lr": groups[0], "params": groups[1]},
        "1": {"lr": groups[2]},
    }


def test_torchtitan_top_level_model_keys() -> None:
    keys = [*WEIGHTS, *_flat("optimizer."), "train_state.step", "lr_scheduler.last_epoch"]
    layout = split_layout(keys, set(WEIGHTS), "d")
    assert layout.model_key == "." and layout.params == {n: n for n in WEIGHTS}
    assert layout.other == ["train_state.step", "lr_scheduler.last_epoch"]


def test_torchtitan_with_fqns_that_start_with_model() -> None:
    """An HF model saved torchtitan-style: its own FQNs begin with ``model.``."""
    weights = ["model.embed.weight", "lm_head.weight"]
    keys = [*weights, "optimizer.state.model.embed.weight.exp_avg",
            "optimizer.state.lm_head.weight.exp_avg"]  # fmt: skip
    layout = split_layout(keys, set(keys), "d")
    assert layout.model_key == "." and set(layout.params) == set(weights)
    assert set(layout.states) == set(weights)


def test_explicit_keys() -> None:
    keys = ["net.w", "opt.state.w.exp_avg", "opt.param_groups.w.lr"]
    layout = split_layout(keys, {"net.w", "opt.state.w.exp_avg"}, "d", model_key="net",
                          optimizer_key="opt")  # fmt: skip
    assert layout.params == {"w": "net.w"} and layout.states == {"w": {"exp_avg": keys[1]}}


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [
        (["weights.w"], "top-level keys found: weights"),
        (["model.w", "optimizer.state.0.exp_avg"], "keyed by parameter index"),
        (["model.w", "optimizer.param_groups.x.lr"], "names no model weight"),
        (["model.w", "optimizer.param_groups.0.lr", "optimizer.param_groups.w.lr"], "both"),
    ],
)
def test_unknown_layouts_name_keys_and_options(keys: list[str], fragment: str) -> None:
    with pytest.raises(NotACheckpointError) as info:
        split_layout(keys, {k for k in keys if k.endswith(("w", "exp_avg"))}, "d")
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
