"""Megatron-Core ``torch_dist`` checkpoints: a real GPTModel (GQA, SwiGLU) trained at TP=2 with
Megatron's DDP and distributed Adam, saved by ``dist_checkpointing.save``, against its TP=1
reload through Megatron's own ``dist_checkpointing.load`` (tests/fixtures/megatron_cases.py).

Two torchrun launches (W=2 save, W=1 reload), cached under tests/.cache/megatron.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
from tests.fixtures.megatron_cases import generate_megatron, truth_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (the 'megatron' extra)",
)


@pytest.fixture(scope="module")
def megatron_dir() -> Path:
    return generate_megatron()


@pytest.fixture(scope="module")
def truth(megatron_dir: Path) -> dict[str, Any]:
    return torch.load(truth_path(megatron_dir), weights_only=False)


def test_fixture_tp1_reload_reproduces_the_tp2_model(megatron_dir: Path, truth: dict) -> None:
    """The oracle is Megatron's own TP=1 view of the TP=2 run: same logits, trained weights."""
    tp2 = torch.load(megatron_dir / "tp2.pt")
    assert tp2["losses"][-1] != tp2["losses"][0]
    assert truth["iteration"] == 2
    torch.testing.assert_close(truth["logits"], tp2["logits"], rtol=0, atol=1e-5)
    assert truth["optimizer"].keys() == truth["weights"].keys()
    for name, states in truth["optimizer"].items():
        assert set(states) == {"param", "exp_avg", "exp_avg_sq"}, name
        assert torch.equal(states["param"], truth["weights"][name]), name
        assert states["exp_avg_sq"].abs().sum() > 0, name


#: Megatron's local spec saves these module weights under TE-compatible keys
#: (TransformerLayer's sharded_state_dict_keys_map); the store keeps the checkpoint's keys.
_LOCAL_SPEC_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def store_name(module_name: str) -> str:
    """The store's name of a ``module.state_dict()`` name of the local-spec GPTModel."""
    for old, new in _LOCAL_SPEC_KEYS.items():
        if module_name.endswith(old):
            return module_name[: -len(old)] + new
    return module_name


