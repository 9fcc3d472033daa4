"""Objects and folders per store, from the real planner on manifest-only model descriptions.

``python -m tests.bench.store_objects`` describes each model as the converter describes a
checkpoint (every parameter trainable with an fp32 master weight and Adam's ``exp_avg`` and
``exp_avg_sq``; the fragments of a ZeRO-1 source of ``--world-size`` ranks: one flat partition
per rank, parameters cut where the partitions fall), without any tensor bytes, runs
:func:`ucformat.write.plan.plan_convert` on it with the default chunk policy, and counts what
the store would hold: the root ``zarr.json``, the manifest, one ``zarr.json`` per group and
stored array, one object per shard, and the folders of a local store. The same description is
also planned as format 3.0 laid stores out (one array per (parameter, state), ``/`` chunk keys),
for comparison. ``--markdown`` prints the table of docs/benchmarks.md.

Models (public configurations): the benchmark decoder ``100m`` (tests/bench/cases.py);
Llama 3.1 405B (hidden 16384, 126 layers, FFN 53248, 128 query and 8 KV heads of 128, vocabulary
128256, untied head); DeepSeek-V3 (hidden 7168, 61 layers of which the first 3 dense with FFN
18432, the rest MoE with 256 routed experts and one shared expert of FFN 2048 each, a router of
256 x 7168 with its bias; multi-head latent attention: q LoRA rank 1536, kv LoRA rank 512,
128 heads of 128 + 64 rotary dims, value heads of 128; vocabulary 129280, untied head; the
multi-token-prediction layer left out).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.bench.cases import SIZES
from ucformat.format.models import ClientState, SourceInfo, TrainingProgress
from ucformat.write.plan import ConvertOptions, ConvertPlan, plan_convert


class _NoBytes:
    """A fragment's tensor that the planner never reads (a manifest-only description)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @property
    def dtype_name(self) -> str:
        return "float32"

    def is_contiguous(self) -> bool:
        return True

    def read_into(self, *_: object) -> None:
        raise RuntimeError("a manifest-only description has no bytes")

    read_scattered = read_into
    load = read_into


Shape = tuple[int, ...]


def decoder_100m() -> list[tuple[str, Shape]]:
    """The live-save benchmark's decoder (97.5M parameters)."""
    return SIZES["100m"].param_shapes()


