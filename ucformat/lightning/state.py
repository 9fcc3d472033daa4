"""Lightning's checkpoint dictionary beside the tensors: kept in the store's client state.

``Trainer.save_checkpoint`` builds one dictionary (``_CheckpointConnector.dump_checkpoint``):
the model's ``state_dict``, ``optimizer_states``, and the rest, which Lightning itself restores
on ``fit(ckpt_path=...)``: ``loops`` (the fit loop's progress: global step, epoch, batches),
``lr_schedulers`` (each scheduler's ``state_dict()``), ``callbacks`` (e.g. ``ModelCheckpoint``'s
best scores), ``epoch``, ``global_step``, the precision plugin's and the datamodule's state, the
hyper-parameters and what ``on_save_checkpoint`` hooks added.

The tensors go into the store's arrays (the strategy's ``ucformat.torch.save`` /
``ucformat.deepspeed.save``); every other top-level entry goes into the client state under
``lightning.<key>``, exactly (:mod:`ucformat.format.pyvalue`). The entries Lightning needs to
resume (:data:`RESTORED`) must be exact, else the save is refused before anything is written;
the others are kept when exact and otherwise listed by type (:func:`split_lightning_state`
says which). :func:`lightning_state` gives the dictionary back for Lightning's restore, with
the stored progress standing in for a store Lightning did not write. Pure: no Lightning import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucformat.errors import UCFormatError
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode, try_encode

__all__ = [
    "PREFIX",
    "RESTORED",
    "TENSOR_KEYS",
    "lightning_state",
    "split_lightning_state",
]

#: Client-state keys of the checkpoint dictionary's entries: ``lightning.<key>``.
PREFIX = "lightning."
#: Entries the store's arrays hold (not client state).
TENSOR_KEYS = frozenset({"state_dict", "optimizer_states"})
#: Entries Lightning reads back when it resumes: they must be stored exactly.
RESTORED = frozenset({"loops", "lr_schedulers", "callbacks", "epoch", "global_step"})


def split_lightning_state(
    checkpoint: Mapping[str, Any], restored: frozenset[str] = RESTORED
) -> tuple[dict[str, Any], list[str]]:
    """``(client state, keys kept by type only)`` for the entries besides the tensors.

    ``restored``: entries that must be exact (the default, plus a precision plugin's and a
    datamodule's state where the strategy passes them).

    Raises:
        UCFormatError: an entry in ``restored`` has no exact form (nothing is written).
    """
    client: dict[str, Any] = {}
    by_type: list[str] = []
    for key, value in checkpoint.items():
        if key in TENSOR_KEYS:
            continue
        ok, encoded = try_encode(value)
        if not ok and key in restored:
            raise UCFormatError(
                f"Lightning's checkpoint entry '{key}' holds {encoded}, which a store cannot "
                "keep exactly; nothing was written. Keep tensors and objects out of the "
                "callbacks', schedulers' and loops' state, or save this run natively."
            )
        client[f"{PREFIX}{key}"] = value
        if not ok:
            by_type.append(key)
    return client, by_type


def lightning_state(manifest: CheckpointManifest, version: str) -> dict[str, Any]:
    """The checkpoint dictionary Lightning restores from (everything but the tensors).

    A store Lightning saved gives back its entries. Another store (converted, or saved by
    ``ucformat.torch.save`` / ``ucformat.deepspeed.save``) has none: Lightning then restores
    weights and optimizer only, with ``global_step`` from the store's progress and no loop or
    scheduler state (``version`` is the running Lightning's).
    """
    values = manifest.client_state.values
    state = {k[len(PREFIX) :]: decode(v) for k, v in values.items() if k.startswith(PREFIX)}
    if state:
        return state
    return {
        "epoch": 0,
        "global_step": manifest.progress.global_steps,
        "pytorch-lightning_version": version,
        "lr_schedulers": [],
    }
