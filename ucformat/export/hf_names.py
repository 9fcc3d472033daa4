"""Hugging Face names for a store converted from a Megatron-Core GPT checkpoint: Llama
(``--names hf-llama``, dense models) and Mixtral (``--names hf-mixtral``, MoE models).

Pure: from the manifest alone (``manifest.megatron``), the output tensors as pieces of the
stored parameters. Each output tensor is a list of flat element ranges of one stored
parameter, read in order:

* ``linear_qkv.weight`` (rows: per query group, ``heads_per_group`` query heads, one key head,
  one value head, each ``head_dim`` rows) becomes ``q_proj`` (every group's query rows, groups in
  order), ``k_proj`` and ``v_proj`` (every group's key rows, value rows): Llama's grouped-query
  attention uses key head ``h // heads_per_group`` for query head ``h``, which is Megatron's
  grouping;
* SwiGLU ``linear_fc1.weight`` (gate rows, then up rows) becomes ``gate_proj`` and ``up_proj``;
* Mixtral (an MoE model without shared experts: Megatron's top-k of the router's logits then
  softmax over them is Mixtral's softmax, top-k and renormalisation): the router
  ``mlp.router.weight`` becomes ``block_sparse_moe.gate.weight``; expert ``E``'s SwiGLU
  ``linear_fc1`` becomes ``block_sparse_moe.experts.E.w1`` (gate) and ``w3`` (up), its
  ``linear_fc2`` ``w2`` (the checkpoint names Mixtral's hub models use; transformers converts
  them on ``from_pretrained``);
* the rest is renamed one to one (:data:`RENAMES`).

A parameter the map does not know (a shared expert: neither Llama nor Mixtral has one; a bias),
or a fused one whose head counts the checkpoint did not record, is refused in one line.
:func:`hf_config` gives the matching ``config.json`` (None where the model's args are not
recorded or do not fit the architecture: the tensors are still written).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ucformat.errors import UnsupportedExportError
from ucformat.format.megatron import MegatronFused
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode_for_display

__all__ = [
    "HF_LLAMA",
    "HF_MIXTRAL",
    "HF_NAMINGS",
    "NAMINGS",
    "RENAMES",
    "NamedTensor",
    "hf_config",
    "hf_llama_tensors",
    "hf_tensors",
    "llama_config",
    "mixtral_config",
]

HF_LLAMA = "hf-llama"
HF_MIXTRAL = "hf-mixtral"
#: The Hugging Face namings.
HF_NAMINGS = (HF_LLAMA, HF_MIXTRAL)
#: ``--names`` values: ``store`` (the store's own names), ``hf-llama``, ``hf-mixtral``.
NAMINGS = ("store", *HF_NAMINGS)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: Megatron key (after ``decoder.layers.<i>.``, or at the top) -> Llama name (``{i}``: layer).
RENAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "self_attention.linear_qkv.layer_norm_weight": "model.layers.{i}.input_layernorm.weight",
    "input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "self_attention.linear_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "model.layers.{i}.post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_QKV = "self_attention.linear_qkv.weight"
_FC1 = "mlp.linear_fc1.weight"
_ROUTER = "mlp.router.weight"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


@dataclass(frozen=True)
class NamedTensor:
    """One output tensor: ``shape``, made of flat ranges ``[start, stop)`` of param ``name``."""

    key: str
    name: str
    shape: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]


def _rows(first: int, count: int, width: int) -> tuple[int, int]:
    return first * width, (first + count) * width


def _split_qkv(
    name: str, layer: str, shape: tuple[int, ...], fused: MegatronFused
) -> list[NamedTensor]:
    groups, per, dim = fused.num_query_groups, fused.heads_per_group, fused.head_dim
    if not (fused.known and groups and per and dim):
        raise UnsupportedExportError(
            f"'{name}': the checkpoint does not record the attention head counts (no training "
            "args in common.pt), so linear_qkv cannot be split; expected Megatron-LM's args "
            "(num_attention_heads, num_query_groups, kv_channels)."
        )
    width = math.prod(shape[1:])
    block = (per + 2) * dim
    q = tuple(_rows(g * block, per * dim, width) for g in range(groups))
    k = tuple(_rows(g * block + per * dim, dim, width) for g in range(groups))
    v = tuple(_rows(g * block + (per + 1) * dim, dim, width) for g in range(groups))
    prefix = f"model.layers.{layer}.self_attn."
    return [
        NamedTensor(prefix + "q_proj.weight", name, (groups * per * dim, *shape[1:]), q),
        NamedTensor(prefix + "k_proj.weight", name, (groups * dim, *shape[1:]), k),
        NamedTensor(prefix + "v_proj.weight", name, (groups * dim, *shape[1:]), v),
    ]


def _split_gate_up(
    name: str, shape: tuple[int, ...], fused: MegatronFused | None, gate_name: str, up_name: str
) -> list[NamedTensor]:
    if fused is None or fused.kind != "gate_up" or not fused.sizes:
        raise UnsupportedExportError(
            f"'{name}': linear_fc1 is not recorded as SwiGLU gate + up halves; Hugging Face "
            "Llama and Mixtral need a gated MLP (train with --swiglu)."
        )
    gate, up = fused.sizes
    width = math.prod(shape[1:])
    return [
        NamedTensor(gate_name, name, (gate, *shape[1:]), (_rows(0, gate, width),)),
        NamedTensor(up_name, name, (up, *shape[1:]), (_rows(gate, up, width),)),
    ]


def _moe_tensors(
    name: str, layer: str, rest: str, shape: tuple[int, ...], fused: MegatronFused | None
) -> list[NamedTensor] | None:
    """Mixtral's tensors of an MoE parameter (None: not one)."""
    prefix = f"model.layers.{layer}.block_sparse_moe."
    whole = ((0, math.prod(shape)),)
    if rest == _ROUTER:
        return [NamedTensor(prefix + "gate.weight", name, shape, whole)]
    match = _EXPERT.match(rest)
    if match is None:
        return None
    expert = f"{prefix}experts.{match.group(1)}."
    if match.group(2) == "linear_fc2":
        return [NamedTensor(expert + "w2.weight", name, shape, whole)]
    return _split_gate_up(name, shape, fused, expert + "w1.weight", expert + "w3.weight")


