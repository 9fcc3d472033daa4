"""DeepSpeed AutoTP checkpoints convert exactly: every array equals DeepSpeed's ``ds_to_universal``.

The checkpoints (tiny HF Llama with GQA, tp2 x dp1 and tp2 x dp2, ZeRO-1/2/3, fp32/bf16) are
written by DeepSpeed itself (tests/fixtures/autotp_cases.py, cached in tests/.cache/autotp), and
so is the oracle: DeepSpeed's universal conversion of the same folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ucformat
from tests.conftest import deepspeed_available
from tests.fixtures.autotp_cases import SAVES
from ucformat.errors import LayoutMismatchError, SourceNotFoundError, UnsupportedCheckpointError

pytestmark = pytest.mark.deepspeed

TAG = "step2"


@pytest.fixture(scope="module")
def autotp() -> dict[str, Path]:
    """Every AutoTP save case (generated once, then cached)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.autotp_cases import generate_autotp

    return generate_autotp()


def _universal(case_dir: Path, name: str, state: str) -> torch.Tensor:
    saved = torch.load(
        case_dir / "universal" / TAG / "zero" / name / f"{state}.pt", weights_only=False
    )
    return saved["param"] if isinstance(saved, dict) else saved


@pytest.mark.parametrize("case", [c.name for c in SAVES])
def test_autotp_converts_like_ds_to_universal(
    case: str, autotp: dict[str, Path], tmp_path: Path
) -> None:
    source = autotp[case]
    manifest = ucformat.convert(source / "ckpt", tmp_path / "store")
    ckpt = ucformat.open(tmp_path / "store")
    assert ckpt.manifest == manifest
    assert manifest.tensor_parallel is not None and manifest.tensor_parallel.degree == 2
    assert manifest.source.world_size == int(case.split("dp")[1][0])
    names = set(manifest.params)
    assert names == {p.name for p in (source / "universal" / TAG / "zero").iterdir() if p.is_dir()}
    for name, entry in manifest.params.items():
        assert set(entry.states) == {"fp32", "exp_avg", "exp_avg_sq"}, name
        for state in entry.states:
            want = _universal(source, name, state)
            got = ckpt.read(name, state)
            assert got.shape == want.shape and torch.equal(got, want), (name, state)
        step_file = source / "universal" / TAG / "zero" / name / "step.pt"
        # ZeRO-3: ds_to_universal writes no per-parameter step (it is in optimizer_state.pt)
        step = torch.load(step_file, weights_only=False) if step_file.exists() else 2.0
        assert float(ckpt.read(name, "step")) == float(step), name


def test_autotp_manifest_describes_the_split(autotp: dict[str, Path], tmp_path: Path) -> None:
    """Column, row, replicated and uneven vocabulary splits, in words and as pieces."""
    manifest = ucformat.convert(autotp["tp2dp1-z1-fp32"] / "ckpt", tmp_path / "store")
    tp = manifest.tensor_parallel
    assert tp is not None and tp.framework == "deepspeed-autotp"
    assert set(tp.params) == set(manifest.params)
    q = tp.params["model.layers.0.self_attn.q_proj.weight"]
    k = tp.params["model.layers.0.self_attn.k_proj.weight"]
    o = tp.params["model.layers.0.self_attn.o_proj.weight"]
    head = tp.params["lm_head.weight"]
    norm = tp.params["model.norm.weight"]
    assert (q.kind, q.dim, q.widths, q.logical_shape) == ("split", 0, [32, 32], [64, 64])
    assert (k.kind, k.dim, k.widths, k.logical_shape) == ("split", 0, [16, 16], [32, 64])
    assert (o.kind, o.dim, o.widths) == ("split", 1, [32, 32])
    assert (head.kind, head.dim, head.widths) == ("split", 0, [49, 48])
    assert (head.vocab_size, head.padded_vocab_size) == (97, 97)
    assert norm.kind == "replicated" and norm.dim is None
    # rank 1 of the row split: one block of 64 rows x 32 columns starting at column 32
    piece = o.shards[1].pieces[0]
    assert (piece.shape, piece.source_offset, piece.source_strides) == ([64, 32], 32, [64, 1])
    assert o.shards[1].shard_shape == [64, 32]
    from ucformat.format.summary import summarize

    header = summarize(manifest).header
    assert header["tensor parallel"] == (
        "deepspeed-autotp, degree 2: 15 split, 6 replicated, 0 other (arrays hold full shapes)"
    )


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "ckpt" / TAG, dst)
    return dst


def test_autotp_refuses_what_deepspeed_marks_unsupported(
    autotp: dict[str, Path], tmp_path: Path
) -> None:
    folder = _copy(autotp["tp2dp1-z1-fp32"], tmp_path / "ckpt")
    path = folder / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    state["universal_checkpoint_info"]["autotp_unsupported_parameter_patterns"] = {
        r"^model\.layers\.0\.self_attn\.q_proj\.weight$": "its fused qkv layout interleaves"
    }
    torch.save(state, path)
    with pytest.raises(UnsupportedCheckpointError) as info:
        ucformat.convert(folder, tmp_path / "store")
    message = str(info.value)
    assert "\n" not in message and "marks 1 parameter layout(s) unsupported" in message
    assert "q_proj" in message and "fused qkv" in message


