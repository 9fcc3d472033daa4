"""An export either completes or leaves its destination folder as it found it.

:func:`transactional` wraps each export entry point. Inside it, :func:`begin` records what the
destination folder held before the export wrote anything, and :func:`remove_entry` (what
``--overwrite`` does to a file or folder the export replaces) moves the entry into a hidden
folder ``.ucformat-replaced-<id>`` instead of deleting it. When the export returns, the moved
entries are deleted; when it raises (an error, a full disk, Ctrl-C), everything it created is
removed, temporary files included, and the moved entries are put back. A write error of a file
(``OSError``, or torch's ``inline_container.cc`` write failure) becomes one
:class:`~ucformat.errors.StoreWriteError` line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

from ucformat.errors import StoreWriteError, UCFormatError

__all__ = ["begin", "file_writes", "remove_entry", "transactional"]

P = ParamSpec("P")
R = TypeVar("R")

_REPLACED_PREFIX = ".ucformat-replaced-"


@dataclass
class _Scope:
    folder: Path
    existed: bool
    before: set[str]
    aside: Path | None = None
    moved: list[str] = field(default_factory=list)

    def rollback(self) -> None:
        if not self.folder.is_dir():
            return
        if not self.existed:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        for child in list(self.folder.iterdir()):
            if child.name not in self.before and child != self.aside:
                _delete(child)
        if self.aside is not None:
            for name in self.moved:
                _delete(self.folder / name)
                os.rename(self.aside / name, self.folder / name)
            shutil.rmtree(self.aside, ignore_errors=True)

    def commit(self) -> None:
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)


_ACTIVE: ContextVar[list[_Scope] | None] = ContextVar("ucformat_export_scopes", default=None)


def transactional(export: Callable[P, R]) -> Callable[P, R]:
    """Decorate an export entry point: all or nothing in its destination folder(s)."""

    @functools.wraps(export)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if _ACTIVE.get() is not None:  # an export called by another: the outer one decides
            return export(*args, **kwargs)
        scopes: list[_Scope] = []
        token = _ACTIVE.set(scopes)
        try:
            result = export(*args, **kwargs)
        except BaseException:
            for scope in reversed(scopes):
                scope.rollback()
            raise
        finally:
            _ACTIVE.reset(token)
        for scope in scopes:
            scope.commit()
        return result

    return wrapper


def begin(folder: Path) -> None:
    """Record what ``folder`` holds before the export writes into it (once per folder)."""
    scopes = _ACTIVE.get()
    if scopes is None or any(scope.folder == folder for scope in scopes):
        return
    existed = folder.is_dir()
    before = {child.name for child in folder.iterdir()} if existed else set()
    scopes.append(_Scope(folder, existed, before))


def remove_entry(path: Path) -> None:
    """Remove ``path`` (a file or folder the export replaces): moved aside until the export
    completes, inside :func:`transactional`; deleted at once outside it."""
    scopes = _ACTIVE.get() or []
    scope = next((s for s in scopes if s.folder == path.parent), None)
    if scope is None or path.name not in scope.before:
        _delete(path)
        return
    if scope.aside is None:
        scope.aside = path.parent / f"{_REPLACED_PREFIX}{uuid.uuid4().hex[:12]}"
        scope.aside.mkdir()
    os.rename(path, scope.aside / path.name)
    scope.moved.append(path.name)


@contextlib.contextmanager
def file_writes(path: Path) -> Iterator[None]:
    """Turn a failed write of ``path`` into one :class:`StoreWriteError` line (the export's
    rollback then removes what it wrote)."""
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
        f"{path}: writing failed ({reason[:200]}); the export was removed and the destination "
        "left as it was. Free some space or choose another destination."
    )


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