def hf_tensors(manifest: CheckpointManifest, names: str) -> list[NamedTensor]:
    """Every output tensor of a Hugging Face named export (``names``: :data:`HF_NAMINGS`), in
    the store's parameter order.

    Raises:
        UnsupportedExportError: the store is not from Megatron-Core, holds a parameter the
            architecture has no place for (biases, shared experts, ...), or is MoE for Llama
            (dense for Mixtral).
    """
    layout = manifest.megatron
    if layout is None:
        raise UnsupportedExportError(
            f"--names {names} maps Megatron-Core GPT parameters; this store was converted from "
            f"{manifest.source.checkpoint_format or manifest.source.framework}. Use --names store."
        )
    moe = any(
        (meta.expert is not None or ".mlp.router." in name) for name, meta in layout.params.items()
    )
    if moe and names == HF_LLAMA:
        raise UnsupportedExportError(
            "--names hf-llama is for dense models; this store has MoE experts: use --names "
            "hf-mixtral."
        )
    if not moe and names == HF_MIXTRAL:
        raise UnsupportedExportError(
            "--names hf-mixtral is for MoE models; this store has no experts: use --names hf-llama."
        )
    out: list[NamedTensor] = []
    for name, entry in manifest.params.items():
        shape = tuple(entry.shape)
        whole = ((0, math.prod(shape)),)
        match = _LAYER.match(name)
        layer, rest = (match.group(1), match.group(2)) if match else ("", name)
        info = layout.params.get(name)
        fused = info.fused if info else None
        if match and rest == _QKV:
            if fused is None:
                raise UnsupportedExportError(f"'{name}': no fused layout in manifest.megatron.")
            out.extend(_split_qkv(name, layer, shape, fused))
            continue
        if match and rest == _FC1:
            prefix = f"model.layers.{layer}.mlp."
            out.extend(
                _split_gate_up(name, shape, fused, prefix + "gate_proj.weight",
                               prefix + "up_proj.weight")
            )  # fmt: skip
            continue
        moe_tensors = _moe_tensors(name, layer, rest, shape, fused) if match and moe else None
        if moe_tensors is not None:
            out.extend(moe_tensors)
        elif rest in RENAMES and (match is not None) == ("{i}" in RENAMES[rest]):
            out.append(NamedTensor(RENAMES[rest].format(i=layer), name, shape, whole))
        else:
            arch = "Mixtral" if moe else "Llama"
            known = ", ".join(sorted(RENAMES)) + ", linear_qkv, linear_fc1"
            known += ", mlp.router, experts' linear_fc1/linear_fc2" if moe else ""
            raise UnsupportedExportError(
                f"'{name}': Hugging Face {arch} has no parameter for it (known: {known}); "
                "export with --names store."
            )
    return out


