"""Where a native DeepSpeed export goes: a new tag in a run folder, ``latest`` repointed.

A DeepSpeed *run folder* holds tag folders and a ``latest`` file naming the one
``engine.load_checkpoint(folder)`` loads; a Hugging Face Trainer ``checkpoint-N/`` folder is
one, with the Trainer's own files beside the tag. An export into a run folder behaves like
``engine.save_checkpoint``: it adds a tag and repoints ``latest``, and touches nothing else.

The rules, decided before anything is written (:func:`plan_destination`):

* an empty or missing folder: the tag is ``--tag`` or the source's tag;
* a run folder (it has ``latest``): the tag is ``--tag``; else the source's tag when that is
  free (or ``--overwrite`` is given, to replace it); else ``<source tag>_ws<W>_zero<S>``.
  A tag folder that exists is refused without ``--overwrite``;
* any other non-empty folder is refused without ``--overwrite`` (which then removes only the
  tag folder and ``latest`` this export writes).

The tag ``latest`` named before is kept unless ``remove_previous`` asks for it to go, which
happens at the commit, after the new tag and ``latest`` are in place (:func:`prepare_folder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ucformat.errors import StoreExistsError, UnsupportedExportError
from ucformat.export.destination import stage

__all__ = [
    "Destination",
    "check_run_folder",
    "derived_tag",
    "plan_destination",
    "prepare_folder",
]

LATEST = "latest"


@dataclass(frozen=True)
class Destination:
    """The decided destination of one export.

    Attributes:
        folder: the run folder.
        tag: the tag folder this export writes.
        previous: the tag ``latest`` named before the export (None: no ``latest``).
        replace: ``folder/tag`` exists and will be replaced (``--overwrite``).
        remove_previous: remove ``folder/previous`` once the export is complete.
    """

    folder: Path
    tag: str
    previous: str | None
    replace: bool
    remove_previous: bool

    def notes(self) -> list[str]:
        """What changed in the folder beyond the new tag, for the user."""
        if self.previous is None or self.previous == self.tag:
            return []
        if self.remove_previous:
            return [f"latest: {self.previous} -> {self.tag}; {self.previous} removed"]
        return [
            f"latest: {self.previous} -> {self.tag}; {self.previous} is kept (to go back, write "
            f"'{self.previous}' into {self.folder / LATEST})"
        ]


def derived_tag(source_tag: str, world_size: int, stage: int) -> str:
    """The tag written beside the source's own: ``global_step300_ws3_zero3``.

    It keeps the source tag as its prefix, so Hugging Face's ``global_step*`` check still
    recognises the folder.
    """
    return f"{source_tag}_ws{world_size}_zero{stage}"


def _read_latest(folder: Path) -> str | None:
    latest = folder / LATEST
    if not latest.is_file():
        return None
    return latest.read_text().strip() or None


def _check_tag_name(tag: str) -> None:
    if not tag or tag in (".", "..", LATEST) or "/" in tag or "\\" in tag:
        raise UnsupportedExportError(
            f"tag {tag!r} is not a folder name; choose a plain name such as global_step300."
        )


def plan_destination(
    out: Path,
    *,
    source_tag: str,
    tag: str | None,
    world_size: int,
    stage: int,
    overwrite: bool,
    remove_previous: bool,
) -> Destination:
    """Decide the tag and check the folder (reads names only; writes nothing).

    Raises:
        StoreExistsError: ``out`` is a file, the tag folder exists, or ``out`` is a non-empty
            folder that is not a run folder, without ``overwrite``.
        UnsupportedExportError: ``tag`` is not a plain folder name.
    """
    previous = _read_latest(out)
    check_run_folder(out, pointer=previous, pointer_name="'latest' file", kind="DeepSpeed",
                     overwrite=overwrite)  # fmt: skip
    if tag is None:
        taken = (out / source_tag).exists() and previous is not None and not overwrite
        tag = derived_tag(source_tag, world_size, stage) if taken else source_tag
    _check_tag_name(tag)
    exists = (out / tag).exists()
    if exists and not overwrite:
        raise StoreExistsError(
            f"{out / tag}: already exists; pass --tag NAME to write a new tag beside it, or "
            "overwrite=True to replace it."
        )
    return Destination(
        folder=out,
        tag=tag,
        previous=previous,
        replace=exists,
        remove_previous=remove_previous,
    )


def check_run_folder(
    out: Path, *, pointer: str | None, pointer_name: str, kind: str, overwrite: bool
) -> None:
    """Refuse ``out`` if it is a file, or a non-empty folder without the run's pointer file
    (``pointer`` None: not a ``kind`` checkpoint folder) unless ``overwrite`` (names only).

    Raises:
        StoreExistsError: see above.
    """
    if out.exists() and not out.is_dir():
        raise StoreExistsError(f"{out}: exists and is a file; choose a folder as destination.")
    children = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if children and pointer is None and not overwrite:
        raise StoreExistsError(
            f"{out}: already exists, is not empty and has no {pointer_name} (not a {kind} "
            "checkpoint folder); pass overwrite=True to replace the files this export writes "
            "(other files are kept), or choose an empty folder."
        )


def prepare_folder(dest: Destination, pointer: str = LATEST) -> Path:
    """Stage the run folder (:func:`ucformat.export.destination.stage`); return the (empty)
    staged tag folder. The ``pointer`` file (DeepSpeed's ``latest``, Megatron-LM's tracker)
    goes beside it (``tag_folder.parent``); the commit moves the tag folder in, then the
    pointer, and deletes the tag folder replaced and, if asked for, the previous tag (only once
    the new one and the pointer are in place)."""
    gone = {dest.tag, pointer}
    if dest.remove_previous and _plain_name(dest.previous) and dest.previous != dest.tag:
        gone.add(str(dest.previous))
    staged = stage(dest.folder, owned=lambda name: name in gone, last=(pointer,))
    tag_dir = staged / dest.tag
    tag_dir.mkdir()
    return tag_dir


def _plain_name(name: str | None) -> bool:
    return bool(name) and "/" not in str(name) and "\\" not in str(name) and name not in (".", "..")
