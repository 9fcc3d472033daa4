"""``torchrun -m ucformat_cli convert``: every process writes a share, rank 0 commits.

Two processes must produce exactly the store a single-process convert makes (every object,
manifest included: same source, same plan); a process whose writes fail (``RLIMIT_FSIZE``:
EFBIG, a real OS error) must fail every process with the same one-line error and exit code 2,
and leave no committed store.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import ucformat
from tests.launch import REPO_ROOT, run_in_group, torchrun_command
from ucformat.errors import IncompleteStoreError, NotAStoreError, SourceNotFoundError

pytestmark = pytest.mark.deepspeed  # needs torchrun (torch.distributed), not DeepSpeed itself

SOURCE = REPO_ROOT / "tests" / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4" / "ckpt"
SMALL = ["--chunk-kib", "1", "--shard-mib", "1"]


def _torchrun(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = torchrun_command(
        2, [str(REPO_ROOT / "tests" / "fixtures" / "_limited_cli.py"), *args]
    )
    done = run_in_group(command, timeout_s=600, env=env, capture=True)
    assert done.returncode is not None, f"distributed convert timed out: {done.stdout[-2000:]}"
    return done


def _objects(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_two_processes_write_the_single_process_store(tmp_path: Path) -> None:
    single, spread = tmp_path / "single.ucf", tmp_path / "spread.ucf"
    ucformat.convert(SOURCE, single, chunk_bytes=1024, shard_bytes=1024 * 1024)
    done = _torchrun(["convert", str(SOURCE), str(spread), *SMALL])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 reports
    assert _objects(spread) == _objects(single)
    assert ucformat.verify(spread, against=SOURCE).ok


def test_one_failing_process_fails_all_and_commits_nothing(tmp_path: Path) -> None:
    spread = tmp_path / "spread.ucf"
    done = _torchrun(["convert", str(SOURCE), str(spread), *SMALL], {"UCF_TEST_FSIZE_RANK": "1"})
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    # One line per process that got to print it before torchrun tore the job down, the same
    # on each, naming the process that failed; no traceback from ucformat's own code.
    assert errors, done.stderr[-3000:]
    assert len(set(errors)) == 1
    assert "failed on rank 1 of 2" in errors[0]
    assert "File too large" in errors[0]
    assert "exitcode  : 2" in done.stderr  # the CLI's user-error exit code
    assert f'File "{REPO_ROOT / "ucformat"}' not in done.stderr
    with pytest.raises((IncompleteStoreError, NotAStoreError, SourceNotFoundError)):
        ucformat.open(spread)
