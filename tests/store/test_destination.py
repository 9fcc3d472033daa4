"""The one destination lifecycle (ucformat/store/destination.py) on real folders.

Start (lock, staging beside), commit (whole-folder swap, or entry by entry beside the user's
files, the commit markers last), discard, and what is left said from the disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucformat.errors import StoreBusyError, StoreExistsError
from ucformat.store.destination import (
    LocalDestination,
    left_on_disk,
    staging_path,
    transient_name,
    was_committed,
)
from ucformat.store.writer_lock import local_lock_path


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_a_new_destination_is_the_staging_folder_renamed(tmp_path: Path) -> None:
    dst = tmp_path / "new" / "out"
    destination = LocalDestination(dst)
    staged = destination.start()
    assert staged == staging_path(dst) and staged.parent == dst.parent
    assert local_lock_path(dst).exists()
    with pytest.raises(StoreBusyError):  # one writer at a time, this process too
        LocalDestination(dst).start()
    (staged / "a").write_text("1")
    assert not dst.exists()  # nothing there until the commit
    destination.commit()
    assert _tree(dst) == {"a": "1"}
    assert sorted(p.name for p in dst.parent.iterdir()) == ["out"]  # no staging, no lock
    assert was_committed(dst) and left_on_disk(dst) == (
        f"the write was committed before the interrupt; {dst} is complete"
    )


def test_a_whole_folder_is_exchanged_and_the_old_one_deleted(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old").write_text("0")
    (dst / "ucformat.json").write_text("{}")
    destination = LocalDestination(dst)
    (destination.start() / "a").write_text("1")
    destination.commit()  # replaces=None: the folder is the writer's
    assert _tree(dst) == {"a": "1"}
    assert os.listdir(tmp_path) == ["out"]


def test_beside_the_users_files_entries_move_in_the_marker_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "run"
    dst.mkdir()
    for name, text in (("notes.txt", "mine"), ("latest", "t1"), ("t1", "x"), ("t0", "y")):
        (dst / name).write_text(text)
    destination = LocalDestination(dst)
    staged = destination.start()
    (staged / "t2").mkdir()
    (staged / "t2" / "f").write_text("2")
    (staged / "latest").write_text("t2")
    moves: list[str] = []
    rename = os.rename

    def recording(src: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        moves.append(Path(target).relative_to(tmp_path).as_posix())
        rename(src, target)

    monkeypatch.setattr(os, "rename", recording)
    destination.commit(replaces=lambda name: name in ("t1", "latest"), last=("latest",))
    assert _tree(dst) == {"notes.txt": "mine", "latest": "t2", "t0": "y", "t2/f": "2"}
    entering = [move for move in moves if move in ("run/t2", "run/latest")]
    assert entering == ["run/t2", "run/latest"]  # the marker after what it names
    assert moves.index("run/latest") < max(i for i, m in enumerate(moves) if "/t1" in m)
    assert sorted(os.listdir(tmp_path)) == ["run"]  # aside folder and staging gone


def test_discard_leaves_the_destination_and_nothing_beside_it(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("0")
    destination = LocalDestination(dst)
    (destination.start() / "a").write_text("1")
    destination.discard()
    assert _tree(dst) == {"keep": "0"}
    assert os.listdir(tmp_path) == ["out"]
    assert not was_committed(dst)
    assert (
        left_on_disk(dst)
        == f"nothing was committed; {dst} is as it was (no staged write is left beside it)"
    )


def test_the_check_runs_under_the_lock_and_a_refusal_releases_it(tmp_path: Path) -> None:
    dst = tmp_path / "out"

    def refuse(path: Path) -> None:
        assert local_lock_path(path).exists()
        raise StoreExistsError(f"{path}: no")

    with pytest.raises(StoreExistsError):
        LocalDestination(dst).start(refuse)
    assert os.listdir(tmp_path) == []


def test_a_killed_writers_staging_folder_is_named_and_replaced(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    leftover = staging_path(dst)
    leftover.mkdir()
    (leftover / "ucformat.json").write_text("{}")  # killed between its manifest and the swap
    assert transient_name(leftover.name)
    assert left_on_disk(dst).endswith(f"or delete it): {leftover}")
    destination = LocalDestination(dst)
    assert list(destination.start().iterdir()) == []  # the lock says its writer is gone
    destination.discard()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("name", "transient"),
    [
        (".out.ucf.ucformat-staging", True),
        (".out.ucf.ucformat-old-0a1b", True),
        (".ucformat-replaced-0a1b2c", True),
        (".ucformat-staging", True),
        ("out.ucf", False),
        (".ucformat-staging-notes", False),
        ("out.ucformat-staging", False),
    ],
)
def test_transient_names(name: str, transient: bool) -> None:
    assert transient_name(name) is transient
