"""``ucformat.megatron``: a store and a LIVE Megatron-Core job.

* :func:`load` (:mod:`~ucformat.megatron.load`): resume a Megatron-Core model and optimizer
  from a store, on every rank, at any TP x PP x EP x DP, each rank reading only the boxes its
  own ``sharded_state_dict()`` names;
* :mod:`~ucformat.megatron.job`: what a live job asks for (its sharded state dict, the
  distributed optimizer's data-parallel ranges, the parameters' TP=1 names).

Reading a Megatron-Core checkpoint *on disk* is :mod:`ucformat.sources.megatron`; writing one is
:mod:`ucformat.export.megatron`. Megatron-Core is imported only when a function runs.
"""

from __future__ import annotations

from ucformat.megatron.load import MegatronLoadReport, load

__all__ = ["MegatronLoadReport", "load"]
