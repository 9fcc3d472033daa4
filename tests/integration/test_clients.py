"""Real training clients on CPU: each saves at W=2 (with its own API, or to a store through
its own save call), and resumes through its own resume call at another size, every parameter
and Adam state bit-exact against the saving job's gathered state, then trains on; Hugging Face
weights start sharded runs bit-exact against ``from_pretrained``.

The client saves are cached (tests/fixtures/clients_cases.py, ``tests/.cache/clients``) and
made, when stale, in the one W=2 launch that also loads the Hugging Face weights; the resumes
run in one torchrun launch per world size (1 and 3). Recipes: docs/clients.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
from tests.fixtures.clients_cases import available, record_saves, run_client_jobs, stale_saves
from tests.fixtures.pretrained_cases import LOADS, generate_pretrained, pretrained_jobs
from tests.fixtures.pretrained_cases import available as transformers_available

pytestmark = pytest.mark.clients


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _lightning_jobs(root: Path, saved: Path) -> list[dict[str, Any]]:
    """Resumes at W=1 and W=3 of the W=2 saves: ModelParallel from its store and natively,
    DeepSpeed from its store (ZeRO-2 saved; ZeRO-2 at W=1, ZeRO-3 at W=3), and the converted
    native ModelParallel checkpoint (its meta.pt in the store's client state) at W=3."""
    _cli("convert", str(saved / "ckpt"), str(root / "lightning.ucf"))
    jobs = []
    for world, stage in ((1, 2), (3, 3)):
        for name, strategy, ours, ckpt in (
            ("mp-store", "mp", True, saved / "mp.ucf"),
            ("mp-native", "mp", False, saved / "mp-native"),
            ("ds-store", "ds", True, saved / "ds.ucf"),
        ):
            jobs.append({
                "name": f"lightning-{name}-w{world}", "client": "lightning", "kind": "resume",
                "world_size": world, "strategy": strategy, "ours": ours, "stage": stage,
                "ckpt": str(ckpt), "dir": str(root),
            })  # fmt: skip
    jobs.append({
        "name": "lightning-mp-converted-w3", "client": "lightning", "kind": "resume",
        "world_size": 3, "strategy": "mp", "ours": True, "ckpt": str(root / "lightning.ucf"),
        "dir": str(root),
    })  # fmt: skip
    return jobs


def _accelerate_jobs(root: Path, saved: Path) -> list[dict[str, Any]]:
    """Convert Accelerate's save_state folder, export it back for W=1, resume with load_state."""
    _cli("convert", str(saved / "checkpoint_0"), str(root / "accelerate.ucf"))
    resumed = root / "checkpoint_0"  # the user's folder, RNG files included, minus the model
    shutil.copytree(saved / "checkpoint_0", resumed)
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        shutil.rmtree(resumed / sub)
    _cli("export", "accelerate", str(root / "accelerate.ucf"), str(resumed), "--world-size", "1")
    return [{"name": "accelerate-resume-w1", "client": "accelerate", "kind": "resume",
             "world_size": 1, "dir": str(root), "folder": str(resumed),
             "truth": str(saved / "truth.pt")}]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every client's save (cached) and the W=2 loads of Hugging Face weights in one launch;
    then the conversions, and every resume: one launch per world size (1, 3)."""
    root = tmp_path_factory.mktemp("clients")
    sources, saves = stale_saves()
    first: list[dict[str, Any]] = list(saves)
    later: list[dict[str, Any]] = []
    if transformers_available():  # Hugging Face weights into FSDP2, ZeRO-3, TP models
        folders = generate_pretrained()
        stores = {which: root / f"pretrained-{which}.ucf" for which in folders}
        for which, folder in folders.items():
            _cli("convert", str(folder), str(stores[which]))
        for job in pretrained_jobs(folders, stores):
            (first if job["world_size"] == 2 else later).append(job)
    results = run_client_jobs(first, root / "first") if first else {}
    record_saves(saves, results)
    if "lightning" in sources:
        later.extend(_lightning_jobs(root, sources["lightning"]))
    if "accelerate" in sources:
        later.extend(_accelerate_jobs(root, sources["accelerate"]))
    results.update(run_client_jobs(later, root / "run") if later else {})
    return {"root": root, "sources": sources, "results": results}


def _load(path: str | Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Weights, Adam states, scheduler, lr, global step and epoch, bit for bit."""
    import torch

    assert sorted(got["params"]) == sorted(want["params"]) and want["params"]
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), f"{name}: weight differs"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["states"][name][key], want["states"][name][key]), (name, key)
    for key in ("scheduler", "lr", "global_step", "epoch"):
        assert got[key] == want[key], key
    assert got["global_step"] == 3


