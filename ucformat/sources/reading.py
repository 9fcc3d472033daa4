"""Describing a foreign checkpoint: what goes wrong becomes one error of ucformat's hierarchy.

Every reader of foreign files (DeepSpeed ZeRO and pipeline checkpoints, DCP folders) opens its
files, then describes them as a :class:`~ucformat.sources.base.SourceCheckpoint`. If the
description fails, the files it opened are closed and:

* an error of ucformat's hierarchy passes unchanged;
* a value the manifest cannot hold exactly (pydantic refuses it, e.g. ``inf``) becomes
  :class:`~ucformat.errors.UnsupportedCheckpointError` naming the field and the value;
* a structure the reader did not expect (``KeyError``, ``TypeError``, ...: files damaged, or
  written by something else) becomes :class:`~ucformat.errors.NotACheckpointError`.

Usage::

    with describing(folder, "the shard files", "a supported DeepSpeed", close):
        return describe(...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from ucformat.errors import NotACheckpointError, UCFormatError, UnsupportedCheckpointError

__all__ = ["describing"]


@contextmanager
def describing(
    folder: Path, content: str, written_by: str, close: Callable[[], object]
) -> Iterator[None]:
    """Run a reader's description of ``folder``; on failure ``close`` its files, then raise.

    Args:
        folder: the checkpoint, for messages.
        content: what was being read (``"the DCP items"``), for messages.
        written_by: what writes such files (``"dcp.save"``), for messages.
        close: closes every file the reader opened.
    """
    try:
        yield
    except UCFormatError:
        close()
        raise
    except ValidationError as exc:  # a value the manifest cannot hold exactly (e.g. inf)
        close()
        first = exc.errors()[0]
        raise UnsupportedCheckpointError(
            f"{folder}: {exc.title}.{'.'.join(map(str, first['loc']))} = {first.get('input')!r} "
            f"cannot be stored in the manifest ({first['msg']})."
        ) from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        close()  # structure that no supported writer makes: damaged or foreign files
        raise NotACheckpointError(
            f"{folder}: unexpected content in {content} ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the files are damaged or not written by {written_by}."
        ) from None
    except BaseException:
        close()
        raise
