"""CheckedStore: a missing chunk object is an error, a missing metadata object is just absent."""

from __future__ import annotations

import pytest
from zarr.storage import MemoryStore

from ucformat.errors import ChunkMissingError
from ucformat.store.checked import CheckedStore
from ucformat.store.keys import read_key


@pytest.mark.parametrize("key", ["params/w/fp32/c/0/1", "buffers/n/c", "params/c/fp32/c/0"])
def test_missing_chunk_object_is_an_error(key: str) -> None:
    with pytest.raises(ChunkMissingError, match=f"^{key}: this chunk object is missing"):
        read_key(CheckedStore(MemoryStore()), key)


@pytest.mark.parametrize("key", ["ucformat.json", "zarr.json", "params/c/fp32/zarr.json"])
def test_missing_metadata_is_absent(key: str) -> None:
    assert read_key(CheckedStore(MemoryStore()), key) is None
