"""Lightning strategies whose checkpoints can be ucformat stores.

Lightning's ``ModelParallelStrategy`` (FSDP2) and ``DeepSpeedStrategy`` write and read their
checkpoints themselves (a DCP folder and ``meta.pt``; ``engine.save_checkpoint``): neither calls
a ``CheckpointIO`` plugin (both refuse ``storage_options`` for that reason), so the hook is the
strategy's own ``save_checkpoint`` / ``load_checkpoint``. :class:`StoreCheckpoints` overrides
exactly those two, for paths that are stores, and leaves every other path to Lightning:

* ``trainer.save_checkpoint("ckpt.ucf")`` (any path ending in ``.ucf``; a ``ModelCheckpoint``
  writes stores once its ``FILE_EXTENSION`` is ``".ucf"``): the model and optimizer through
  ``ucformat.torch.save`` (FSDP2) or ``ucformat.deepspeed.save`` (every rank writes its own
  part, one commit), the rest of Lightning's checkpoint dictionary (loops, schedulers,
  callbacks, epoch, global step, ...) in the store's client state
  (:mod:`~ucformat.lightning.state`);
* ``trainer.fit(model, ckpt_path=STORE)`` (a committed store: a folder holding
  ``ucformat.json``, or a path ending in ``.ucf``), at any number of devices: the model and,
  when fitting, the optimizer through ``ucformat.torch.load`` / ``ucformat.deepspeed.load``
  (each rank reads its own part); Lightning then restores the loops, the lr schedulers, the
  callbacks and the precision plugin from the returned dictionary, as it does for its own
  checkpoints.

One optimizer per run (Lightning's automatic optimization); a run with several is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy as _DeepSpeedStrategy
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

import ucformat.deepspeed
import ucformat.torch
from ucformat.errors import UnsupportedExportError
from ucformat.format.spec import MANIFEST_KEY
from ucformat.lightning.state import RESTORED, lightning_state, split_lightning_state
from ucformat.read.checkpoint import open_checkpoint

__all__ = ["DeepSpeedStrategy", "ModelParallelStrategy", "StoreCheckpoints", "is_store_path"]

#: The suffix that makes ``save_checkpoint`` write a store.
STORE_SUFFIX = ".ucf"


def is_store_path(path: Any) -> bool:
    """Whether ``path`` names a store: it ends in ``.ucf``, or is a folder holding a manifest."""
    text = str(path)
    return text.rstrip("/").endswith(STORE_SUFFIX) or (Path(text) / MANIFEST_KEY).is_file()


class StoreCheckpoints:
    """Mixin for a Lightning strategy: checkpoints at store paths are ucformat stores.

    Put it before the strategy class: ``class S(StoreCheckpoints, ModelParallelStrategy)``.
    The strategy implements :meth:`save_store` and :meth:`load_store`.
    """

    # provided by Lightning's Strategy
    lightning_module: Any
    optimizers: list[Any]
    broadcast: Any

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Write a store at a ``.ucf`` path; any other path as the strategy does."""
        if not is_store_path(filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
            return
        if storage_options is not None:
            raise TypeError(
                f"{filepath}: storage_options do not apply to a store (give a URL such as "
                "s3://bucket/ckpt.ucf; credentials come from the environment)."
            )
        path = str(self.broadcast(str(filepath)))  # rank 0's path, as Lightning does
        restored = RESTORED | self._restored_keys(checkpoint)
        client_state, by_type = split_lightning_state(checkpoint, restored)
        if by_type:
            rank_zero_warn(
                f"{path}: Lightning checkpoint entries kept by type only (not restored on "
                f"resume): {', '.join(by_type)}."
            )
        with_optimizer = "optimizer_states" in checkpoint
        if with_optimizer and len(self.optimizers) > 1:
            raise UnsupportedExportError(
                f"{path}: the run has {len(self.optimizers)} optimizers; a store holds one. "
                "Save this run natively."
            )
        optimizer = self.optimizers[0] if with_optimizer and self.optimizers else None
        self.save_store(path, optimizer, client_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load a store into the model (and, when fitting, the optimizer); return Lightning's
        checkpoint dictionary without the tensors. Any other path: as the strategy does."""
        if not is_store_path(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        path = str(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if fitting and len(self.optimizers) > 1:
            raise UnsupportedExportError(
                f"{path}: the run has {len(self.optimizers)} optimizers; a store holds one."
            )
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        ckpt = open_checkpoint(path)
        if optimizer is not None and ckpt.manifest.optimizer is None:
            optimizer = None  # weights only (e.g. converted Hugging Face weights)
        self.load_store(ckpt, optimizer, strict=bool(module.strict_loading))
        return lightning_state(ckpt.manifest, str(getattr(pl, "__version__", "")))

    def _restored_keys(self, checkpoint: dict[str, Any]) -> frozenset[str]:
        """The precision plugin's and datamodule's entries Lightning restores, if present."""
        trainer = self.lightning_module.trainer
        names = {type(trainer.precision_plugin).__qualname__}
        if trainer.datamodule is not None:
            names.add(type(trainer.datamodule).__qualname__)
        return frozenset(names & set(checkpoint))

    def save_store(self, path: str, optimizer: Any, client_state: dict[str, Any]) -> None:
        """Write the model (and ``optimizer``) with ``client_state`` to the store at ``path``."""
        raise NotImplementedError

    def load_store(self, ckpt: Any, optimizer: Any, *, strict: bool) -> None:
        """Fill the model (and ``optimizer``) from the opened store ``ckpt``."""
        raise NotImplementedError


class ModelParallelStrategy(StoreCheckpoints, _ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, TP) whose checkpoints can be stores.

    Takes the same arguments. Names in the store are the LightningModule's own
    (``model.layers.0...`` when it holds the network as ``self.model``), as a converted
    native checkpoint has them.
    """

    def save_store(self, path: str, optimizer: Any, client_state: dict[str, Any]) -> None:
        """``ucformat.torch.save`` of the LightningModule on every rank."""
        ucformat.torch.save(
            self.lightning_module, optimizer, path, client_state=client_state, overwrite=True
        )

    def load_store(self, ckpt: Any, optimizer: Any, *, strict: bool) -> None:
        """``ucformat.torch.load`` into the LightningModule on every rank."""
        ucformat.torch.load(self.lightning_module, optimizer, ckpt, strict=strict)


class DeepSpeedStrategy(StoreCheckpoints, _DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` whose checkpoints can be stores (ZeRO-1/2/3).

    Takes the same arguments. Names in the store are the engine's, which are the
    LightningModule's own (``model.layers.0...``), as a converted native checkpoint has them.
    """

    deepspeed_engine: Any

    def save_store(self, path: str, optimizer: Any, client_state: dict[str, Any]) -> None:
        """``ucformat.deepspeed.save`` of the engine on every rank."""
        if optimizer is None:
            raise UnsupportedExportError(
                f"{path}: a weights-only save; DeepSpeed stores hold the optimizer's fp32 "
                "partitions. Save with save_weights_only=False."
            )
        ucformat.deepspeed.save(
            self.deepspeed_engine, path, client_state=client_state, overwrite=True
        )

    def load_store(self, ckpt: Any, optimizer: Any, *, strict: bool) -> None:
        """``ucformat.deepspeed.load`` into the engine on every rank (Lightning restores the
        lr schedulers itself)."""
        ucformat.deepspeed.load(
            self.deepspeed_engine,
            ckpt,
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=False,
            strict=strict,
        )
