"""The simulated scale table: read amplification of 7B- and 70B-class loads, no data needed.

``python -m tests.bench.scale`` prints, for LLaMA-7B-like and LLaMA-70B-like parameter lists,
ZeRO-1 and ZeRO-3 layouts and W = 8, 64, 512, 4096, the bytes all ranks fetch over the bytes
they need for the fp32 state (:func:`ucformat.layout.simulate.simulate_load`, i.e. the real
read planner and the read-cost model checked byte-exact in tests/integration/test_read_cost.py),
for the default chunk policy and a few candidates. ``--markdown`` prints the tables for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ucformat.layout.chunking import ChunkPolicy
from ucformat.layout.simulate import ParamShape, simulate_load

KIB = 1024
MIB = 1024 * KIB
WORLD_SIZES = (8, 64, 512, 4096)
STAGES = (1, 3)


@dataclass(frozen=True)
class Transformer:
    """A LLaMA-like decoder's dimensions (untied head, RMSNorm, gated MLP, no biases)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_dim: int

    def params(self) -> list[ParamShape]:
        """Every parameter in module order."""
        h, f, kv = self.hidden, self.intermediate, self.kv_dim
        out: list[ParamShape] = [("embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)),
            ]
        return [*out, ("norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]

    def groups(self) -> list[list[str]]:
        """The usual two optimizer groups: matrices (weight decay), then norms (none)."""
        params = self.params()
        return [[n for n, s in params if len(s) >= 2], [n for n, s in params if len(s) < 2]]


LLAMA_7B = Transformer("7B", hidden=4096, intermediate=11008, layers=32, vocab=32000, kv_dim=4096)
LLAMA_70B = Transformer("70B", hidden=8192, intermediate=28672, layers=80, vocab=32000, kv_dim=1024)
MODELS = (LLAMA_7B, LLAMA_70B)

#: The default policy first, then candidates (chunk bytes, shard bytes); 128 KiB / 64 MiB was
#: the default before this table chose 64 KiB / 16 MiB.
POLICIES: tuple[ChunkPolicy, ...] = (
    ChunkPolicy(),
    ChunkPolicy(128 * KIB, 64 * MIB),
    ChunkPolicy(128 * KIB, 16 * MIB),
    ChunkPolicy(64 * KIB, 64 * MIB),
    ChunkPolicy(32 * KIB, 8 * MIB),
    ChunkPolicy(256 * KIB, 64 * MIB),
    ChunkPolicy(1 * MIB, 64 * MIB),
)


def policy_name(policy: ChunkPolicy) -> str:
    """``128 KiB / 64 MiB``."""

    def size(n: int) -> str:
        return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB"

    return f"{size(policy.chunk_bytes)} / {size(policy.shard_bytes)}"


def amplification(model: Transformer, stage: int, world_size: int, policy: ChunkPolicy) -> float:
    """Summed fetched / needed bytes of the fp32 state."""
    groups = model.groups() if stage != 3 else None
    return simulate_load(model.params(), world_size, stage, policy, groups=groups).amplification


def table(
    policies: Sequence[ChunkPolicy] = POLICIES, world_sizes: Sequence[int] = WORLD_SIZES
) -> list[dict[str, object]]:
    """One row per (model, stage, policy) with the amplification at each world size."""
    rows: list[dict[str, object]] = []
    for model in MODELS:
        for stage in STAGES:
            for policy in policies:
                row: dict[str, object] = {
                    "model": model.name, "stage": stage, "policy": policy_name(policy),
                }  # fmt: skip
                for world_size in world_sizes:
                    row[f"W={world_size}"] = amplification(model, stage, world_size, policy)
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, object]], world_sizes: Sequence[int] = WORLD_SIZES) -> str:
    """The rows as a markdown table."""
    head = ["model", "ZeRO", "chunk / shard", *(f"W={w}" for w in world_sizes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["model"]), str(row["stage"]), str(row["policy"])]
        cells += [f"{row[f'W={w}']:.3f}" for w in world_sizes]  # type: ignore[str-format]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = table()
    if args.markdown:
        print(markdown(rows))
    else:
        for row in rows:
            print(row)
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
