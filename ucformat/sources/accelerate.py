"""Accelerate ``save_state`` folders of FSDP2 runs: two DCP folders read as one checkpoint.

``accelerator.save_state(DIR)`` under FSDP2 (``SHARDED_STATE_DICT``) writes, per prepared model
``i`` and optimizer ``i`` (``_0``, ``_1``, ...): ``DIR/pytorch_model_fsdp_<i>/`` (a DCP folder
whose state is ``{"model": <model state dict>}``), ``DIR/optimizer_<i>/`` (``{"optimizer":
<optimizer state dict keyed by FQN>}``), and beside them ``random_states_<rank>.pkl``,
``scheduler*.bin``, ``sampler*.bin``, ``scaler.pt`` (left alone: they are not model state).
The two DCP folders' keys are disjoint (``model.*``, ``optimizer.*``), so their metadata merge
into one key space whose items name ``<folder>/__<rank>_<n>.distcp`` relative to ``DIR``; the
DCP reader (:mod:`~ucformat.sources.dcp`) then reads model ``i`` with its optimizer as one
checkpoint; ``DIR/pytorch_model_fsdp_<i>/`` given alone is read with its ``optimizer_<i>/``
(the way to convert model ``i`` of several). When both folders hold the same checkpoint, as
``ucformat export accelerate`` writes them, it is read once. A DeepSpeed-backed Accelerate
folder is a DeepSpeed run folder (``latest`` names ``pytorch_model``) and needs nothing here.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from ucformat.errors import NotACheckpointError, UnsupportedCheckpointError
from ucformat.sources.base import SourceCheckpoint
from ucformat.sources.dcp import read_dcp_checkpoint
from ucformat.sources.dcp_metadata import METADATA_NAME, DcpMetadata, read_dcp_metadata
from ucformat.sources.safe_unpickle import PicklePolicy

__all__ = [
    "MODEL_FOLDER",
    "OPTIMIZER_FOLDER",
    "accelerate_model_index",
    "is_accelerate_folder",
    "read_accelerate_state",
]

#: Folder names ``save_state`` gives model ``i`` and optimizer ``i`` under FSDP2.
MODEL_FOLDER = "pytorch_model_fsdp_{index}"
OPTIMIZER_FOLDER = "optimizer_{index}"
_MODEL_RE = re.compile(r"^pytorch_model_fsdp_(\d+)$")


def model_indexes(src: Path) -> list[int]:
    """The ``i`` of every ``pytorch_model_fsdp_<i>/`` DCP folder in ``src``, sorted."""
    found = []
    if Path(src).is_dir():
        for child in Path(src).iterdir():
            match = _MODEL_RE.match(child.name)
            if match and (child / METADATA_NAME).is_file():
                found.append(int(match.group(1)))
    return sorted(found)


def accelerate_model_index(src: Path) -> int | None:
    """``i`` when ``src`` is ``pytorch_model_fsdp_<i>/`` beside an ``optimizer_<i>/`` DCP folder."""
    match = _MODEL_RE.match(Path(src).name)
    if match is None:
        return None
    index = int(match.group(1))
    sibling = Path(src).parent / OPTIMIZER_FOLDER.format(index=index) / METADATA_NAME
    return index if sibling.is_file() else None


def is_accelerate_folder(src: Path) -> bool:
    """Whether ``src`` is an Accelerate FSDP2 ``save_state`` folder."""
    return bool(model_indexes(src))


def _prefixed(metadata: DcpMetadata, folder: str) -> DcpMetadata:
    items = {
        key: replace(item, relative_path=f"{folder}/{item.relative_path}")
        for key, item in metadata.items.items()
    }
    return replace(metadata, items=items)


def read_accelerate_state(
    src: Path, *, index: int | None = None, policy: PicklePolicy | None = None
) -> SourceCheckpoint:
    """Describe model ``index`` (default: the only one) of ``src`` with its optimizer.

    Raises:
        UnsupportedCheckpointError: several models and no ``index``, or no such model.
        NotACheckpointError: the two folders share keys.
        UCFormatError: whatever the DCP reader raises.
    """
    folder = Path(src)
    indexes = model_indexes(folder)
    if index is None and len(indexes) > 1:
        raise UnsupportedCheckpointError(
            f"{folder}: an Accelerate save_state folder of {len(indexes)} models "
            f"(pytorch_model_fsdp_{indexes}); convert one at a time: ucformat convert "
            f"{folder}/pytorch_model_fsdp_I (its optimizer_I/ is read with it)."
        )
    index = indexes[0] if index is None and indexes else index
    if index not in indexes:
        raise UnsupportedCheckpointError(
            f"{folder}: no pytorch_model_fsdp_{index}/ DCP folder (found {indexes}); pass one of "
            "those indexes."
        )
    model_dir = MODEL_FOLDER.format(index=index)
    merged = _prefixed(read_dcp_metadata(folder / model_dir), model_dir)
    optim_dir = OPTIMIZER_FOLDER.format(index=index)
    optim_meta = folder / optim_dir / METADATA_NAME
    same = optim_meta.is_file() and (
        optim_meta.read_bytes() == (folder / model_dir / METADATA_NAME).read_bytes()
    )  # one DCP checkpoint in both folders (ucformat export accelerate)
    if optim_meta.is_file() and not same:
        optim = _prefixed(read_dcp_metadata(folder / optim_dir), optim_dir)
        shared = set(merged.entries) & set(optim.entries)
        if shared:
            raise NotACheckpointError(
                f"{folder}: {model_dir}/ and {optim_dir}/ both hold {sorted(shared)[:3]}; not an "
                "Accelerate save_state folder. Convert each DCP folder on its own."
            )
        merged = DcpMetadata(
            {**merged.entries, **optim.entries},
            {**merged.items, **optim.items},
            merged.version,
        )
    return read_dcp_checkpoint(folder, policy=policy, metadata=merged)
