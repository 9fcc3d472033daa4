"""The Megatron → Hugging Face Llama split is pure row arithmetic on the manifest: checked against
an explicit per-head model of Megatron's fused layouts."""

from __future__ import annotations

import pytest
import torch

from ucformat.errors import UnsupportedExportError
from ucformat.export.hf_names import hf_llama_tensors
from ucformat.format.megatron import MegatronFused, MegatronLayout, MegatronParam
from ucformat.format.models import ArrayRef, CheckpointManifest, ParamEntry, SourceInfo
from ucformat.format.spec import state_array_path

HIDDEN = 6


def _manifest(
    groups: int, per: int, dim: int, ffn: int, extra: str | None = None
) -> CheckpointManifest:
    shapes = {
        "decoder.layers.0.self_attention.linear_qkv.weight": [groups * (per + 2) * dim, HIDDEN],
        "decoder.layers.0.mlp.linear_fc1.weight": [2 * ffn, HIDDEN],
    }
    if extra:
        shapes[extra] = [HIDDEN]
    params = {
        name: ParamEntry(
            shape=shape, dtype="float32", requires_grad=True, group=None,
            states={"fp32": ArrayRef(path=state_array_path(name, "fp32"), dtype="float32",
                                     shape=shape, chunk_shape=shape, shard_shape=shape,
                                     nbytes=0)},
        )
        for name, shape in shapes.items()
    }  # fmt: skip
    fused = {
        "decoder.layers.0.self_attention.linear_qkv.weight": MegatronFused(
            kind="qkv", parts=["q", "k", "v"], num_query_groups=groups, heads_per_group=per,
            head_dim=dim,
        ),
        "decoder.layers.0.mlp.linear_fc1.weight": MegatronFused(
            kind="gate_up", parts=["gate", "up"], sizes=[ffn, ffn]
        ),
    }  # fmt: skip
    layout = MegatronLayout(
        sharded_backend="torch_dist",
        optimizer_stored=False,
        params={n: MegatronParam(key=n, layer=0, fused=fused.get(n)) for n in params},
    )
    source = SourceInfo(framework="pytorch", framework_version="x", path="/", tag="",
                        world_size=1, train_dtype="float32")  # fmt: skip
    return CheckpointManifest(created_by="t", source=source, params=params, megatron=layout)


def _gather(flat: torch.Tensor, segments: tuple[tuple[int, int], ...], shape: tuple[int, ...]):
    return torch.cat([flat[a:b] for a, b in segments]).reshape(shape)


@pytest.mark.parametrize(("groups", "per", "dim"), [(1, 1, 2), (2, 2, 3), (4, 1, 2), (1, 4, 1)])
def test_qkv_and_gate_up_split_match_a_per_head_model(groups: int, per: int, dim: int) -> None:
    manifest = _manifest(groups, per, dim, ffn=5)
    qkv_rows = groups * (per + 2) * dim
    qkv = torch.arange(qkv_rows * HIDDEN, dtype=torch.float32).reshape(qkv_rows, HIDDEN)
    fc1 = torch.arange(10 * HIDDEN, dtype=torch.float32).reshape(10, HIDDEN)
    # the model: Megatron's per-group blocks [q heads of the group, k head, v head]
    blocks = qkv.reshape(groups, per + 2, dim, HIDDEN)
    expected = {
        "model.layers.0.self_attn.q_proj.weight": blocks[:, :per].reshape(-1, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": blocks[:, per].reshape(-1, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": blocks[:, per + 1].reshape(-1, HIDDEN),
        "model.layers.0.mlp.gate_proj.weight": fc1[:5],
        "model.layers.0.mlp.up_proj.weight": fc1[5:],
    }
    sources = {
        "decoder.layers.0.self_attention.linear_qkv.weight": qkv.flatten(),
        "decoder.layers.0.mlp.linear_fc1.weight": fc1.flatten(),
    }
    got = {t.key: _gather(sources[t.name], t.segments, t.shape) for t in hf_llama_tensors(manifest)}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_unknown_parameter_and_unknown_heads_are_refused() -> None:
    manifest = _manifest(2, 2, 3, ffn=5, extra="decoder.layers.0.self_attention.linear_qkv.bias")
    with pytest.raises(UnsupportedExportError, match="Llama has no parameter for it"):
        hf_llama_tensors(manifest)
    manifest = _manifest(2, 2, 3, ffn=5)
    layout = manifest.megatron
    assert layout is not None
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    unknown = MegatronParam(
        key=name, layer=0, fused=MegatronFused(kind="qkv", parts=["q", "k", "v"], known=False)
    )
    manifest = manifest.model_copy(
        update={"megatron": layout.model_copy(update={"params": {**layout.params, name: unknown}})}
    )
    with pytest.raises(UnsupportedExportError, match="does not record the attention head counts"):
        hf_llama_tensors(manifest)
