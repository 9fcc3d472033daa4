"""DeepSpeed -> convert -> ``ucformat.torch.load`` into a plain model and ``torch.optim`` optimizer.

The model and the optimizer are built exactly as an unsharded run would build them (same param
groups, torch Adam or AdamW matching the DeepSpeed optimizer's math, a different seed); after
the load every tensor must equal the truth read from the live DeepSpeed engine, the optimizer's
``state_dict()`` must have the structure torch itself produces (param ids, ``step`` dtype, group
keys), the forward loss on a fixed batch must equal the saved engine's, and training continues.
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
from tests.truth import assert_exact, load_truth, plain
from ucformat.errors import ModelMismatchError, UnsupportedExportError
from ucformat.read.checkpoint import UniversalCheckpoint

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
COMMITTED = sorted(p.name for p in DATA.iterdir() if (p / "truth.pt").exists())
#: Grid cases with several groups, sub-groups, BF16_Optimizer, alignment, torch AdamW.
GRID = [
    "z2-fp32-tadam-multi-ws4",
    "z3-fp32-dsadam-multi-ws2-sg12",
    "z1-bf16-tadam-multi-ws2-bf16opt",
    "z2-bf16-dsadam-multi-ws3-palign",
    "z3-bf16-tadamw-multi-ws3",
    "z1-fp16-dsadam-multi-ws4",
]
LP = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PROBE_STEP = 10_000  # tests/fixtures/_ds_save_worker.PROBE_STEP


def fresh(case: dict[str, Any], adamw: bool | None = None) -> tuple[torch.nn.Module, Any]:
    """The model in its training dtype and the torch optimizer an unsharded run would use."""
    model, groups = build_model(case["model"], seed=2024)
    for param in model.parameters():  # DeepSpeed casts parameters, not buffers
        param.data = param.data.to(LP[case["dtype"]])
    if adamw is None:
        adamw = case["optimizer"] != "torch_adam"  # DeepSpeed's "Adam" is AdamW math
    return model, grid_adam(groups, adamw=adamw)


def probe(model: torch.nn.Module, case: dict[str, Any]) -> float:
    inputs, targets = make_batch(case["model"], PROBE_STEP, 0, 4)
    if inputs.is_floating_point():
        inputs = inputs.to(LP[case["dtype"]])
    model.eval()
    with torch.no_grad():
        return float(loss_fn(model(inputs), targets).item())


def check_plain_torch_load(store: Path, truth: dict[str, Any]) -> None:
    case = truth["case"]
    model, optimizer = fresh(case)
    report = uctorch.load(model, optimizer, store)
    assert (report.missing, report.unexpected) == ([], [])
    assert report.client_state["iteration"] == truth["client_state"]["iteration"]
    state = model.state_dict()
    for name, want in truth["module"].items():
        assert_exact(state[name], want, f"model {name}")
    for alias, owner in truth["shared_params"].items():
        assert model.get_parameter(alias) is model.get_parameter(owner)

    saved = optimizer.state_dict()
    names = [n for g in truth["param_groups"] for n in g["param_names"]]
    sizes = [len(g["param_names"]) for g in truth["param_groups"]]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert [g["params"] for g in saved["param_groups"]] == [
        list(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)
    ]
    for index, name in enumerate(names):
        entry = saved["state"][index]
        for key in ("exp_avg", "exp_avg_sq"):
            want = truth["optim"][name][key].to(LP[case["dtype"]])  # torch casts to param dtype
            assert_exact(entry[key], want, f"{name} {key}")
        assert_exact(entry["step"], torch.tensor(float(truth["step"][name])), f"{name} step")
    for group, want in zip(saved["param_groups"], truth["param_groups"], strict=True):
        for key in ("lr", "eps", "weight_decay"):
            assert group[key] == want[key], key
        assert plain(group["betas"]) == plain(want["betas"])
        assert group["decoupled_weight_decay"] == (case["optimizer"] != "torch_adam")

    # The structure torch itself produces for the same model and groups after a step.
    reference_model, reference = fresh(case)
    inputs, targets = make_batch(case["model"], 0)
    if inputs.is_floating_point():
        inputs = inputs.to(LP[case["dtype"]])
    loss_fn(reference_model(inputs), targets).backward()
    reference.step()
    expected = reference.state_dict()
    assert [sorted(g) for g in saved["param_groups"]] == [
        sorted(g) for g in expected["param_groups"]
    ]
    assert [g["params"] for g in saved["param_groups"]] == [
        g["params"] for g in expected["param_groups"]
    ]
    for index, entry in saved["state"].items():
        ref = expected["state"][index]
        assert list(entry) == list(ref)
        assert entry["step"].dtype == ref["step"].dtype and entry["step"].dim() == 0

    if "probe_loss" in truth:  # the committed fixtures predate it; every grid case has it
        assert probe(model, case) == truth["probe_loss"]
    model.train()
    for step in range(case["steps"], case["steps"] + 2):
        inputs, targets = make_batch(case["model"], step)
        if inputs.is_floating_point():
            inputs = inputs.to(LP[case["dtype"]])
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
    assert float(optimizer.state_dict()["state"][0]["step"]) == truth["global_steps"] + 2


@pytest.fixture(scope="module")
def committed_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for case in COMMITTED:
        out[case] = root / f"{case}.ucf"
        ucformat.convert(DATA / case / "ckpt", out[case])
    return out


@pytest.mark.parametrize("case", COMMITTED)
def test_committed_fixture_into_plain_torch(case: str, committed_stores: dict[str, Path]) -> None:
    check_plain_torch_load(committed_stores[case], load_truth(DATA / case))


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", GRID)
def test_grid_case_into_plain_torch(case: str, ds_grid: Path, tmp_path: Path) -> None:
    ucformat.convert(ds_grid / case / "ckpt", tmp_path / "s.ucf")
    check_plain_torch_load(tmp_path / "s.ucf", load_truth(ds_grid / case))


def test_state_dicts_are_torch_format(committed_stores: dict[str, Path]) -> None:
    case = "z3-fp16-tadam-multi-ws2"
    truth = load_truth(DATA / case)
    state = uctorch.state_dicts(committed_stores[case])
    assert set(state) == {"model", "optimizer"}
    assert state["model"].keys() == truth["module"].keys()
    for name, want in truth["fp32"].items():
        assert_exact(state["model"][name], want, name)
    groups = state["optimizer"]["param_groups"]
    assert [g["params"] for g in groups] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert groups[1]["lr"] == truth["param_groups"][1]["lr"] and groups[1]["weight_decay"] == 0.0
    half = uctorch.state_dicts(committed_stores[case], dtype=torch.float16, optimizer=False)
    assert half["optimizer"] is None
    for name, want in truth["module"].items():
        assert_exact(half["model"][name], want, name)


def test_fused_adam_store_gets_torch_adamw_groups(committed_stores: dict[str, Path]) -> None:
    state = uctorch.optimizer_state_dict(committed_stores["z1-bf16-dsadam-simple-ws2"])
    group = state["param_groups"][0]
    assert "bias_correction" not in group and group["decoupled_weight_decay"] is True
    assert isinstance(group["betas"], tuple) and group["foreach"] is None
    raw = uctorch.optimizer_state_dict(
        committed_stores["z1-bf16-dsadam-simple-ws2"], torch_step=False
    )
    assert raw["state"][0]["step"] == 4 and type(raw["state"][0]["step"]) is int


def test_mismatched_model_fails_before_changing_anything(
    committed_stores: dict[str, Path],
) -> None:
    model, groups = build_model("multi", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelMismatchError, match=r"^the model does not match the checkpoint: "):
        uctorch.load(model, None, committed_stores["z1-bf16-dsadam-simple-ws2"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    del groups


def test_weight_decay_mode_mismatch(committed_stores: dict[str, Path]) -> None:
    store = committed_stores["z1-bf16-dsadam-simple-ws2"]  # FusedAdam in AdamW mode
    case = load_truth(DATA / "z1-bf16-dsadam-simple-ws2")["case"]
    model, adam = fresh(case, adamw=False)
    with pytest.raises(ModelMismatchError, match=r"use torch\.optim\.AdamW, or pass strict=False"):
        uctorch.load(model, adam, store)
    uctorch.load(model, adam, store, strict=False)  # keeps the optimizer's own setting
    assert adam.param_groups[0]["decoupled_weight_decay"] is False
    model, wrong_groups = fresh(case)
    wrong_groups.param_groups[0]["params"] = wrong_groups.param_groups[0]["params"][:2]
    with pytest.raises(ModelMismatchError, match="param groups do not match"):
        uctorch.load(model, wrong_groups, store)


def test_store_without_optimizer_state(committed_stores: dict[str, Path]) -> None:
    ckpt = ucformat.open(committed_stores["z1-bf16-dsadam-simple-ws2"])
    manifest = ckpt.manifest.model_copy(update={"optimizer": None})
    bare = UniversalCheckpoint(ckpt.store, manifest, "no optimizer")  # type: ignore[arg-type]
    assert uctorch.state_dicts(bare)["optimizer"] is None
    with pytest.raises(UnsupportedExportError, match="holds no optimizer state"):
        uctorch.optimizer_state_dict(bare)
    model, optimizer = fresh(load_truth(DATA / "z1-bf16-dsadam-simple-ws2")["case"])
    with pytest.raises(UnsupportedExportError, match="pass optimizer=None"):
        uctorch.load(model, optimizer, bare)
    uctorch.load(model, None, bare)