def test_autotp_replica_mismatch_names_the_param(autotp: dict[str, Path], tmp_path: Path) -> None:
    """embed_tokens is replicated and first in the flat group: change one value on tp rank 1."""
    folder = _copy(autotp["tp2dp1-z1-fp32"], tmp_path / "ckpt")
    path = folder / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    state = torch.load(path, weights_only=False)
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1.0
    torch.save(state, path)
    with pytest.raises(LayoutMismatchError) as info:
        ucformat.convert(folder, tmp_path / "store")
    assert str(info.value) == (
        "param 'model.embed_tokens.weight' is tensor-parallel replicated, but its 'fp32' on tp "
        "rank 1 differs from rank 0's; the checkpoint is inconsistent (ranks diverged)."
    )


def test_autotp_missing_rank_file(autotp: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(autotp["tp2dp2-z2-fp32"], tmp_path / "ckpt")
    (folder / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(SourceNotFoundError, match="zero_pp_rank_1_mp_rank_01"):
        ucformat.convert(folder, tmp_path / "store")


def test_autotp_native_export_round_trips(autotp: dict[str, Path], tmp_path: Path) -> None:
    """``export deepspeed --tp 2`` at another dp and stage, converted back: the same arrays
    (a stock engine loads such an export: tests/integration/test_autotp_load.py)."""
    from tests.cli.helpers import invoke

    store = tmp_path / "store"
    ucformat.convert(autotp["tp2dp1-z1-fp32"] / "ckpt", store)
    out = tmp_path / "native"
    args = ("export", "deepspeed", store, out, "--world-size", "4", "--tp", "2", "--stage", "2")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "tp2 x dp2 ZeRO-2" in result.stdout
    assert (out / TAG / "zero_pp_rank_1_mp_rank_01_optim_states.pt").is_file()
    back = ucformat.convert(out, tmp_path / "back")
    assert back.source.world_size == 2 and back.source.zero_stage == 2
    assert back.tensor_parallel == ucformat.open(store).manifest.tensor_parallel
    a, b = ucformat.open(store), ucformat.open(tmp_path / "back")
    for name, entry in a.manifest.params.items():
        for state in entry.states:
            assert torch.equal(a.read(name, state), b.read(name, state)), (name, state)
    refused = invoke("export", "deepspeed", store, tmp_path / "x", "--world-size", "4", "--tp", "4",
                     "--stage", "1")  # fmt: skip
    assert refused.exit_code == 2
    assert (
        "param 'model.layers.0.self_attn.q_proj.weight': cannot re-cut its tp 2 split for tp 4: "
        "its even widths [32, 32]" in refused.output
    )


def test_autotp_export_at_other_tp_round_trips(autotp: dict[str, Path], tmp_path: Path) -> None:
    """tp2 store -> ``export deepspeed --tp 1`` -> convert: a tp-less store with the same arrays;
    it refuses ``--tp 2`` without split rules, and with ``--tp-layout`` (the tp2 store's rules)
    exports the tp2 files again: converted back, the tp2 store's layout and arrays. (Stock
    ``load_checkpoint`` of both exports: tests/integration/test_autotp_load.py.)"""
    from tests.cli.helpers import invoke
    from ucformat.export.deepspeed_tensor_parallel import export_deepspeed_tensor_parallel

    store = tmp_path / "store"
    ucformat.convert(autotp["tp2dp1-z1-fp32"] / "ckpt", store)
    export_deepspeed_tensor_parallel(store, tmp_path / "tp1", world_size=2, tp=1, stage=2)
    assert sorted(p.name for p in (tmp_path / "tp1" / TAG).iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    plain = ucformat.convert(tmp_path / "tp1", tmp_path / "plain")
    assert plain.tensor_parallel is None and plain.source.world_size == 2
    a, b = ucformat.open(store), ucformat.open(tmp_path / "plain")
    for name, entry in a.manifest.params.items():
        for state in entry.states:
            assert torch.equal(a.read(name, state), b.read(name, state)), (name, state)
    args = ("export", "deepspeed", tmp_path / "plain", tmp_path / "tp2", "--world-size", "2",
            "--tp", "2", "--stage", "1")  # fmt: skip
    refused = invoke(*args)
    assert refused.exit_code == 2
    assert "records no tensor-parallel split, so the AutoTP shards at tp 2" in refused.output
    result = invoke(*args, "--tp-layout", store)
    assert result.exit_code == 0, result.output
    back = ucformat.convert(tmp_path / "tp2", tmp_path / "back")
    assert back.tensor_parallel == a.manifest.tensor_parallel
    c = ucformat.open(tmp_path / "back")
    for name, entry in a.manifest.params.items():
        for state in entry.states:
            assert torch.equal(a.read(name, state), c.read(name, state)), (name, state)
    # ZeRO-3 AutoTP files (per-rank model states): converted back, the same layout and arrays
    export_deepspeed_tensor_parallel(store, tmp_path / "z3", world_size=4, tp=2, stage=3)
    assert (tmp_path / "z3" / TAG / "zero_pp_rank_1_mp_rank_01_model_states.pt").is_file()
    z3 = ucformat.convert(tmp_path / "z3", tmp_path / "z3.ucf")
    assert z3.source.zero_stage == 3 and z3.tensor_parallel == a.manifest.tensor_parallel
    d = ucformat.open(tmp_path / "z3.ucf")
    for name, entry in a.manifest.params.items():
        for state in entry.states:
            assert torch.equal(a.read(name, state), d.read(name, state)), (name, state)
