"""The distributed optimizer's ``dp_reshardable`` format: per-bucket flat state cut into parameters.

Megatron-Core saves, for every model-parallel rank ``g`` (``dp_group_idx``: the rank in the
tensor x pipeline group, or for the expert optimizer in the expert-tensor x expert x pipeline
group), every DDP buffer ``b`` (``gbuf_idx``: model chunk by model chunk, one buffer per param
dtype) and every bucket ``k``, one flat tensor per optimizer state (``param``: the fp32 main
param, ``exp_avg``, ``exp_avg_sq``) of the bucket's unpadded size, and the buckets' unpadded and
padded sizes (``per_bucket_numel[_unpadded]``). Which range of a bucket is which parameter is not
saved. It is rebuilt here (docs/megatron.md, "dp_reshardable"):

1. **who holds what**: the ranks that wrote a group's bucket chunks are that group's ranks; the
   rank that wrote a weight chunk therefore names the group, hence the tensor (or expert tensor,
   expert) rank and pipeline rank, of the parameter it holds. A pipeline rank's layers split into
   runs of consecutive layers: its model chunks (virtual pipeline stages), in order; parameters
   outside the layer stack go to the first model chunk of pipeline rank 0 (embedding) or the last
   one of the last pipeline rank (final norm, output layer; with tied embeddings and pp > 1 a
   copy of the embedding there, in a bucket of its own);
2. **the local tensor**: a group holds, of a parameter split over tensor-parallel ranks, the boxes
   its tensor rank wrote (SwiGLU's gate box, then its up box), else the whole parameter;
3. **order**: a buffer holds its model chunk's parameters of its dtype in reverse module order
   (:func:`~.params.order_params` gives the module order), and
   :func:`~ucformat.layout.megatron_buckets.place_params` places them from the recorded sizes;
4. every parameter's states are then the runs of the bucket tensors' chunks over its range, each
   mapped through its local boxes to the full parameter.

Whatever this rule gets wrong shows: the recorded sizes do not match (refused here), or the
masters do not match the weights (:mod:`.proof` refuses). GroupedMLP experts (one transposed
tensor per linear for all of a rank's experts, each expert's weight its block transposed) give
each expert's states as a transposed block (:mod:`.transposed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ucformat.errors import LayoutMismatchError, UnsupportedCheckpointError
from ucformat.format.dtypes import dtype_name
from ucformat.format.megatron import EXPERT_AXIS
from ucformat.format.spec import FP32_STATE
from ucformat.layout.megatron_buckets import BucketParam, cut_runs, local_runs, place_params
from ucformat.sources.base import ArraySource, SourceFragment
from ucformat.sources.megatron.files import MegatronFiles
from ucformat.sources.megatron.keys import BucketKey, parse_bucket_key
from ucformat.sources.megatron.optimizers import InnerOptimizer
from ucformat.sources.megatron.params import ParamSlot
from ucformat.sources.megatron.transposed import Piece, TransposedBlock

__all__ = ["BucketLayout", "Parallel", "read_buckets"]

#: Bucket state names and the store's state names.
_STATES = {"param": FP32_STATE, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Parallel:
    """The source's parallel sizes."""

    tp: int
    pp: int
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    #: Experts are TEGroupedMLP's (``linear_fc1.weight<i>`` for every local expert, then
    #: ``linear_fc2.weight<i>``): their module order is key by key, not expert by expert.
    te_grouped: bool = False


@dataclass
class _Member:
    """A parameter in a buffer: its slot (None: the tied embedding's last-stage copy), or a
    GroupedMLP weight: every local expert's slot and boxes, one transposed block each."""

    slot: ParamSlot | None
    numel: int
    boxes: list[Box]
    dtype: str
    own_bucket: bool = False
    experts: list[tuple[ParamSlot, list[Box]]] | None = None


@dataclass
class BucketLayout:
    """What was rebuilt: each parameter's states, and per group the model chunks' layers."""

    arrays: dict[str, dict[str, ArraySource]]
    #: Per pipeline rank, ``[first layer, count]`` of each model chunk.
    pipeline_layers: list[list[list[int]]]


