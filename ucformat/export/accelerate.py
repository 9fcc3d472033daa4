"""``ucformat export accelerate``: a folder stock ``accelerator.load_state(DIR)`` resumes (FSDP2).

What Accelerate's ``save_state`` writes under FSDP2 with ``SHARDED_STATE_DICT`` and
``load_state`` reads back (``accelerate/utils/fsdp_utils.py``)::

    DIR/pytorch_model_fsdp_0/   DCP: dcp.load({"model": model.state_dict()})
    DIR/optimizer_0/            DCP: dcp.load({"optimizer": get_optimizer_state_dict(m, opt)})
    DIR/random_states_<r>.pkl   RNG states (load_state skips them, with a log line, if absent)

The store is written once as a DCP checkpoint (:func:`~ucformat.export.dcp.export_dcp`, nested
optimizer layout, FSDP2's dim-0 chunks for ``world_size`` ranks) into ``pytorch_model_fsdp_0/``;
``optimizer_0/`` holds the same files (hard links, else copies): a stock ``dcp.load`` reads only
the keys it is asked for, so each folder serves its half. Everything else in ``DIR`` (the user's
RNG, scheduler, sampler files) is left as it is; model 0 and optimizer 0 are the ones written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ucformat.errors import StoreExistsError
from ucformat.export.common import ExportHooks, ExportResult
from ucformat.export.dcp import export_dcp
from ucformat.export.destination import stage, transactional
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.store.keys import StoreLike

__all__ = ["export_accelerate"]

MODEL_FOLDER = "pytorch_model_fsdp_{index}"
OPTIMIZER_FOLDER = "optimizer_{index}"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@transactional
def export_accelerate(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    world_size: int | None = None,
    index: int = 0,
    overwrite: bool = False,
    dry_run: bool = False,
    hooks: ExportHooks | None = None,
) -> ExportResult:
    """Write ``out/pytorch_model_fsdp_0/`` and ``out/optimizer_0/`` for ``accelerator.load_state``.

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        out: the ``save_state`` folder (created if missing; its other files are kept).
        world_size: ranks whose FSDP2 shards the data files hold (default: the source's);
            stock DCP reshards on load, so any world size resumes it.
        index: write model and optimizer ``index`` (``pytorch_model_fsdp_<index>/``,
            ``optimizer_<index>/``), for a run that prepared several.
        overwrite: replace the two folders if they exist.
        dry_run: plan only; write nothing.
        hooks: progress callbacks.

    Raises:
        StoreExistsError: one of the two folders exists and ``overwrite`` is not set.

    Example:
        >>> ucformat.export.export_accelerate("ckpt.ucf", "out/checkpoint_0")  # doctest: +SKIP
    """
    folder = Path(out)
    model_name, optim_name = MODEL_FOLDER.format(index=index), OPTIMIZER_FOLDER.format(index=index)

    def check(folder: Path) -> None:
        for sub in (folder / model_name, folder / optim_name):
            if sub.exists() and any(sub.iterdir()) and not overwrite:
                raise StoreExistsError(
                    f"{sub}: exists and is not empty; pass --overwrite to replace the model and "
                    "optimizer folders (the folder's other files are kept)."
                )

    if dry_run:
        if folder.is_dir():
            check(folder)
        staged = folder
    else:
        staged = stage(
            folder,
            owned=lambda name: name in (model_name, optim_name),
            check=lambda folder: check(folder) if folder.is_dir() else None,
        )
    model_dir, optim_dir = staged / model_name, staged / optim_name
    result = export_dcp(
        store, model_dir, world_size=world_size, layout="nested", dry_run=dry_run, hooks=hooks
    )
    files = [f"{model_name}/{name}" for name in result.files]
    if not dry_run:
        optim_dir.mkdir()
        for child in sorted(model_dir.iterdir()):
            _link_or_copy(child, optim_dir / child.name)
    files += [f"{optim_name}/{name}" for name in result.files]
    inner = result.summary.replace(str(model_dir), str(folder / model_name))
    summary = (
        f"Accelerate save_state folder ({model_name}/, {optim_name}/): "
        f"{inner}); resume with accelerator.load_state({str(folder)!r})"
    )
    return ExportResult(
        "accelerate", folder, files, result.nbytes, dry_run, result.seconds, summary,
        list(result.notes),
    )  # fmt: skip