@pytest.fixture(scope="module")
def stores(megatron_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both checkpoints converted by the CLI with no flags."""
    work = tmp_path_factory.mktemp("megatron")
    out = {}
    for sharding in ("fully_reshardable", "dp_reshardable"):
        store = work / f"{sharding}.ucf"
        result = CliRunner().invoke(app, ["convert", str(megatron_dir / sharding), str(store)])
        assert result.exit_code == 0, result.output
        out[sharding] = store
    return out


def test_convert_weights_and_optimizer_equal_megatron_tp1_reload(
    stores: dict[str, Path], truth: dict
) -> None:
    ckpt = ucformat.open(stores["fully_reshardable"])
    manifest = ckpt.manifest
    assert manifest.megatron is not None and manifest.megatron.optimizer_stored
    assert manifest.megatron.optimizer_sharding == "fully_reshardable"
    assert set(manifest.params) == {store_name(n) for n in truth["weights"]}
    for module_name, weight in truth["weights"].items():
        name = store_name(module_name)
        states = truth["optimizer"][module_name]
        assert torch.equal(ckpt.read(name, "fp32"), states["param"]), name
        assert torch.equal(ckpt.read(name, "fp32"), weight), name
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ckpt.read(name, state), states[state]), (name, state)
        assert ckpt.read(name, "step") == 2.0
        group = manifest.optimizer.groups[manifest.params[name].group]  # type: ignore[union-attr]
        wd_mult = group.hyperparams["wd_mult"]
        assert wd_mult == (0.0 if weight.dim() == 1 else 1.0), name
    assert manifest.progress.global_steps == truth["iteration"]


def test_convert_records_megatron_layout(stores: dict[str, Path], truth: dict) -> None:
    layout = ucformat.open(stores["fully_reshardable"]).manifest.megatron
    assert layout is not None and layout.num_layers == 2
    qkv = layout.params["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert (qkv.key, qkv.layer) == ("decoder.layers.self_attention.linear_qkv.weight", 1)
    assert qkv.fused is not None and qkv.fused.kind == "qkv"
    assert (qkv.fused.num_query_groups, qkv.fused.heads_per_group, qkv.fused.head_dim) == (2, 2, 8)
    # TP=2: each rank held one query group's rows
    assert [(c.rank, c.offsets, c.sizes) for c in qkv.chunks] == [
        (0, [0, 0], [32, 32]), (1, [32, 0], [32, 32]),
    ]  # fmt: skip
    fc1 = layout.params["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.fused is not None and (fc1.fused.kind, fc1.fused.sizes) == ("gate_up", [48, 48])
    # SwiGLU: each rank held its slice of the gate half and of the up half
    assert [(c.rank, c.offsets[0]) for c in fc1.chunks] == [(0, 0), (0, 48), (1, 24), (1, 72)]
    proj = layout.params["decoder.layers.0.self_attention.linear_proj.weight"]
    assert [c.offsets for c in proj.chunks] == [[0, 0], [0, 16]]  # row-parallel: split on dim 1


def test_dp_reshardable_optimizer_is_model_only_and_inspect_says_so(
    stores: dict[str, Path], truth: dict
) -> None:
    ckpt = ucformat.open(stores["dp_reshardable"])
    assert ckpt.manifest.optimizer is None
    layout = ckpt.manifest.megatron
    assert layout is not None and not layout.optimizer_stored
    assert layout.optimizer_sharding == "dp_reshardable"
    for module_name, weight in truth["weights"].items():
        assert torch.equal(ckpt.read(store_name(module_name), "fp32"), weight), module_name
    shown = CliRunner().invoke(app, ["inspect", str(stores["dp_reshardable"])]).output
    assert "optimizer dp_reshardable: model only" in shown
    shown = CliRunner().invoke(app, ["inspect", str(stores["fully_reshardable"])]).output
    assert "optimizer fully_reshardable (stored)" in shown


def test_hf_llama_export_gives_megatron_logits(
    stores: dict[str, Path], truth: dict, tmp_path: Path
) -> None:
    """``export safetensors --names hf-llama`` → transformers LlamaForCausalLM (eager attention)
    built from the exported config.json: the Megatron TP=1 model's logits. float32 throughout;
    the two implementations order RMSNorm, RoPE and softmax differently, which moves logits of
    magnitude < 1 by a few ulps (6e-8 measured): atol 1e-6."""
    import json

    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures._megatron_worker import MODEL, _tokens

    out = tmp_path / "hf"
    args = ["export", "safetensors", str(stores["fully_reshardable"]), str(out)]
    result = CliRunner().invoke(app, [*args, "--names", "hf-llama"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] == MODEL["ffn_hidden_size"]
    llama_config = LlamaConfig(**config)
    llama_config._attn_implementation = "eager"
    model = LlamaForCausalLM(llama_config).eval()
    weights = load_file(out / "model.safetensors")
    model.load_state_dict(weights, strict=True)
    # the split is per query group, not a plain cut of the fused rows
    qkv = truth["weights"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], qkv[:32])
    torch.testing.assert_close(
        weights["model.layers.0.self_attn.k_proj.weight"], torch.cat([qkv[16:24], qkv[48:56]])
    )
    with torch.no_grad():
        logits = model(input_ids=_tokens(0)[:, :-1]).logits
    torch.testing.assert_close(logits, truth["logits"], rtol=0, atol=1e-6)


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
    megatron_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint saved without Megatron-LM's ``args`` (plain dist_checkpointing.save) converts;
    the head counts are unknown, so the manifest says so and the Llama export refuses."""
    import shutil

    from ucformat.errors import UnsupportedExportError
    from ucformat.export.safetensors import export_safetensors

    folder = tmp_path / "no-args"
    shutil.copytree(megatron_dir / "fully_reshardable", folder)
    common = torch.load(folder / "common.pt", weights_only=False)
    del common["args"]
    torch.save(common, folder / "common.pt")
    store = tmp_path / "no-args.ucf"
    ucformat.convert(folder, store)
    layout = ucformat.open(store).manifest.megatron
    assert layout is not None and layout.model_args == {}
    fused = layout.params["decoder.layers.0.self_attention.linear_qkv.weight"].fused
    assert fused is not None and not fused.known and fused.num_query_groups is None
    gate_up = layout.params["decoder.layers.0.mlp.linear_fc1.weight"].fused
    assert gate_up is not None and gate_up.sizes == [48, 48]  # from linear_fc2's width
    with pytest.raises(UnsupportedExportError, match="does not record the attention head counts"):
        export_safetensors(store, tmp_path / "hf", names="hf-llama")