def hf_llama_tensors(manifest: CheckpointManifest) -> list[NamedTensor]:
    """:func:`hf_tensors` with Llama names."""
    return hf_tensors(manifest, HF_LLAMA)


def llama_config(manifest: CheckpointManifest) -> dict[str, Any] | None:
    """``config.json`` of the matching ``LlamaForCausalLM``; None when the args are missing."""
    layout = manifest.megatron
    args = {k: decode_for_display(v) for k, v in (layout.model_args if layout else {}).items()}
    needed = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
    embed = manifest.params.get("embedding.word_embeddings.weight")
    if layout is None or embed is None or any(args.get(k) is None for k in needed):
        return None
    if args.get("normalization", "RMSNorm") != "RMSNorm" or args.get("swiglu") is False:
        return None  # not a Llama block: the tensors are still written, without a config
    if args.get("position_embedding_type", "rope") != "rope":
        return None
    heads = int(args["num_attention_heads"])
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    head_dim = args.get("kv_channels") or int(args["hidden_size"]) // heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["ffn_hidden_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": groups or heads,
        "head_dim": head_dim,
        "vocab_size": embed.shape[0],
        "max_position_embeddings": args.get("max_position_embeddings") or 4096,
        "rms_norm_eps": args.get("norm_epsilon") or 1e-5,
        "rope_theta": args.get("rotary_base") or 10000,
        "hidden_act": "silu",
        "attention_bias": bool(args.get("add_qkv_bias")),
        "mlp_bias": bool(args.get("add_bias_linear")),
        "tie_word_embeddings": "lm_head.weight" not in _renamed(manifest),
        "torch_dtype": "float32",
    }


def mixtral_config(manifest: CheckpointManifest) -> dict[str, Any] | None:
    """``config.json`` of the matching ``MixtralForCausalLM``; None when the args are missing
    or the routing is not Mixtral's (a score function other than softmax, softmax before the
    top-k, a capacity factor that drops tokens)."""
    base = llama_config(manifest)
    layout = manifest.megatron
    if base is None or layout is None:
        return None
    args = {k: decode_for_display(v) for k, v in layout.model_args.items()}
    full = manifest.client_state.values.get("args")
    stored = {k: decode_for_display(v) for k, v in full.items()} if isinstance(full, dict) else {}
    experts = layout.num_experts or args.get("num_experts")
    ffn, topk = args.get("moe_ffn_hidden_size"), args.get("moe_router_topk")
    if not experts or not ffn or not topk:
        return None
    if stored.get("moe_router_score_function", "softmax") != "softmax":
        return None
    if stored.get("moe_router_pre_softmax") or stored.get("moe_expert_capacity_factor"):
        return None
    config = dict(base)
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=ffn,
        num_local_experts=experts,
        num_experts_per_tok=topk,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    config.pop("mlp_bias", None)
    config.pop("attention_bias", None)
    return config


def hf_config(manifest: CheckpointManifest, names: str) -> dict[str, Any] | None:
    """``config.json`` for a ``names`` export (:func:`llama_config`, :func:`mixtral_config`)."""
    return mixtral_config(manifest) if names == HF_MIXTRAL else llama_config(manifest)


def _renamed(manifest: CheckpointManifest) -> set[str]:
    return {RENAMES.get(n, n) for n in manifest.params}
