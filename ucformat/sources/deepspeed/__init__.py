"""Read FROM a DeepSpeed ZeRO-1/2/3 checkpoint on disk (no DeepSpeed needed).

* :mod:`~ucformat.sources.deepspeed.files`: find and check a checkpoint's files (names only);
* :mod:`~ucformat.sources.deepspeed.states`: flat optimizer partitions to per-parameter
  fragments;
* :mod:`~ucformat.sources.deepspeed.checkpoint`: :func:`read_deepspeed_checkpoint`, a whole
  checkpoint as a format-neutral :class:`~ucformat.sources.base.SourceCheckpoint`.

Nothing is imported here; a LIVE engine is :mod:`ucformat.deepspeed`.
"""
