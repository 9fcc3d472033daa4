"""The steps every native DeepSpeed export takes, with a stub plan and file writer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ucformat.errors import StoreExistsError
from ucformat.export import native_export
from ucformat.export.common import ExportHooks, Stopwatch
from ucformat.export.destination import export_session
from ucformat.export.native_export import NativeExport, run_native_export


@dataclass(frozen=True)
class _Plan:
    target: Any
    files: tuple[str, ...]
    nbytes: int


def _ckpt() -> Any:
    return SimpleNamespace(manifest=SimpleNamespace(source=SimpleNamespace(tag="global_step4")))


def _export(calls: list[Any]) -> NativeExport[Any]:
    def plan(tag: str | None) -> _Plan:
        calls.append(("plan", tag))
        chosen = tag or "global_step4"
        return _Plan(SimpleNamespace(tag=chosen), (f"{chosen}/a.pt", "latest"), 12)

    def write(ckpt: Any, plan: _Plan, classes: Any, tag_dir: Path, hooks: ExportHooks) -> list:
        calls.append(("write", tag_dir.name, classes))
        latest = tag_dir.parent / "latest"  # written after the files (and moved in last)
        assert not latest.exists() or latest.read_text() != plan.target.tag
        (tag_dir / "a.pt").write_bytes(b"x")
        hooks.advance(12)
        return ["from the files"]

    return NativeExport(
        plan=plan,
        write=write,
        describe=lambda plan: f"stub checkpoint (tag {plan.target.tag})",
        notes=lambda dest: [f"destination {dest.tag}"],
    )


def _run(out: Path, calls: list[Any], **options: Any) -> Any:
    defaults: dict[str, Any] = {
        "world_size": 2, "stage": 3, "tag": None, "overwrite": False, "remove_previous": False,
        "dry_run": False, "hooks": ExportHooks(), "clock": Stopwatch(),
    }  # fmt: skip
    return run_native_export(_ckpt(), out, _export(calls), **{**defaults, **options})


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "global_step4").mkdir(parents=True)
    (run / "latest").write_text("global_step4")
    return run


def test_a_dry_run_decides_the_tag_and_plans_for_it_but_writes_nothing(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    calls: list[Any] = []
    result = _run(run, calls, dry_run=True)
    assert calls == [("plan", "global_step4_ws2_zero3")]
    assert sorted(p.name for p in run.iterdir()) == ["global_step4", "latest"]
    assert result.dry_run and result.target == "deepspeed" and result.out == run
    assert result.files == ["global_step4_ws2_zero3/a.pt", "latest"]
    want = f"would write stub checkpoint (tag global_step4_ws2_zero3) to {run} in "
    assert result.summary.startswith(want)
    assert result.notes == ["destination global_step4_ws2_zero3"]


def test_a_write_fills_the_tag_folder_then_repoints_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_export, "deepspeed_classes", lambda target: f"classes:{target}")
    run = _run_folder(tmp_path)
    calls: list[Any] = []
    seen: list[int] = []
    hooks = ExportHooks(on_plan=seen.append, on_bytes=seen.append)
    with export_session():  # what the export entry points open (export/destination.py)
        result = _run(run, calls, tag="new", remove_previous=True, hooks=hooks)
    assert calls == [("plan", "new"), ("write", "new", "classes:deepspeed")]
    assert seen == [12, 12]
    assert (run / "latest").read_text() == "new"
    assert (run / "new" / "a.pt").read_bytes() == b"x"
    assert not (run / "global_step4").exists()  # remove_previous, once latest names the new tag
    assert result.notes == ["from the files", "destination new"]
    assert result.summary.startswith(f"wrote stub checkpoint (tag new) to {run} in ")


def test_a_taken_tag_is_refused_before_the_plan(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    calls: list[Any] = []
    with pytest.raises(StoreExistsError, match="global_step4: already exists"):
        _run(run, calls, tag="global_step4")
    assert calls == []
