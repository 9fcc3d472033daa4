"""Refuse an fp16 ZeRO-0 pipeline checkpoint in one line that says so.

Without ZeRO, a pipeline trained in fp16 runs under DeepSpeed's ``FP16_UnfusedOptimizer`` (a
torch optimizer, e.g. ``"torch_adam": true``) or ``FP16_Optimizer`` (a fused one). Neither
writes optimizer shards: each stage's ``mp_rank_XX_model_states.pt`` holds the wrapper's
``state_dict()`` in its ``optimizer`` entry, the fp32 masters as ``fp32_groups`` (one tensor
per parameter) or ``fp32_groups_flat`` (one flat tensor per group) and the Adam moments in
the torch ``optimizer_state_dict``, all by position, with ``param_shapes`` None and no names.
Which position is which layer would have to be guessed from the partition and the module
order, so such a folder is refused like an fp32 ZeRO-0 one, with the reason.

Algorithm: only a folder without ``*_optim_states.pt`` shards is looked at; its stage-0
model-states file is opened (as every reader opens it: nothing is executed from the pickle),
and an ``optimizer`` entry with fp32 master groups is the fp16 wrapper's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ucformat.errors import UnsupportedCheckpointError
from ucformat.sources.deepspeed.pipeline_files import MODEL_FILE, OPTIM_FILE
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.torchfile import open_torch_file

__all__ = ["refuse_fp16_zero0"]

#: The key of the fp32 master weights in each fp16 wrapper's ``state_dict()``.
_WRAPPERS = {"fp32_groups": "FP16_UnfusedOptimizer", "fp32_groups_flat": "FP16_Optimizer"}


def refuse_fp16_zero0(folder: Path, policy: PicklePolicy | None, *, check_crc: bool) -> None:
    """Raise if ``folder`` (a pipeline tag folder) is an fp16 ZeRO-0 checkpoint.

    Returns without opening anything when the folder has optimizer shards; otherwise opens
    stage 0's model-states file (when there is one) and returns unless its ``optimizer``
    entry is an fp16 wrapper's.

    Raises:
        UnsupportedCheckpointError: the fp16 wrapper's state, saved by position only (the
            message names the file, the wrapper, and what ucformat reads instead).
    """
    names = [p.name for p in folder.iterdir() if p.is_file()]
    models = sorted(n for n in names if MODEL_FILE.match(n))
    if not models or any(OPTIM_FILE.match(n) for n in names):
        return
    path = folder / models[0]
    handle = open_torch_file(path, policy, check_crc=check_crc)
    try:
        meta = handle.obj
        state = meta.get("optimizer") if isinstance(meta, Mapping) else None
        found = [k for k in _WRAPPERS if isinstance(state, Mapping) and k in state]
    finally:
        handle.close()
    if found:
        raise UnsupportedCheckpointError(
            f"{path}: ZeRO-0 in fp16 ({_WRAPPERS[found[0]]}): each stage's fp32 master weights "
            f"and Adam moments are saved in its model-states 'optimizer' entry by position "
            f"({found[0]}, optimizer_state_dict), without parameter names or param_shapes; "
            'ucformat reads fp16 pipelines trained with ZeRO-1 ("zero_optimization": '
            '{"stage": 1}).'
        )
