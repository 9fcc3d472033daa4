"""Ctrl-C at every step of a write: the exit code and the one line tell what is on disk.

Each case runs the real ``ucformat`` command in a fresh process (``tests/fixtures/
_interrupted_cli.py``) that sends itself SIGINT just before a named step, where a timed Ctrl-C
lands only now and then (the timed ones: tests/integration/test_overwrite_safety.py). What is
checked is what a script and its user see: the exit code (0 once the write was committed, 130
before), the one line on stderr, and what is on disk: the destination (the old store, or the
new one, complete), and no leftover that opens as a store (docs/format.md §6.2).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
from ucformat.errors import IncompleteStoreError

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
SOURCE = DATA / "z3-bf16-dsadam-ftb-ws4" / "ckpt"
OTHER = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"
SMALL = ["--chunk-kib", "1", "--shard-mib", "1", "-q"]
WRAPPER = Path(__file__).resolve().parents[1] / "fixtures" / "_interrupted_cli.py"


def _run(args: list[str], at: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UCF_TEST_SIGINT_AT": at}
    return subprocess.run(
        [sys.executable, str(WRAPPER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _refused(path: Path) -> None:
    """A leftover never opens, never inspects: whatever it holds, it is no store."""
    with pytest.raises(IncompleteStoreError, match="staging folder of an unfinished"):
        ucformat.open(path)
    done = CliRunner().invoke(app, ["inspect", str(path)])
    assert done.exit_code == 2, done.output
    assert "staging folder of an unfinished" in done.output


@pytest.fixture
def old_store(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    dst = tmp_path / "out.ucf"
    ucformat.convert(OTHER, dst, chunk_bytes=1024, shard_bytes=2**20)
    return dst, _snapshot(dst)


def _convert(dst: Path) -> list[str]:
    return ["convert", str(SOURCE), str(dst), *SMALL, "--overwrite"]


def test_ctrl_c_while_writing_leaves_the_old_store_and_says_so(
    old_store: tuple[Path, dict[str, bytes]],
) -> None:
    dst, before = old_store
    done = _run(_convert(dst), "ucformat.write.convert:write_units")
    assert done.returncode == 130, done.stderr
    assert _line(done) == (
        f"interrupted: nothing was committed; {dst} is as it was (no staged write is left "
        "beside it)."
    )
    assert _snapshot(dst) == before
    assert _hidden(dst.parent) == []


def test_a_second_ctrl_c_during_the_cleanup_names_what_is_left(
    old_store: tuple[Path, dict[str, bytes]],
) -> None:
    dst, before = old_store
    done = _run(
        _convert(dst), "ucformat.write.convert:write_units,ucformat.store.destination:_remove"
    )
    assert done.returncode == 130, done.stderr
    staging = dst.parent / f".{dst.name}.ucformat-staging"
    assert _line(done) == (
        f"interrupted: nothing was committed; {dst} is as it was; left behind by the unfinished "
        f"write (no reader opens it, the next write removes it, or delete it): {staging}."
    )
    assert _snapshot(dst) == before
    _refused(staging)
    rerun = subprocess.run(
        [sys.executable, "-m", "ucformat_cli", *_convert(dst)], capture_output=True, timeout=300
    )
    assert rerun.returncode == 0
    assert _hidden(dst.parent) == []


def test_ctrl_c_as_the_manifest_is_written_commits_and_exits_0(
    old_store: tuple[Path, dict[str, bytes]],
) -> None:
    """The commit (manifest, swap) holds Ctrl-C back until it is done; the interrupt then stops
    the command before the old store, swapped out, is deleted: said, and refused by readers."""
    dst, _ = old_store
    done = _run(_convert(dst), "ucformat.store.manifest_io:write_file_atomic")
    assert done.returncode == 0, done.stderr
    staging = dst.parent / f".{dst.name}.ucformat-staging"  # the old store, swapped out
    assert _line(done) == (
        f"interrupted after the commit: the write was committed before the interrupt; {dst} is "
        "complete; left behind by the unfinished write (no reader opens it, the next write "
        f"removes it, or delete it): {staging}."
    )
    assert ucformat.verify(dst, against=SOURCE).ok
    _refused(staging)


def test_ctrl_c_while_the_old_store_is_removed_leaves_nothing_that_opens(
    old_store: tuple[Path, dict[str, bytes]],
) -> None:
    dst, _ = old_store
    done = _run(_convert(dst), "ucformat.store.destination:_remove")
    assert done.returncode == 0, done.stderr
    staging = dst.parent / f".{dst.name}.ucformat-staging"  # the old store, swapped out
    assert _line(done) == (
        f"interrupted after the commit: the write was committed before the interrupt; {dst} is "
        "complete; left behind by the unfinished write (no reader opens it, the next write "
        f"removes it, or delete it): {staging}."
    )
    assert ucformat.verify(dst, against=SOURCE).ok
    _refused(staging)


def test_export_ctrl_c_while_writing_says_what_is_left(tmp_path: Path) -> None:
    store = tmp_path / "s.ucf"
    ucformat.convert(SOURCE, store)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine")
    args = ["export", "safetensors", str(store), str(out), "-q", "--overwrite"]
    done = _run(args, "ucformat.export.safetensors:_write_file")
    assert done.returncode == 130, done.stderr
    assert _line(done) == (
        f"interrupted: nothing was committed; {out} is as it was (no staged write is left "
        "beside it)."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "s.ucf"]
    assert _snapshot(out) == {"README.md": b"mine"}


def test_export_ctrl_c_at_the_swap_commits_and_exits_0(tmp_path: Path) -> None:
    store = tmp_path / "s.ucf"
    ucformat.convert(SOURCE, store)
    out = tmp_path / "hf"
    args = ["export", "safetensors", str(store), str(out), "-q"]
    done = _run(args, "ucformat.store.destination:LocalDestination._swap")
    assert done.returncode == 0, done.stderr
    assert _line(done) == (
        f"interrupted after the commit: the write was committed before the interrupt; {out} "
        "is complete."
    )
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "s.ucf"]
