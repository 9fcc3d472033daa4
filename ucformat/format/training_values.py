"""Python training-state values encoded for the manifest: the one encoder of every writer.

Two rules, one per kind of value:

* **state ucformat restores** (an lr scheduler's ``state_dict``, a loss scaler's attributes) must
  be stored exactly: :func:`encode_exact` raises where a value has no exact JSON form;
* **client state** is kept where it can be: :func:`encode_client_state`.

Client state is whatever the training script saved beside the model (``client_state=`` of
``save_checkpoint`` or ``ucformat.*.save``, DCP's extra keys, Megatron's ``common.pt``). Each value
is kept exactly, as :mod:`ucformat.format.pyvalue` encodes it, under its key; a value with no exact
JSON form (an object, a tensor) is recorded by key and type instead
(``ClientState.unrepresentable``, docs/format.md). Readers that know a value cannot be stored
without reading it (a DCP tensor entry) pass :class:`NotStored` with its description.

Keys are kept in the order given, so the manifest's bytes follow the source's key order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ucformat.errors import UCFormatError
from ucformat.format.models import ClientState
from ucformat.format.pyvalue import JSON, try_encode

__all__ = ["NotStored", "encode_client_state", "encode_exact"]


@dataclass(frozen=True)
class NotStored:
    """A client-state value recorded by its description only (known unstorable, never read)."""

    description: str


def encode_client_state(items: Iterable[tuple[object, Any]]) -> ClientState:
    """``(key, value)`` pairs as the manifest's client state; keys are recorded as ``str(key)``.

    A later pair with the same key replaces the earlier one in its dictionary.
    """
    values: dict[str, Any] = {}
    unrepresentable: dict[str, str] = {}
    for key, value in items:
        name = str(key)
        if isinstance(value, NotStored):
            unrepresentable[name] = value.description
            continue
        ok, encoded = try_encode(value)
        if ok:
            values[name] = encoded
        else:
            unrepresentable[name] = str(encoded)
    return ClientState(values=values, unrepresentable=unrepresentable)


def encode_exact(value: Any, what: str) -> JSON:
    """``value`` encoded exactly (see :mod:`ucformat.format.pyvalue`), else one error naming it."""
    ok, encoded = try_encode(value)
    if not ok:
        raise UCFormatError(
            f"{what}: cannot be stored exactly (contains {encoded}); give a state whose values "
            "are numbers, strings, lists and dicts."
        )
    return encoded