def _step_means(losses: list[list[float]]) -> list[float]:
    """Per step, the mean over ranks (each rank's loss is its local batch's mean)."""
    return [sum(step) / len(step) for step in zip(*losses, strict=True)]


@pytest.mark.skipif(not available("lightning"), reason="lightning is not installed")
@pytest.mark.parametrize("world", [1, 3])
def test_lightning_model_parallel_resumes_a_store_as_it_resumes_its_own_checkpoint(
    work: dict[str, Any], world: int
) -> None:
    """Saved at W=2 by ``trainer.save_checkpoint("mp.ucf")``; ``fit(ckpt_path=...)`` at W:
    after the restore, weights, Adam states, scheduler, lr, global step and epoch equal the
    native resume's (Lightning's own DCP checkpoint) and the saving run's, bit for bit; the
    next losses equal the native resume's, and (summed over ranks) the W=2 resume's."""
    saved = work["sources"]["lightning"]
    store = work["results"][f"lightning-mp-store-w{world}"]
    native = work["results"][f"lightning-mp-native-w{world}"]
    assert store["failures"] == [] and native["failures"] == []
    _same_state(_load(store["captured"]), _load(native["captured"]))
    _same_state(_load(store["captured"]), _load(saved / "mp-truth.pt"))
    assert store["losses"] == native["losses"] and len(store["losses"]) == world
    reference = _step_means(_load(saved / "mp-reference.pt"))  # type: ignore[arg-type]
    assert _step_means(store["losses"]) == pytest.approx(reference, rel=1e-5)


@pytest.mark.skipif(not available("lightning"), reason="lightning is not installed")
@pytest.mark.parametrize(("world", "stage"), [(1, 2), (3, 3)])
def test_lightning_deepspeed_resumes_a_store_at_another_size_and_stage(
    work: dict[str, Any], world: int, stage: int
) -> None:
    """Saved at W=2 (ZeRO-2) by ``trainer.save_checkpoint("ds.ucf")``; ``fit(ckpt_path=...)``
    at W=1 (ZeRO-2) and W=3 (ZeRO-3), where DeepSpeed itself refuses another size: the restored
    state equals the saving run's bit for bit (gathered fp32 weights, Adam states, scheduler,
    lr, global step, epoch); the next losses are the W=2 native resume's (summed over ranks)."""
    saved = work["sources"]["lightning"]
    result = work["results"][f"lightning-ds-store-w{world}"]
    assert result["failures"] == []
    _same_state(_load(result["captured"]), _load(saved / "ds-truth.pt"))
    reference = _step_means(_load(saved / "ds-reference.pt"))  # type: ignore[arg-type]
    assert _step_means(result["losses"]) == pytest.approx(reference, rel=1e-5)
    manifest = ucformat.open(saved / "ds.ucf").manifest
    assert manifest.source.zero_stage == 2 and manifest.progress.global_steps == 3
    assert "lightning.loops" in manifest.client_state.values


@pytest.mark.skipif(not available("lightning"), reason="lightning is not installed")
def test_lightning_native_checkpoint_converts_with_its_meta_and_resumes_at_w3(
    work: dict[str, Any],
) -> None:
    """``ucformat convert`` of the native ModelParallel folder keeps ``meta.pt`` (loops,
    schedulers, epoch, global step) as client state: the store resumes the loop state too."""
    saved = work["sources"]["lightning"]
    manifest = ucformat.open(work["root"] / "lightning.ucf").manifest
    assert manifest.optimizer is not None and manifest.source.world_size == 2
    assert "model.a.weight" in manifest.params
    assert manifest.client_state.values["lightning.global_step"] == 3
    result = work["results"]["lightning-mp-converted-w3"]
    assert result["failures"] == []
    _same_state(_load(result["captured"]), _load(saved / "mp-truth.pt"))


