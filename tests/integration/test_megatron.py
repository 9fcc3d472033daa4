"""Megatron-Core ``torch_dist`` checkpoints converted with their optimizer state, whatever the
layout and optimizer that saved them, against the saving job's own gathered state.

Real checkpoints (tests/fixtures/megatron_cases.py): tiny GPTModels trained 2 steps by
Megatron-Core 0.16.1 (GQA, SwiGLU, RMSNorm, RoPE) at TP=2 with FP32Optimizer and with
Float16OptimizerWithFloat16Params (bf16), with the distributed optimizer in both formats at DP=2
(bf16, several buckets), TP=2 x DP=2, PP=2 (uneven stages, tied embeddings), PP=2 x TP=2 with
virtual stages, and MoE models: EP=2 (SequentialMLP + shared expert, chained FP32Optimizers with
prefixed keys), EP=2 GroupedMLP in bf16 with the distributed optimizer (whose dp_reshardable
buckets hold each expert transposed), EP=2 x ETP=2 with the distributed optimizer. The oracle is
each job's ``truth.pt``: every parameter's weight, fp32 master, ``exp_avg`` and ``exp_avg_sq``
at TP=1, gathered from the live job, under the naming contract's names. Two torchrun launches
(W=2, W=4), cached under tests/.cache/megatron.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
from tests.fixtures.megatron_cases import CASES, generate_megatron, truth_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (the 'megatron' extra)",
)

#: Every checkpoint that converts with its optimizer state (case, format).
CONVERTS = [
    (name, fmt)
    for name, case in CASES.items()
    for fmt in case.formats
    if (name, fmt) != ("dp2-bf16", "fully_reshardable")
]
_HYPER = ("lr", "weight_decay", "wd_mult", "lr_mult", "is_expert_parallel", "betas", "eps")


@pytest.fixture(scope="module")
def cases() -> dict[str, Path]:
    return generate_megatron()


@pytest.fixture(scope="module")
def truths(cases: dict[str, Path]) -> dict[str, dict[str, Any]]:
    return {
        name: torch.load(truth_path(folder), weights_only=False) for name, folder in cases.items()
    }


@pytest.fixture(scope="module")
def stores(cases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every convertible checkpoint converted with no options (one through the CLI)."""
    work = tmp_path_factory.mktemp("megatron")
    out = {}
    for name, fmt in CONVERTS:
        store = work / f"{name}-{fmt}.ucf"
        if name == "tp2-fp32":
            result = CliRunner().invoke(app, ["convert", str(cases[name] / fmt), str(store)])
            assert result.exit_code == 0, result.output
        else:
            ucformat.convert(cases[name] / fmt, store)
        out[f"{name}/{fmt}"] = store
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize(("name", "fmt"), CONVERTS)
def test_convert_equals_the_saving_jobs_state(
    name: str, fmt: str, stores: dict[str, Path], truths: dict[str, dict[str, Any]]
) -> None:
    """Every weight, fp32 master, exp_avg, exp_avg_sq and step bit-equal to the job's; the names
    are the contract's; the param groups are the job's (membership and hyper-parameters)."""
    truth = truths[name]
    ckpt = ucformat.open(stores[f"{name}/{fmt}"])
    manifest = ckpt.manifest
    assert manifest.format_version == "3.1"
    assert list(manifest.params) == list(truth["params"]) or set(manifest.params) == set(
        truth["params"]
    )
    assert manifest.optimizer is not None and manifest.megatron is not None
    assert manifest.megatron.optimizer_stored
    assert manifest.megatron.optimizers == truth["optimizer"]
    for param, values in truth["params"].items():
        entry = manifest.params[param]
        assert entry.requires_grad and entry.group is not None, param
        assert entry.dtype == str(values["weight"].dtype).removeprefix("torch."), param
        master = ckpt.read(param, "fp32")
        assert torch.equal(_bits(master), _bits(values["fp32"])), param
        # the master is the weight (fp32), or rounds to it (bf16)
        assert torch.equal(master.to(values["weight"].dtype), values["weight"]), param
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(ckpt.read(param, state)), _bits(values[state])), (param, state)
        assert float(ckpt.read(param, "step")) == truth["step"], param
        group = manifest.optimizer.groups[entry.group]
        assert param in group.params
        want = {k: v for k, v in truth["groups"][param].items() if k in _HYPER}
        got = {k: group.hyperparams[k] for k in want}
        got = {k: list(v["$tuple"]) if isinstance(v, dict) else v for k, v in got.items()}
        assert got == want, param
    assert manifest.progress.global_steps == truth["iteration"] == 2
    client = manifest.client_state.values
    assert client["iteration"] == 2 and client["num_floating_point_operations_so_far"] == 24690
    assert client["args"]["tensor_model_parallel_size"] == CASES[name].tp
    assert "rng_state" in client and client["opt_param_scheduler"]["num_steps"] > 0
    assert ucformat.verify(stores[f"{name}/{fmt}"]).ok


