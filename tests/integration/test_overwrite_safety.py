"""No store lost by a failed overwrite or a second writer (docs/format.md §6.2, §6.3; issue #21).

* a failing ``convert --overwrite`` (permission error, Ctrl-C at several moments),
  ``save(overwrite=True)`` and ``export --overwrite`` leave the old store / export complete;
* two converts started together on one destination: one wins, the other fails in one line,
  and the result verifies (repeated);
* the writer lock: held, stale (its process is gone) and foreign-host locks.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
import ucformat.export.destination as export_destination
import ucformat.torch as uctorch
import ucformat.write.convert
from ucformat.errors import IncompleteStoreError, StoreBusyError, StoreWriteError
from ucformat.store.writer_lock import local_lock_path

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
SOURCE = DATA / "z3-bf16-dsadam-ftb-ws4" / "ckpt"
OTHER = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"
SMALL = ["--chunk-kib", "1", "--shard-mib", "1", "-q"]


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_a_failed_overwrite_keeps_the_old_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "out.ucf"
    ucformat.convert(SOURCE, dst)
    before = _snapshot(dst)

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(dst / "params"))

    monkeypatch.setattr(ucformat.write.convert, "write_units", denied)
    result = CliRunner().invoke(app, ["convert", str(SOURCE), str(dst), "--overwrite", "-q"])
    assert result.exit_code == 2
    assert _one_line(result.output) == (
        f"error: {dst}: writing the arrays failed (PermissionError: Permission denied); "
        "nothing was committed. The destination (or its parent folder, which holds the staging "
        "folder and the lock) is not writable: choose a writable destination."
    )
    monkeypatch.undo()
    assert _snapshot(dst) == before
    assert ucformat.verify(dst, against=SOURCE).ok
    assert _entries(tmp_path) == ["out.ucf"]  # no staging folder, no lock left


def test_a_failed_save_overwrite_keeps_the_old_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    dst = tmp_path / "live.ucf"
    uctorch.save(model, optimizer, dst)
    before = _snapshot(dst)
    save_module = sys.modules["ucformat.write.spread"]  # the one write engine of every save

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_module, "write_units", full)
    with pytest.raises(Exception, match="No space left on device"):
        uctorch.save(model, optimizer, dst, overwrite=True)
    monkeypatch.undo()
    assert _snapshot(dst) == before and ucformat.verify(dst).ok
    assert _entries(tmp_path) == ["live.ucf"]
    uctorch.save(model, optimizer, dst, overwrite=True)  # the lock was released
    assert ucformat.verify(dst).ok


@pytest.mark.parametrize(
    ("command", "options"),
    [("safetensors", ()), ("deepspeed", ("--world-size", "2", "--stage", "2"))],
)
def test_a_failed_export_overwrite_keeps_the_old_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, options: tuple[str, ...]
) -> None:
    store = tmp_path / "s.ucf"
    ucformat.convert(SOURCE, store)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    args = ["export", command, str(store), str(out), *options, "--overwrite", "-q"]
    assert CliRunner().invoke(app, args).exit_code == 0
    before = _snapshot(out)
    writes = {"count": 0}
    real_save = torch.save

    def failing_save(obj: object, path: object, *a: object, **k: object) -> None:
        writes["count"] += 1
        if writes["count"] == 2:  # torch's own error for a full disk
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . unexpected pos 0 vs 64: "
                "PytorchStreamWriter failed writing file data/0: file write failed"
            )
        real_save(obj, path, *a, **k)  # type: ignore[arg-type]

    def failing_write(path: Path, data: bytes) -> None:
        with open(path.with_name(f".{path.name}.tmp"), "wb") as handle:
            handle.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(export_destination, "write_bytes", failing_write)
    import ucformat.export.safetensors as st

    real_file = st._write_file

    def failing_file(*a: object, **k: object) -> None:
        real_file(*a, **k)  # type: ignore[arg-type]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "_write_file", failing_file)
    result = CliRunner().invoke(app, args)
    monkeypatch.undo()
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert line.startswith("error: ") and "Traceback" not in result.output
    assert "No space left on device" in line or "the export was removed" in line, line
    assert _snapshot(out) == before  # old export intact; no .tmp, no new files
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert _entries(tmp_path) == ["out", "s.ucf"]  # no staging folder, no lock left


def test_torch_write_failure_is_one_store_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", failing)
    target = tmp_path / "x.pt"
    with pytest.raises(StoreWriteError) as info:
        export_destination.save_torch({"a": 1}, target)
    assert str(info.value) == (
        f"{target}: writing failed (the file could not be written); the export was removed "
        "and the destination left as it was. Free some space or choose another destination."
    )
    assert _entries(tmp_path) == []


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _lock(dst: Path, pid: int, host: str) -> Path:
    path = local_lock_path(dst)
    body = {"pid": pid, "host": host, "started": "2026-01-01T00:00:00Z", "argv": "ucformat"}
    path.write_text(json.dumps(body))
    return path


def test_the_writer_lock(tmp_path: Path) -> None:
    dst = tmp_path / "out.ucf"
    lock = _lock(dst, 1, socket.gethostname())  # pid 1 is alive: a live writer
    with pytest.raises(StoreBusyError) as info:
        ucformat.convert(SOURCE, dst)
    assert str(info.value) == (
        f"{dst}: another ucformat writer holds the lock {lock} (pid 1 on host "
        f"{socket.gethostname()} since 2026-01-01T00:00:00Z); wait for it to finish, or delete "
        "the lock if that process is gone."
    )
    result = CliRunner().invoke(app, ["convert", str(SOURCE), str(dst), "-q"])
    assert result.exit_code == 2 and _one_line(result.output).startswith("error: ")
    _lock(dst, 1, "another-host")  # cannot be checked from here: refused, holder named
    with pytest.raises(StoreBusyError, match="pid 1 on host another-host"):
        ucformat.convert(SOURCE, dst)
    _lock(dst, _dead_pid(), socket.gethostname())  # stale: taken over
    ucformat.convert(SOURCE, dst)
    assert not lock.exists() and _entries(tmp_path) == ["out.ucf"]


def test_the_lock_is_never_seen_empty_and_dead_writers_drafts_go(tmp_path: Path) -> None:
    """A lock is written whole as a draft and linked into place, so a writer killed at any
    moment leaves a full lock (stale once its pid is gone) or none, and maybe its draft: the
    next writer on the host removes the drafts of dead processes and leaves the live ones'."""
    dst = tmp_path / "out.ucf"
    lock = local_lock_path(dst)
    host = socket.gethostname()
    dead = lock.with_name(f"{lock.name}.{host}.{_dead_pid()}.draft")
    live = lock.with_name(f"{lock.name}.{host}.1.draft")  # pid 1: a writer still drafting
    elsewhere = lock.with_name(f"{lock.name}.another-host.{_dead_pid()}.draft")
    for draft in (dead, live, elsewhere):
        draft.write_bytes(b"")
    ucformat.convert(SOURCE, dst)
    assert _entries(tmp_path) == sorted(["out.ucf", live.name, elsewhere.name])
    # a killed writer's lock is whole: the next writer takes it over at once
    _lock(dst, _dead_pid(), host)
    ucformat.convert(SOURCE, dst, overwrite=True)
    assert not lock.exists()


