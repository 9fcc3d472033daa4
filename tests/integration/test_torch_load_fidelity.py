"""``ucformat.torch.load`` leaves a plain model and optimizer exactly as torch's own load does.

Differential check: two identical fresh models and ``torch.optim`` optimizers (the training run's
param groups, another seed). A gets torch's own ``load_state_dict`` of the saved engine's truth
(fp32 master weights for trainable params, the saved frozen params and buffers, tied aliases;
per-parameter ``exp_avg``/``exp_avg_sq``/``step`` and the saved param groups, as torch's
``Optimizer.state_dict()`` lays them out); B gets ``ucformat.torch.load`` of the converted store.
Their ``state_dict()``s must be equal, bit for bit and type for type, right after the load and
after one more training step on a fixed batch (losses too). The sources were trained with
``torch.optim`` Adam/AdamW, so the truth's param groups are torch's own (DeepSpeed FusedAdam
stores are translated to torch keys by ucformat; ``test_export_torch.py`` covers them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from tests.fixtures.models import build_model, loss_fn, make_batch
from tests.fixtures.torch_optim import grid_adam
from tests.truth import load_truth

pytestmark = pytest.mark.deepspeed

SOURCES = [
    "z2-fp32-tadam-multi-ws4",  # two groups, torch Adam
    "z1-bf16-tadam-multi-ws2-bf16opt",  # BF16_Optimizer
    "z3-bf16-tadamw-multi-ws3",  # ZeRO-3, torch AdamW
    "z3-fp32-tadam-multi-ws3-sg12",  # ZeRO-3 sub-groups
    "z2-fp16-tadamw-ftb-ws2",  # frozen, tied, buffers
]
LP = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STEP_BATCH = 20_000


def _fresh(case: dict[str, Any], dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    model, groups = build_model(case["model"], seed=4321)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model, grid_adam(groups, adamw=case["optimizer"] == "torch_adamw")


def _torch_load_truth(model: torch.nn.Module, optimizer: Any, truth: dict[str, Any]) -> None:
    """torch's own load of the truth: ``load_state_dict`` of the dicts torch would have saved."""
    weights = dict(truth["module"])
    weights.update(truth["fp32"])  # the master weights (module holds their 16-bit copies)
    for alias, owner in truth["shared_params"].items():
        weights[alias] = weights[owner]
    model.load_state_dict(weights)
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for live, saved in zip(optimizer.param_groups, truth["param_groups"], strict=True):
        ids = []
        for param in live["params"]:
            name = names[id(param)]
            state[index] = {"step": truth["step"][name], **truth["optim"][name]}
            ids.append(index)
            index += 1
        group = {k: v for k, v in saved.items() if k != "param_names"}
        groups.append({**group, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _differences(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
        return [] if same else [f"{path}: torch {a!r} != ucformat {b!r}"[:300]]
    if type(a) is not type(b):
        return [f"{path}: type {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: torch {a!r} != ucformat {b!r}"]


def _step(
    model: torch.nn.Module, optimizer: Any, case: dict[str, Any], dtype: torch.dtype
) -> float:
    inputs, targets = make_batch(case["model"], STEP_BATCH, 0, 4)
    if inputs.is_floating_point():
        inputs = inputs.to(dtype)
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    return {"model": dict(model.state_dict()), "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("dtype", ["fp32", "train"])
@pytest.mark.parametrize("source", SOURCES)
def test_torch_load_equals_torch_own_load(
    source: str, dtype: str, ds_grid: Path, tmp_path: Path
) -> None:
    truth = load_truth(ds_grid / source)
    case = truth["case"]
    store = tmp_path / "store.ucf"
    ucformat.convert(ds_grid / source / "ckpt", store)
    model_dtype = torch.float32 if dtype == "fp32" else LP[case["dtype"]]
    model_a, optimizer_a = _fresh(case, model_dtype)
    model_b, optimizer_b = _fresh(case, model_dtype)
    _torch_load_truth(model_a, optimizer_a, truth)
    uctorch.load(model_b, optimizer_b, store)
    assert _differences(_state(model_a, optimizer_a), _state(model_b, optimizer_b), "loaded") == []
    loss_a = _step(model_a, optimizer_a, case, model_dtype)
    loss_b = _step(model_b, optimizer_b, case, model_dtype)
    assert loss_a == loss_b
    assert _differences(_state(model_a, optimizer_a), _state(model_b, optimizer_b), "stepped") == []
