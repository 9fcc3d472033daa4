"""A DeepSpeed PipelineModule at pp2 x tp2 (a ``model`` topology axis; column- and row-parallel
Linear layers over the model-parallel group, ZeRO-1, fp32), made by DeepSpeed itself
(tests/fixtures/pp_cases.py, case ``pp2mp2-z1-fp32``), converted by ``ucformat.convert`` from
the ``universal_checkpoint_info`` patterns its training script saved, compared with the job's
own gathered full state and with DeepSpeed's ``ds_to_universal``; the same run saved without
those patterns is refused in one line; the store loads into a plain torch network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from tests.conftest import deepspeed_available
from tests.fixtures.pp_cases import BARE_CKPT, GRAD_ACCUM, LR, SAVE_STEPS, WIDTH
from ucformat.errors import UnsupportedCheckpointError

pytestmark = pytest.mark.deepspeed

CASE = "pp2mp2-z1-fp32"
PLAIN = "pp2mp2-z1-fp32-plain"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
#: Layers 0 and 3 column-parallel (dim 0), 1 and 4 row-parallel weights (dim 1), their biases
#: and the LayerNorms (2, 5) replicated.
SPLITS = {
    "0.weight": ("split", 0), "0.bias": ("split", 0), "1.weight": ("split", 1),
    "1.bias": ("replicated", None), "2.weight": ("replicated", None),
    "2.bias": ("replicated", None),
}  # fmt: skip


@pytest.fixture(scope="module")
def case_dir() -> Path:
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.pp_cases import generate_pipeline

    return generate_pipeline()[CASE]


@pytest.fixture(scope="module")
def store(case_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pptp") / "store"
    ucformat.convert(case_dir / "ckpt", out)
    return out


def _truth(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    truth: dict[str, dict[str, torch.Tensor]] = {}
    for stage in range(2):
        truth.update(torch.load(folder / f"truth-stage{stage}.pt"))
    return truth


def _check(store: Path, want: dict[str, dict[str, torch.Tensor]]) -> None:
    ckpt = ucformat.open(store)
    assert sorted(ckpt.manifest.params) == sorted(want)
    for name, states in want.items():
        for state in STATES:
            got = ckpt.read(name, state)
            assert got.dtype == torch.float32, (name, state)
            assert torch.equal(got, states[state].reshape(got.shape)), (name, state)
        assert float(ckpt.read(name, "step")) == float(SAVE_STEPS), name


def test_pp_tp_converts_like_the_training_job_holds_it(case_dir: Path, store: Path) -> None:
    truth = _truth(case_dir)
    assert truth["0.weight"]["fp32"].shape == (2 * WIDTH, WIDTH)  # full, not a shard
    assert truth["1.weight"]["fp32"].shape == (WIDTH, 2 * WIDTH)
    _check(store, truth)
    manifest = ucformat.open(store).manifest
    pipeline = manifest.source.pipeline
    assert pipeline is not None
    assert [s.layers for s in pipeline.stages] == [[0, 1, 2], [3, 4, 5]]
    assert pipeline.data_parallel == 1
    tp = manifest.tensor_parallel
    assert tp is not None and tp.framework == "deepspeed-patterns" and tp.degree == 2
    # Written by this writer: format 3.1, every array in a stack (format.md §5)
    assert manifest.format_version == "3.1"
    for name, (kind, dim) in SPLITS.items():
        for layer in (name, f"{int(name[0]) + 3}{name[1:]}"):
            split = tp.params[layer]
            assert (split.kind, split.dim) == (kind, dim), layer
            assert split.logical_shape == list(manifest.params[layer].shape)
            assert split.widths == (None if kind == "replicated" else [8, 8])


def test_pp_tp_converts_like_ds_to_universal(case_dir: Path, store: Path) -> None:
    from tests.fixtures.pp_cases import to_universal
    from tests.integration.test_pipeline_convert import _universal_params

    universal = to_universal({CASE: case_dir})[CASE]
    _check(store, _universal_params(universal))


def test_pp_tp_without_universal_checkpoint_info_is_refused_naming_a_split_param(
    case_dir: Path, tmp_path: Path
) -> None:
    # the column-parallel layer's shards have the same shape on both model ranks, but not the
    # same values: split along a dimension the files do not name
    with pytest.raises(UnsupportedCheckpointError) as info:
        ucformat.convert(case_dir / BARE_CKPT, tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message
    assert "layer_00-model_00-model_states.pt (no hints): param '0.weight': its '" in message
    assert "differs between model ranks 0 and 1" in message
    assert "no universal_checkpoint_info" in message
    assert not (tmp_path / "s" / "ucformat.json").exists()


def test_a_refusal_fails_every_process_of_a_distributed_convert(
    case_dir: Path, tmp_path: Path
) -> None:
    """Every process reads the checkpoint; the one-line refusal is agreed on (collective), so
    no process waits for the others: both exit with it, nothing is committed."""
    from tests.launch import REPO_ROOT, run_in_group, torchrun_command

    command = torchrun_command(
        2, [str(REPO_ROOT / "tests" / "fixtures" / "_limited_cli.py"), "convert",
            "--distributed", str(case_dir / BARE_CKPT), str(tmp_path / "s")],
    )  # fmt: skip
    done = run_in_group(command, timeout_s=600, capture=True)
    assert done.returncode not in (0, None), done.stdout[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("param '0.weight'" in line for line in errors), done.stderr[-3000:]
    assert not (tmp_path / "s" / "ucformat.json").exists()


def test_pp_tp_of_plain_layers_converts_without_hints(tmp_path: Path) -> None:
    """Plain layers copied on both model ranks (no split), saved without hints: every copy is
    byte-identical, so each parameter is stored once as replicated, equal to the job's own."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.pp_cases import generate_pipeline

    folder = generate_pipeline()[PLAIN]
    manifest = ucformat.convert(folder / "ckpt", tmp_path / "s")
    _check(tmp_path / "s", _truth(folder))
    tp = manifest.tensor_parallel
    assert tp is not None and tp.degree == 2
    assert {split.kind for split in tp.params.values()} == {"replicated"}
    assert manifest.source.pipeline is not None and manifest.source.pipeline.num_stages == 2


