"""Hugging Face Llama names for a store converted from a Megatron-Core GPT checkpoint.

Pure: from the manifest alone (``manifest.megatron``), the output tensors as pieces of the
stored parameters. Each output tensor is a list of flat element ranges of one stored
parameter, read in order:

* ``linear_qkv.weight`` (rows: per query group, ``heads_per_group`` query heads, one key head,
  one value head, each ``head_dim`` rows) becomes ``q_proj`` (every group's query rows, groups in
  order), ``k_proj`` and ``v_proj`` (every group's key rows, value rows): Llama's grouped-query
  attention uses key head ``h // heads_per_group`` for query head ``h``, which is Megatron's
  grouping;
* SwiGLU ``linear_fc1.weight`` (gate rows, then up rows) becomes ``gate_proj`` and ``up_proj``;
* the rest is renamed one to one (:data:`RENAMES`).

A parameter the map does not know, or a fused one whose head counts the checkpoint did not
record, is refused in one line. :func:`llama_config` gives the matching ``config.json``.
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

__all__ = ["HF_LLAMA", "NAMINGS", "RENAMES", "NamedTensor", "hf_llama_tensors", "llama_config"]

HF_LLAMA = "hf-llama"
#: ``--names`` values: ``store`` (the store's own names) and ``hf-llama``.
NAMINGS = ("store", HF_LLAMA)

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
    name: str, layer: str, shape: tuple[int, ...], fused: MegatronFused | None
) -> list[NamedTensor]:
    if fused is None or fused.kind != "gate_up" or not fused.sizes:
        raise UnsupportedExportError(
            f"'{name}': linear_fc1 is not recorded as SwiGLU gate + up halves; Llama needs a "
            "gated MLP (train with --swiglu)."
        )
    gate, up = fused.sizes
    width = math.prod(shape[1:])
    prefix = f"model.layers.{layer}.mlp."
    return [
        NamedTensor(
            prefix + "gate_proj.weight", name, (gate, *shape[1:]), (_rows(0, gate, width),)
        ),
        NamedTensor(prefix + "up_proj.weight", name, (up, *shape[1:]), (_rows(gate, up, width),)),
    ]


def hf_llama_tensors(manifest: CheckpointManifest) -> list[NamedTensor]:
    """Every output tensor of a Llama-named export, in the store's parameter order.

    Raises:
        UnsupportedExportError: the store is not from Megatron-Core, or holds a parameter
            Llama has no place for (biases, experts, ...).
    """
    layout = manifest.megatron
    if layout is None:
        raise UnsupportedExportError(
            f"--names {HF_LLAMA} maps Megatron-Core GPT parameters; this store was converted from "
            f"{manifest.source.checkpoint_format or manifest.source.framework}. Use --names store."
        )
    out: list[NamedTensor] = []
    for name, entry in manifest.params.items():
        shape = tuple(entry.shape)
        whole = ((0, math.prod(shape)),)
        match = _LAYER.match(name)
        layer, rest = (match.group(1), match.group(2)) if match else ("", name)
        info = layout.params.get(name)
        if match and rest == _QKV:
            if info is None or info.fused is None:
                raise UnsupportedExportError(f"'{name}': no fused layout in manifest.megatron.")
            out.extend(_split_qkv(name, layer, shape, info.fused))
        elif match and rest == _FC1:
            out.extend(_split_gate_up(name, layer, shape, info.fused if info else None))
        elif rest in RENAMES and (match is not None) == ("{i}" in RENAMES[rest]):
            out.append(NamedTensor(RENAMES[rest].format(i=layer), name, shape, whole))
        else:
            raise UnsupportedExportError(
                f"'{name}': Hugging Face Llama has no parameter for it (known: "
                f"{', '.join(sorted(RENAMES))}, linear_qkv, linear_fc1); export with --names store."
            )
    return out


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


def _renamed(manifest: CheckpointManifest) -> set[str]:
    return {RENAMES.get(n, n) for n in manifest.params}