def llama_405b() -> list[tuple[str, Shape]]:
    """Llama 3.1 405B."""
    h, f, v, layers, kv = 16384, 53248, 128256, 126, 8 * 128
    shapes: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
        ]
        shapes += [
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
        ]
        shapes += [(p + f"mlp.{n}_proj.weight", (f, h)) for n in ("gate", "up")]
        shapes += [(p + "mlp.down_proj.weight", (h, f))]
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return [*shapes, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def deepseek_v3() -> list[tuple[str, Shape]]:
    """DeepSeek-V3 (671B), without its multi-token-prediction layer."""
    h, v, layers, dense, experts = 7168, 129280, 61, 3, 256
    heads, nope, rope, value, q_rank, kv_rank = 128, 128, 64, 128, 1536, 512
    shapes: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (v, h))]

    def mlp(prefix: str, ffn: int) -> list[tuple[str, Shape]]:
        return [(prefix + "gate_proj.weight", (ffn, h)), (prefix + "up_proj.weight", (ffn, h)),
                (prefix + "down_proj.weight", (h, ffn))]  # fmt: skip

    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes += [(p + "input_layernorm.weight", (h,))]
        shapes += [(a + "q_a_proj.weight", (q_rank, h)), (a + "q_a_layernorm.weight", (q_rank,))]
        shapes += [(a + "q_b_proj.weight", (heads * (nope + rope), q_rank))]
        shapes += [(a + "kv_a_proj_with_mqa.weight", (kv_rank + rope, h))]
        shapes += [(a + "kv_a_layernorm.weight", (kv_rank,))]
        shapes += [(a + "kv_b_proj.weight", (heads * (nope + value), kv_rank))]
        shapes += [(a + "o_proj.weight", (h, heads * value))]
        shapes += [(p + "post_attention_layernorm.weight", (h,))]
        if i < dense:
            shapes += mlp(p + "mlp.", 18432)
            continue
        shapes += [(p + "mlp.gate.weight", (experts, h))]
        shapes += [(p + "mlp.gate.e_score_correction_bias", (experts,))]
        for e in range(experts):
            shapes += mlp(p + f"mlp.experts.{e}.", 2048)
        shapes += mlp(p + "mlp.shared_experts.", 2048)
    return [*shapes, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


MODELS = {"100m": decoder_100m, "llama-3.1-405b": llama_405b, "deepseek-v3": deepseek_v3}


def describe(shapes: list[tuple[str, Shape]], world_size: int) -> object:
    """The model as a ZeRO-1 checkpoint of ``world_size`` ranks, fp32 + Adam, no bytes."""
    from ucformat.sources.base import ArraySource, SourceCheckpoint, SourceFragment, SourceParam

    total = sum(math.prod(shape) for _, shape in shapes)
    per_rank = -(-total // world_size)
    tensors = [_NoBytes(rank) for rank in range(world_size)]
    params: dict[str, SourceParam] = {}
    at = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        arrays = {}
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            array = ArraySource(shape, "float32")
            start = at
            while start < at + numel:
                rank = start // per_rank
                stop = min(at + numel, (rank + 1) * per_rank)
                array.fragments.append(
                    SourceFragment(tensors[rank], start - rank * per_rank, start - at, stop - start)  # type: ignore[arg-type]
                )
                start = stop
            arrays[state] = array
        at += numel
        params[name] = SourceParam(shape, "bfloat16", True, 0, arrays)
    info = SourceInfo(framework="deepspeed", framework_version="0.19.8", path="", tag="t",
                      zero_stage=1, world_size=world_size, train_dtype="bfloat16")  # fmt: skip
    return SourceCheckpoint(source=info, params=params, buffers={}, tied={}, optimizer=None,
                            progress=TrainingProgress(), client_state=ClientState())  # fmt: skip


@dataclass(frozen=True)
class Counts:
    """What a store holds, by kind."""

    params: int
    arrays: int
    stored_arrays: int
    shards: int
    metadata: int
    folders: int
    seconds: float

    @property
    def objects(self) -> int:
        """Every object: metadata (zarr.json documents and the manifest) and shards."""
        return self.metadata + self.shards


def count(plan: ConvertPlan, seconds: float) -> Counts:
    """Objects and folders of a local store written from ``plan``."""
    groups: set[str] = set()
    folders: set[str] = set()
    for array in plan.arrays:
        parts = array.path.split("/")
        groups.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
        folders.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    for unit in plan.units:  # the folders of the chunk keys ('/' separators: c/i/...)
        array = plan.arrays[unit.array]
        if array.separator == "/" and array.shape:
            coords = [p.start // s for p, s in zip(unit.region, array.shard_shape, strict=True)]
            key = array.shard_key(tuple(coords))
            parts = key.split("/")
            folders.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
    manifest = plan.manifest
    arrays = sum(len(e.states) for e in manifest.params.values()) + len(manifest.buffers)
    metadata = 2 + len(groups) + len(plan.arrays)  # root zarr.json, manifest, groups, arrays
    return Counts(len(manifest.params), arrays, len(plan.arrays), len(plan.units), metadata,
                  1 + len(folders), seconds)  # fmt: skip


def measure(model: str, world_size: int, version: str | None) -> Counts:
    """Plan ``model`` (format ``version``; None: this writer's) and count its store."""
    source = describe(MODELS[model](), world_size)
    started = time.perf_counter()
    plan = plan_convert(source, ConvertOptions(format_version=version))  # type: ignore[arg-type]
    return count(plan, time.perf_counter() - started)


def rows(models: list[str], world_size: int) -> Iterator[tuple[str, str, Counts]]:
    """(model, layout, counts) for this writer (3.1) and format 3.0's layout."""
    for model in models:
        for layout, version in (("3.1", None), ("3.0", "3.0")):
            yield model, layout, measure(model, world_size, version)


def main() -> None:
    """Print the counts (``--markdown``: the table of docs/benchmarks.md)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    head = ("| model | layout | parameters | arrays | zarr arrays | objects (metadata + shards) "
            "| objects per parameter | folders | planning (s) |")  # fmt: skip
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---" * 9 + "|")
    for model, layout, c in rows(args.models, args.world_size):
        cells = (model, layout, f"{c.params:,}", f"{c.arrays:,}", f"{c.stored_arrays:,}",
                 f"{c.objects:,} ({c.metadata:,} + {c.shards:,})",
                 f"{c.objects / c.params:.2f}", f"{c.folders:,}", f"{c.seconds:.1f}")  # fmt: skip
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
