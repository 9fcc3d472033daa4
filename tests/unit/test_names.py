"""Names and keys (docs/format.md §2.4): the names a store admits; the writer refuses others."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucformat.errors import InvalidNameError
from ucformat.format.spec import name_problem, state_array_path
from ucformat.sources.deepspeed.checkpoint import read_deepspeed_checkpoint
from ucformat.write.plan import ConvertOptions, plan_convert

FIXTURE = Path(__file__).parents[1] / "fixtures" / "data" / "z2-fp32-dsadam-ftb-ws3" / "ckpt"

GOOD = [
    "weight",
    "layers.0.attn.q_proj.weight",
    "model.layers.10.mlp.down_proj.weight",
    "ü.größe",
    "层.权重",
    "emoji😀.w",
    "a-b_c~d(e)+f g",
    "x" * 255,
    "é" * 127,  # 254 bytes of UTF-8
    "_private.w",
    "a.zarr.json",  # only the whole name is reserved
]
BAD = {
    "": "empty",
    "a..b": "empty",
    ".a": "empty",
    "a.": "empty",
    "a/b": "'/'",
    "a\\b": "'/'",
    "a\nb": "control",
    "a\x7fb": "control",
    "__dunder.w": "'__'",
    "zarr.json": "metadata",
    "\ud800.w": "surrogate",
    "x" * 256: "bytes",
    "é" * 128: "bytes",
}


@pytest.mark.parametrize("name", GOOD)
def test_admitted_names(name: str) -> None:
    assert name_problem(name, "parameter") is None
    assert name_problem(name, "buffer") is None
    assert state_array_path(name, "fp32") == f"params/{name}/fp32"  # no escaping


@pytest.mark.parametrize(("name", "why"), BAD.items())
def test_refused_names(name: str, why: str) -> None:
    problem = name_problem(name, "parameter")
    assert problem is not None and why in problem


@pytest.mark.parametrize(
    ("state", "ok"),
    [("fp32", True), ("value", True), ("exp_avg_sq", True), ("_x1", True), ("step", False),
     ("1x", False), ("a.b", False), ("a-b", False), ("", False), ("é", False)],
)  # fmt: skip
def test_state_names(state: str, ok: bool) -> None:
    assert (name_problem(state, "state") is None) is ok


@pytest.mark.parametrize("bad", ["emb/weight", "zarr.json", "__x"])
def test_writer_refuses_a_bad_name_before_writing(bad: str) -> None:
    with read_deepspeed_checkpoint(FIXTURE) as source:
        first = next(iter(source.params))
        source.params = {bad if n == first else n: p for n, p in source.params.items()}
        with pytest.raises(InvalidNameError, match="cannot name an array") as info:
            plan_convert(source, ConvertOptions())
    assert repr(bad) in str(info.value) and "\n" not in str(info.value)


def test_writer_refuses_a_bad_buffer_name() -> None:
    with read_deepspeed_checkpoint(FIXTURE) as source:
        first = next(iter(source.buffers))
        source.buffers = {"bn/x" if n == first else n: b for n, b in source.buffers.items()}
        with pytest.raises(InvalidNameError, match="buffer name 'bn/x'"):
            plan_convert(source, ConvertOptions())
