"""The benchmark checkpoints: a LLaMA-like decoder at two sizes, saved by DeepSpeed on CPU.

Importable without DeepSpeed. A :class:`BenchCase` fully determines one checkpoint (model
size, ZeRO stage, world size, steps); its :func:`fingerprint` covers the case, the DeepSpeed
config, the torch/deepspeed versions and this package's save worker and model code, so a
cached checkpoint is reused only if it would be made the same way again.

Shapes (``decoder``): token embedding ``V x h``; per layer ``q, k, v, o`` (``h x h``),
``gate, up`` (``f x h``), ``down`` (``h x f``) and two RMSNorm weights (``h``); a final norm
and an untied ``lm_head`` (``V x h``). Two optimizer param groups, as real training uses:
matrices with weight decay, norms without.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

BENCH_DIR = Path(__file__).resolve().parent
TAG = "global_step2"
SEQ_LEN = 32
LR = 1e-4
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class ModelSize:
    """A decoder's dimensions."""

    hidden: int
    ffn: int
    layers: int
    vocab: int

    @property
    def heads(self) -> int:
        """Attention heads of 64 dims."""
        return self.hidden // 64

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter (name, shape) in module order."""
        h, f = self.hidden, self.ffn
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes += [(p + "attn_norm.weight", (h,))]
            shapes += [(p + f"attn.{n}.weight", (h, h)) for n in ("q", "k", "v", "o")]
            shapes += [(p + "mlp_norm.weight", (h,))]
            shapes += [(p + "mlp.gate.weight", (f, h)), (p + "mlp.up.weight", (f, h))]
            shapes += [(p + "mlp.down.weight", (h, f))]
        shapes += [("norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return shapes

    @property
    def numel(self) -> int:
        """Parameter count."""
        total = 0
        for _, shape in self.param_shapes():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


#: ~100M parameters (~1.4 GB as a ZeRO bf16 checkpoint) and ~3x that; 25m for the S3 loads
#: (tests/bench/s3_loads.py: the S3 server holds its objects in memory).
SIZES: dict[str, ModelSize] = {
    "25m": ModelSize(hidden=512, ffn=1408, layers=6, vocab=8192),
    # ~28M (the same model as 25m): the live-save benchmark's name for it (docs/benchmarks.md).
    "30m": ModelSize(hidden=512, ffn=1408, layers=6, vocab=8192),
    "100m": ModelSize(hidden=768, ffn=2048, layers=12, vocab=8192),
    "300m": ModelSize(hidden=1024, ffn=2816, layers=22, vocab=8192),
}


@dataclass(frozen=True)
class BenchCase:
    """One DeepSpeed ``save_checkpoint``: model size, ZeRO stage, world size, dtype."""

    size: str
    stage: int
    world_size: int = 2
    dtype: str = "bf16"
    steps: int = 2

    @property
    def name(self) -> str:
        """``z1-bf16-100m-ws2``."""
        return f"z{self.stage}-{self.dtype}-{self.size}-ws{self.world_size}"

    @property
    def model(self) -> ModelSize:
        """The model's dimensions."""
        return SIZES[self.size]


CASES: tuple[BenchCase, ...] = tuple(
    BenchCase(size, stage) for size in ("100m", "300m") for stage in (1, 3)
)


def ds_config(case: BenchCase, *, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config the case trains (and loads) with."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": case.stage},
        "bf16": {"enabled": case.dtype == "bf16"},
    }
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def fingerprint(case: BenchCase) -> str:
    """A digest of everything that decides the checkpoint's content."""
    payload = {
        "case": asdict(case),
        "config": ds_config(case),
        "torch": metadata.version("torch"),
        "deepspeed": metadata.version("deepspeed"),
        "sources": hashlib.sha256(
            b"".join((BENCH_DIR / n).read_bytes() for n in ("cases.py", "_save_worker.py"))
        ).hexdigest(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention and a gated MLP (no biases)."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        h, f = size.hidden, size.ffn
        self.heads = size.heads
        self.attn_norm = nn.RMSNorm(h)
        self.attn = nn.ModuleDict({n: nn.Linear(h, h, bias=False) for n in ("q", "k", "v", "o")})
        self.mlp_norm = nn.RMSNorm(h)
        self.mlp = nn.ModuleDict(
            {
                "gate": nn.Linear(h, f, bias=False),
                "up": nn.Linear(h, f, bias=False),
                "down": nn.Linear(f, h, bias=False),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq, hidden)``."""
        b, s, h = x.shape
        y = self.attn_norm(x)
        q, k, v = (
            self.attn[n](y).view(b, s, self.heads, h // self.heads).transpose(1, 2)
            for n in ("q", "k", "v")
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["o"](y.transpose(1, 2).reshape(b, s, h))
        y = self.mlp_norm(x)
        return x + self.mlp["down"](F.silu(self.mlp["gate"](y)) * self.mlp["up"](y))


class Decoder(nn.Module):
    """A LLaMA-like decoder (untied head)."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.hidden)
        self.layers = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = nn.RMSNorm(size.hidden)
        self.lm_head = nn.Linear(size.hidden, size.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for ``(batch, seq)`` token ids."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(case: BenchCase, seed: int) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The decoder of ``case`` and its two param groups (decay, no decay)."""
    torch.manual_seed(seed)
    model = Decoder(case.model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return model, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_batch(case: BenchCase, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and next-token targets."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, case.model.vocab, (1, SEQ_LEN + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
