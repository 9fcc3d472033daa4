"""The read-once simulation against a real load of the same shape, in one process.

Four ranks run as threads (tests/threads.py: the executor's collectives done between threads)
on a real store (the read-once worker's MLP, saved by ``ucformat.torch.save``), each with its
own reader and counters, needing what real layouts give them: ZeRO-3 pieces of ``fp32``
(:class:`~ucformat.layout.partition.PerParamLayout`), HSDP ``(replicate 2, shard 2)`` row blocks
of ``exp_avg`` (:func:`~ucformat.layout.placements.local_runs`), tensor-parallel column blocks
of ``exp_avg_sq`` (one run per row). Every rank's values equal its own reads, and the
simulation (:func:`ucformat.layout.simulate.simulate_read_once`, no data) predicts, rank by
rank, exactly the bytes and requests each fetched from storage and the bytes it sent.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ucformat
from tests.fixtures._read_once_worker import LR, make_mlp
from tests.threads import ThreadTransport, run_ranks
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.models import ArrayRef
from ucformat.format.stacks import placement
from ucformat.layout.partition import PerParamLayout
from ucformat.layout.placements import Placement, local_intervals, local_runs
from ucformat.layout.simulate import simulate_read_once
from ucformat.read.batch import ReadBatch, grid_of, read_own
from ucformat.read.once import execute_shared, plan_shared, stored_arrays

WORLD = 4


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sim") / "mlp.ucf")
    model = make_mlp(1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model(torch.randn(4, 256, generator=torch.Generator().manual_seed(0))).sum().backward()
    optimizer.step()
    ucformat.torch.save(model, optimizer, path, overwrite=True, fsync=False, chunk_bytes=16384,
                        shard_bytes=131072)  # fmt: skip
    return path


def _needs(store: str, rank: int) -> list[tuple[ArrayRef, list[tuple[int, int]]]]:
    """Per logical array, the flat ranges rank ``rank`` needs (module docstring)."""
    manifest = ucformat.open(store).manifest
    needs: list[tuple[ArrayRef, list[tuple[int, int]]]] = []
    names = list(manifest.params)
    pieces = PerParamLayout.build([(n, math.prod(manifest.params[n].shape)) for n in names], WORLD)
    for fragment in pieces.fragments(rank):
        ref = manifest.params[fragment.name].states["fp32"]
        needs.append((ref, [(fragment.param_start, fragment.param_stop)]))
    hsdp = (Placement("replicate"), Placement("shard", 0))
    for name in names:
        entry = manifest.params[name]
        shape = tuple(entry.shape)
        intervals = local_intervals(shape, (2, 2), hsdp, divmod(rank, 2))
        runs = local_runs(shape, intervals)
        needs.append((entry.states["exp_avg"], [(r.start, r.start + r.length) for r in runs]))
        if len(shape) == 2:  # a column block of a quarter of the columns, one run per row
            rows, cols = shape
            width = cols // WORLD
            block = [(y * cols + rank * width, y * cols + (rank + 1) * width) for y in range(rows)]
            needs.append((entry.states["exp_avg_sq"], block))
        else:
            needs.append((entry.states["exp_avg_sq"], [(0, shape[0])]))
    return needs


def _batch(store: str, rank: int) -> ReadBatch:
    """Rank ``rank``'s needs as a batch of new buffers."""
    batch = ReadBatch()
    for ref, ranges in _needs(store, rank):
        runs, at = [], 0
        for start, stop in ranges:
            runs.append((start, stop, at))
            at += stop - start
        batch.add(ref, runs, np.empty(at, numpy_storage_dtype(ref.dtype)))
    return batch


