"""The one way tests and benchmarks start distributed jobs.

* :func:`torchrun_command`: the one builder of ``python -m torch.distributed.run`` command lines
  (loopback rendezvous on a fresh port, this interpreter, the given program and arguments);
* :func:`run_in_group`: run a command in its own process group, killed whole (torchrun and every
  worker) on timeout, so a stuck launch never leaves workers behind;
* :func:`launch_jobs`: one torchrun launch of a worker over a JSON list of jobs;
* :func:`run_batches`: the "group by world size -> write jobs -> launch -> read results" loop,
  one launch per world size, results read back from each job's ``result`` file.

Every launch gets :func:`launch_env`: ``DS_ACCELERATOR=cpu``, one OpenMP thread per rank, the
checkout on ``PYTHONPATH`` and DeepSpeed's JIT builds in the checkout's own
``tests/.cache/torch_extensions`` (a folder shared with other virtualenvs is rebuilt by each and
keeps stale locks). Rendezvous and collectives get timeouts that fit a loaded 2-core machine.

This module imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Lines of a failed launch's log shown in the error.
LOG_TAIL_LINES = 80
#: Seconds torchrun waits for every rank to join the rendezvous (a loaded 2-core machine
#: starts four DeepSpeed processes in well under this).
RENDEZVOUS_TIMEOUT_S = 900

T = TypeVar("T")


class LaunchError(RuntimeError):
    """A torchrun launch failed or timed out (the message carries the log's tail)."""


_USED_PORTS: set[int] = set()


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1, never handed out twice by this process."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _USED_PORTS:
            _USED_PORTS.add(port)
            return port
    raise LaunchError("could not find a free TCP port")


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every launch: this one plus the settings above, then ``extra``."""
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / "tests" / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def torchrun_command(world_size: int, program: Sequence[str], port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` on ``world_size`` local ranks running ``program``.

    ``program`` is a script and its arguments, or ``["-m", module, *args]``.
    """
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc_per_node", str(world_size),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port if port is not None else free_port()),
        "--rdzv_conf", f"timeout={RENDEZVOUS_TIMEOUT_S}",
        *program,
    ]  # fmt: skip


def run_in_group(
    cmd: Sequence[str],
    *,
    timeout_s: float,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; on timeout kill the whole group.

    Output goes to ``log_path`` (the command line first), or is returned when ``capture``,
    else is inherited. The result's ``returncode`` is None when the command timed out.
    """
    run_env = launch_env(env)
    log = log_path.open("w") if log_path is not None else None
    if log is not None:
        log.write(" ".join(cmd) + "\n")
        log.flush()
    out: Any = log if log is not None else (subprocess.PIPE if capture else None)
    err: Any = subprocess.STDOUT if log is not None else (subprocess.PIPE if capture else None)
    try:
        proc = subprocess.Popen(
            list(cmd), cwd=REPO_ROOT, env=run_env, stdout=out, stderr=err, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            kill_group(proc)
            stdout, stderr = proc.communicate()
            code = None
    finally:
        if log is not None:
            log.close()
    return subprocess.CompletedProcess(list(cmd), code, stdout or "", stderr or "")  # type: ignore[arg-type]


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """Terminate the process group started for ``proc`` (torchrun and its workers)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def log_excerpt(log_path: Path) -> str:
    """The failure markers and the last lines of a launch log."""
    lines = log_path.read_text(errors="replace").splitlines()
    failed = [ln for ln in lines if "FIXTURE-FAILED" in ln]
    head = "\n".join(failed) + "\n" if failed else ""
    return head + "\n".join(lines[-LOG_TAIL_LINES:])


def launch_jobs(
    worker: Path,
    world_size: int,
    jobs: Sequence[dict[str, Any]],
    log_dir: Path,
    label: str,
    timeout_s: float,
) -> float:
    """One torchrun launch of ``worker --jobs FILE`` over ``jobs``; return its wall time.

    The jobs file and the log go to ``log_dir/<label>-ws<N>.{json,log}``. A port clash is
    retried once.

    Raises:
        LaunchError: the launch failed or timed out (with the log's tail).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs_file = log_dir / f"{label}-ws{world_size}.json"
    log_path = log_dir / f"{label}-ws{world_size}.log"
    jobs_file.write_text(json.dumps(list(jobs), indent=1))
    start = time.monotonic()
    status: int | None = None
    for attempt in range(2):
        cmd = torchrun_command(world_size, [str(worker), "--jobs", str(jobs_file)])
        status = run_in_group(cmd, timeout_s=timeout_s, log_path=log_path).returncode
        port_clash = "address already in use" in log_path.read_text(errors="replace").lower()
        if status == 0 or not (port_clash and attempt == 0):
            break
    elapsed = time.monotonic() - start
    if status != 0:
        why = f"timed out after {timeout_s:.0f} s" if status is None else f"exit status {status}"
        raise LaunchError(
            f"torchrun {label} ws={world_size} ({len(jobs)} jobs) {why}; log: {log_path}\n"
            f"{log_excerpt(log_path)}"
        )
    jobs_file.unlink()
    return elapsed


def group_by_world(items: Iterable[T], world_of: Callable[[T], int]) -> dict[int, list[T]]:
    """``items`` grouped by world size, smallest first (one launch each)."""
    groups: dict[int, list[T]] = {}
    for item in items:
        groups.setdefault(world_of(item), []).append(item)
    return dict(sorted(groups.items()))


def run_batches(
    worker: Path,
    batches: Mapping[int, Sequence[dict[str, Any]]],
    log_dir: Path,
    label: str,
    *,
    base_timeout_s: float,
    per_job_timeout_s: float,
    verbose: bool = True,
) -> dict[int, float]:
    """Launch ``worker`` once per world size of ``batches``; wall time per world size.

    Each launch's timeout is ``base_timeout_s + per_job_timeout_s * len(jobs)``.
    """
    times: dict[int, float] = {}
    for world_size, jobs in sorted(batches.items()):
        if not jobs:
            continue
        timeout = base_timeout_s + per_job_timeout_s * len(jobs)
        times[world_size] = launch_jobs(worker, world_size, jobs, log_dir, label, timeout)
        if verbose:
            print(f"[{label}] ws={world_size}: {len(jobs)} jobs in {times[world_size]:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    return times


def read_results(jobs: Iterable[Mapping[str, Any]], key: str = "result") -> list[Any]:
    """Each job's result document (the JSON file its ``key`` names), in order."""
    return [json.loads(Path(job[key]).read_text()) for job in jobs]


def grid_cli(
    argv: Sequence[str] | None,
    description: str,
    run: Callable[[str | None, Path, Path], Mapping[str, Mapping[str, Any]]],
    accepted: Callable[[Mapping[str, Any]], bool] = lambda result: not result["failures"],
) -> int:
    """The command line of a fixture runner: ``--grid DIR --work DIR [--only SUBSTRING]``.

    ``run(only, grid, work)`` returns each case's result; a case whose result is not
    ``accepted`` has its ``failures`` printed. Exit status 1 if any case failed.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--grid", type=Path, required=True, help="generated fixture grid")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder")
    parser.add_argument("--only", help="only cases whose name contains this substring")
    args = parser.parse_args(argv)
    results = run(args.only, args.grid, args.work)
    bad = {name: r["failures"] for name, r in results.items() if not accepted(r)}
    for name, failures in bad.items():
        print(f"FAIL {name}:\n  " + "\n  ".join(failures))
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0
