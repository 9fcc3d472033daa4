"""``ucformat.torch``: a store as live PyTorch state, plain or FSDP2 / HSDP (DTensor).

:func:`load` resumes a model and a ``torch.optim`` optimizer (on every rank for a DTensor
model, each rank reading only its local shards: :mod:`~ucformat.torch.sharded_load`);
:func:`save` writes a store from a live model and optimizer (collectively under
``torch.distributed``: :mod:`~ucformat.torch.save`), :func:`save_async` the same in a
background thread after a host copy; :func:`state_dicts` (and
:func:`model_state_dict`, :func:`optimizer_state_dict`) give torch's own ``state_dict()``
formats (:mod:`~ucformat.torch.load` says exactly what they hold).
"""

from __future__ import annotations

from ucformat.torch.load import (
    TorchLoadReport,
    load,
    model_state_dict,
    optimizer_state_dict,
    state_dicts,
)
from ucformat.torch.save import save, save_async

__all__ = [
    "TorchLoadReport",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "save",
    "save_async",
    "state_dicts",
]