def test_simulation_predicts_a_real_load(store: str) -> None:
    def rank_load(transport: ThreadTransport) -> dict[str, Any]:
        ckpt = ucformat.open(store)
        own = ucformat.open(store)
        batch, mine = _batch(store, transport.rank), _batch(store, transport.rank)
        needs = {path: ranges for path, (_, ranges) in batch.needs().items()}
        before = (ckpt.stats.bytes_read, ckpt.stats.requests)
        plan = plan_shared(ckpt, needs, transport, mode="once", budget=1 << 16)
        assert execute_shared(ckpt, plan, batch, transport) is None
        own_before = own.stats.bytes_read  # the manifest
        own_requests_before = own.stats.requests
        read_own(own, mine)
        return {
            "same": all(
                np.array_equal(a.out, b.out) for a, b in zip(batch.items, mine.items, strict=True)
            ),
            "bytes_read": ckpt.stats.bytes_read - before[0],
            "requests": ckpt.stats.requests - before[1],
            "sent": plan.stats.bytes_sent,
            "received": plan.stats.bytes_received,
            "rounds": plan.rounds,
            "own": own.stats.bytes_read - own_before,
            "own_requests": own.stats.requests - own_requests_before,
        }

    real = run_ranks(WORLD, rank_load)
    assert [r["same"] for r in real] == [True] * WORLD
    assert min(r["rounds"] for r in real) > 1  # the small budget splits the moves into rounds

    stored = stored_arrays(ucformat.open(store).manifest)
    assert any(path.startswith("stacks/") for path in stored)  # format 3.1: through stacks
    ids = {path: number for number, path in enumerate(stored)}
    grids = {ids[path]: grid_of(array) for path, array in stored.items()}
    sim = simulate_read_once(
        grids,
        WORLD,
        lambda rank: {ids[p]: r for p, (_, r) in _batch(store, rank).needs().items()},
    )
    assert [t.bytes_read for t in sim.ranks] == [r["bytes_read"] for r in real]
    assert [t.requests for t in sim.ranks] == [r["requests"] for r in real]
    assert [t.bytes_sent for t in sim.ranks] == [r["sent"] for r in real]
    assert [t.bytes_received for t in sim.ranks] == [r["received"] for r in real]
    assert [t.own_bytes for t in sim.ranks] == [r["own"] for r in real]
    # own requests as one read per stored array's cells: the loader reads each logical array of
    # a stack apart, so a rank needing neighbouring arrays of a stack makes a few more
    assert all(
        0.8 * r["own_requests"] <= t.own_requests <= r["own_requests"]
        for t, r in zip(sim.ranks, real, strict=True)
    )
    assert sim.storage_bytes < 0.6 * sim.own_bytes  # replicas and shared chunks read once
    assert Path(store).exists()


def test_a_damaged_chunk_fails_its_reader_and_no_rank_waits(store: str, tmp_path: Path) -> None:
    """The reader of a damaged chunk gets a CorruptDataError naming the array; every other rank
    finishes every round (it is the caller's agreement that stops them all)."""
    from ucformat.errors import CorruptDataError

    damaged = str(tmp_path / "damaged.ucf")
    shutil.copytree(store, damaged)
    ref = ucformat.open(damaged).manifest.params["0.weight"].states["exp_avg"]
    stored, _ = placement(ref)
    assert ref.stack is not None and ref.stack.per_shard == 1  # its shards are its own
    first = Path(damaged) / stored.shard_key((ref.stack.index, *[0] * len(ref.shape)))
    data = bytearray(first.read_bytes())
    data[0] ^= 0xFF  # the first chunk of its first shard
    first.write_bytes(bytes(data))

    def rank_load(transport: ThreadTransport) -> BaseException | None:
        ckpt = ucformat.open(damaged)
        batch = _batch(damaged, transport.rank)
        needs = {path: ranges for path, (_, ranges) in batch.needs().items()}
        plan = plan_shared(ckpt, needs, transport, mode="once", budget=1 << 16)
        return execute_shared(ckpt, plan, batch, transport)

    failures = run_ranks(WORLD, rank_load)
    failed = [f for f in failures if f is not None]
    assert len(failed) == 1  # the chunk has one reader
    assert isinstance(failed[0], CorruptDataError)
    assert f"params/0.weight/exp_avg ({ref.path}[{ref.stack.index}]): chunk (" in str(failed[0])
