"""ucformat's one agreement: every collective that ucformat runs goes through this module.

Distributed saves, converts and loads never use the training job's default process group.
Per process group, ucformat creates once (a collective: every rank calls it, in the same
order, from the main thread) a :class:`Group`:

* a **private gloo group** for the bytes a writer lacks (:func:`exchange_bytes`). It works
  whatever the job's default backend is (NCCL needs GPU tensors; these bytes are in host
  memory) and can be used from a background thread (``save_async``) while the training loop
  keeps issuing its own collectives: two groups never share a communicator;
* the job's **rendezvous store** (the key-value store ``init_process_group`` used), under a
  private key prefix, for agreements (:func:`agree`, :func:`settle`). Each rank posts its
  outcome under its own key and waits, at most :func:`timeout` seconds, for every other
  rank's: a rank that died or hangs is named in the error (``ranks 1, 3 did not answer``)
  instead of leaving the others blocked in a collective.

Every step that can fail runs between two agreements: each rank contributes its error or None
(and, optionally, a plan :func:`fingerprint` that must be the same everywhere), every rank
learns every failure, and every rank raises the same
:class:`~ucformat.errors.CollectiveError`, naming the failing ranks and their messages. One
process (no ``torch.distributed``, or a world of one) raises its own error as it is.

Each operation works in a :meth:`Group.operation` of its own (fresh keys, its own counter), so
an asynchronous save's background thread and the main thread's next load never mix their
agreements.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ucformat.errors import CollectiveError, UCFormatError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "NOTHING_LOADED",
    "TIMEOUT_ENV",
    "Group",
    "agree",
    "exchange_blobs",
    "exchange_bytes",
    "fingerprint",
    "gather_ints",
    "group",
    "settle",
    "share_read",
    "timeout",
]

#: Seconds an agreement waits for the slowest rank by default: long enough for a rank of a
#: loaded machine to finish writing its shards before the others give up on it.
DEFAULT_TIMEOUT_S = 1800.0
#: Environment variable overriding :data:`DEFAULT_TIMEOUT_S` (seconds).
TIMEOUT_ENV = "UCFORMAT_COLLECTIVE_TIMEOUT"
_PREFIX = "ucformat"
#: How a failed load's message ends.
NOTHING_LOADED = "Nothing was loaded on any rank."


def timeout() -> float:
    """Seconds every wait of an agreement or exchange lasts at most (:data:`TIMEOUT_ENV`)."""
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


class Group:
    """The ranks of one process group as ucformat talks to them.

    ``handle`` is the private gloo group (None in one process), ``store`` the rendezvous
    store under ucformat's key prefix. Agreements are numbered per group, in call order (the
    same on every rank, as every rank runs the same collective steps).
    """

    def __init__(
        self, handle: Any, rank: int, world_size: int, store: Any = None, prefix: str = _PREFIX
    ) -> None:
        self.handle = handle
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.prefix = prefix
        self._count = itertools.count()
        self._lock = threading.Lock()
        #: The key of this rank's last agreement in this group (deleted after the next one).
        self.posted: str | None = None

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.handle is not None and self.world_size > 1

    def next_key(self) -> str:
        """The key prefix of this group's next agreement (or operation)."""
        with self._lock:
            return f"{self.prefix}/{next(self._count)}"

    def operation(self) -> Group:
        """A group with fresh agreement keys for one operation (a save, a load); collective in
        the sense that every rank must ask for it in the same order, from the main thread."""
        return Group(self.handle, self.rank, self.world_size, self.store, self.next_key())


_GROUPS: dict[int, tuple[Any, Group]] = {}
#: Groups made by this process so far: every rank makes them in the same order, so the number
#: names the same group everywhere, and a group made after a re-initialisation (on a store that
#: outlived the old one) never reads the old group's keys.
_MADE = itertools.count()
_SINGLE = Group(None, 0, 1)


