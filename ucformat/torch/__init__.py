"""``ucformat.torch``: a store as plain, single-process PyTorch state.

:func:`load` resumes a model and a ``torch.optim`` optimizer; :func:`state_dicts` (and
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

__all__ = ["TorchLoadReport", "load", "model_state_dict", "optimizer_state_dict", "state_dicts"]
