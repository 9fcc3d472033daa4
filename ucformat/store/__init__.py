"""Bytes to and from a store: where it lives, its manifest, its zarr arrays and objects.

* :mod:`~ucformat.store.locations`: local directory or URL (no zarr, no torch);
* :mod:`~ucformat.store.manifest_io`: read, validate and commit ``ucformat.json``;
* :mod:`~ucformat.store.keys`: open a store; whole objects by key;
* :mod:`~ucformat.store.checked`: :class:`~ucformat.store.checked.CheckedStore`, the reading
  wrapper (byte counts, shard-index cache, missing-object errors);
* :mod:`~ucformat.store.arrays`: the codec chain, array creation, writes and checked box reads;
* :mod:`~ucformat.store.direct`: the fast shard path that reads and writes shard objects
  without zarr's codec pipeline.

Nothing is imported here, so ``import ucformat.store.manifest_io`` (what ``ucformat inspect``
uses) imports neither zarr nor torch.
"""
