"""``ucformat.deepspeed``: a store and a LIVE DeepSpeed engine.

* :func:`load` (:mod:`~ucformat.deepspeed.load`): resume an engine from a store, at any world
  size and ZeRO stage, each rank reading only its own partitions;
* :mod:`~ucformat.deepspeed.engine`: look inside a live engine (its flat partitions, in order,
  and how to write them).

Reading a DeepSpeed checkpoint *on disk* is :mod:`ucformat.sources.deepspeed`; writing one is
:mod:`ucformat.export.deepspeed_native`.
"""

from __future__ import annotations

from ucformat.deepspeed.load import LoadReport, load

__all__ = ["LoadReport", "load"]
