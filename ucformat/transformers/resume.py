"""The stock Hugging Face ``Trainer`` with :class:`~ucformat.transformers.store.ResumeFromStore`.

Importing this module imports transformers.
"""

from __future__ import annotations

import transformers

from ucformat.transformers.store import ResumeFromStore

__all__ = ["Trainer"]


class Trainer(ResumeFromStore, transformers.Trainer):
    """``transformers.Trainer`` that resumes from a store in the checkpoint folder."""