def _rendezvous_store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def group() -> Group:
    """The :class:`Group` of the default process group (created on first use).

    Collective the first time: every rank must call it, from the same (main) thread. In one
    process it is a group of one that never communicates.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _SINGLE
    world = dist.group.WORLD
    cached = _GROUPS.get(id(world))
    if cached is None or cached[0] is not world:
        handle = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout()))
        store = dist.PrefixStore(f"{_PREFIX}/{next(_MADE)}", _rendezvous_store())  # type: ignore[attr-defined]
        made = Group(handle, dist.get_rank(group=handle), dist.get_world_size(group=handle), store)
        cached = (world, made)
        _GROUPS[id(world)] = cached
    return cached[1]


def _describe(error: BaseException) -> str:
    text = error.message if isinstance(error, UCFormatError) else str(error)
    text = " ".join(text.split())  # one line
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _post_and_collect(group: Group, mine: Any) -> tuple[list[Any], list[int]]:
    """Every rank's posted value, and the ranks that did not answer in time (then no values).

    Whether the round succeeded is decided once, for every rank, by the first rank to set the
    round's verdict key: a rank that arrives after another gave up on it learns that, instead
    of going on (and committing) alone. A rank deletes its previous key once every rank has
    posted the next one (so they all read it): the store keeps about one round per operation.
    """
    key = group.next_key()
    store = group.store
    keys = [f"{key}/{rank}" for rank in range(group.world_size)]
    store.set(keys[group.rank], json.dumps(mine))
    missing: list[int] = []
    try:
        store.wait(keys, timedelta(seconds=timeout()))
    except Exception:  # the store's timeout (DistStoreError / RuntimeError): who is missing?
        try:
            missing = [rank for rank, k in enumerate(keys) if not store.check([k])]
        except Exception:  # the store itself is gone (its host died)
            return [None] * group.world_size, [
                r for r in range(group.world_size) if r != group.rank
            ]
    verdict = json.loads(store.compare_set(f"{key}/verdict", "", json.dumps(missing)))
    if verdict:
        return [None] * group.world_size, [int(rank) for rank in verdict]
    everyone = [json.loads(store.get(k)) for k in keys]
    previous, group.posted = group.posted, key
    if previous is not None:
        store.delete_key(f"{previous}/{group.rank}")
        if group.rank == 0:
            store.delete_key(f"{previous}/verdict")
    return everyone, []


def agree(
    failure: BaseException | None,
    group: Group,
    where: str,
    *,
    extra: str = "",
    undone: str = "Nothing was committed.",
) -> CollectiveError | None:
    """Tell every rank whether any rank failed; return the error every rank must raise.

    Args:
        failure: this rank's error in the step just finished, or None.
        group: the ranks (:func:`group`, or one of its operations).
        where: names the store and the operation in the message.
        extra: a value every rank must agree on too (a plan's :func:`fingerprint`); ranks that
            differ from rank 0 count as failed.
        undone: the sentence that ends the message (what did not happen).

    Returns:
        None when every rank succeeded (and agrees on ``extra``); else one
        :class:`CollectiveError`, the same on every rank, naming every failing rank and its
        message, or the ranks that did not answer within :func:`timeout` seconds. The caller
        raises it (after any cleanup), ``from failure`` on a failing rank.
    """
    if not group.distributed:
        if failure is None:
            return None
        text = _describe(failure)
        return CollectiveError(
            f"{where}: {text}. {undone}",
            rank=0,
            error_type=type(failure).__name__,
            failures={0: text},
        )
    mine = [None if failure is None else [type(failure).__name__, _describe(failure)], extra]
    everyone, missing = _post_and_collect(group, mine)
    if missing:
        return CollectiveError(
            f"{where}: {_ranks(missing)} of {group.world_size} did not answer within "
            f"{timeout():.0f} s (died or hung; see their logs). {undone}",
            rank=missing[0],
            error_type="TimeoutError",
            missing=tuple(missing),
        )
    failed: dict[int, tuple[str, str]] = {}
    for rank, (error, theirs) in enumerate(everyone):
        if error is None and theirs != everyone[0][1]:
            error = [
                "LayoutMismatchError",
                "LayoutMismatchError: its plan differs from rank 0's (the ranks do not see the "
                "same model, optimizer or source)",
            ]
        if error is not None:
            failed[rank] = (error[0], error[1])
    if not failed:
        return None
    ranks = sorted(failed)
    if len(ranks) == 1:
        detail = f"failed on rank {ranks[0]} of {group.world_size}: {failed[ranks[0]][1]}"
    else:
        detail = f"failed on {_ranks(ranks)} of {group.world_size}: " + "; ".join(
            f"rank {rank}: {failed[rank][1]}" for rank in ranks
        )
    return CollectiveError(
        f"{where}: {detail}. {undone}",
        rank=ranks[0],
        error_type=failed[ranks[0]][0],
        failures={rank: text for rank, (_, text) in failed.items()},
    )


def settle(
    failure: BaseException | None,
    group: Group,
    where: str,
    *,
    extra: str = "",
    undone: str = "Nothing was committed.",
    cleanup: Callable[[], object] | None = None,
) -> None:
    """:func:`agree`, then raise: nothing when every rank succeeded.

    In one process the rank's own ``failure`` is raised as it is; across ranks every rank
    raises the same :class:`CollectiveError` (``from failure`` on a failing rank). ``cleanup``
    runs first when anything is raised.
    """
    if failure is not None and not group.distributed:
        if cleanup is not None:
            cleanup()
        raise failure
    error = agree(failure, group, where, extra=extra, undone=undone)
    if error is None:
        return
    if cleanup is not None:
        cleanup()
    raise error from failure


def fingerprint(document: Any) -> str:
    """A short digest of a JSON-able value (plans are compared across ranks by it)."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def exchange_bytes(
    payload: torch.Tensor,
    send_sizes: list[int],
    receive_sizes: list[int],
    group: Group,
    *,
    undone: str = "Nothing was committed.",
) -> list[torch.Tensor]:
    """All-to-all of bytes: the ``send_sizes[d]`` bytes of ``payload`` at ``sum(send_sizes[:d])``
    go to rank ``d``; returns what each rank sent here (views of one buffer).

    Runs on the private gloo group (bounded by its :func:`timeout`), right after an agreement,
    so every rank is there.

    Args:
        payload: one 1-D ``uint8`` CPU tensor, the bytes for every rank in rank order.
        send_sizes: bytes of ``payload`` for each rank.
        receive_sizes: bytes expected from each rank.
        group: the ranks.

    Raises:
        CollectiveError: the exchange broke (a rank died or did not answer in time).
    """
    if not group.distributed:
        return [payload]
    received = torch.empty(sum(receive_sizes), dtype=torch.uint8)
    try:
        dist.all_to_all_single(
            received,
            payload,
            output_split_sizes=receive_sizes,
            input_split_sizes=send_sizes,
            group=group.handle,
        )
    except RuntimeError as exc:
        raise _broken(group, "the exchange of shard bytes", exc, undone) from exc
    return list(torch.split(received, receive_sizes))