@pytest.mark.skipif(not available("accelerate"), reason="accelerate is not installed")
def test_accelerate_fsdp2_save_state_converts_and_load_state_resumes_at_w1(
    work: dict[str, Any],
) -> None:
    saved = work["sources"]["accelerate"] / "checkpoint_0"
    manifest = ucformat.open(work["root"] / "accelerate.ucf").manifest
    assert manifest.optimizer is not None and manifest.source.world_size == 2
    assert sorted(manifest.params) == sorted(manifest.optimizer.groups[0].params)
    resumed = work["root"] / "checkpoint_0"
    for rng in sorted(saved.glob("random_states_*.pkl")):  # left as the user had them
        assert (resumed / rng.name).read_bytes() == rng.read_bytes()
    assert work["results"]["accelerate-resume-w1"]["failures"] == []
    # the exported folder converts back to the same state
    _cli("convert", str(resumed), str(work["root"] / "back.ucf"))
    back = ucformat.open(work["root"] / "back.ucf")
    first = ucformat.open(work["root"] / "accelerate.ucf")
    for name in manifest.params:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert back.read(name, state).equal(first.read(name, state)), (name, state)


@pytest.mark.skipif(not transformers_available(), reason="transformers is not installed")
@pytest.mark.parametrize(("layout", "world_size", "dtype", "which"), LOADS)
def test_hugging_face_weights_load_into_sharded_models_as_from_pretrained_does(
    work: dict[str, Any], layout: str, world_size: int, dtype: str, which: str
) -> None:
    """Every gathered weight and the logits of a fixed batch bit-equal to ``from_pretrained``
    sharded the same way. Bytes fetched from storage: where the load read once (the default
    when ranks share chunks), at most 1.02x the chunks some rank needed, job-wide; where each
    rank read its own, at most 1.2x what that rank needed."""
    result = work["results"][f"pretrained-{layout}-ws{world_size}-{dtype}"]
    assert result["failures"] == []
    assert len(result["amplification"]) == world_size
    for mode, amplification in zip(result["modes"], result["amplification"], strict=True):
        assert 1.0 <= amplification <= (1.02 if mode == "once" else 1.2), result


