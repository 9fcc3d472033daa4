"""A writer's folders made ahead of its objects, and objects written into them (or not)."""

from __future__ import annotations

import os
from pathlib import Path

from zarr.storage import LocalStore, MemoryStore

from ucformat.store.direct.objects import local_object, make_folders

KEYS = [
    "params/layers.0.w/fp32/c/0/1",
    "params/layers.0.w/fp32/c/0/0",
    "params/layers.0.w/exp_avg/zarr.json",
    "params/layers.0.w/zarr.json",
    "zarr.json",
]


def _folders(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}


def test_make_folders_makes_each_folder_once_parents_first(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, read_only=False)
    assert make_folders(store, KEYS) == 6
    assert _folders(tmp_path) == {
        "params", "params/layers.0.w", "params/layers.0.w/fp32", "params/layers.0.w/fp32/c",
        "params/layers.0.w/fp32/c/0", "params/layers.0.w/exp_avg",
    }  # fmt: skip
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # folders only
    # another writer's folders exist already: skipped, only the new one is made
    assert make_folders(store, [*KEYS, "params/layers.0.w/exp_avg/c/0"]) == 1


def test_make_folders_does_nothing_for_stores_without_folders(tmp_path: Path) -> None:
    assert make_folders(MemoryStore(), KEYS) == 0
    assert make_folders(LocalStore(tmp_path, read_only=True), KEYS) == 0
    assert _folders(tmp_path) == set()


def test_local_object_writes_with_or_without_folders_made(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, read_only=False)
    make_folders(store, KEYS[:1])
    for key in (KEYS[0], "buffers/b/c/0"):  # the second one's folders are not made yet
        with local_object(store, key) as fd:
            assert fd is not None
            os.write(fd, key.encode())
        assert (tmp_path / key).read_bytes() == key.encode()
    assert not list(tmp_path.rglob("*.partial"))