def _broken(group: Group, what: str, exc: BaseException, undone: str) -> CollectiveError:
    return CollectiveError(
        f"rank {group.rank}: {what} broke ({_describe(exc)}); another rank died or did not "
        f"answer. {undone}",
        rank=group.rank,
        error_type=type(exc).__name__,
    )


def share_read(
    read: Callable[[], bytes], group: Group, what: str, *, undone: str = NOTHING_LOADED
) -> bytes | None:
    """``read()`` (of ``what``, named in errors) on the group's first rank only, its bytes sent
    to every rank (two broadcasts on the private gloo group: the size, then the bytes), so
    storage serves them once.

    Returns:
        The bytes on every rank, or None on every rank but the first where ``read`` raised
        there (the first rank raises that error, once the others know): each then reads for
        itself, and meets the error its own way.

    Raises:
        CollectiveError: a broadcast broke (a rank died or did not answer in time).
    """
    if not group.distributed:
        return read()
    data, failure = b"", None
    if group.rank == 0:
        try:
            data = read()
        except Exception as exc:  # raised below, after the others know
            failure = exc
    size = torch.tensor([-1 if failure is not None else len(data)], dtype=torch.int64)
    try:
        dist.broadcast(size, group=group.handle, group_src=0)
    except RuntimeError as exc:
        raise _broken(group, f"a broadcast of {what}", exc, undone) from exc
    if failure is not None:
        raise failure
    if int(size) < 0:
        return None
    if group.rank == 0:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(size), dtype=torch.uint8)
    try:
        if buffer.numel():
            dist.broadcast(buffer, group=group.handle, group_src=0)
    except RuntimeError as exc:
        raise _broken(group, f"a broadcast of {what}", exc, undone) from exc
    return data if group.rank == 0 else buffer.numpy().tobytes()


def exchange_blobs(
    blobs: list[np.ndarray], group: Group, *, undone: str = NOTHING_LOADED
) -> list[np.ndarray]:
    """All-to-all of byte strings of any size: ``blobs[d]`` (a 1-D ``uint8`` array) goes to
    rank ``d``; returns what each rank sent here. Two collectives on the private gloo group:
    the sizes, then the bytes (:func:`exchange_bytes`).

    Raises:
        CollectiveError: the exchange broke (a rank died or did not answer in time).
    """
    if not group.distributed:
        return [blobs[0]]
    sizes = torch.tensor([int(blob.nbytes) for blob in blobs], dtype=torch.int64)
    theirs = torch.empty_like(sizes)
    try:
        dist.all_to_all_single(theirs, sizes, group=group.handle)
    except RuntimeError as exc:
        raise _broken(group, "an exchange of read plans", exc, undone) from exc
    flat = [blob.reshape(-1).view(np.uint8) for blob in blobs]
    payload = torch.from_numpy(np.concatenate(flat) if flat else np.empty(0, np.uint8))
    parts = exchange_bytes(payload, sizes.tolist(), theirs.tolist(), group, undone=undone)
    return [part.numpy() for part in parts]


def gather_ints(
    values: list[int], group: Group, *, undone: str = NOTHING_LOADED
) -> list[list[int]]:
    """Every rank's ``values`` (the same number on every rank), in rank order (all-gather on
    the private gloo group)."""
    if not group.distributed:
        return [list(values)]
    mine = torch.tensor(list(values), dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(group.world_size)]
    try:
        dist.all_gather(out, mine, group=group.handle)
    except RuntimeError as exc:
        raise _broken(group, "a gathering of read statistics", exc, undone) from exc
    return [[int(v) for v in tensor.tolist()] for tensor in out]
