"""``ucformat.lightning``: Lightning runs that save to and resume from ucformat stores.

Use the strategies here in place of Lightning's own (same arguments)::

    from ucformat.lightning import ModelParallelStrategy   # or DeepSpeedStrategy

    trainer = L.Trainer(strategy=ModelParallelStrategy(...), ...)
    trainer.fit(model, ckpt_path="ckpt.ucf")     # resume from a store, at any device count
    trainer.save_checkpoint("ckpt.ucf")          # write a store

Lightning is optional for ucformat: importing this package does not import it; the strategy
classes do, on first use (:mod:`~ucformat.lightning.strategies`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucformat.lightning.strategies import (
        DeepSpeedStrategy,
        ModelParallelStrategy,
        StoreCheckpoints,
        is_store_path,
    )

__all__ = ["DeepSpeedStrategy", "ModelParallelStrategy", "StoreCheckpoints", "is_store_path"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ucformat.lightning import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'ucformat.lightning' has no attribute {name!r}")
