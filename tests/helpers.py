"""Small builders shared by tests (no files, no torch.distributed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ucformat.format.models import (
    ArrayRef,
    CheckpointManifest,
    OptimizerGroup,
    OptimizerInfo,
    ParamEntry,
    ScalarState,
    SourceInfo,
)


def array_ref(path: str, shape: list[int], dtype: str = "float32") -> ArrayRef:
    numel = 1
    for dim in shape:
        numel *= dim
    return ArrayRef(
        path=path,
        dtype=dtype,
        shape=shape,
        chunk_shape=shape or [],
        shard_shape=shape or [],  # type: ignore[arg-type]
        nbytes=numel * 4,
    )


def source_info(**overrides: object) -> SourceInfo:
    """A valid :class:`SourceInfo` (ZeRO-1, world size 2, bf16) with ``overrides`` applied."""
    fields: dict[str, object] = {
        "framework_version": "0.19.8",
        "path": "/x",
        "tag": "t",
        "zero_stage": 1,
        "world_size": 2,
        "train_dtype": "bfloat16",
        "optimizer_wrapper": "DeepSpeedZeroOptimizer",
        "files": [],
    }
    return SourceInfo.model_validate({**fields, **overrides})


def tiny_manifest() -> CheckpointManifest:
    """A valid two-param manifest with one tied alias."""
    params = {
        name: ParamEntry(
            shape=shape,
            dtype="bfloat16",
            requires_grad=True,
            group=0,
            states={s: array_ref(f"params/{name}/{s}", shape) for s in ("fp32", "exp_avg")},
            scalars={"step": ScalarState(kind="int", value=4)},
        )
        for name, shape in (("emb.weight", [4, 3]), ("head.bias", [4]))
    }
    return CheckpointManifest(
        created_by="tests",
        source=source_info(),
        params=params,
        tied={"lm_head.weight": "emb.weight"},
        optimizer=OptimizerInfo(
            name="deepspeed.ops.adam.FusedAdam",
            state_keys=["exp_avg"],
            scalar_keys=["step"],
            groups=[OptimizerGroup(params=list(params), hyperparams={"lr": 0.001})],
        ),
    )


def logical_values(store: Any, ref: ArrayRef) -> np.ndarray:
    """The values of the logical array ``ref`` in its storage dtype, read whole through zarr
    from the zarr array holding it (its stack's ``[index]`` in a format-3.1 store)."""
    from ucformat.format.stacks import stored_array
    from ucformat.store.arrays import array_from_manifest

    array = array_from_manifest(store, stored_array(ref))
    return np.asarray(array[...] if ref.stack is None else array[ref.stack.index])


def shard_key(ref: ArrayRef, coords: tuple[int, ...]) -> str:
    """The store key of shard ``coords`` (in the logical array's own shard grid) of ``ref``:
    ``params/w/fp32/c/1/0`` in a format-3.0 store, ``stacks/3/c.<q>.1.0`` in a stack."""
    from ucformat.format.stacks import stored_array

    stored = stored_array(ref)
    if ref.stack is None:
        return stored.shard_key(coords)
    return stored.shard_key((ref.stack.index // ref.stack.per_shard, *coords))


def _stored_costs(items: list[tuple[ArrayRef, list[tuple[int, int]]]], runs: bool) -> list[Any]:
    """What :mod:`ucformat.layout.reads` says reading flat ranges of several arrays (``(ref,
    ranges)`` pairs) costs, one cost per zarr array holding them: arrays stacked in one zarr
    array share its shards, whose indexes a reader fetches once (format 3.1), so their ranges
    are priced together, in the stored array's geometry."""
    from ucformat.format.dtypes import itemsize
    from ucformat.format.stacks import placement
    from ucformat.layout.reads import range_read_cost, runs_read_cost

    by_stored: dict[str, tuple[Any, int, list[tuple[int, int]]]] = {}
    for ref, ranges in items:
        stored, offset = placement(ref)
        held = by_stored.setdefault(stored.path, (stored, itemsize(ref.dtype), []))
        held[2].extend((offset + a, offset + b) for a, b in ranges)
    cost = runs_read_cost if runs else range_read_cost
    return [
        cost(stored.shape, stored.chunk_shape, stored.shard_shape, size, sorted(ranges))
        for stored, size, ranges in by_stored.values()
    ]


def read_cost(ref: ArrayRef, ranges: list[tuple[int, int]], *, runs: bool = False) -> Any:
    """What reading flat ``ranges`` of ``ref`` costs, in the geometry of the zarr array
    holding it (a stack's index is that of its shared shards)."""
    return _stored_costs([(ref, ranges)], runs)[0]


def reads_cost(items: list[tuple[ArrayRef, list[tuple[int, int]]]], *, runs: bool = False) -> int:
    """Bytes a reader fetches for flat ranges of several arrays (``(ref, ranges)`` pairs), each
    shard index once per shard object."""
    return sum(cost.total for cost in _stored_costs(items, runs))


def chunk_place(ref: ArrayRef, coords: tuple[int, ...]) -> tuple[str, int, int]:
    """The key of the shard object holding chunk ``coords`` (in the logical array's own chunk
    grid) of ``ref``, the chunk's entry in that shard's index, and the index's entries."""
    import math

    from ucformat.format.stacks import placement

    stored, _ = placement(ref)
    where = coords if ref.stack is None else (ref.stack.index, *coords)
    per_shard = [s // c for s, c in zip(stored.shard_shape, stored.chunk_shape, strict=True)]
    shard = tuple(c // p for c, p in zip(where, per_shard, strict=True))
    local = tuple(c % p for c, p in zip(where, per_shard, strict=True))
    entry = int(np.ravel_multi_index(local, per_shard)) if per_shard else 0
    return stored.shard_key(shard), entry, math.prod(per_shard)


def chunk_offset(data: bytes, entry: int, entries: int) -> int:
    """Where the chunk at index ``entry`` lies in the shard object ``data``, whose index of
    ``entries`` ``(offset, nbytes)`` uint64 pairs and a crc32c ends it."""
    index = np.frombuffer(data[-(16 * entries + 4) : -4], dtype="<u8")
    return int(index[2 * entry])


def chunk_in_object(root: Any, ref: ArrayRef, coords: tuple[int, ...]) -> tuple[Any, int]:
    """The file of a local store ``root`` holding chunk ``coords`` of ``ref`` and the byte
    offset of that chunk's data in it."""
    key, entry, entries = chunk_place(ref, coords)
    path = root / key
    return path, chunk_offset(path.read_bytes(), entry, entries)
