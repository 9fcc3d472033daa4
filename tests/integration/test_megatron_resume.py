"""Back into Megatron-Core at another layout: ``export megatron`` folders loaded by Megatron's own
``dist_checkpointing.load`` (Megatron-LM's steps), and ``ucformat.megatron.load`` of the store,
against Megatron's own reshardable load of the original checkpoint and the saving job's state.

Sources: the checkpoints of :mod:`tests.fixtures.megatron_cases` (TP=2 fp32 / bf16 with
non-distributed optimizers; the distributed optimizer at TP=2 x DP=2, DP=2, PP=2 (uneven, tied),
PP=2 x TP=2 with virtual stages; MoE EP=2 with SequentialMLP + shared expert, and GroupedMLP).
Every job of :data:`~tests.fixtures.megatron_resume_cases.RESUMES` runs the saving job's model
at the new layout; two torchrun launches (world sizes 1 and 2).

The judges, per resume:

* the state the resumed job holds, gathered at TP=1 under the store's names by the fixture
  worker's own code (not ucformat's): every weight, fp32 master, ``exp_avg``, ``exp_avg_sq`` and
  the step bit-equal to the saving job's (``truth.pt``), the groups' hyper-parameters equal;
* two more training steps: the same losses as Megatron's own load of the original checkpoint at
  that layout (where Megatron can load it), and the same for both optimizer kinds;
* at one layout and optimizer kind, every tensor a rank holds (the model's ``state_dict()``,
  each inner optimizer's torch state and master weights) bit-equal across the loaders.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.megatron_cases import CASES
from tests.fixtures.megatron_resume_cases import RESUMES, Resume, Run, run_resumes, source_truth

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (the 'megatron' extra)",
)

TRAINED = [r for r in RESUMES if not r.model_only and not r.expect_refusal]
#: Resumes that differ only in the optimizer kind: their losses must be the same.
KIND_PAIRS = [
    ("tp2-fp32>tp1", "tp2-fp32>tp1-dist"),
    ("tp2-bf16>tp1", "tp2-bf16>tp1-dist"),
    ("dp2-bf16>tp2", "dp2-bf16>tp2-plain"),
]
_HYPER = ("lr", "weight_decay", "wd_mult", "lr_mult", "is_expert_parallel", "betas", "eps")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Run]]:
    return run_resumes(tmp_path_factory.mktemp("megatron-resume"))


def _losses(run: Run) -> list[list[float | None]]:
    """Each rank's losses (None for a pipeline rank without the loss)."""
    return [[x if not math.isnan(x) else None for x in rank["losses"]] for rank in run.ranks]


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("resume", TRAINED, ids=lambda r: r.name)
def test_resumed_job_holds_the_saving_jobs_state(
    runs: dict[str, dict[str, Run]], resume: Resume
) -> None:
    truth = source_truth(resume)
    assert set(runs[resume.name]) == set(resume.hows)
    for how, run in runs[resume.name].items():
        held = run.truth
        assert held["params"].keys() == truth["params"].keys(), how
        for name, values in truth["params"].items():
            for state in ("weight", "fp32", "exp_avg", "exp_avg_sq"):
                got = held["params"][name][state]
                assert got.dtype == values[state].dtype, (how, name, state)
                assert torch.equal(got, values[state]), (how, name, state)
            for key in _HYPER:
                if key == "is_expert_parallel" and resume.ep != CASES[resume.source].ep:
                    continue  # experts join the dense groups at EP=1 (and leave them at EP>1)
                assert held["groups"][name][key] == truth["groups"][name][key], (how, name, key)
        assert held["step"] == truth["step"], how


@pytest.mark.parametrize("resume", TRAINED, ids=lambda r: r.name)
def test_two_more_steps_give_the_oracles_losses(
    runs: dict[str, dict[str, Run]], resume: Resume
) -> None:
    """Megatron's own load of the original checkpoint where it can; else every loader alike."""
    loaders = runs[resume.name]
    reference = loaders.get("original") or loaders[resume.hows[0]]
    expected = _losses(reference)
    assert any(x is not None for rank in expected for x in rank)
    for how, run in loaders.items():
        assert _losses(run) == expected, how


@pytest.mark.parametrize("pair", KIND_PAIRS, ids=lambda p: p[0])
def test_both_optimizer_kinds_train_alike(
    runs: dict[str, dict[str, Run]], pair: tuple[str, str]
) -> None:
    """The same job with the non-distributed and the distributed optimizer: the same losses."""
    plain, dist = (runs[name]["megatron-lm"] for name in pair)
    assert _losses(plain) == _losses(dist)
    assert _losses(runs[pair[0]]["ucformat"]) == _losses(runs[pair[1]]["ucformat"])


@pytest.mark.parametrize("resume", TRAINED, ids=lambda r: r.name)
def test_loaders_hold_the_same_tensors(runs: dict[str, dict[str, Run]], resume: Resume) -> None:
    """At one layout and optimizer kind every tensor each rank holds, bit for bit."""
    loaders = runs[resume.name]
    reference = loaders.get("original") or loaders[resume.hows[0]]
    for how, run in loaders.items():
        for rank, (got, want) in enumerate(zip(run.ranks, reference.ranks, strict=True)):
            _assert_same(got["held"], want["held"], f"{how} rank {rank}")


