"""Compare a ucformat store with the ground truth dumped from the live DeepSpeed engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ucformat.format.dtypes import dtype_name
from ucformat.format.pyvalue import decode
from ucformat.read.checkpoint import UniversalCheckpoint

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def load_truth(case_dir: Path) -> dict[str, Any]:
    """The truth dict written by tests/fixtures/_ds_save_worker.py."""
    truth: dict[str, Any] = torch.load(case_dir / "truth.pt", weights_only=True)
    return truth


def plain(value: Any) -> Any:
    """Tuples as lists, recursively, so hyper-parameters compare across encodings."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def assert_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-exact equality, dtype and shape included."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(
        got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
    ), f"{what}: values differ"


def assert_step(got: Any, want: Any, what: str) -> None:
    """Same value and same type (python int, or 0-d tensor of the same dtype)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {got!r} is not a tensor like {want!r}"
        assert_exact(got, want, what)
    else:
        assert type(got) is type(want) and got == want, f"{what}: {got!r} != {want!r}"


def assert_store_matches_truth(ckpt: UniversalCheckpoint, truth: dict[str, Any]) -> None:
    """Every array and manifest field the truth knows about, compared exactly."""
    manifest = ckpt.manifest
    case = truth["case"]
    assert manifest.source.zero_stage == case["stage"]
    assert manifest.source.world_size == case["world_size"]
    assert manifest.source.train_dtype == dtype_name(_DTYPES[case["dtype"]])
    assert set(manifest.params) == set(truth["fp32"]) | set(truth["frozen"])
    for name, want in truth["fp32"].items():
        assert_exact(ckpt.read(name, "fp32"), want, f"{name}/fp32")
        entry = manifest.params[name]
        assert entry.requires_grad and entry.group is not None
    for name, states in (truth["optim"] or {}).items():
        for key, want in states.items():
            assert_exact(ckpt.read(name, key), want, f"{name}/{key}")
    if truth["optim"] is not None:
        for name, want in truth["step"].items():
            assert_step(ckpt.read(name, "step"), want, f"{name}/step")
    _check_odd_states(ckpt, truth)
    for name, want in truth["frozen"].items():
        entry = manifest.params[name]
        assert not entry.requires_grad and entry.group is None, name
        assert entry.dtype == dtype_name(want.dtype), name
        assert_exact(ckpt.read(name, "fp32"), want.to(torch.float32), f"{name}/frozen")
    assert set(manifest.buffers) == set(truth["buffers"])
    for name, want in truth["buffers"].items():
        assert_exact(ckpt.read(name, "buffer"), want, f"buffer {name}")
    assert manifest.tied == truth["shared_params"]
    for name, want in truth["module"].items():
        if name in truth["buffers"]:
            continue
        got = ckpt.read(manifest.resolve(name), "fp32").to(want.dtype)
        assert_exact(got, want, f"module {name} (lp from fp32)")
    assert manifest.optimizer is not None
    assert len(manifest.optimizer.groups) == len(truth["param_groups"])
    for index, (group, want) in enumerate(
        zip(manifest.optimizer.groups, truth["param_groups"], strict=True)
    ):
        want = dict(want)
        assert group.params == want.pop("param_names"), f"group {index} members"
        got = {k: decode(v) for k, v in group.hyperparams.items()}
        if case.get("elastic_checkpoint"):
            assert got == {}, "legacy elastic shards store no param-group hyper-parameters"
            continue
        assert plain(got) == plain(want), f"group {index} hyper-parameters"
    progress = manifest.progress
    assert progress.global_steps == truth["global_steps"]
    assert progress.global_samples == truth["global_samples"]
    assert progress.skipped_steps == truth["skipped_steps"]
    assert plain(decode(progress.lr_scheduler)) == plain(truth["lr_scheduler"])
    if truth["loss_scaler"] is not None:
        assert progress.loss_scaler is not None
        attributes = {k: decode(v) for k, v in progress.loss_scaler.attributes.items()}
        for key, want in truth["loss_scaler"].items():
            assert plain(attributes[key]) == plain(want), f"loss scaler {key}"
    values = {k: decode(v) for k, v in manifest.client_state.values.items()}
    for key, want in truth["client_state"].items():
        assert plain(values[key]) == plain(want), f"client state {key}"


def _check_odd_states(ckpt: UniversalCheckpoint, truth: dict[str, Any]) -> None:
    """States neither elementwise nor 0-d (format 3.1): kept whole per parameter (ZeRO-0) or
    once per partition (ZeRO-1/2), exactly as the job held them."""
    manifest = ckpt.manifest
    odd = truth.get("odd") or {}
    if truth["case"]["stage"] == 0:
        whole = {k for states in odd.values() for k in states}
        assert manifest.optimizer is not None
        assert sorted(manifest.optimizer.whole_keys) == sorted(whole)
        for name, states in odd.items():
            assert sorted(manifest.params[name].whole_states) == sorted(states), name
            for key, want in states.items():
                assert_exact(ckpt.read(name, key), want, f"{name}/{key} (whole)")
        return
    assert manifest.optimizer is not None
    for index, group in enumerate(manifest.optimizer.groups):
        held = odd.get(str(index), {})
        assert sorted(group.partition_states) == sorted(held), f"group {index} partition states"
        for key, per_rank in held.items():
            state = group.partition_states[key]
            rows = ckpt.read_array(state.array)
            assert state.partitions == len(per_rank)
            for rank, want in enumerate(per_rank):
                assert_exact(rows[rank], want, f"group {index} {key} partition {rank}")
            same = all(torch.equal(per_rank[0], t) for t in per_rank)
            assert state.replicated == same, f"group {index} {key} replicated"


def _tensor_mismatch(got: Any, want: Any) -> str | None:
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return None if (type(got) is type(want) and got == want) else f"{got!r} != {want!r}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    same = torch.equal(
        got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
    )
    if same:
        return None
    return f"values differ (max abs diff {(got.double() - want.double()).abs().max().item():.3g})"


def compare_truths(got: dict[str, Any], want: dict[str, Any], *, with_optimizer: bool) -> list[str]:
    """Mismatches between the truth of a loaded engine (``got``) and of the saved one (``want``)."""
    failures: list[str] = []

    def check(what: str, a: Any, b: Any) -> None:
        problem = _tensor_mismatch(a, b)
        if problem:
            failures.append(f"{what}: {problem}")

    for section in ("fp32", "module"):
        if set(got[section]) != set(want[section]):
            failures.append(f"{section} names {sorted(got[section])} != {sorted(want[section])}")
        for name in sorted(set(got[section]) & set(want[section])):
            check(f"{section} {name}", got[section][name], want[section][name])
    if got["shared_params"] != want["shared_params"]:
        failures.append(f"shared params {got['shared_params']} != {want['shared_params']}")
    for key in ("global_steps", "global_samples", "skipped_steps"):
        check(key, got[key], want[key])
    if plain(got["lr_scheduler"]) != plain(want["lr_scheduler"]):
        failures.append(f"lr scheduler {got['lr_scheduler']} != {want['lr_scheduler']}")
    if not with_optimizer:
        return failures
    if want["optim"] is not None:
        for name, states in want["optim"].items():
            for key, value in states.items():
                check(f"{key} {name}", got["optim"][name][key], value)
        for name, value in want["step"].items():
            check(f"step {name}", got["step"].get(name), value)
    odd = (got.get("odd"), want.get("odd"))
    same_layout = all(got["case"][k] == want["case"][k] for k in ("stage", "world_size")) or (
        got["case"]["stage"] == want["case"]["stage"] == 0
    )
    if odd[1] and same_layout:  # not elementwise: compared where the layout holds them alike
        if sorted(odd[0] or {}) != sorted(odd[1]):
            failures.append(f"odd states of {sorted(odd[0] or {})} != {sorted(odd[1])}")
        for where, states in odd[1].items():
            for key, value in states.items():
                have = (odd[0] or {}).get(where, {}).get(key)
                if isinstance(value, list):
                    for rank, (a, b) in enumerate(zip(have or [], value, strict=False)):
                        check(f"{key} of group {where} partition {rank}", a, b)
                    if have is None or len(have) != len(value):
                        failures.append(f"{key} of group {where}: {have} != {value}")
                else:
                    check(f"{key} of {where}", have, value)
    if not want["case"].get("elastic_checkpoint"):
        # 'name' says which group it is (an MoE expert group's 'ep_size_<N>'), not how it
        # trains: the engine keeps its own (ucformat.deepspeed.load, _GROUP_IDENTITY)
        got_groups = [
            plain({k: v for k, v in g.items() if k != "name"}) for g in got["param_groups"]
        ]
        want_groups = [
            plain({k: v for k, v in g.items() if k != "name"}) for g in want["param_groups"]
        ]
        if got_groups != want_groups:
            failures.append(f"param groups {got_groups} != {want_groups}")
    scalers = (got["loss_scaler"], want["loss_scaler"])
    if None not in scalers:  # across classes (a stage change): the attributes both have
        common = sorted(set(scalers[0]) & set(scalers[1]))
        if not common or [plain(scalers[0][k]) for k in common] != [
            plain(scalers[1][k]) for k in common
        ]:
            failures.append(f"loss scaler {got['loss_scaler']} != {want['loss_scaler']}")
    return failures
