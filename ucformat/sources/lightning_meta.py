"""Lightning's ``meta.pt`` beside a ``ModelParallelStrategy`` checkpoint: the loop state.

``ModelParallelStrategy.save_checkpoint`` writes the tensors as a DCP folder and everything
else of Lightning's checkpoint dictionary (``loops``, ``lr_schedulers``, ``callbacks``,
``epoch``, ``global_step``, ``pytorch-lightning_version``, hyper-parameters) with ``torch.save``
into ``meta.pt`` in the same folder. Read through the allow-list unpickler, its entries join
the store's client state as ``lightning.<key>``, the keys a store saved by
:mod:`ucformat.lightning` uses, so a converted Lightning checkpoint resumes its loops and
schedulers through ``fit(ckpt_path=STORE)`` like a store Lightning saved.
"""

from __future__ import annotations

from pathlib import Path

from ucformat.format.models import ClientState, SourceFile
from ucformat.format.training_values import encode_client_state
from ucformat.sources.base import SourceCheckpoint
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.torchfile import open_torch_file

__all__ = ["META_NAME", "VERSION_KEY", "with_lightning_meta"]

#: Lightning's file of the non-tensor entries.
META_NAME = "meta.pt"
#: The entry that makes a ``meta.pt`` Lightning's.
VERSION_KEY = "pytorch-lightning_version"
PREFIX = "lightning."


def with_lightning_meta(
    ckpt: SourceCheckpoint, folder: Path, policy: PicklePolicy | None
) -> SourceCheckpoint:
    """``ckpt`` with ``folder/meta.pt``'s entries in its client state, when the folder has a
    Lightning ``meta.pt``; else ``ckpt`` unchanged. On an error ``ckpt`` is closed.

    Raises:
        UCFormatError: ``meta.pt`` is damaged or names a global outside the allow-list.
    """
    path = Path(folder) / META_NAME
    if not path.is_file():
        return ckpt
    try:
        with open_torch_file(path, policy, check_crc=False) as meta:
            entries = meta.obj
            if not isinstance(entries, dict) or VERSION_KEY not in entries:
                return ckpt
            extra = encode_client_state((f"{PREFIX}{k}", v) for k, v in entries.items())
    except BaseException:
        ckpt.close()
        raise
    ckpt.client_state = ClientState(
        values={**ckpt.client_state.values, **extra.values},
        unrepresentable={**ckpt.client_state.unrepresentable, **extra.unrepresentable},
    )
    files = [*ckpt.source.files, SourceFile(name=META_NAME, size=path.stat().st_size)]
    ckpt.source = ckpt.source.model_copy(update={"files": files})
    return ckpt
