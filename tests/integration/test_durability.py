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
    assert len(files) > 25
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


def test_spread_write_syncs_each_object_once_before_agreeing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distributed write's writers flush what they wrote; the commit flushes only the manifest.

    In one process (every unit's writer is rank 0, which also wrote the metadata): every object
    and directory is fsynced before the manifest's rename, each object exactly once (the commit
    does not walk the store again), and after it only the root and the destination's parent.
    """
    from ucformat.collective import Group
    from ucformat.sources.deepspeed.checkpoint import read_deepspeed_checkpoint
    from ucformat.store.keys import open_store
    from ucformat.write.convert import convert_options
    from ucformat.write.plan import plan_convert
    from ucformat.write.spread import write_spread

    final = (tmp_path / "s.ucf").resolve()
    with read_deepspeed_checkpoint(FIXTURE) as source:
        plan = plan_convert(source, convert_options(64, 256))
        events = observe(monkeypatch)
        report = write_spread(
            plan, open_store(final, read_only=False), writers=[0] * len(plan.units),
            group=Group(None, 0, 1), where=str(final),
        )  # fmt: skip
    assert report.committed
    store = final.parent / ".s.ucf.ucformat-staging"
    commit = events.index(("rename", str(store / "ucformat.json")))
    swap = events.index(("rename", str(final)))
    before = [path for kind, path in events[:commit] if kind == "fsync" and ".partial" not in path]
    files = {
        str(store / p.relative_to(final))
        for p in final.rglob("*")
        if p.is_file() and p.name != "ucformat.json"
    }
    folders = {str(store / p.relative_to(final)) for p in final.rglob("*") if p.is_dir()}
    assert len(files) > 25
    assert files | folders | {str(store)} == set(before), "every object and directory, only them"
    assert len(before) == len(set(before)), "each once"
    after = [path for kind, path in events[commit + 1 : swap] if kind == "fsync"]
    assert after == [str(store)], "the manifest's rename, by syncing the root"
    assert [path for kind, path in events[swap + 1 :] if kind == "fsync"] == [str(final.parent)]
    assert ucformat.verify(final).ok


def test_live_save_fsync_off_syncs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsync=False`` of a live save (here ``ucformat.torch.save``, one process, through the
    same ``write_spread`` as every live save) makes no fsync call; the store is complete."""
    import torch

    import ucformat.torch as uctorch

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    events = observe(monkeypatch)
    uctorch.save(model, optimizer, tmp_path / "off.ucf", fsync=False)
    assert not [event for event in events if event[0] == "fsync"]
    uctorch.save(model, optimizer, tmp_path / "on.ucf")
    synced = [path for kind, path in events if kind == "fsync"]
    assert any("/c." in path for path in synced), synced  # the default syncs shards
    assert ucformat.verify(tmp_path / "off.ucf").ok
    copy = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    uctorch.load(copy, None, tmp_path / "off.ucf")
    pairs = zip(model.parameters(), copy.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_writers_together_sync_every_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers' :func:`sync_written` of disjoint objects cover every file and directory."""
    from ucformat.store.durable import sync_written

    keys = ["zarr.json", "a/zarr.json", "a/b/zarr.json", "a/b/c/0/0", "a/b/c/0/1", "x/c", "y/c/3"]
    for key in keys:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(b"1")
    events = observe(monkeypatch)
    first = sync_written(tmp_path, [*keys[:4], "a/b/c/9/9"])  # an absent key is skipped
    second = sync_written(tmp_path, keys[4:])
    synced = [path for kind, path in events if kind == "fsync"]
    everything = {str(p) for p in tmp_path.rglob("*")} | {str(tmp_path)}
    assert set(synced) == everything
    assert (first.files, second.files) == (4, 3)
    assert first.directories == 5  # root, a, a/b, a/b/c, a/b/c/0
    files_first = synced[: first.files]
    assert set(files_first) == {str(tmp_path / k) for k in keys[:4]}, "files before directories"