def read_buckets(
    files: MegatronFiles,
    slots: Sequence[ParamSlot],
    optimizers: Sequence[InnerOptimizer],
    chained: bool,
    parallel: Parallel,
) -> BucketLayout:
    """Every parameter's states from the ``dp_reshardable`` buckets.

    Raises:
        UnsupportedCheckpointError: the buckets cannot be cut by Megatron's rule (one line naming
            the buffer and what did not fit).
    """
    return _Reader(files, slots, optimizers, chained, parallel).read()


class _Reader:
    def __init__(
        self,
        files: MegatronFiles,
        slots: Sequence[ParamSlot],
        optimizers: Sequence[InnerOptimizer],
        chained: bool,
        parallel: Parallel,
    ) -> None:
        self.files, self.parallel = files, parallel
        self.slots = _key_major(list(slots)) if parallel.te_grouped else list(slots)
        self.optimizers = list(optimizers)
        self.chained = chained
        self.keys: dict[tuple[int, int, int, int, str], tuple[str, BucketKey]] = {}
        for key in files.tensors():
            parsed = parse_bucket_key(key)
            if parsed is not None:
                c = parsed.chained or 0
                self.keys[(c, parsed.group, parsed.buffer, parsed.bucket, parsed.state)] = (
                    key,
                    parsed,
                )
        #: Expert keys a GroupedMLP saved (several experts per chunk: one weight per rank).
        self.grouped = {
            slot.weight.key
            for slot in self.slots
            if EXPERT_AXIS in slot.weight.axes
            and any(
                c.sizes[slot.weight.axes.index(EXPERT_AXIS)] > 1
                for c in files.tensor(slot.weight.key).chunks
            )
        }
        self.rank_group: dict[int, dict[int, int]] = {}  # optimizer -> rank -> group
        for (c, g, _, _, _), (key, _) in self.keys.items():
            ranks = self.rank_group.setdefault(c, {})
            for chunk in files.tensor(key).chunks:
                rank = files.writer(key, chunk)
                if ranks.setdefault(rank, g) != g:
                    self._refuse(f"rank {rank} wrote buckets of groups {ranks[rank]} and {g}")

    def _refuse(self, what: str) -> NoReturn:
        raise UnsupportedCheckpointError(
            f"{self.files.folder}: the distributed optimizer's dp_reshardable buckets do not "
            f"follow Megatron-Core's layout: {what}. Save with "
            "distrib_optim_sharding_type='fully_reshardable' to convert the optimizer state."
        )

    # --- who holds what -----------------------------------------------------------------------
    def _optimizer_of(self, slot: ParamSlot) -> int:
        expert = slot.weight.has_experts
        if len(self.optimizers) > 1 and expert:
            return self.optimizers[-1].index
        return self.optimizers[0].index

    def _coordinates(self, c: int, group: int) -> tuple[int, int, int]:
        """(tensor rank, expert rank, pipeline rank) of group ``group`` of optimizer ``c``."""
        p = self.parallel
        if len(self.optimizers) > 1 and c == self.optimizers[-1].index:
            return group % p.etp, (group // p.etp) % p.ep, group // (p.etp * p.ep)
        return group % p.tp, 0, group // p.tp

    def _boxes(self, slot: ParamSlot) -> list[tuple[Box, int]]:
        """The parameter's boxes and the group (of its optimizer) whose rank wrote each."""
        c = self._optimizer_of(slot)
        key = slot.weight.key
        entry = self.files.tensor(key)
        depth = len(slot.index)
        ranks = self.rank_group.get(c, {})
        out: list[tuple[Box, int]] = []
        for chunk in entry.chunks:
            if not all(
                o <= i < o + s
                for i, o, s in zip(slot.index, chunk.offsets, chunk.sizes, strict=False)
            ):
                continue
            rank = self.files.writer(key, chunk)
            if rank not in ranks:
                self._refuse(f"rank {rank} wrote '{key}' but no bucket of optimizer {c}")
            box = (tuple(chunk.offsets[depth:]), tuple(chunk.sizes[depth:]))
            out.append((box, ranks[rank]))
        return out

    # --- the rebuild ----------------------------------------------------------------------------
    def read(self) -> BucketLayout:
        members: dict[tuple[int, int], list[list[_Member]]] = {}  # (c, group) -> chunk -> members
        stage_layers = self._stage_layers()
        chunks_of = {p: _runs(layers) for p, layers in stage_layers.items()}
        grouped: dict[tuple[int, int, int | None, str], _Member] = {}
        for slot in self.slots:
            c = self._optimizer_of(slot)
            boxes = self._boxes(slot)
            groups = {g for _, g in boxes}
            coords = {self._coordinates(c, g) for g in groups}
            pipes = {pp for _, _, pp in coords}
            if len(pipes) != 1:
                self._refuse(f"'{slot.name}' was written by pipeline ranks {sorted(pipes)}")
            pp = pipes.pop()
            experts = {ep for _, ep, _ in coords}
            split = len({b for b, _ in boxes}) > 1
            chunk = self._model_chunk(slot, pp, chunks_of)
            for g in self._groups(c, pp, experts):
                tensor_rank = self._coordinates(c, g)[0]
                local = sorted(
                    {
                        b
                        for b, writer in boxes
                        if not split or self._coordinates(c, writer)[0] == tensor_rank
                    }
                )
                if not local:
                    self._refuse(f"no rank of group {g} wrote its part of '{slot.name}'")
                numel = sum(_prod(sizes) for _, sizes in local)
                dtype = self.files.tensor(slot.weight.key).dtype
                if slot.weight.key in self.grouped:  # one GroupedMLP weight for all experts
                    at = (c, g, slot.layer, slot.weight.key)
                    if at not in grouped:
                        grouped[at] = _Member(None, 0, [], dtype, experts=[])
                        self._chunk_list(members, c, g, chunk).append(grouped[at])
                    weight = grouped[at]
                    weight.numel += numel
                    weight.experts = [*(weight.experts or []), (slot, local)]
                    continue
                self._chunk_list(members, c, g, chunk).append(_Member(slot, numel, local, dtype))
        self._add_tied_copy(members)
        arrays: dict[str, dict[str, ArraySource]] = {}
        covered: dict[str, set[Box]] = {}
        for (c, g), chunks in sorted(members.items()):
            self._place(c, g, chunks, arrays, covered)
        for slot in self.slots:
            if slot.name not in arrays:
                self._refuse(f"'{slot.name}' is in no bucket")
        pipeline_layers = [
            [[run[0], len(run)] for run in chunks_of.get(p, [])] for p in range(self.parallel.pp)
        ]
        return BucketLayout(arrays, pipeline_layers)

    def _stage_layers(self) -> dict[int, list[int]]:
        """Pipeline rank -> the global layers its ranks wrote."""
        stages: dict[int, set[int]] = {}
        for slot in self.slots:
            if slot.layer is None:
                continue
            c = self._optimizer_of(slot)
            for _, g in self._boxes(slot):
                stages.setdefault(self._coordinates(c, g)[2], set()).add(slot.layer)
        return {p: sorted(layers) for p, layers in stages.items()}

    def _model_chunk(self, slot: ParamSlot, pp: int, chunks_of: dict[int, list[list[int]]]) -> int:
        runs = chunks_of.get(pp, [])
        if slot.layer is not None:
            for index, run in enumerate(runs):
                if slot.layer in run:
                    return index
        if pp == 0 and slot.name.startswith("embedding."):
            return 0
        return max(len(runs) - 1, 0)

    def _groups(self, c: int, pp: int, experts: set[int]) -> list[int]:
        p = self.parallel
        if len(self.optimizers) > 1 and c == self.optimizers[-1].index:
            return [
                etp + p.etp * (ep + p.ep * pp) for ep in sorted(experts) for etp in range(p.etp)
            ]
        return [tp + p.tp * pp for tp in range(p.tp)]

    @staticmethod
    def _chunk_list(
        members: dict[tuple[int, int], list[list[_Member]]], c: int, g: int, chunk: int
    ) -> list[_Member]:
        chunks = members.setdefault((c, g), [])
        while len(chunks) <= chunk:
            chunks.append([])
        return chunks[chunk]

    def _add_tied_copy(self, members: dict[tuple[int, int], list[list[_Member]]]) -> None:
        """With tied embeddings and pp > 1 the last pipeline rank holds the embedding's copy as
        ``output_layer.weight``, last in its last model chunk, in a bucket of its own; the first
        stage's embedding has a bucket of its own too."""
        if self.parallel.pp == 1 or any(s.name == "output_layer.weight" for s in self.slots):
            return
        embedding = [s for s in self.slots if s.name == "embedding.word_embeddings.weight"]
        if not embedding:
            return
        dense = self.optimizers[0].index
        for (c, g), chunks in members.items():
            if c != dense:
                continue
            for member in (m for chunk in chunks for m in chunk):
                if member.slot is embedding[0]:
                    member.own_bucket = True
                    tp = self._coordinates(c, g)[0]
                    last = tp + self.parallel.tp * (self.parallel.pp - 1)
                    copy = _Member(None, member.numel, member.boxes, member.dtype, True)
                    tail = members.setdefault((c, last), [[]])
                    tail[-1].append(copy)

    def _place(
        self,
        c: int,
        g: int,
        chunks: list[list[_Member]],
        arrays: dict[str, dict[str, ArraySource]],
        covered: dict[str, set[Box]],
    ) -> None:
        recorded = self._recorded(c, g)
        buffers: list[tuple[int, str, list[_Member]]] = []
        for index, chunk in enumerate(chunks):
            dtypes = list(dict.fromkeys(m.dtype for m in chunk))
            for dtype in dtypes:
                buffers.append((index, dtype, [m for m in chunk if m.dtype == dtype]))
        if len(buffers) != len(recorded):
            self._refuse(
                f"group {g} of optimizer {c} records {len(recorded)} buffers; its parameters "
                f"make {len(buffers)} (model chunks x dtypes)"
            )
        for b, ((_, dtype, buffer), (param_dtype, unpadded, padded)) in enumerate(
            zip(buffers, recorded, strict=True)
        ):
            if param_dtype != dtype:
                self._refuse(f"group {g} buffer {b} holds {param_dtype}, its parameters {dtype}")
            order = list(reversed(buffer))
            try:
                places = place_params(
                    [BucketParam(m.numel, m.own_bucket) for m in order], unpadded, padded
                )
            except LayoutMismatchError as exc:
                where = f"optimizer {c} group {g} buffer {b}"
                self._refuse(f"{where}: {exc}")
            for member, place in zip(order, places, strict=True):
                if member.experts is not None:
                    self._grouped(c, g, b, member, place.bucket, place.start, arrays, covered)
                    continue
                if member.slot is None:
                    continue
                name = member.slot.name
                done = covered.setdefault(name, set())
                if all(box in done for box in member.boxes):
                    continue  # a tensor-parallel replica of what another group gave
                done.update(member.boxes)
                states = arrays.setdefault(name, {})
                for state, store_state in _STATES.items():
                    found = self.keys.get((c, g, b, place.bucket, state))
                    if found is None:
                        self._refuse(f"no '{state}' tensor of group {g} buffer {b} bucket "
                                     f"{place.bucket}")  # fmt: skip
                    array = states.get(store_state)
                    if array is None:
                        array = states[store_state] = ArraySource(
                            member.slot.weight.param_shape, self.files.tensor(found[0]).dtype
                        )
                    self._fragments(array, found[0], member, place.start, place.stop)

    def _grouped(
        self,
        c: int,
        g: int,
        b: int,
        member: _Member,
        bucket: int,
        start: int,
        arrays: dict[str, dict[str, ArraySource]],
        covered: dict[str, set[Box]],
    ) -> None:
        """A GroupedMLP weight's range: each local expert's transposed block, cut by its boxes."""
        assert member.experts is not None
        for state, store_state in _STATES.items():
            found = self.keys.get((c, g, b, bucket, state))
            if found is None:
                self._refuse(f"no '{state}' tensor of group {g} buffer {b} bucket {bucket}")
            key = found[0]
            entry = self.files.tensor(key)
            pieces = [
                Piece(
                    self.files.items.chunk_tensor(key, entry, chunk),
                    max(start, chunk.offsets[0]) - chunk.offsets[0],
                    max(start, chunk.offsets[0]) - start,
                    min(start + member.numel, chunk.offsets[0] + chunk.sizes[0])
                    - max(start, chunk.offsets[0]),
                )
                for chunk in entry.chunks
                if chunk.offsets[0] < start + member.numel
                and start < chunk.offsets[0] + chunk.sizes[0]
            ]
            base = 0
            for slot, boxes in sorted(member.experts, key=lambda item: item[0].expert or 0):
                rows = sum(sizes[0] for _, sizes in boxes)
                cols = _prod(boxes[0][1][1:])
                block = TransposedBlock(pieces, base, rows, cols, entry.dtype)
                base += rows * cols
                done = covered.setdefault(f"{slot.name}/{state}", set())
                if all(box in done for box in boxes):
                    continue
                done.update(boxes)
                states = arrays.setdefault(slot.name, {})
                array = states.setdefault(
                    store_state, ArraySource(slot.weight.param_shape, entry.dtype)
                )
                for run in local_runs(array.shape, [(list(o), list(s)) for o, s in boxes]):
                    array.fragments.append(
                        SourceFragment(block, run.chunk_start, run.start, run.length)
                    )

    def _fragments(
        self, array: ArraySource, key: str, member: _Member, start: int, stop: int
    ) -> None:
        entry = self.files.tensor(key)
        runs = local_runs(array.shape, [(list(o), list(s)) for o, s in member.boxes])
        for chunk in entry.chunks:
            low = max(start, chunk.offsets[0])
            high = min(stop, chunk.offsets[0] + chunk.sizes[0])
            if low >= high:
                continue
            tensor = self.files.items.chunk_tensor(key, entry, chunk)
            for run in cut_runs(runs, low - start, high - start):
                array.fragments.append(
                    SourceFragment(
                        tensor, low - chunk.offsets[0] + run.chunk_start, run.start, run.length
                    )
                )

    def _recorded(self, c: int, g: int) -> list[tuple[str, list[int], list[int]]]:
        """Each buffer's (param dtype, unpadded sizes, padded sizes) group ``g`` recorded."""
        prefix = f"chained_{c}." if self.chained else ""
        head = f"{prefix}optimizer.distributed.dp_group_idx_{g}."
        values: dict[str, Any] = {}
        for key in self.files.objects():
            if key.startswith(head):
                name = key[len(head) :].partition("/")[0]
                if name in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                    values[name] = _unwrap(self.files.value(key))
        if len(values) != 2:
            self._refuse(f"group {g} of optimizer {c} records no bucket sizes")
        out = []
        for padded, unpadded in zip(
            values["per_bucket_numel"], values["per_bucket_numel_unpadded"], strict=True
        ):
            if not isinstance(padded, dict) or len(padded) != 1 or padded.keys() != unpadded.keys():
                self._refuse(f"group {g} records buffers of several dtypes at once")
            ((dtypes, sizes),) = padded.items()
            out.append((_param_dtype(dtypes), list(unpadded[dtypes]), list(sizes)))
        return out


def _key_major(slots: list[ParamSlot]) -> list[ParamSlot]:
    """Each run of expert parameters of one layer reordered key by key (TEGroupedMLP's order)."""
    out: list[ParamSlot] = []
    run: list[ParamSlot] = []
    keys: dict[str, int] = {}
    for slot in [*slots, None]:
        if slot is not None and slot.expert is not None and (not run or run[0].layer == slot.layer):
            run.append(slot)
            keys.setdefault(slot.weight.key, len(keys))
            continue
        out.extend(sorted(run, key=lambda s: (keys[s.weight.key], s.expert or 0)))
        run, keys = [], {}
        if slot is not None:
            if slot.expert is not None:
                run.append(slot)
                keys[slot.weight.key] = 0
            else:
                out.append(slot)
    return out


def _unwrap(value: Any) -> Any:
    """A ShardedObject's value as saved (dist_checkpointing wraps it in a one-element list)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _param_dtype(dtypes: Any) -> str:
    first = dtypes[0] if isinstance(dtypes, tuple) else dtypes
    return dtype_name(first) if not isinstance(first, str) else first.removeprefix("torch.")


def _runs(layers: list[int]) -> list[list[int]]:
    """Consecutive layer numbers grouped: a pipeline rank's model chunks."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][-1] + 1 == layer:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _prod(sizes: Sequence[int]) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out