def test_unknown_dcp_layout_names_keys_and_the_layouts_it_resembles(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ucformat.errors import NotACheckpointError

    dcp.save({"weights": {"w": torch.ones(2)}, "optimizer_0": {"lr": 1.0}},
             checkpoint_id=str(tmp_path / "d"))  # fmt: skip
    with pytest.raises(NotACheckpointError) as info:
        ucformat.convert(tmp_path / "d", tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message and "top-level keys found: optimizer_0, weights" in message
    assert "Lightning ModelParallelStrategy" in message and "--model-key" in message


def test_split_weights_with_fused_optimizer_state_are_refused_in_one_line(tmp_path: Path) -> None:
    """torchtitan's fuse_qkv hook saves wq/wk/wv while the optimizer state stays under wqkv:
    the refusal names both layouts and what to do, never --model-key."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ucformat.errors import UnsupportedCheckpointError

    attn = "layers.0.attention"
    state = {f"{attn}.{m}.weight": torch.ones(4, 8) for m in ("wq", "wk", "wv", "wo")}
    state["optimizer"] = {
        "state": {f"{attn}.{m}.weight": {"exp_avg": torch.ones(n, 8), "step": torch.tensor(1.0)}
                  for m, n in (("wqkv", 12), ("wo", 4))},
        "param_groups": {f"{attn}.{m}.weight": {"lr": 0.1} for m in ("wqkv", "wo")},
    }  # fmt: skip
    dcp.save(state, checkpoint_id=str(tmp_path / "step-3"))
    with pytest.raises(UnsupportedCheckpointError) as info:
        ucformat.convert(tmp_path / "step-3", tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message and "--model-key" not in message
    assert f"{attn}.wq.weight, {attn}.wk.weight, {attn}.wv.weight" in message
    assert f"fused '{attn}.wqkv.weight'" in message and "--head-dim" in message


def test_split_weights_rejoin_with_the_head_dimension(tmp_path: Path) -> None:
    """torchtitan's fuse_qkv layout (stock dcp.save): with head_dim the store holds ``wqkv``,
    rows interleaved per KV head (2 query heads, 1 key, 1 value, of 2 rows each), exactly."""
    import torch
    import torch.distributed.checkpoint as dcp

    attn, hd, n_kv, per_kv = "layers.0.attention", 2, 2, 2
    torch.manual_seed(0)
    wq, wk, wv = torch.randn(n_kv * per_kv * hd, 3), torch.randn(n_kv * hd, 3), torch.randn(4, 3)
    fused = torch.cat([wq.reshape(n_kv, per_kv, hd, 3), wk.reshape(n_kv, 1, hd, 3),
                       wv.reshape(n_kv, 1, hd, 3)], dim=1).reshape(-1, 3)  # fmt: skip
    state = {f"{attn}.{m}.weight": t for m, t in (("wq", wq), ("wk", wk), ("wv", wv))}
    state["optimizer"] = {
        "state": {f"{attn}.wqkv.weight": {"exp_avg": fused * 2, "step": torch.tensor(1.0)}},
        "param_groups": {f"{attn}.wqkv.weight": {"lr": 0.1}},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "step-3"))
    manifest = ucformat.convert(tmp_path / "step-3", tmp_path / "s.ucf", head_dim=hd)
    assert list(manifest.params) == [f"{attn}.wqkv.weight"]
    store = ucformat.open(tmp_path / "s.ucf")
    assert store.read(f"{attn}.wqkv.weight", "fp32").equal(fused)
    assert store.read(f"{attn}.wqkv.weight", "exp_avg").equal(fused * 2)
    result = CliRunner().invoke(
        app, ["convert", str(tmp_path / "step-3"), str(tmp_path / "t.ucf"), "--head-dim", "3"]
    )
    assert result.exit_code == 2 and "--head-dim 3 does not fit" in result.output


def test_accelerate_folder_of_two_models_converts_model_by_model(tmp_path: Path) -> None:
    """``save_state`` of two prepared models (folders ``_0``, ``_1``, as Accelerate names them,
    written with stock dcp.save): the folder is refused in one line; ``pytorch_model_fsdp_1/``
    converts with its ``optimizer_1/``, and ``export accelerate --index 1`` writes that pair."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from tests.fixtures.models import build_model
    from ucformat.errors import UnsupportedCheckpointError

    root = tmp_path / "checkpoint_0"
    models = {}
    for index, name in enumerate(("simple", "multi")):
        model, groups = build_model(name, seed=index)
        opt = torch.optim.AdamW(groups, lr=0.01)
        inputs = torch.randn(2, model.in_features)
        model(inputs).sum().backward()
        opt.step()
        dcp.save({"model": get_model_state_dict(model)},
                 checkpoint_id=str(root / f"pytorch_model_fsdp_{index}"))  # fmt: skip
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(root / f"optimizer_{index}"))  # fmt: skip
        models[index] = (model, opt)
    with pytest.raises(UnsupportedCheckpointError) as info:
        ucformat.convert(root, tmp_path / "all.ucf")
    assert "\n" not in str(info.value) and "pytorch_model_fsdp_I" in str(info.value)

    _cli("convert", str(root / "pytorch_model_fsdp_1"), str(tmp_path / "m1.ucf"))
    store = ucformat.open(tmp_path / "m1.ucf")
    model, opt = models[1]
    for name, param in model.named_parameters():
        assert store.read(name, "fp32").equal(param.detach())
        assert store.read(name, "exp_avg").equal(opt.state[param]["exp_avg"])
    _cli("export", "accelerate", str(tmp_path / "m1.ucf"), str(tmp_path / "out"), "--index", "1")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "optimizer_1", "pytorch_model_fsdp_1"]  # fmt: skip
    _cli("convert", str(tmp_path / "out" / "pytorch_model_fsdp_1"), str(tmp_path / "back.ucf"))
    back = ucformat.open(tmp_path / "back.ucf")
    for name in store.manifest.params:
        assert back.read(name, "exp_avg_sq").equal(store.read(name, "exp_avg_sq"))