def test_the_distributed_optimizer_reads_each_dp_ranks_shard(
    runs: dict[str, dict[str, Run]],
) -> None:
    """TP=1 x DP=2: each rank needs the whole model and its half of the optimizer state; the two
    ranks' optimizer ranges tile every parameter exactly once (reading its own boxes, each rank
    fetches at least what it needs; reading once, the job does)."""
    import ucformat
    from ucformat.format.spec import FP32_STATE

    store = Path(runs["tp2dp2>dp2"]["ucformat"].ranks[0]["report"]["store"])
    manifest = ucformat.open(store).manifest
    model = sum(e.states[FP32_STATE].nbytes for e in manifest.params.values())
    optimizer = sum(
        ref.nbytes for e in manifest.params.values() for s, ref in e.states.items()
    )  # the fp32 master, exp_avg, exp_avg_sq
    for name in ("tp2dp2>dp2-own", "tp2dp2>dp2"):
        reports = runs[name]["ucformat"].reports
        assert sum(r["bytes_needed"] for r in reports) == 2 * model + optimizer
        for report in reports:
            assert model < report["bytes_needed"] < model + optimizer
            if report["read_mode"] == "own":
                assert report["bytes_read"] >= report["bytes_needed"]
        assert reports[0]["job_bytes_read"] >= optimizer  # every array, whole


def test_read_once_equals_own_reads(runs: dict[str, dict[str, Run]]) -> None:
    """TP=1 x DP=2 with the distributed optimizer: both ranks hold the whole model, so
    ``read="auto"`` reads once (each chunk by one rank, shared over the job's group); every
    tensor each rank holds equals, bit for bit, what ``read="own"`` loads, and the job fetches
    from storage at most 1.02x the bytes of the arrays it loads (each once), where own reads
    fetch the model's twice."""
    import ucformat

    once, own = runs["tp2dp2>dp2"]["ucformat"], runs["tp2dp2>dp2-own"]["ucformat"]
    for rank, (got, want) in enumerate(zip(once.ranks, own.ranks, strict=True)):
        _assert_same(got["held"], want["held"], f"rank {rank}")
    assert [r["read_mode"] for r in once.reports] == ["once", "once"]
    assert [r["read_mode"] for r in own.reports] == ["own", "own"]
    manifest = ucformat.open(Path(once.reports[0]["store"])).manifest
    needed = sum(ref.nbytes for e in manifest.params.values() for ref in e.states.values())
    fetched = once.reports[0]["job_bytes_read"]
    assert fetched == sum(r["bytes_read"] for r in once.reports)
    assert fetched <= 1.02 * needed, (fetched, needed)
    assert sum(r["bytes_sent"] for r in once.reports) > 0
    assert own.reports[0]["job_bytes_read"] > 1.2 * fetched  # the model read by both ranks


def test_a_store_of_the_models_own_names_loads(runs: dict[str, dict[str, Run]]) -> None:
    """A store that did not come from Megatron (``ucformat.torch.save`` of the TP=1 model: its
    ``state_dict()`` names) loads by name at TP=2, to the same tensors as the Megatron store."""
    megatron = runs["tp2-fp32>tp2-model"]["ucformat"]
    named = runs["torch-names>tp2"]["ucformat"]
    for got, want in zip(named.ranks, megatron.ranks, strict=True):
        _assert_same(got["held"]["model"], want["held"]["model"], "model")


def test_another_network_is_refused_in_one_line(runs: dict[str, dict[str, Run]]) -> None:
    """A 3-layer model from the 2-layer store: nothing loaded, one line naming what is missing."""
    message = runs["tp2-fp32>3-layers"]["ucformat"].refused
    assert "\n" not in message and "Nothing was loaded" in message
    assert "missing from the store: " in message
    assert "decoder.layers.self_attention.linear_qkv.weight[2]" in message


def test_hugging_face_names_are_refused_in_one_line(runs: dict[str, dict[str, Run]]) -> None:
    message = runs["hf-llama>tp1"]["ucformat"].refused
    assert "\n" not in message
    assert "missing from the store: " in message
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in message
    assert "Hugging Face Llama names" in message and "not back" in message


def test_hf_mixtral_export_gives_megatrons_logits(
    runs: dict[str, dict[str, Run]], tmp_path: Path
) -> None:
    """``export safetensors --names hf-mixtral`` of the GroupedMLP MoE store, loaded by
    transformers' own ``MixtralForCausalLM.from_pretrained`` (it converts the hub's per-expert
    ``w1``/``w2``/``w3`` names): the logits of Megatron's model holding the same fp32 masters.
    float32 throughout; the two implementations order RMSNorm, RoPE, softmax and the expert sum
    differently: atol 1e-5."""
    from transformers import MixtralForCausalLM

    from tests.fixtures._megatron_worker import tokens
    from ucformat.export.safetensors import export_safetensors

    run = runs["ep2-grouped>fp32"]["ucformat"]
    store = run.reports[0]["store"]
    export_safetensors(store, tmp_path / "hf", names="hf-mixtral", dtype="fp32")
    model = MixtralForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    with torch.no_grad():
        logits = model.eval()(input_ids=tokens(0)[:, :-1]).logits
    megatron = run.ranks[0]["held"]["logits"]
    assert megatron is not None and logits.shape == megatron.shape
    torch.testing.assert_close(logits, megatron, rtol=0, atol=1e-5)
