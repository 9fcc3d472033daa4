"""Durability of the commit on a local store (docs/format.md §6).

Every file and directory of the store is fsynced before the manifest is renamed into place, and
the manifest and the store root after; ``fsync=False`` (benchmarks, scratch stores) skips it.
The fsync and rename system calls are observed while converting a real DeepSpeed checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucformat

FIXTURE = Path(__file__).parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4" / "ckpt"


def observe(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record ``("fsync", path)`` and ``("rename", destination)`` in call order."""
    events: list[tuple[str, str]] = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", os.fspath(dst)))
        replace(src, dst)

    def recording_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", os.fspath(dst)))
        rename(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    monkeypatch.setattr(os, "rename", recording_rename)
    return events


def test_everything_is_fsynced_around_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = observe(monkeypatch)
    final = tmp_path / "s.ucf"
    ucformat.convert(FIXTURE, final, chunk_bytes=64, shard_bytes=256)
    final = final.resolve()
    store = final.parent / ".s.ucf.ucformat-staging"  # written there, then moved (§6.2)
    manifest = str(store / "ucformat.json")
    commit = events.index(("rename", manifest))
    swap = events.index(("rename", str(final)))
    before = {path for kind, path in events[:commit] if kind == "fsync"}
    after = [path for kind, path in events[commit + 1 : swap] if kind == "fsync"]
    files = {
        str(store / p.relative_to(final))
        for p in final.rglob("*")
        if p.is_file() and p.name != "ucformat.json"
    }
    folders = {str(store / p.relative_to(final)) for p in final.rglob("*") if p.is_dir()}
    folders |= {str(store)}
    assert len(files) > 50
    assert files <= before, sorted(files - before)[:5]
    assert folders <= before, sorted(folders - before)[:5]
    partial = [path for kind, path in events[:commit] if kind == "fsync" and ".partial" in path]
    assert partial and partial[-1].startswith(str(store / "ucformat.")), "manifest data synced"
    assert after == [str(store)], "then the rename itself, by syncing the root directory"
    assert [path for kind, path in events[swap + 1 :] if kind == "fsync"] == [str(final.parent)]
    ordered = [path for kind, path in events[:commit] if kind == "fsync" and path in folders]
    assert ordered.index(str(store)) == len(ordered) - 1 - ordered[::-1].index(str(store))
    assert all(
        ordered.index(child) < ordered.index(str(Path(child).parent))
        for child in ordered
        if child != str(store)
    ), "a directory is synced after its children"
    assert not store.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["s.ucf"]
    store = final
    assert ucformat.verify(store).ok


def test_fsync_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = observe(monkeypatch)
    ucformat.convert(FIXTURE, tmp_path / "s.ucf", fsync=False)
    assert not [event for event in events if event[0] == "fsync"]
    assert ucformat.open(tmp_path / "s.ucf").manifest.digest