RACER = r"""
import json, os, sys, time
from pathlib import Path
import ucformat
from ucformat.errors import UCFormatError
folder, source, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for r in range(rounds):
    (folder / f"ready-{r}-{os.getpid()}").touch()
    while not (folder / f"go-{r}").exists():
        time.sleep(0.001)
    try:
        ucformat.convert(source, folder / f"race{r}.ucf", overwrite=r % 2 == 1,
                         chunk_bytes=1024, shard_bytes=2**20)
        print(json.dumps([r, "ok", ""]), flush=True)
    except UCFormatError as exc:
        print(json.dumps([r, type(exc).__name__, str(exc)]), flush=True)
"""


def test_two_converts_started_together(tmp_path: Path) -> None:
    """Synchronised starts, repeated: one writer wins each round, the other fails in one line
    (busy, or the store it finds already there), and the store verifies."""
    rounds = 4
    for r in range(rounds):
        if r % 2:  # odd rounds race two --overwrite runs over a complete store
            ucformat.convert(OTHER, tmp_path / f"race{r}.ucf")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), str(src), str(rounds)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for src in (SOURCE, OTHER)
    ]
    try:
        for r in range(rounds):
            deadline = time.monotonic() + 120
            while len(list(tmp_path.glob(f"ready-{r}-*"))) < 2:
                assert time.monotonic() < deadline, "racers did not start"
                time.sleep(0.01)
            (tmp_path / f"go-{r}").touch()
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    results = [json.loads(line) for out in outputs for line in out.splitlines()]
    busy = 0
    for r in range(rounds):
        mine = [res for res in results if res[0] == r]
        assert len(mine) == 2, results
        kinds = sorted(kind for _, kind, _ in mine)
        assert "ok" in kinds, mine
        for _, kind, message in mine:
            assert kind in ("ok", "StoreBusyError", "StoreExistsError"), mine
            assert "\n" not in message
        busy += "StoreBusyError" in kinds
        assert ucformat.verify(tmp_path / f"race{r}.ucf").ok
    assert busy >= 2, results  # started together, most rounds meet the lock
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_at_several_moments_keeps_the_old_store(tmp_path: Path) -> None:
    dst = tmp_path / "out.ucf"
    ucformat.convert(OTHER, dst)
    before = _snapshot(dst)
    command = [sys.executable, "-m", "ucformat_cli", "convert", str(SOURCE), str(dst), *SMALL]
    full = float("inf")
    for _ in range(2):  # the warm time: a first, cold run can take twice as long
        started = time.perf_counter()
        measure = [*command[:5], str(tmp_path / "measure.ucf"), *SMALL, "--overwrite"]
        subprocess.run(measure, check=True, timeout=300)
        full = min(full, time.perf_counter() - started)
    outcomes = []
    for fraction in (0.3, 0.5, 0.7, 0.9):
        process = subprocess.Popen(
            [*command, "--overwrite"],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # as a terminal's Ctrl-C finds it: a suite started as a background job (`cmd &`)
            # hands its children SIGINT ignored, and the signal would never arrive
            preexec_fn=_default_sigint,
        )
        try:
            time.sleep(fraction * full)
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        outcomes.append(process.returncode)
        committed = _snapshot(dst) != before
        if committed:  # finished (committed) before the signal: the new store, exit code 0
            assert process.returncode == 0, stderr
            assert ucformat.verify(dst, against=SOURCE).ok
        elif stderr.strip() == "interrupted before the command started; nothing was written.":
            # in Python's start-up (imports): the interpreter may end by the signal itself
            assert process.returncode in (130, -signal.SIGINT), stderr
        else:  # 130, or the signal's own status (which a shell reports as 130 too)
            assert process.returncode in (130, -signal.SIGINT), stderr
            assert ucformat.verify(dst, against=OTHER).ok
            assert _one_line(stderr) == (
                f"interrupted: nothing was committed; {dst} is as it was (no staged write is "
                "left beside it)."
            )
        for leftover in (p for p in tmp_path.iterdir() if p.name.startswith(".")):
            assert leftover.name in _one_line(stderr), stderr  # said, and refused by readers
            with pytest.raises(IncompleteStoreError):
                ucformat.open(leftover)
            ucformat.convert(OTHER, dst, overwrite=True)  # the next write removes it
        if committed:
            ucformat.convert(OTHER, dst, overwrite=True)
            before = _snapshot(dst)
        assert _entries(tmp_path) == ["measure.ucf", "out.ucf"]
    assert 130 in outcomes, outcomes
