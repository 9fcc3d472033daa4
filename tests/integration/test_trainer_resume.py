"""Resume a Hugging Face Trainer + DeepSpeed run at another process count / ZeRO stage.

Real ``transformers`` + ``accelerate`` + DeepSpeed on CPU (gloo), a tiny ``LlamaForCausalLM``
built from a config, no downloads (``tests/fixtures/trainer_runs.py``). The saving runs (2
processes: ZeRO-2 fp32, ZeRO-3 bf16; checkpoint-3 of 6 steps) are cached under
``tests/.cache/trainer``; the commands of docs/trainer.md then run on a copy of each
``checkpoint-3/`` and the stock Trainer resumes from it with ``resume_from_checkpoint``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

import torch

from tests.conftest import REPO
from tests.fixtures.trainer_runs import RESUMES, TRAINER_FILES, ResumeResult

pytestmark = [pytest.mark.trainer, pytest.mark.deepspeed]

CACHE = Path(os.environ.get("UCFORMAT_TRAINER_CACHE", REPO / "tests" / ".cache" / "trainer"))
SAVED_STEP = 3
RESUMED_STEPS = ("4", "5", "6")


@pytest.fixture(scope="module")
def saved() -> dict[str, Path]:
    from tests.fixtures.trainer_runs import generate_saves

    return generate_saves(CACHE)


@pytest.fixture(scope="module")
def resumed(saved: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.fixtures.trainer_runs import run_resumes

    return run_resumes(RESUMES, saved, tmp_path_factory.mktemp("trainer"))


def _load(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _saved_result(saved: dict[str, Path], name: str) -> dict[str, Any]:
    import json

    result: dict[str, Any] = json.loads((saved[name] / "result.json").read_text())
    return result


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Every gathered fp32 weight and Adam state, bit for bit, and the counters."""
    assert set(got["fp32"]) == set(want["fp32"]) and want["fp32"]
    for name, tensor in want["fp32"].items():
        assert got["fp32"][name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(got["fp32"][name], tensor), f"{name}: fp32 master weight differs"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][name][key], want["optim"][name][key]), (name, key)
    for key in ("optimizer_steps", "lr", "scheduler_last_epoch", "engine_global_steps"):
        assert got[key] == want[key], key
    assert got["global_step"] == want["global_step"] == SAVED_STEP


def _check_commands(result: ResumeResult, world_size: int, stage: int) -> None:
    for command, (code, out, err) in result.commands.items():
        assert code == 0, f"ucformat {command} failed: {out}{err}"
    for verify in ("verify", "verify-export"):
        assert result.commands[verify][1].startswith("ok: "), result.commands[verify]
    tag = f"global_step{SAVED_STEP}_ws{world_size}_zero{stage}"
    assert result.latest == tag
    assert result.tags == sorted([f"global_step{SAVED_STEP}", tag])
    assert f"latest: global_step{SAVED_STEP} -> {tag}" in result.commands["export"][2]
    assert all(result.untouched.values()), result.untouched
    assert set(result.untouched) >= {f"global_step{SAVED_STEP}", "trainer_state.json"}
    assert (
        {"rng_state_0.pth", "rng_state_1.pth"}
        <= set(result.untouched)
        <= {
            *TRAINER_FILES,
            f"global_step{SAVED_STEP}",
        }
    )


def _samples(result: dict[str, Any], step: str) -> list[int]:
    return sorted(i for rank in result["samples"] for i in rank.get(step, []))


def test_same_size_resume_repeats_the_uninterrupted_losses(
    saved: dict[str, Path], resumed: dict[str, ResumeResult]
) -> None:
    """(a) ZeRO-2 fp32 at 2 processes -> convert -> export at 2 -> losses 4-6 bit for bit."""
    result = resumed["z2-fp32@ws2-z2"]
    _check_commands(result, world_size=2, stage=2)
    uninterrupted = _saved_result(saved, "z2-fp32")
    trainer = result.trainer
    assert trainer["failures"] == []
    assert trainer["final_global_step"] == 6
    for rank, (got, want) in enumerate(
        zip(trainer["losses"], uninterrupted["losses"], strict=True)
    ):
        assert sorted(got) == list(RESUMED_STEPS), f"rank {rank} trained steps {sorted(got)}"
        for step in RESUMED_STEPS:
            assert got[step] == want[step], f"rank {rank} step {step}: {got[step]} != {want[step]}"
    assert result.truth is not None
    _assert_same_state(_load(result.truth), _load(saved["z2-fp32"] / "truth.pt"))


