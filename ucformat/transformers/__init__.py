"""``ucformat.transformers``: the Hugging Face ``Trainer`` resumes from a store.

Add :class:`ResumeFromStore` in front of your ``Trainer`` class (or use
:class:`~ucformat.transformers.resume.Trainer`, the stock one with it)::

    from ucformat.transformers import ResumeFromStore

    class MyTrainer(ResumeFromStore, transformers.Trainer): ...

    trainer.train(resume_from_checkpoint="out/checkpoint-300")  # holds ckpt.ucf

transformers is optional for ucformat: importing this package does not import it; ``Trainer``
does, on first use (:mod:`~ucformat.transformers.resume`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ucformat.transformers.store import ResumeFromStore, store_in

if TYPE_CHECKING:
    from ucformat.transformers.resume import Trainer

__all__ = ["ResumeFromStore", "Trainer", "store_in"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from ucformat.transformers.resume import Trainer

        return Trainer
    raise AttributeError(f"module 'ucformat.transformers' has no attribute {name!r}")
