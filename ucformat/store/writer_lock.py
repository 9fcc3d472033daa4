"""One writer per destination: the lock object (docs/format.md §6.3).

A writer creates the lock atomically before it touches the destination and removes it on every
exit path (commit or discard):

* local stores: the file ``.<name>.ucformat-lock`` beside the destination folder, written
  whole as a draft (``.<name>.ucformat-lock.<host>.<pid>.draft``) and hard-linked into place,
  which fails if the lock exists: a lock is never seen empty, even when its writer is killed
  at any moment (a draft a dead process left is removed by the next writer on its host). On a
  file system without hard links: ``O_CREAT | O_EXCL``, then the content;
* S3 (s3fs): the object ``<prefix>/ucformat.lock``, created with a conditional PUT
  (``If-None-Match: *``); other object stores get a check-then-put (not atomic; documented).

The lock holds ``{"pid", "host", "started", "argv"}``. A lock whose process is gone (same host,
no such pid) is stale and taken over; a lock from another host is reported with its holder so
that a person can remove it. Stdlib only, plus the store's whole-object calls for object stores.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from ucformat.errors import StoreBusyError

__all__ = [
    "IN_PLACE_LOCK",
    "LOCK_KEY",
    "LockInfo",
    "acquire_local",
    "busy_message",
    "holds_local",
    "local_lock_path",
    "lock_payload",
    "parse_lock",
    "release_local",
]

#: The lock's key inside an object-store destination (never part of a store's data).
LOCK_KEY = "ucformat.lock"
#: The lock's name inside a destination written in place (a mount point).
IN_PLACE_LOCK = ".ucformat-lock"
#: A lock file that is still empty or unparsable after this many seconds is stale (its writer
#: died between creating and filling it).
_UNREADABLE_GRACE_S = 30.0

_HELD: set[Path] = set()


@dataclass(frozen=True)
class LockInfo:
    """Who holds a lock."""

    pid: int
    host: str
    started: str
    argv: str

    def describe(self) -> str:
        """``pid 123 on host h since 2026-01-01T00:00:00Z``."""
        return f"pid {self.pid} on host {self.host} since {self.started}"

    def is_stale(self) -> bool:
        """True if the holder is a process of this host that no longer exists."""
        if self.host != socket.gethostname():
            return False
        if self.pid == os.getpid():
            return False  # a live lock of this very process: see acquire_local
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # someone else's live process
            return False
        return False


def lock_payload() -> bytes:
    """The lock's content for this process."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    argv = " ".join(sys.argv)[:200]
    body = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "argv": argv}
    return json.dumps(body).encode()


def parse_lock(data: bytes) -> LockInfo | None:
    """The holder a lock's bytes name, or None if they are not a lock ucformat wrote."""
    try:
        body: Any = json.loads(data[:4096])
        pid, host, started, argv = body["pid"], body["host"], body["started"], body["argv"]
        return LockInfo(int(pid), str(host), str(started), str(argv))
    except (ValueError, TypeError, KeyError):
        return None


def local_lock_path(root: Path) -> Path:
    """The lock file of the local destination ``root`` (beside it, in its parent)."""
    root = Path(os.path.abspath(root))
    if os.path.ismount(root):  # written in place (staged_local.in_place): the lock inside it
        return root / IN_PLACE_LOCK
    return root.parent / f".{root.name}.ucformat-lock"


def busy_message(where: str, lock: str, holder: LockInfo | None) -> str:
    """The one line a second writer gets."""
    who = holder.describe() if holder is not None else "a writer that is still starting"
    return (
        f"{where}: another ucformat writer holds the lock {lock} ({who}); wait for it to "
        "finish, or delete the lock if that process is gone."
    )


def acquire_local(root: Path) -> Path:
    """Create the lock of the local destination ``root``; return its path.

    A stale lock (its process is gone) is replaced; so is a lock this process left behind
    (an earlier write of this process that failed before releasing it).

    Raises:
        StoreBusyError: another live writer holds the lock.
        OSError: the lock cannot be created (permissions, read-only file system).
    """
    path = local_lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_drafts(path)
    payload = lock_payload()
    for _ in range(3):
        try:
            _create(path, payload)
        except FileExistsError:
            if not _take_over(path):
                raise StoreBusyError(busy_message(str(root), str(path), _read(path))) from None
            continue
        _HELD.add(path)
        return path
    raise StoreBusyError(busy_message(str(root), str(path), _read(path)))


def _draft_suffix() -> str:
    return f".{socket.gethostname()}.{os.getpid()}.draft"


def _create(path: Path, payload: bytes) -> None:
    """Create the lock ``path`` holding ``payload``, or raise FileExistsError."""
    draft = path.with_name(path.name + _draft_suffix())
    try:
        draft.write_bytes(payload)
        try:
            os.link(draft, path)
            return
        except FileExistsError:
            raise
        except OSError:  # no hard links here: create it exclusively, then fill it
            pass
    finally:
        draft.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)


def _remove_dead_drafts(path: Path) -> None:
    """Remove the drafts of ``path`` that processes of this host left when they died."""
    host = socket.gethostname()
    for draft in path.parent.glob(f"{glob_escape(path.name)}.*.draft"):
        owner, _, pid = draft.name[len(path.name) + 1 : -len(".draft")].rpartition(".")
        if owner == host and pid.isdigit() and LockInfo(int(pid), host, "", "").is_stale():
            draft.unlink(missing_ok=True)


def holds_local(root: Path) -> bool:
    """True if this process holds the lock of ``root``."""
    return local_lock_path(root) in _HELD


def release_local(root: Path) -> None:
    """Remove the lock of ``root`` if this process holds it (idempotent)."""
    path = local_lock_path(root)
    if path in _HELD:
        _HELD.discard(path)
        holder = _read(path)
        if holder is None or (holder.pid == os.getpid() and holder.host == socket.gethostname()):
            path.unlink(missing_ok=True)


def _read(path: Path) -> LockInfo | None:
    try:
        return parse_lock(path.read_bytes())
    except OSError:
        return None


def _take_over(path: Path) -> bool:
    """Remove a stale lock at ``path``; True if the caller may try to create it again."""
    try:
        data, age = path.read_bytes(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True  # released meanwhile
    holder = parse_lock(data)
    mine = holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname()
    if holder is None:
        stale = age > _UNREADABLE_GRACE_S
    else:
        stale = holder.is_stale() or (mine and path not in _HELD)
    if not stale:
        return False
    # Move it aside, then check that what moved is what was judged stale: a racing writer may
    # have replaced it with a live lock in between (then that lock is put back).
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True
    try:
        if aside.read_bytes() != data:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
            return False
    finally:
        aside.unlink(missing_ok=True)
    return True
