"""Run one command and measure it: wall time, peak memory of its process tree, peak disk.

Memory is sampled every ``interval`` seconds from ``/proc/<pid>/smaps_rollup`` of the process
and all its descendants: the peak of the summed PSS (shared pages split between the processes
that map them, so forked workers are not counted twice) and of the summed RSS. The largest single
process's peak RSS comes exactly from the kernel, not sampled: GNU ``time``'s ``%M`` (the command
runs under ``/usr/bin/time``, so the figure is not inflated by this process's own memory, which
a forked child carries until it execs); without ``/usr/bin/time``, ``wait4``'s ``ru_maxrss``.
Disk is the allocated size (``st_blocks``) of everything under ``watch``, sampled too: the peak
minus the final size is the temporary disk the command used there.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

GNU_TIME = Path("/usr/bin/time")


@dataclass(frozen=True)
class RunStats:
    """What :func:`measure` saw."""

    wall_s: float
    #: Peak of the summed PSS / RSS of the process tree (sampled), bytes.
    peak_pss: int
    peak_rss: int
    #: Peak RSS of the largest single process (kernel-exact), bytes.
    max_rss: int
    #: Peak and final allocated bytes under the watched folder.
    peak_disk: int
    final_disk: int
    returncode: int

    @property
    def temp_disk(self) -> int:
        """Disk used during the run beyond what was left at the end."""
        return max(0, self.peak_disk - self.final_disk)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields, plus ``temp_disk``."""
        return {**asdict(self), "temp_disk": self.temp_disk}


def tree_size(path: Path) -> int:
    """Allocated bytes of every file under ``path`` (0 if absent)."""
    total = 0
    stack = [path]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total


def _memory(pid: int) -> tuple[int, int]:
    """Summed (PSS, RSS) in bytes of ``pid`` and its descendants."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    pss = rss = 0
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pss, rss


def measure(
    cmd: Sequence[str],
    *,
    watch: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    log: Path | None = None,
    interval: float = 0.05,
    disk_interval: float = 0.25,
    timeout_s: float = 900.0,
) -> RunStats:
    """Run ``cmd`` to completion and return its :class:`RunStats`."""
    peak = {"pss": 0, "rss": 0, "disk": 0}
    done = threading.Event()
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    timed = Path(tempfile.mkstemp(prefix="ucf-bench-time-")[1]) if GNU_TIME.exists() else None
    argv = [str(GNU_TIME), "-f", "%M", "-o", str(timed), *cmd] if timed else list(cmd)
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )

    def sample() -> None:
        next_disk = 0.0
        while not done.is_set():
            pss, rss = _memory(proc.pid)
            peak["pss"] = max(peak["pss"], pss)
            peak["rss"] = max(peak["rss"], rss)
            now = time.perf_counter()
            if watch is not None and now >= next_disk:
                peak["disk"] = max(peak["disk"], tree_size(watch))
                next_disk = now + disk_interval
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    deadline = started + timeout_s
    status = None
    while status is None:
        pid, status_word, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status = os.waitstatus_to_exitcode(status_word)
            break
        if time.perf_counter() > deadline:
            os.killpg(proc.pid, 9)
            raise TimeoutError(f"{' '.join(cmd)} ran longer than {timeout_s} s")
        time.sleep(0.005)
    wall = time.perf_counter() - started
    proc.returncode = status
    done.set()
    sampler.join()
    if log is not None:
        out.close()  # type: ignore[union-attr]
    final = tree_size(watch) if watch is not None else 0
    max_rss = usage.ru_maxrss * 1024
    if timed is not None:
        text = timed.read_text().strip().splitlines()
        timed.unlink()
        max_rss = int(text[-1]) * 1024 if text and text[-1].isdigit() else max_rss
    return RunStats(
        wall_s=wall,
        peak_pss=peak["pss"],
        peak_rss=peak["rss"],
        max_rss=max_rss,
        peak_disk=max(peak["disk"], final),
        final_disk=final,
        returncode=status,
    )
