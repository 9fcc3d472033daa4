"""What a Hugging Face ``Trainer`` resuming from an exported ``checkpoint-N/`` will do.

The export writes the DeepSpeed part of the folder; the Trainer's own files
(``trainer_state.json``, ``rng_state_R.pth``, weights, configs) stay as they are. Two things
the Trainer does with them depend on the number of processes (transformers 5.x,
``Trainer._load_rng_state`` and the data skipping in ``_run_epoch``), and
:func:`trainer_notes` says when they matter:

* process ``R`` reads ``rng_state_R.pth`` (a one-process job reads ``rng_state.pth``); a
  missing file is logged ("Didn't find an RNG file ...") and that process keeps the RNG state
  its ``set_seed(args.seed)`` gave it. Only random operations (dropout, random augmentation)
  see it.
* the data: the Trainer skips ``global_step x gradient_accumulation_steps`` batches per
  process of the same seeded shuffle. The skipped samples are exactly the ones already
  trained on when the global batch (``per_device_train_batch_size x
  gradient_accumulation_steps x processes``) is what it was.

Reads file names and the manifest only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode

__all__ = ["TRAINER_STATE", "is_trainer_checkpoint", "trainer_notes"]

TRAINER_STATE = "trainer_state.json"


def is_trainer_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` looks like a Trainer ``checkpoint-N/`` (it has ``trainer_state.json``)."""
    return (folder / TRAINER_STATE).is_file()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rng_note(folder: Path, world_size: int) -> str | None:
    if world_size == 1:
        if (folder / "rng_state.pth").is_file():
            return None
        if not (folder / "rng_state_0.pth").is_file():
            return None
        return (
            "Trainer: a one-process run reads rng_state.pth, which this checkpoint lacks "
            "(distributed runs write rng_state_R.pth): no RNG state is restored; copy "
            "rng_state_0.pth to rng_state.pth to restore process 0's."
        )
    missing = [r for r in range(world_size) if not (folder / f"rng_state_{r}.pth").is_file()]
    if not missing:
        return None
    ranks = ", ".join(map(str, missing))
    return (
        f"Trainer: no rng_state_R.pth for process {ranks}: it keeps the RNG state set_seed "
        'gave it (the Trainer logs "Didn\'t find an RNG file"); only random operations such '
        "as dropout see it."
    )


def _data_note(manifest: CheckpointManifest, world_size: int) -> str | None:
    source = manifest.source
    if world_size == source.world_size or source.ds_config is None:
        return None
    config = decode(source.ds_config)
    if not isinstance(config, dict):
        return None
    batch = _int(config.get("train_batch_size"))
    if batch is None:
        return None
    keep = f"per_device_train_batch_size x gradient_accumulation_steps x {world_size} = {batch}"
    if batch % world_size:
        return (
            f"Trainer data: the run's global batch was {batch} samples, not a multiple of "
            f"{world_size} processes, so the resumed epoch does not continue on the same "
            "samples (the Trainer skips global_step x gradient_accumulation_steps batches per "
            "process)."
        )
    return (
        f"Trainer data: the run's global batch was {batch} samples; resume with {keep} to "
        "continue on the same samples (the Trainer skips global_step x "
        "gradient_accumulation_steps batches per process)."
    )


def trainer_notes(folder: Path, manifest: CheckpointManifest, world_size: int) -> list[str]:
    """Notes for a Trainer resuming from ``folder`` at ``world_size`` processes ([] if the
    folder is not a Trainer checkpoint)."""
    if not is_trainer_checkpoint(folder):
        return []
    notes = [_rng_note(folder, world_size), _data_note(manifest, world_size)]
    return [note for note in notes if note is not None]
