"""ucformat's own collectives: a private gloo group, agreement on success, byte exchange.

Distributed saves and converts talk over a **separate gloo process group**, created (a
collective: every rank calls it, in the same order) the first time one runs and reused after:

* it works whatever the training job's default backend is (NCCL needs GPU tensors; the bytes
  exchanged here are in host memory);
* it can be used from a background thread (:func:`ucformat.deepspeed.save_async`) while the
  training loop keeps issuing its own collectives on the default group: two groups never share
  a communicator, so neither can see the other's messages.

Every step that can fail runs between two agreements (:func:`agree`): each rank contributes its
error or None, every rank learns the first failure, and every rank raises the same
:class:`~ucformat.errors.DistributedWriteError`. A rank that fails therefore never leaves the
others waiting in a collective it will not join. A rank that *dies* cannot agree: the others
block in the next collective until the launcher (torchrun) tears the job down, or until the
group's timeout (:data:`TIMEOUT`) raises.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ucformat.errors import DistributedWriteError, UCFormatError

__all__ = ["TIMEOUT", "Group", "agree", "exchange_bytes", "fingerprint", "group"]

#: How long a collective of the private group waits for a missing rank before raising.
TIMEOUT = timedelta(minutes=30)

_GROUPS: dict[int, tuple[Any, Any]] = {}


@dataclass(frozen=True)
class Group:
    """A private gloo group (None when the job is not distributed), with this rank's place."""

    handle: Any
    rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.handle is not None and self.world_size > 1


def group() -> Group:
    """The private gloo group of the default process group (created on first use).

    Collective the first time: every rank must call it, from the same (main) thread.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Group(None, 0, 1)
    world = dist.group.WORLD
    cached = _GROUPS.get(id(world))
    if cached is None or cached[0] is not world:
        cached = (world, dist.new_group(backend="gloo", timeout=TIMEOUT))
        _GROUPS[id(world)] = cached
    handle = cached[1]
    return Group(handle, dist.get_rank(group=handle), dist.get_world_size(group=handle))


def _describe(error: BaseException) -> str:
    text = error.message if isinstance(error, UCFormatError) else str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def agree(
    failure: BaseException | None, group: Group, where: str, *, extra: str = ""
) -> DistributedWriteError | None:
    """Tell every rank whether any rank failed; return the error every rank must raise.

    Args:
        failure: this rank's error in the step just finished, or None.
        group: the private group.
        where: names the store and the operation in the message.
        extra: a value every rank must agree on too (a plan's :func:`fingerprint`); ranks that
            differ from rank 0 count as failed.

    Returns:
        None when every rank succeeded (and agrees on ``extra``); else one
        :class:`DistributedWriteError`, the same on every rank, naming the first rank that
        failed. The caller raises it (after any cleanup), ``from failure`` on that rank.
    """
    if not group.distributed:
        if failure is None:
            return None
        return DistributedWriteError(
            f"{where}: {_describe(failure)}", rank=0, error_type=type(failure).__name__
        )
    mine = (None if failure is None else (type(failure).__name__, _describe(failure)), extra)
    everyone: list[Any] = [None] * group.world_size
    dist.all_gather_object(everyone, mine, group=group.handle)
    for rank, (error, theirs) in enumerate(everyone):
        if error is None and theirs != everyone[0][1]:
            error = (
                "LayoutMismatchError",
                "LayoutMismatchError: its plan differs from rank 0's (the ranks do not see the "
                "same model, optimizer or source)",
            )
        if error is not None:
            kind, text = error
            return DistributedWriteError(
                f"{where}: failed on rank {rank} of {group.world_size}: {text}. Nothing was "
                "committed.",
                rank=rank,
                error_type=kind,
            )
    return None


def fingerprint(document: Any) -> str:
    """A short digest of a JSON-able value (plans are compared across ranks by it)."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def exchange_bytes(
    send: list[torch.Tensor], receive_sizes: list[int], group: Group
) -> list[torch.Tensor]:
    """All-to-all of byte buffers: ``send[d]`` goes to rank ``d``; returns what each rank sent.

    Args:
        send: one 1-D ``uint8`` CPU tensor per rank (empty for ranks that get nothing).
        receive_sizes: bytes expected from each rank.
        group: the private group.
    """
    if not group.distributed:
        return [send[0]]
    payload = torch.cat(send) if any(t.numel() for t in send) else torch.empty(0, dtype=torch.uint8)
    received = torch.empty(sum(receive_sizes), dtype=torch.uint8)
    dist.all_to_all_single(
        received,
        payload,
        output_split_sizes=receive_sizes,
        input_split_sizes=[int(t.numel()) for t in send],
        group=group.handle,
    )
    return list(torch.split(received, receive_sizes))
