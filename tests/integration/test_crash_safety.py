"""Crash safety (docs/format.md §6): SIGKILL ``ucformat convert`` at random moments.

After every kill, the destination either refuses to open (incomplete, or not a store yet) or
opens as complete, and then the convert had really finished: the store verifies against its
source, bit for bit. Re-running ``ucformat convert --overwrite`` always succeeds and verifies
(it takes over the killed writer's stale lock and staging folder). Half the trials kill a
``--overwrite`` run over a complete store: the write is staged beside it (§6.2), so the old
store stays complete.

Most trials fork the CLI from a *zygote* process that has already imported ucformat, so that the
kill times (seeded, spread over a measured full conversion) fall in the conversion itself rather
than in Python's start-up; a few trials kill the real ``ucformat`` console script.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO

import pytest
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
import ucformat.write.convert
from ucformat.errors import IncompleteStoreError, NotAStoreError, SourceNotFoundError

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"
SMALL = ["--chunk-kib", "1", "--shard-mib", "1", "-q"]
FORK_TRIALS, SCRIPT_TRIALS = 24, 3

#: Forks one ``ucformat`` CLI process per request line; waits for the child only when told, so
#: that the killed pid is never reaped (and so never reused) before the test has killed it.
ZYGOTE = r"""
import json, os, sys
import ucformat.write.convert  # the CLI imports the library lazily: import what the convert runs
from ucformat_cli.main import app
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "reap":
        _, status = os.waitpid(child, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
        continue
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        try:
            app(json.loads(line), prog_name="ucformat")
        except SystemExit as exit:
            os._exit(exit.code if isinstance(exit.code, int) else 1)
        os._exit(0)
    print(child, flush=True)
"""


class Zygote:
    """A Python process with ucformat imported that forks CLI runs on request."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        return stdout.readline().strip()

    def _send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def run(self, args: list[str], kill_after: float | None) -> tuple[int, float]:
        """Run the CLI; SIGKILL it after ``kill_after`` s. Returns (exit code, seconds)."""
        self._send(json.dumps(args))
        pid, started = int(self._line()), time.perf_counter()
        if kill_after is not None:
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)  # our child, not yet reaped: the pid is still ours
        self._send("reap")
        code = int(self._line())
        return code, time.perf_counter() - started

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def _convert_args(dst: Path) -> list[str]:
    return ["convert", str(SOURCE / "ckpt"), str(dst), *SMALL]


def _state_after_kill(dst: Path, code: int) -> str:
    """Check the invariant after a (possibly) killed convert; name the state it left."""
    try:
        ucformat.open(dst)
    except (IncompleteStoreError, NotAStoreError, SourceNotFoundError) as exc:
        assert code == -signal.SIGKILL, f"convert exited {code} but the store is not complete"
        if isinstance(exc, SourceNotFoundError):
            return "not created"
        return "incomplete" if (dst / "zarr.json").exists() else "not a store yet"
    report = ucformat.verify(dst, against=SOURCE / "ckpt")
    assert report.ok, [str(p) for p in report.problems]
    return "complete" if code == 0 else "complete (killed after commit, or before uncommit)"


def _rerun_and_verify(dst: Path) -> None:
    result = CliRunner().invoke(app, [*_convert_args(dst), "--overwrite"])
    assert result.exit_code == 0, result.output
    report = ucformat.verify(dst, against=SOURCE / "ckpt")
    assert report.ok and report.arrays == 20, [str(p) for p in report.problems]


def test_sigkill_at_random_moments_never_leaves_a_complete_looking_store(tmp_path: Path) -> None:
    zygote = Zygote()
    try:
        code, full = zygote.run(_convert_args(tmp_path / "measure.ucf"), kill_after=None)
        assert code == 0
        assert ucformat.verify(tmp_path / "measure.ucf").ok
        rng = random.Random(20240611)
        states: Counter[str] = Counter()
        for trial in range(FORK_TRIALS):
            # odd trials overwrite the complete store the previous trial's re-run left
            dst = tmp_path / f"fork{trial - trial % 2}.ucf"
            args = _convert_args(dst) + (["--overwrite"] if trial % 2 else [])
            code, _ = zygote.run(args, kill_after=rng.uniform(0, 1.25 * full))
            state = _state_after_kill(dst, code)
            if trial % 2:
                assert state.startswith("complete"), "a killed overwrite lost the old store"
            states[state] += 1
            _rerun_and_verify(dst)
            assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    finally:
        zygote.close()
    assert sum(states.values()) == FORK_TRIALS
    assert states["incomplete"] == 0, states  # the destination is never written in place
    assert states["not created"] >= 3, states  # most kills land while arrays are being written


def test_sigkill_of_the_console_script(tmp_path: Path) -> None:
    """The installed ``ucformat`` script, killed in the second half of its (measured) run."""
    executable = Path(sys.executable).with_name("ucformat")
    if not executable.exists():
        pytest.skip("the ucformat console script is not installed next to this Python")

    def run(dst: Path, kill_after: float | None) -> tuple[int, float]:
        started = time.perf_counter()
        process = subprocess.Popen(
            [executable, *_convert_args(dst)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            process.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
        return process.returncode, time.perf_counter() - started

    code, full = run(tmp_path / "measure.ucf", kill_after=None)
    assert code == 0
    rng = random.Random(7)
    for trial in range(SCRIPT_TRIALS):
        dst = tmp_path / f"script{trial}.ucf"
        code, _ = run(dst, kill_after=rng.uniform(0.5, 1.05) * full)
        _state_after_kill(dst, code)
        _rerun_and_verify(dst)


def test_overwrite_accepts_a_store_killed_while_writing_its_root(tmp_path: Path) -> None:
    """A kill during the very first write leaves only zarr's temporary file at the root."""
    dst = tmp_path / "out.ucf"
    dst.mkdir()
    (dst / f"zarr.{'0' * 32}.partial").write_bytes(b'{"zarr_form')
    with pytest.raises(NotAStoreError):
        ucformat.open(dst)
    _rerun_and_verify(dst)


def test_a_crash_while_overwriting_leaves_the_old_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails half-way through an overwrite leaves the old store complete."""
    dst = tmp_path / "out.ucf"
    _rerun_and_verify(dst)
    calls = []

    def crash(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise OSError("simulated crash")

    monkeypatch.setattr(ucformat.write.convert, "write_units", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ucformat.convert(SOURCE / "ckpt", dst, overwrite=True)
    monkeypatch.undo()
    assert calls
    assert ucformat.verify(dst, against=SOURCE / "ckpt").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.ucf"]  # no staging, no lock
    _rerun_and_verify(dst)
