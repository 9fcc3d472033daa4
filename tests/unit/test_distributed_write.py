"""The spread writer in one process: file fragments, in-memory fragments, and refusals.

A committed DeepSpeed fixture is planned as ``convert`` plans it; :func:`write_spread` (world
size 1) must then write exactly ``convert``'s store, both from the files and with every fragment
replaced by a :class:`MemoryTensor` of the same values (what a live save hands the writer).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import ucformat
from ucformat.collective import Group, agree
from ucformat.errors import DistributedWriteError, StoreExistsError
from ucformat.sources.base import SourceCheckpoint
from ucformat.sources.deepspeed.checkpoint import read_deepspeed_checkpoint
from ucformat.sources.live import MemoryTensor, RemoteTensor
from ucformat.store.keys import Store, open_store
from ucformat.write.convert import convert_options
from ucformat.write.plan import plan_convert
from ucformat.write.spread import SpreadReport, write_spread

SOURCE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4" / "ckpt"
)
ALONE = Group(None, 0, 1)


def _objects(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _in_memory(source: SourceCheckpoint) -> None:
    """Replace every fragment's file tensor by a MemoryTensor holding the same values."""
    cache: dict[int, MemoryTensor] = {}
    arrays = [a for p in source.params.values() for a in p.arrays.values()]
    for array in [*arrays, *source.buffers.values()]:
        for index, fragment in enumerate(array.fragments):
            key = id(fragment.tensor)
            if key not in cache:
                cache[key] = MemoryTensor.of(fragment.tensor.load().contiguous(), 0)
            array.fragments[index] = replace(fragment, tensor=cache[key])


def _spread_alone(target: Path, *, memory: bool = False) -> tuple[SpreadReport, int]:
    """``SOURCE`` planned as ``convert`` plans it (256-byte chunks, 1 KiB shards), written to
    ``target`` by :func:`write_spread` at world size 1 (``memory``: from in-memory fragments);
    the report and the number of units planned."""
    with read_deepspeed_checkpoint(SOURCE) as source:
        if memory:
            _in_memory(source)
        plan = plan_convert(source, convert_options(256, 1024))
        report = write_spread(
            plan, open_store(target, read_only=False), writers=[0] * len(plan.units),
            group=ALONE, where=str(target),
        )  # fmt: skip
    return report, len(plan.units)


@pytest.mark.parametrize("memory", [False, True])
def test_one_process_writes_the_converted_store(tmp_path: Path, memory: bool) -> None:
    reference = tmp_path / "convert.ucf"
    ucformat.convert(SOURCE, reference, chunk_bytes=256, shard_bytes=1024)
    report, units = _spread_alone(tmp_path / "spread.ucf", memory=memory)
    assert report.committed
    assert report.units_written == units
    assert _objects(tmp_path / "spread.ucf") == _objects(reference)


def test_rank_zero_makes_every_folder_once_before_any_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's folders are made in one call, at the start, and are all the folders the
    committed store has (no writer makes one of its own)."""
    import ucformat.store.direct.objects as objects
    import ucformat.write.spread as spread

    calls: list[set[str]] = []
    made_late: list[Path] = []

    def recording(store: Store, keys: list[str]) -> int:
        root = objects.local_object_root(store)  # the staging folder the store is written in
        assert root is not None
        calls.append({str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()})
        return objects.make_folders(store, keys)

    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        made_late.append(self)
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(spread, "make_folders", recording)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    target = tmp_path / "spread.ucf"
    report, _ = _spread_alone(target)
    assert report.committed
    assert len(calls) == 1
    assert calls[0] == {"zarr.json"}  # only the root group was written before
    assert not [p for p in made_late if target in p.parents]  # no writer made a folder


def test_existing_store_is_refused_in_one_process_with_its_own_error(tmp_path: Path) -> None:
    target = tmp_path / "spread.ucf"
    ucformat.convert(SOURCE, target)
    with read_deepspeed_checkpoint(SOURCE) as source:
        plan = plan_convert(source, convert_options())
        with pytest.raises(StoreExistsError, match="overwrite=True"):
            write_spread(
                plan, open_store(target, read_only=False), writers=[0] * len(plan.units),
                group=ALONE, where=str(target),
            )  # fmt: skip
    assert ucformat.open(target).manifest.params  # the old store is untouched


def test_memory_tensor_reads_exact_bytes() -> None:
    values = torch.arange(10, dtype=torch.bfloat16)
    tensor = MemoryTensor.of(values, 3)
    assert (tensor.rank, tensor.numel, tensor.dtype_name) == (3, 10, "bfloat16")
    out = np.zeros(4, dtype=np.uint16)
    tensor.read_into(out, 2, 6)
    assert out.tobytes() == values[2:6].view(torch.uint16).numpy().tobytes()
    a, b = bytearray(4), bytearray(2)
    tensor.read_scattered(7, [memoryview(a), memoryview(b)])
    assert bytes(a + b) == values[7:10].view(torch.uint16).numpy().tobytes()
    assert torch.equal(tensor.load(), values)
    with pytest.raises(ValueError, match="requested"):
        tensor.read_into(np.zeros(2, dtype=np.uint16), 9, 11)


def test_remote_tensor_is_never_read() -> None:
    with pytest.raises(RuntimeError, match="rank 2"):
        RemoteTensor(2, "float32").read_into(np.zeros(1, dtype=np.float32), 0, 1)


def test_agree_alone_turns_a_failure_into_the_typed_error() -> None:
    assert agree(None, ALONE, "x") is None
    error = agree(OSError(28, "No space left on device"), ALONE, "dst")
    assert isinstance(error, DistributedWriteError)
    assert error.rank == 0
    assert "No space left on device" in str(error)
