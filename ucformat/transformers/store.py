"""The Hugging Face ``Trainer``'s own ``resume_from_checkpoint``, with the engine's state from a
store instead of DeepSpeed's files.

A ``Trainer`` run with DeepSpeed saves ``checkpoint-N/``: the Trainer's own files
(``trainer_state.json``, ``rng_state_<rank>.pth``, ``scheduler.pt`` where the Trainer schedules,
the config files) beside DeepSpeed's (``latest``, ``global_stepN/``), which only a job of the
same world size can load. Convert it into the folder itself::

    ucformat convert out/checkpoint-300 out/checkpoint-300/ckpt.ucf

and resume with ``trainer.train(resume_from_checkpoint="out/checkpoint-300")`` (or ``True``) at
any number of processes and ZeRO stage. :class:`ResumeFromStore` changes one step of the
Trainer's resume: where the stock Trainer calls DeepSpeed's ``engine.load_checkpoint`` on the
folder (after ``deepspeed.initialize``, before training), it calls ``ucformat.deepspeed.load``
on the store it finds there (fp32 weights, optimizer states and step, lr scheduler, DeepSpeed's
counters; each rank reads its own partitions). Everything else is the Trainer's: it reads
``trainer_state.json`` (global step, log history, callbacks' state), restores each process's RNG
from ``rng_state_<rank>.pth``, its scheduler and scaler files if present, and skips the data it
already trained on. No DeepSpeed file is read or written: ``global_stepN/`` may be deleted.

The hook is ``Trainer._prepare_for_training`` (transformers 5.x), the method that builds the
engine and loads the checkpoint into it: the mixin calls it without the checkpoint, then loads
the store. A folder without a store resumes as the stock Trainer does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ucformat.errors import UnsupportedExportError
from ucformat.format.spec import MANIFEST_KEY

__all__ = ["ResumeFromStore", "store_in"]


def store_in(folder: str | Path | None) -> Path | None:
    """The committed store directly inside ``folder`` (a folder holding ``ucformat.json``),
    None if there is none.

    Raises:
        UnsupportedExportError: several stores are there (the message names them).
    """
    if folder is None or not Path(folder).is_dir():
        return None
    found = sorted(p for p in Path(folder).iterdir() if (p / MANIFEST_KEY).is_file())
    if len(found) > 1:
        raise UnsupportedExportError(
            f"{folder}: holds {len(found)} stores ({', '.join(p.name for p in found)}); keep the "
            "one to resume from."
        )
    return found[0] if found else None


class ResumeFromStore:
    """Mixin for ``transformers.Trainer``: resume the DeepSpeed engine from a store found in
    the ``resume_from_checkpoint`` folder (module docstring). Put it first:
    ``class MyTrainer(ResumeFromStore, transformers.Trainer)``."""

    # provided by transformers.Trainer
    is_deepspeed_enabled: bool
    model_wrapped: Any

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> Any:
        store = store_in(resume_from_checkpoint)
        parent: Any = super()
        if store is None:
            return parent._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if not self.is_deepspeed_enabled:
            raise UnsupportedExportError(
                f"{store}: resuming a Trainer from a store needs a DeepSpeed run (the store is "
                "loaded into its engine); for another run, load it with ucformat.torch.load."
            )
        prepared = parent._prepare_for_training(max_steps, train_dataloader, None)
        import ucformat.deepspeed

        ucformat.deepspeed.load(self.model_wrapped, store)
        parent._load_optimizer_and_scheduler(resume_from_checkpoint)  # the Trainer's own files
        parent._load_scaler(resume_from_checkpoint)
        return prepared
