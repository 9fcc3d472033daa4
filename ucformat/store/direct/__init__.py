"""The direct shard path: shard objects read and written without zarr's codec pipeline.

Contract: for the layouts ucformat writes (the codec chain of :mod:`ucformat.store.arrays`,
uncompressed), the bytes written here are identical to those zarr's ``sharding_indexed`` codec
writes, and a read returns exactly what zarr would return; anything else (compressed arrays,
layouts that do not tile a request, damaged objects) goes through zarr, which owns the error
messages. The conformance tests beside this package's mirror, ``tests/store/direct/``, check
the byte identity against zarr itself.

* :mod:`~ucformat.store.direct.shard_read`: chunk runs of a flat range read straight from shard
  objects, every crc32c checked where it lands; the in-place check of the loader;
* :mod:`~ucformat.write.shard_encode`: encode an uncompressed shard object from source
  fragments (streamed through a window on local stores);
* :mod:`~ucformat.store.direct.objects`: byte ranges of objects, and the local files behind them;
* :mod:`~ucformat.sysio.fileio`: whole ``preadv`` / ``pwrite`` at an offset (stdlib only);
* :mod:`~ucformat.sysio.memory`: large staging buffers mapped up front.

Nothing is imported here, so :mod:`~ucformat.sysio.fileio` stays free of zarr.
"""