@pytest.mark.parametrize(
    ("name", "source", "world_size", "stage"),
    [("z2-fp32@ws3-z3", "z2-fp32", 3, 3), ("z3-bf16@ws3-z1", "z3-bf16", 3, 1)],
)
def test_new_size_and_stage_resume_starts_from_the_saved_state(
    saved: dict[str, Path],
    resumed: dict[str, ResumeResult],
    name: str,
    source: str,
    world_size: int,
    stage: int,
) -> None:
    """(b) 2 -> 3 processes, ZeRO-2 -> 3 and bf16 ZeRO-3 -> 1: the gathered state at the
    start of the resumed training is the step-3 state bit for bit; training completes."""
    result = resumed[name]
    _check_commands(result, world_size=world_size, stage=stage)
    assert "no rng_state_R.pth for process 2" in result.commands["export"][2]
    trainer = result.trainer
    assert trainer["failures"] == []
    assert result.truth is not None
    got = _load(result.truth)
    want = _load(saved[source] / "truth.pt")
    _assert_same_state(got, want)
    assert want["wrapper"] != got["wrapper"]  # the other stage's optimizer really loaded it
    assert trainer["final_global_step"] == 6
    assert len(trainer["losses"]) == world_size
    for rank in trainer["losses"]:
        assert sorted(rank) == list(RESUMED_STEPS)
        assert all(math.isfinite(v) for step in RESUMED_STEPS for v in rank[step])
    assert trainer["log_steps"] == [1, 2, 3, 4, 5, 6]
    # Same global batch (3 x 2 = 2 x 3): the resumed steps train on the very samples the
    # uninterrupted run trained on, and step 4 (the loaded weights) gives the same mean loss.
    uninterrupted = _saved_result(saved, source)
    for step in RESUMED_STEPS:
        assert _samples(trainer, step) == _samples(uninterrupted, step), step
    mean = [sum(r["4"][0] for r in run["losses"]) / len(run["losses"])
            for run in (trainer, uninterrupted)]  # fmt: skip
    assert mean[0] == pytest.approx(mean[1], rel=1e-6)


def test_export_notes_say_what_the_trainer_will_do(saved: dict[str, Path], tmp_path: Path) -> None:
    """Dry runs into the saved folder itself: nothing written, the Trainer notes per size."""
    from tests.cli.helpers import invoke

    ckpt = saved["z2-fp32"] / "out" / f"checkpoint-{SAVED_STEP}"
    before = sorted(p.name for p in ckpt.iterdir())
    store = tmp_path / "ckpt.ucf"
    assert invoke("convert", ckpt, store).exit_code == 0

    def notes(world_size: int) -> str:
        result = invoke("export", "deepspeed", store, ckpt, "--world-size", world_size,
                        "--stage", 1, "--dry-run")  # fmt: skip
        assert result.exit_code == 0, result.stderr
        assert f"tag global_step{SAVED_STEP}_ws{world_size}_zero1" in result.stdout
        return str(result.stderr)

    one = notes(1)
    assert "reads rng_state.pth, which this checkpoint lacks" in one
    assert "global batch was 6 samples; resume with per_device_train_batch_size x " in one
    assert "x 1 = 6" in one
    four = notes(4)
    assert "no rng_state_R.pth for process 2, 3" in four
    assert "not a multiple of 4 processes" in four
    same = notes(2)
    assert "Trainer" not in same  # same size: every rank has its file, same data order
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_a_store_in_the_checkpoint_folder_resumes_through_resume_from_checkpoint(
    saved: dict[str, Path], resumed: dict[str, ResumeResult]
) -> None:
    """``ucformat convert checkpoint-3 checkpoint-3/ckpt.ucf``, DeepSpeed's files deleted, then
    ``ucformat.transformers.Trainer(...).train(resume_from_checkpoint=checkpoint-3)`` at 3
    processes and ZeRO-3 (saved: 2 processes, ZeRO-2): the Trainer's own resume restores its
    state and RNG files, the store the engine; the state at the start equals the saving run's
    step-3 state bit for bit (lr, scheduler, steps included), global step 3 -> 6 on the same
    samples, and step 4's mean loss is the W=2 native resume's."""
    result = resumed["z2-fp32@ws3-z3-store"]
    for command, (code, out, err) in result.commands.items():
        assert code == 0, f"ucformat {command} failed: {out}{err}"
    assert result.commands["verify"][1].startswith("ok: ")
    assert result.tags == ["ckpt.ucf"]  # no DeepSpeed folder left to read
    assert all(result.untouched.values()) and "trainer_state.json" in result.untouched
    trainer = result.trainer
    assert trainer["failures"] == []
    assert result.truth is not None
    got, want = _load(result.truth), _load(saved["z2-fp32"] / "truth.pt")
    _assert_same_state(got, want)
    assert want["wrapper"] != got["wrapper"]  # ZeRO-2 saved, ZeRO-3 resumed
    assert trainer["final_global_step"] == 6 and trainer["log_steps"] == [1, 2, 3, 4, 5, 6]
    native = resumed["z2-fp32@ws2-z2"].trainer  # the W=2 native resume (= uninterrupted)
    for step in RESUMED_STEPS:
        assert _samples(trainer, step) == _samples(native, step), step
    mean = [sum(r["4"][0] for r in run["losses"]) / len(run["losses"]) for run in (trainer, native)]
    assert mean[0] == pytest.approx(mean[1], rel=1e-6)
