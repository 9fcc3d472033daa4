"""``verify --against SRC``: the source checkpoint re-planned in the layout of the store.

The source is read with the converter's own reader (:func:`read_source`: DeepSpeed or DCP) and
planned with :func:`plan_convert`, but with every array's chunk and shard shapes, and its place
in its stack, taken from the store's manifest. The plan's manifest is then what the store's
manifest must say, and each of its :class:`~ucformat.write.plan.WriteUnit` is exactly one shard
of the store: the source fragments that must fill it. Filling a unit reads each source byte it
needs once; units are disjoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ucformat.errors import LayoutMismatchError
from ucformat.format.models import CheckpointManifest
from ucformat.format.stacks import StoredArray
from ucformat.layout.chunking import Chunking
from ucformat.sources.base import SourceCheckpoint
from ucformat.sources.detect import read_source
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.verify.checks import ManifestArray
from ucformat.write.execute import fill_unit
from ucformat.write.plan import ConvertOptions, ConvertPlan, WriteUnit, plan_convert

__all__ = ["SourceShards", "replan_source"]


@dataclass(frozen=True)
class SourceShards:
    """The re-planned source: its plan, its stored arrays by path, and their units by first
    element."""

    plan: ConvertPlan
    arrays: dict[str, StoredArray]
    units: dict[str, dict[int, WriteUnit]]
    source: SourceCheckpoint

    def check_integrity(self) -> None:
        """Check every source storage read against its file's zip CRC-32 (§10, step 6).

        Raises:
            SourceChecksumError: a source file was damaged after it was written.
        """
        self.source.check_integrity()

    def expected(self, path: str, flat_start: int) -> np.ndarray | None:
        """The values (storage dtype, flat) the shard starting at ``flat_start`` must hold."""
        unit = self.units.get(path, {}).get(flat_start)
        if unit is None:
            return None
        return fill_unit(self.plan.arrays[unit.array], unit)


@contextmanager
def replan_source(
    src: Path,
    manifest: CheckpointManifest,
    arrays: Iterable[ManifestArray],
    opaque_globals: Iterable[str] = (),
    check_crc: bool = True,
) -> Iterator[SourceShards]:
    """Open ``src`` and plan it in the layout of ``manifest``'s arrays; close it on exit.

    If ``src`` is a run folder holding the store's tag, that tag is used; otherwise ``src`` is
    resolved as ``ucformat convert`` does (a tag folder, or the ``latest`` tag).

    Raises:
        UCFormatError: the source cannot be read (missing, damaged, hostile, not DeepSpeed).
    """
    named = {array.expected_path: array.ref for array in arrays}
    layouts = {
        name: Chunking(tuple(ref.chunk_shape), tuple(ref.shard_shape))
        for name, ref in named.items()
        if len(ref.chunk_shape) == len(ref.shard_shape)
        and all(size >= 1 for size in (*ref.chunk_shape, *ref.shard_shape))
    }
    compressors = {ref.compressor for ref in named.values()}
    options = ConvertOptions(
        compressor=compressors.pop() if len(compressors) == 1 else "none",
        layouts=layouts,
        format_version=manifest.format_version,
        placements=named,
    )
    names = frozenset(opaque_globals)
    policy = PicklePolicy(opaque_globals=names - {"*"}, all_unknown_opaque="*" in names)
    stored = manifest.source.tag
    deepspeed_tag = manifest.source.framework == "deepspeed" and stored and (src / stored).is_dir()
    tag = stored if deepspeed_tag else None
    with read_source(src, tag=tag, policy=policy, check_crc=check_crc) as source:
        _check_shapes(source, manifest, src)
        plan = plan_convert(source, options)
        units: dict[str, dict[int, WriteUnit]] = {ref.path: {} for ref in plan.arrays}
        for unit in plan.units:
            units[plan.arrays[unit.array].path][unit.flat_start] = unit
        yield SourceShards(plan, {array.path: array for array in plan.arrays}, units, source)


def _check_shapes(source: SourceCheckpoint, manifest: CheckpointManifest, src: Path) -> None:
    """Refuse a source whose parameter or buffer of a stored name has another shape: the store
    was not converted from it, and no value can be compared.

    Raises:
        LayoutMismatchError: one line naming the first such tensor and both shapes.
    """
    pairs = [
        *((name, "parameter", param.shape, manifest.params.get(name))
          for name, param in source.params.items()),
        *((name, "buffer", buffer.shape, manifest.buffers.get(name))
          for name, buffer in source.buffers.items()),
    ]  # fmt: skip
    for name, kind, shape, entry in pairs:
        if entry is not None and list(shape) != list(entry.shape):
            raise LayoutMismatchError(
                f"{src}: {kind} '{name}' has shape {list(shape)} there but {list(entry.shape)} "
                "in the store, so the store was not converted from this checkpoint; give "
                "--against the checkpoint it was converted from."
            )
