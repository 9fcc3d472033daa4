"""``ucformat.verify``: prove that a store holds what its manifest promises, bit for bit.

* :mod:`~ucformat.verify.run`: :func:`verify` and its :class:`VerifyReport`;
* :mod:`~ucformat.verify.checks`: the pure checks (array references, document differences,
  bit comparison);
* :mod:`~ucformat.verify.source`: ``--against``: the source checkpoint re-planned in the store's
  own layout.
"""

from __future__ import annotations

from ucformat.verify.run import Problem, VerifyReport, verify

__all__ = ["Problem", "VerifyReport", "verify"]