class _Plain(torch.nn.Module):
    """The pipeline's network without pipelining or tensor parallelism, same names."""

    def __init__(self) -> None:
        super().__init__()
        for base in (0, 3):
            self.add_module(str(base), torch.nn.Linear(WIDTH, 2 * WIDTH))
            self.add_module(str(base + 1), torch.nn.Linear(2 * WIDTH, WIDTH))
            self.add_module(str(base + 2), torch.nn.LayerNorm(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = dict(self.named_children())
        for base in (0, 3):
            x = torch.tanh(layers[str(base)](x))
            x = layers[str(base + 2)](layers[str(base + 1)](x))
        return x


@pytest.fixture(scope="module")
def engine_loads(
    case_dir: Path, store: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from dataclasses import asdict

    from tests.fixtures.pp_cases import by_name, generate_pipeline, run_pipeline_jobs, to_universal

    universal = to_universal({CASE: case_dir})[CASE]
    common = {"kind": "load", "case": asdict(by_name(CASE)), "dir": str(case_dir),
              "store": str(store)}  # fmt: skip
    plain_dir = generate_pipeline()[PLAIN]  # plain layers, saved without hints
    plain_store = tmp_path_factory.mktemp("pptp-plain") / "store"
    ucformat.convert(plain_dir / "ckpt", plain_store)
    plain = {"kind": "load", "case": asdict(by_name(PLAIN)), "dir": str(plain_dir),
             "store": str(plain_store), "universal": None, "world_size": 4}  # fmt: skip
    jobs = [
        {**plain, "name": "plain-pp2tp2", "native": True,
         "target": {"pp": 2, "dp": 1, "mp": 2, "plain": False}},
        {**plain, "name": "plain-pp2dp2",
         "target": {"pp": 2, "dp": 2, "mp": 1, "plain": False}},
        {**common, "name": "plain", "universal": str(universal),
         "target": {"pp": 1, "dp": 1, "plain": True}, "world_size": 1},
        {**common, "name": "pp1tp2", "universal": None,
         "target": {"pp": 1, "dp": 1, "plain": False}, "world_size": 2},
        {**common, "name": "pp2tp2", "universal": None,
         "target": {"pp": 2, "dp": 1, "plain": False}, "world_size": 4},
        {**common, "name": "pp1tp4", "universal": None,
         "target": {"pp": 1, "dp": 1, "mp": 4, "plain": False}, "world_size": 4},
        {**common, "name": "pp2tp1dp2", "universal": None,
         "target": {"pp": 2, "dp": 2, "mp": 1, "plain": False}, "world_size": 4},
    ]  # fmt: skip
    return run_pipeline_jobs(jobs, tmp_path_factory.mktemp("pptp-loads"))


def test_pp_tp_store_loads_into_a_plain_deepspeed_engine(
    case_dir: Path, engine_loads: dict[str, Any]
) -> None:
    import json

    # fp32 masters and Adam moments equal the training job's, and DeepSpeed's own universal
    # load of its ds_to_universal output gives the same state and the same next two losses
    result = engine_loads["plain"]
    assert result["failures"] == []
    assert result["oracle_losses"] == result["losses"]
    # same batches as the pp2 x tp2 run's (dp 1): its next losses, to float rounding
    want = json.loads((case_dir / "losses.json").read_text())
    assert result["losses"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", ["pp1tp2", "pp2tp2"])
def test_pp_tp_store_loads_into_a_pipeline_tp_engine(
    name: str, engine_loads: dict[str, Any]
) -> None:
    # every rank's fp32 shards and Adam moments (gathered over tp) equal the job's, each stage
    # reads at most its own params' bytes, and the next two losses equal the uninterrupted
    # run's bit for bit (same batches, same tp reductions)
    result = engine_loads[name]
    assert result["failures"] == []
    assert result["uninterrupted"] == result["losses"]


@pytest.mark.parametrize("name", ["pp1tp4", "pp2tp1dp2"])
def test_pp_tp_store_loads_at_another_tp_degree(name: str, engine_loads: dict[str, Any]) -> None:
    # tp2 -> tp4 (each full array cut in equal widths) and tp2 -> tp1 x dp2: every rank's state
    # (gathered over tp) equals the job's; the run continues
    result = engine_loads[name]
    assert result["failures"] == []
    assert len(result["losses"]) == 2 and "uninterrupted" not in result


def test_pp_tp_store_loads_into_a_plain_torch_model(case_dir: Path, store: Path) -> None:
    import json

    from tests.fixtures._pp_worker import batches

    torch.manual_seed(5)
    model = _Plain()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    uctorch.load(model, optimizer, store)
    truth = _truth(case_dir)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), truth[name]["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], truth[name][key]), (name, key)
        assert float(optimizer.state[param]["step"]) == float(SAVE_STEPS)
    # the next step's loss of the uninterrupted pp2 x tp2 run (its row-parallel sums are
    # all-reduced in another order: equal to float rounding)
    data = batches(SAVE_STEPS, 0, torch.float32)
    with torch.no_grad():
        losses = [
            torch.nn.functional.mse_loss(model(x), y)
            for x, y in (next(data) for _ in range(GRAD_ACCUM))
        ]
    want = json.loads((case_dir / "losses.json").read_text())[0]
    assert float(torch.stack(losses).mean()) == pytest.approx(want, rel=1e-5)


def test_pp_tp_of_plain_layers_loads_at_the_same_and_another_layout(
    engine_loads: dict[str, Any],
) -> None:
    """The plain-layer store resumes pp2 x tp2 (every model rank its whole copy; DeepSpeed's own
    load_checkpoint of the checkpoint is the oracle: same state, same next losses, which equal
    the uninterrupted run's) and pp2 x dp2 without tensor parallelism."""
    same = engine_loads["plain-pp2tp2"]
    assert same["failures"] == []
    assert same["oracle_losses"] == same["losses"] == same["uninterrupted"]
    assert engine_loads["plain-pp2dp2"]["failures"] == []
