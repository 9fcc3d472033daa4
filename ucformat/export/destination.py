"""An export's destination folders, through the one destination lifecycle.

An export writes a folder of files (safetensors shards, DeepSpeed's ``.pt`` files, a DCP folder)
into a destination that may hold the user's other files (a Trainer's ``checkpoint-N/``, a
Hugging Face model folder). It goes through the same lifecycle as a store
(:class:`~ucformat.store.destination.LocalDestination`: the writer lock, a staging folder
beside the destination, fsync, the swap, cleanup):

* every export entry point is decorated with :func:`transactional`, which opens a session;
* inside it, :func:`prepare_destination` (the common rule: an empty folder, or ``overwrite``)
  or :func:`stage` (a rule of the export's own) checks the destination, opens its lifecycle
  and returns the staging folder: the export writes everything there, under the names it will
  have in the destination (:func:`write_bytes`, :func:`save_torch`);
* when the export returns, every destination of the session is committed: the staged files
  fsynced, then swapped in (the whole folder when the export replaces all it holds, else entry
  by entry beside the user's other files, the commit markers ``last``), and the entries the
  export owns that it did not write again deleted; when it raises (an error, a full disk,
  Ctrl-C), every staging folder is removed and each destination is as it was.

An export called by another one (accelerate's DCP folders) writes inside the outer export's
staging folder and is committed with it. A write error of a file (``OSError``, or torch's
``inline_container.cc`` failure) becomes one :class:`~ucformat.errors.StoreWriteError` line.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from ucformat.errors import StoreExistsError, StoreWriteError, UCFormatError
from ucformat.store.destination import LocalDestination, transient_name

__all__ = [
    "export_session",
    "file_writes",
    "prepare_destination",
    "save_torch",
    "stage",
    "transactional",
    "write_bytes",
]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Opened:
    destination: LocalDestination
    owned: Callable[[str], bool]
    last: tuple[str, ...]


_SESSION: ContextVar[list[_Opened] | None] = ContextVar("ucformat_export_session", default=None)


@contextlib.contextmanager
def export_session() -> Iterator[None]:
    """Commit every destination staged inside the block when it ends, or discard them all."""
    opened: list[_Opened] = []
    token = _SESSION.set(opened)
    try:
        yield
        for index, item in enumerate(opened):
            try:
                with file_writes(item.destination.path):
                    item.destination.commit(replaces=item.owned, last=item.last)
            except BaseException:
                for later in opened[index + 1 :]:
                    later.destination.discard()
                if item.destination.state != "committed":
                    item.destination.discard()
                raise
    except BaseException:
        for item in reversed(opened):
            if item.destination.state == "started":
                item.destination.discard()
        raise
    finally:
        _SESSION.reset(token)


def transactional(export: Callable[P, R]) -> Callable[P, R]:
    """Decorate an export entry point: all or nothing in its destination folder(s)."""

    @functools.wraps(export)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if _SESSION.get() is not None:  # an export called by another: the outer one commits
            return export(*args, **kwargs)
        with export_session():
            return export(*args, **kwargs)

    return wrapper


def stage(
    out: Path,
    *,
    owned: Callable[[str], bool],
    last: Collection[str] = (),
    check: Callable[[Path], None] | None = None,
) -> Path:
    """Open ``out``'s lifecycle in the current session; return the folder to write into.

    Args:
        out: the destination folder.
        owned: which existing entries of ``out`` the export replaces (deleted at the commit,
            written again or not); the others are kept.
        last: entries moved in last (the files that mark a finished export).
        check: the export's rule for ``out``, run once the lock is held.

    A folder inside a staging folder of the session (an export called by another) is written
    as it is, and committed with the outer export.
    """
    opened = _SESSION.get()
    if opened is None:
        raise RuntimeError("stage() outside an export session (decorate the export entry point)")
    out = Path(out)
    absolute = out.absolute()
    for item in opened:
        if absolute.is_relative_to(item.destination.staging):
            if check is not None:
                check(out)
            out.mkdir(parents=True, exist_ok=True)
            return out
    destination = LocalDestination(out)
    staged = destination.start(check)
    opened.append(_Opened(destination, owned, tuple(last)))
    return staged


def prepare_destination(
    out: Path,
    *,
    overwrite: bool,
    owned: Callable[[str], bool],
    dry_run: bool,
    last: Collection[str] = (),
) -> Path:
    """Check ``out`` by the common rule and :func:`stage` it; return the folder to write into
    (``out`` itself for a dry run, which writes nothing).

    The rule: a destination that exists and is not empty is refused without ``overwrite``.
    With it, only the entries ``owned(name)`` accepts (the files and folders this export
    writes) are replaced; anything else in the folder is left alone.
    """

    def check(folder: Path) -> None:
        if folder.exists() and not folder.is_dir():
            raise StoreExistsError(
                f"{folder}: exists and is a file; choose a folder as destination."
            )
        children = [p for p in folder.iterdir() if not transient_name(p.name)]
        if children and not overwrite:
            raise StoreExistsError(
                f"{folder}: already exists and is not empty; pass overwrite=True to replace the "
                "files this export writes (other files are kept), or choose an empty folder."
            )

    if dry_run:
        if out.exists():
            check(out)
        return out
    return stage(out, owned=owned, last=last, check=lambda folder: _if_present(folder, check))


def _if_present(folder: Path, check: Callable[[Path], None]) -> None:
    if folder.exists():
        check(folder)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (in a staging folder: the commit makes it visible)."""
    with file_writes(path):
        path.write_bytes(data)


def save_torch(obj: Any, path: Path) -> int:
    """``torch.save`` ``obj`` to ``path`` (in a staging folder); return the file size."""
    with file_writes(path):
        torch.save(obj, path)
    return path.stat().st_size


@contextlib.contextmanager
def file_writes(path: Path) -> Iterator[None]:
    """Turn a failed write of ``path`` into one :class:`StoreWriteError` line (the export's
    session then removes what it staged)."""
    try:
        yield
    except UCFormatError:
        raise
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc.strerror or exc}"
        raise StoreWriteError(_message(path, reason)) from None
    except RuntimeError as exc:  # torch.save's zip writer: "inline_container.cc ... failed"
        text = str(exc)
        if "inline_container" not in text and "write" not in text:
            raise
        raise StoreWriteError(_message(path, "the file could not be written")) from None


def _message(path: Path, reason: str) -> str:
    return (
        f"{_shown(path)}: writing failed ({reason[:200]}); the export was removed and the "
        "destination left as it was. Free some space or choose another destination."
    )


def _shown(path: Path) -> str:
    """``path`` as the user named it: a staged file under its destination's name."""
    opened = _SESSION.get() or []
    absolute = path.absolute()
    for item in opened:
        staging = item.destination.staging
        if absolute.is_relative_to(staging) and staging != item.destination.path:
            return str(item.destination.path / absolute.relative_to(staging))
    return str(path)