def test_layout_and_names_do_not_depend_on_the_saving_layout(
    stores: dict[str, Path], truths: dict[str, dict[str, Any]]
) -> None:
    """PP=2 x TP=2 with virtual stages and PP=2 uneven store the layers under global numbers;
    MoE stores experts under global ids, the router and shared expert once per layer."""
    vpp = ucformat.open(stores["pp2tp2-vpp2/dp_reshardable"]).manifest.megatron
    assert vpp is not None and vpp.parallel is not None and vpp.num_layers == 4
    assert (vpp.parallel.tensor, vpp.parallel.pipeline, vpp.parallel.virtual_pipeline) == (2, 2, 2)
    # interleaved: pipeline rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
    assert vpp.parallel.pipeline_layers == [[[0, 1], [2, 1]], [[1, 1], [3, 1]]]
    qkv = vpp.params["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert (qkv.key, qkv.layer, qkv.axes) == (
        "decoder.layers.self_attention.linear_qkv.weight",
        3,
        ["layer"],
    )
    uneven = ucformat.open(stores["pp2-uneven/dp_reshardable"]).manifest.megatron
    assert uneven is not None and uneven.parallel is not None
    assert uneven.parallel.pipeline_layers == [[[0, 1]], [[1, 2]]]
    assert (
        "output_layer.weight"
        not in ucformat.open(stores["pp2-uneven/dp_reshardable"]).manifest.params
    )
    moe = ucformat.open(stores["ep2/none"]).manifest
    assert moe.megatron is not None and moe.megatron.num_experts == 4
    expert = moe.megatron.params["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert (expert.layer, expert.expert, expert.expert_parallel) == (1, 3, True)
    assert expert.axes == ["layer", "expert"] and expert.fused is not None
    assert expert.fused.sizes == [16, 16]
    assert moe.megatron.chained_prefix and moe.megatron.optimizers == ["FP32Optimizer"] * 2
    router = moe.megatron.params["decoder.layers.0.mlp.router.weight"]
    assert not router.expert_parallel and router.expert is None
    names = set(moe.params)
    grouped = set(ucformat.open(stores["ep2-grouped/fully_reshardable"]).manifest.params)
    assert grouped <= names and names - grouped == {
        n for n in names if "shared_experts" in n
    }  # GroupedMLP and SequentialMLP: the same names
    etp = ucformat.open(stores["ep2-etp2/dp_reshardable"]).manifest.megatron
    assert etp is not None and etp.parallel is not None
    assert (etp.parallel.expert, etp.parallel.expert_tensor, etp.parallel.data) == (2, 2, 4)
    fc1 = etp.params["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    # expert tensor parallel: each of 2 ranks wrote its slice of the gate and of the up half
    assert sorted(c.offsets[0] for c in fc1.chunks) == [0, 8, 16, 24]
    expert_groups = [g for g in moe.optimizer.groups if g.hyperparams["is_expert_parallel"]]  # type: ignore[union-attr]
    assert {n for g in expert_groups for n in g.params} == {
        n for n in names if "local_experts" in n
    }


def test_megatron_wrote_corrupt_fully_reshardable_state_and_convert_refuses(
    cases: dict[str, Path], tmp_path: Path
) -> None:
    """Megatron-Core 0.16.1's fully_reshardable writer gathers each buffer's buckets without the
    padding between them: with several buckets (``bucket_size``), the states of parameters after
    the first bucket are shifted (it logs "param range exceeds unpadded buffer ... padded with
    zeros"). The proof of the masters catches it: one line naming the parameter, exit 2,
    nothing written."""
    source = cases["dp2-bf16"] / "fully_reshardable"
    result = CliRunner().invoke(app, ["convert", str(source), str(tmp_path / "out.ucf")])
    assert result.exit_code == 2, result.output
    assert (
        "the fp32 main param of 'embedding.word_embeddings.weight' does not round" in result.output
    )
    assert (
        "Traceback" not in result.output and not (tmp_path / "out.ucf" / "ucformat.json").exists()
    )


def test_a_wrong_bucket_layout_is_refused_by_the_proof(
    cases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were the bucketing rule wrong (two parameters of equal size swapped), the masters cut out
    of the buckets no longer round to the weights: refused, naming the first such parameter."""
    from ucformat.errors import UnsupportedCheckpointError
    from ucformat.sources.megatron import buckets

    real = buckets.place_params

    def swapped(params: Any, unpadded: Any, padded: Any) -> Any:
        slots = real(params, unpadded, padded)
        sizes = [p.numel for p in params]
        first = sizes.index(32)  # a layer norm
        second = sizes.index(32, first + 1)
        slots[first], slots[second] = slots[second], slots[first]
        return slots

    monkeypatch.setattr(buckets, "place_params", swapped)
    with pytest.raises(
        UnsupportedCheckpointError,
        match=r"the fp32 main param of 'decoder\.layers\.\d\..*layer_norm_weight' does not round",
    ):
        ucformat.convert(cases["tp2dp2"] / "dp_reshardable", tmp_path / "out.ucf")


def test_inspect_shows_the_optimizer_and_groups(stores: dict[str, Path]) -> None:
    shown = CliRunner().invoke(app, ["inspect", str(stores["tp2dp2/dp_reshardable"])]).output
    assert "optimizer DistributedOptimizer dp_reshardable (stored)" in shown
    assert "saved at tp2 pp1 dp2" in shown
    assert "frozen" not in shown
    shown = CliRunner().invoke(app, ["inspect", str(stores["tp2-bf16/none"])]).output
    assert "optimizer Float16OptimizerWithFloat16Params (stored)" in shown and "frozen" not in shown


def test_fused_layout_is_recorded(stores: dict[str, Path]) -> None:
    layout = ucformat.open(stores["tp2-fp32/none"]).manifest.megatron
    assert layout is not None and layout.num_layers == 2
    qkv = layout.params["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert (qkv.key, qkv.layer) == ("decoder.layers.self_attention.linear_qkv.weight", 1)
    assert qkv.fused is not None and qkv.fused.kind == "qkv"
    assert (qkv.fused.num_query_groups, qkv.fused.heads_per_group, qkv.fused.head_dim) == (2, 2, 8)
    assert [(c.rank, c.offsets, c.sizes) for c in qkv.chunks] == [
        (0, [0, 0], [32, 32]), (1, [32, 0], [32, 32]),
    ]  # fmt: skip
    fc1 = layout.params["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.fused is not None and (fc1.fused.kind, fc1.fused.sizes) == ("gate_up", [48, 48])
    assert [(c.rank, c.offsets[0]) for c in fc1.chunks] == [(0, 0), (0, 48), (1, 24), (1, 72)]
    proj = layout.params["decoder.layers.0.self_attention.linear_proj.weight"]
    assert [c.offsets for c in proj.chunks] == [[0, 0], [0, 16]]  # row-parallel: split on dim 1


def test_hf_llama_export_gives_megatron_logits(
    stores: dict[str, Path], truths: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``export safetensors --names hf-llama`` -> transformers LlamaForCausalLM (eager attention)
    built from the exported config.json: the TP=2 Megatron model's logits (float32; the two
    implementations order RMSNorm, RoPE and softmax differently: atol 1e-5)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures._megatron_worker import MODEL, tokens

    out = tmp_path / "hf"
    args = ["export", "safetensors", str(stores["tp2-fp32/none"]), str(out), "--names", "hf-llama"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] == MODEL["ffn_hidden_size"]
    llama_config = LlamaConfig(**config)
    llama_config._attn_implementation = "eager"
    model = LlamaForCausalLM(llama_config).eval()
    weights = load_file(out / "model.safetensors")
    model.load_state_dict(weights, strict=True)
    qkv = truths["tp2-fp32"]["params"]["decoder.layers.0.self_attention.linear_qkv.weight"][
        "weight"
    ]
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], qkv[:32])
    torch.testing.assert_close(
        weights["model.layers.0.self_attn.k_proj.weight"], torch.cat([qkv[16:24], qkv[48:56]])
    )
    with torch.no_grad():
        logits = model(input_ids=tokens(0)[:, :-1]).logits
    torch.testing.assert_close(logits, truths["tp2-fp32"]["logits"], rtol=0, atol=1e-5)


def test_hf_llama_names_refuse_a_store_not_from_megatron(tmp_path: Path) -> None:
    from ucformat.errors import UnsupportedExportError
    from ucformat.export.safetensors import export_safetensors

    store = Path(__file__).resolve().parents[1] / "fixtures" / "data"
    source = next(store.glob("*/ckpt"))
    converted = tmp_path / "ds.ucf"
    ucformat.convert(source, converted)
    with pytest.raises(UnsupportedExportError, match="maps Megatron-Core GPT parameters"):
        export_safetensors(converted, tmp_path / "hf", names="hf-llama")


def test_without_training_args_qkv_is_kept_but_not_split(
    cases: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint saved without Megatron-LM's ``args`` (plain dist_checkpointing.save) converts
    with its optimizer; the head counts are unknown, so the manifest says so and the Llama
    export refuses."""
    from ucformat.errors import UnsupportedExportError
    from ucformat.export.safetensors import export_safetensors

    folder = tmp_path / "no-args"
    shutil.copytree(cases["tp2-fp32"] / "none", folder)
    common = torch.load(folder / "common.pt", weights_only=False)
    del common["args"]
    torch.save(common, folder / "common.pt")
    store = tmp_path / "no-args.ucf"
    ucformat.convert(folder, store)
    manifest = ucformat.open(store).manifest
    layout = manifest.megatron
    assert layout is not None and layout.model_args == {} and layout.optimizer_stored
    fused = layout.params["decoder.layers.0.self_attention.linear_qkv.weight"].fused
    assert fused is not None and not fused.known and fused.num_query_groups is None
    gate_up = layout.params["decoder.layers.0.mlp.linear_fc1.weight"].fused
    assert gate_up is not None and gate_up.sizes == [48, 48]  # from linear_fc2's width
    with pytest.raises(UnsupportedExportError, match="does not record the attention head counts"):
        export_safetensors(store, tmp_path / "hf", names="hf-llama")


def test_dp_reshardable_without_training_args_infers_the_layout(
    cases: dict[str, Path], truths: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Without Megatron-LM's ``args`` the tensor-parallel size comes from the embedding's boxes
    and the pipeline size from the bucket groups; the proof accepts what was inferred."""
    for name in ("tp2dp2", "pp2tp2-vpp2"):
        folder = tmp_path / name
        shutil.copytree(cases[name] / "dp_reshardable", folder)
        common = torch.load(folder / "common.pt", weights_only=False)
        del common["args"]
        torch.save(common, folder / "common.pt")
        ckpt = ucformat.convert(folder, tmp_path / f"{name}.ucf")
        store = ucformat.open(tmp_path / f"{name}.ucf")
        assert ckpt.optimizer is not None
        for param, values in truths[name]["params"].items():
            assert torch.equal(_bits(store.read(param, "exp_avg")), _bits(values["exp_avg"])), param


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_rng_states_are_kept_exactly(cases: dict[str, Path], stores: dict[str, Path]) -> None:
    """Every pipeline x tensor rank's RNG state, as torch's own DCP load of the object gives it
    (arrays as lists of their integers)."""
    import io

    from torch.distributed.checkpoint import FileSystemReader, load

    folder = cases["tp2dp2"] / "dp_reshardable"
    kept = ucformat.open(stores["tp2dp2/dp_reshardable"]).manifest.client_state.values["rng_state"]
    assert sorted(kept) == ["0.0", "0.1"]  # type: ignore[arg-type]
    for rank, states in kept.items():  # type: ignore[union-attr]
        key = f"rng_state/shard_{rank}_1.2"
        loaded: dict[str, Any] = {key: io.BytesIO()}
        load(loaded, storage_reader=FileSystemReader(folder), no_dist=True)
        (want,) = loaded[key]
        assert len(states) == len(want) == 1
        np_state = states[0]["np_rng_state"]["$tuple"]
        assert np_state[0] == "MT19937" and np_state[1] == want[0]["np_rng_state"][1].tolist()
        assert np_state[2:] == list(want[0]["np_rng_state"][2:])
        assert states[0]["torch_rng_state"] == want[0]["torch_rng_state"].tolist()
        random_state = states[0]["random_rng_state"]["$tuple"]
        assert random_state[1]["$tuple"] == list(want[0]["random_rng_state"][1])
