"""Read once at 16,384 ranks, simulated with the real code: no tensor data, no processes.

``python -m tests.bench.scale_read_once [--markdown] [--only NAME,...] [--cache DIR]``

For each configuration a *manifest-only store* is generated for the model's shape by the real
planner: the model described as the converter describes a ZeRO-1 checkpoint of 64 ranks (every
parameter trainable, fp32 masters and both Adam states, no tensor bytes:
:func:`tests.bench.store_objects.describe`), planned by :func:`ucformat.write.plan.plan_convert`
with the default chunk policy (format 3.1: stacks, box chunks of large matrices) and committed
as ``ucformat.json`` alone: the store of docs/benchmarks.md's "Objects per store" table. It is
opened with ``ucformat.open`` (the bytes and time every rank spends on the manifest), and every
rank's needs are laid out by the real layout code, then taken to the stored arrays (stacks)
that hold them, as the loaders hand them over (:meth:`ucformat.read.batch.ReadBatch.needs`):

* ``llama405b-zero1``: Llama-3-405B (hidden 16384, MLP 53248, 126 layers, GQA 8 kv heads,
  vocab 128256) at TP 8 x PP 16 x DP 128 = 16,384 ranks, DeepSpeed ZeRO-1: each (stage, tp
  rank) flattens its tensor-parallel shards (column-parallel q/k/v/gate/up/embedding/head
  rows, row-parallel o/down columns, replicated norms) into two param groups partitioned over
  DP 128 (:class:`~ucformat.layout.partition.PartitionedFlatLayout`), each fragment taken back
  to the full arrays (a row-parallel fragment: its rows of the rank's columns, as boxes);
* ``llama405b-hsdp``: the same model and mesh with FSDP2 + TP as HSDP, ``(replicate 16,
  shard 8, tp 8)`` per stage: every rank's local shard of every parameter of its stage from
  :func:`~ucformat.layout.placements.local_intervals` (``_StridedShard`` over column-parallel
  rows, ``Shard(0)`` over row-parallel ones, replicated norms sharded by FSDP only);
* ``deepseek-v3-ep64``: DeepSeek-V3 (671B: MLA attention, 3 dense layers, 58 MoE layers of 256
  routed experts plus a shared one) at EP 64 x PP 16 x DP 128 = 2,048 ranks, DeepSpeed MoE
  ZeRO-1: the stage's dense parameters partitioned over DP 128, each rank's 4 experts per MoE
  layer (:class:`~ucformat.layout.experts.ExpertRanks`) over their 2 expert-data-parallel ranks;
* ``llama7b-zero3-w4096``: the LLaMA-7B ZeRO-3 load at W = 4,096 of the simulated-scale table
  (fp32 state), every parameter in ``ceil(n / W)`` pieces.

Then the job's read-once planning runs as the ranks would run it
(:func:`ucformat.layout.simulate.simulate_read_once`: each rank's demands to their homes, each
home's plan, each rank's reads and moves), and a sample of ranks (the first and last, the rank
that is home to most demands, the rank with most rows) plans again as in a real load: its needs
by the loaders' own path (flat runs, one per row of a column block, as ``ucformat.torch.load``
and ``ucformat.deepspeed.load`` hand them over), then :func:`ucformat.read.once.plan_shared`
itself, the network's answers replayed (:class:`ReplayTransport`: the demands the others send
it, every home's rows for it); timed, then again under ``tracemalloc`` for the peak (plus the
bytes it receives).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import ucformat
from ucformat.format.stacks import placement
from ucformat.layout.cells import OutBox
from ucformat.layout.experts import ExpertRanks
from ucformat.layout.partition import Fragment, PartitionedFlatLayout, PerParamLayout
from ucformat.layout.placements import Placement, local_intervals, local_runs
from ucformat.layout.simulate import ReadOnceSimulation, simulate_read_once
from ucformat.read.batch import grid_of
from ucformat.read.once import plan_shared, stored_arrays

KIB, MIB, GIB = 1024, 1024 * 1024, 1024**3
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Param:
    """A parameter: its shape, how tensor parallelism splits it, its layer (-1: before the
    first, ``layers``: after the last) and its expert id (None: dense)."""

    name: str
    shape: tuple[int, ...]
    split: str  # "col" (rows), "row" (columns), "rep"
    layer: int
    expert: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: Tensor-parallel splits of Llama's matrices (Megatron's column- and row-parallel layers).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")


def params_of(shapes: Sequence[tuple[str, tuple[int, ...]]], tensor_parallel: bool) -> tuple[
    list[Param], int
]:  # fmt: skip
    """The parameters (:func:`tests.bench.store_objects` shape lists, module order) with their
    split, layer and expert, and the layer count."""

    def layer_of(parts: list[str]) -> int | None:
        return int(parts[parts.index("layers") + 1]) if "layers" in parts else None

    layers = 1 + max(layer_of(n.split(".")) or 0 for n, _ in shapes)
    out = []
    for name, shape in shapes:
        parts = name.split(".")
        layer = layer_of(parts)
        if layer is None:
            layer = -1 if "embed_tokens" in parts else layers
        expert = int(parts[parts.index("experts") + 1]) if "experts" in parts else None
        split = "rep"
        if tensor_parallel and len(shape) == 2:
            split = "row" if any(k in parts for k in _ROW) else split
            split = "col" if any(k in parts for k in _COLUMN) else split
        out.append(Param(name, tuple(shape), split, layer, expert))
    return out, layers


def llama405b() -> tuple[list[Param], int]:
    """Llama 3.1 405B (:func:`tests.bench.store_objects.llama_405b`), tensor-parallel splits."""
    from tests.bench.store_objects import llama_405b

    return params_of(llama_405b(), True)


def deepseek_v3() -> tuple[list[Param], int]:
    """DeepSeek-V3 (:func:`tests.bench.store_objects.deepseek_v3`), no tensor parallelism."""
    from tests.bench.store_objects import deepseek_v3 as shapes

    return params_of(shapes(), False)


def llama7b() -> tuple[list[Param], int]:
    """The LLaMA-7B-like model of the simulated-scale table (tests/bench/scale.py)."""
    from tests.bench.scale import LLAMA_7B

    return params_of(LLAMA_7B.params(), False)


# --- the manifest-only store ----------------------------------------------------------------
#: The source the store is converted from: a ZeRO-1 checkpoint of this many ranks.
SOURCE_WORLD = 64


def manifest_store(name: str, params: Sequence[Param], cache: Path) -> Path:
    """``<cache>/<name>.ucf``: only ``ucformat.json``, from the real planner (module docstring)."""
    from tests.bench.store_objects import describe
    from ucformat.store.manifest_io import manifest_digest
    from ucformat.write.plan import ConvertOptions, plan_convert

    path = cache / f"{name}.ucf"
    if (path / "ucformat.json").exists():
        return path
    source = describe([(p.name, p.shape) for p in params], SOURCE_WORLD)
    manifest = plan_convert(source, ConvertOptions()).manifest  # type: ignore[arg-type]
    stamped = manifest.model_copy(update={"digest": manifest_digest(manifest)})
    path.mkdir(parents=True, exist_ok=True)
    (path / "ucformat.json").write_text(stamped.model_dump_json(indent=1))
    return path


@dataclass(frozen=True)
class Place:
    """Where a logical array lies: its stored array's id, its flat offset in it and its index
    (a box-chunked stack's matrices lie ``rows`` apart)."""

    array: int
    offset: int
    index: int
    rows: int


#: Per (parameter, state): its :class:`Place`.
Places = dict[tuple[str, str], Place]


def places(ckpt: Any, ids: dict[str, int]) -> Places:
    """Every (parameter, state)'s :class:`Place`."""
    out = {}
    for name, entry in ckpt.manifest.params.items():
        for state, ref in entry.states.items():
            stored, offset = placement(ref)
            index = ref.stack.index if ref.stack is not None else 0
            rows = ref.shape[0] if ref.shape else 1
            out[name, state] = Place(ids[stored.path], offset, index, rows)
    return out


# --- every rank's needs, from the layout code ---------------------------------------------------
Needs = dict[int, list[tuple[int, int] | OutBox]]


def _stages(layers: int, stages: int) -> list[int]:
    """The first layer of each pipeline stage (the layers split as evenly as they go)."""
    return [s * layers // stages for s in range(stages)] + [layers]


def _stage_of(param: Param, bounds: list[int]) -> int:
    if param.layer < 0:
        return 0
    for stage in range(len(bounds) - 1):
        if param.layer < bounds[stage + 1]:
            return stage
    return len(bounds) - 2


class Layout:
    """A job's ranks and what each needs (subclasses), over one manifest's stored arrays."""

    name: str
    world_size: int
    states: tuple[str, ...] = STATES

    def __init__(self, params: Sequence[Param], layers: int, places: Places) -> None:
        self.params = list(params)
        self.places = places
        self.layers = layers

    def needs(self, rank: int) -> Needs:  # pragma: no cover - abstract
        raise NotImplementedError

    def loader_needs(self, rank: int) -> Needs:
        """The same needs as a loader hands them over (per-row runs where it has them)."""
        return self.needs(rank)

    def _add(self, needs: Needs, param: Param, pieces: Sequence[tuple[int, int] | OutBox]) -> None:
        """Add ``pieces`` of every state of ``param`` (flat ranges and boxes of the logical
        array) as pieces of the stored arrays holding them (a stack's member ``i``: flat
        offset ``i * numel``, matrix rows from ``i * rows``)."""
        for state in self.states:
            place = self.places[param.name, state]
            shift = place.index * place.rows
            out = needs.setdefault(place.array, [])
            for piece in pieces:
                if isinstance(piece, OutBox):
                    out.append(OutBox(piece.y0 + shift, piece.y1 + shift, piece.x0, piece.x1,
                                      piece.at, piece.stride))  # fmt: skip
                else:
                    out.append((piece[0] + place.offset, piece[1] + place.offset))


def _shard_of(param: Param, tp: int, t: int) -> tuple[int, ...]:
    if param.split == "rep" or tp == 1:
        return param.shape
    if param.split == "col":
        return (param.shape[0] // tp, *param.shape[1:])
    return (param.shape[0], param.shape[1] // tp)


def _logical(
    param: Param, tp: int, t: int, start: int, stop: int
) -> Sequence[tuple[int, int] | OutBox]:
    """A fragment ``[start, stop)`` of rank ``t``'s tensor-parallel shard, in the full array:
    a flat range (replicated, column-parallel) or the boxes of its rows (row-parallel)."""
    if param.split == "rep" or tp == 1:
        return [(start, stop)]
    rows, cols = param.shape
    if param.split == "col":
        base = t * (rows // tp) * cols
        return [(base + start, base + stop)]
    width = cols // tp
    x0 = t * width
    boxes: list[OutBox] = []
    y, x = divmod(start, width)
    end_y, end_x = divmod(stop, width)
    if y == end_y:
        return [OutBox(y, y + 1, x0 + x, x0 + end_x, 0, width)]
    if x:
        boxes.append(OutBox(y, y + 1, x0 + x, x0 + width, 0, width))
        y += 1
    if y < end_y:
        boxes.append(OutBox(y, end_y, x0, x0 + width, 0, width))
    if end_x:
        boxes.append(OutBox(end_y, end_y + 1, x0, x0 + end_x, 0, width))
    return boxes


class DenseZero1(Layout):
    """DeepSpeed ZeRO-1 with tensor and pipeline parallelism (module docstring)."""

    def __init__(self, params: Sequence[Param], layers: int, places: Places, *, tp: int, pp: int,
                 dp: int) -> None:  # fmt: skip
        super().__init__(params, layers, places)
        self.name = f"zero1 tp{tp} pp{pp} dp{dp}"
        self.tp, self.pp, self.dp = tp, pp, dp
        self.world_size = tp * pp * dp
        bounds = _stages(layers, pp)
        self.stage_params = [[p for p in params if _stage_of(p, bounds) == s] for s in range(pp)]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, dp rank, tp rank)."""
        return rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a handful of (stage, tp) layouts per run
    def groups(self, stage: int, t: int) -> list[PartitionedFlatLayout]:
        """The stage's two flat groups (matrices, vectors) of tp rank ``t``'s shards."""
        members = self.stage_params[stage]
        out = []
        for matrices in (True, False):
            group = [(p.name, math.prod(_shard_of(p, self.tp, t))) for p in members
                     if (len(p.shape) >= 2) == matrices]  # fmt: skip
            out.append(PartitionedFlatLayout.build(group, self.dp))
        return out

    def fragments(self, rank: int) -> Iterator[tuple[Param, Fragment]]:
        stage, d, t = self.coords(rank)
        by_name = {p.name: p for p in self.stage_params[stage]}
        for layout in self.groups(stage, t):
            for fragment in layout.fragments(d):
                yield by_name[fragment.name], fragment

    def needs(self, rank: int) -> Needs:
        t = self.coords(rank)[2]
        needs: Needs = {}
        for param, f in self.fragments(rank):
            self._add(needs, param, _logical(param, self.tp, t, f.param_start, f.param_stop))
        return needs

    def loader_needs(self, rank: int) -> Needs:
        """As ``ucformat.deepspeed.load`` hands them over: each fragment through the rank's
        real :class:`~ucformat.layout.tensor_parallel.ShardMap` (one run per row of a
        row-parallel shard), as flat ranges."""
        from ucformat.layout.tensor_parallel import ShardMap, split_pieces

        t = self.coords(rank)[2]
        needs: Needs = {}
        for param, f in self.fragments(rank):
            if param.split == "rep":
                runs = [(f.param_start, f.param_stop)]
            else:
                dim = 0 if param.split == "col" else 1
                widths = [[param.shape[dim] // self.tp] * self.tp]
                pieces = split_pieces(param.shape, dim, widths)[t]
                shard = ShardMap.build(
                    param.shape, _shard_of(param, self.tp, t), pieces, param.name
                )
                runs = [(r.logical_start, r.logical_start + r.length)
                        for r in shard.translate(f.param_start, f.length)]  # fmt: skip
            self._add(needs, param, runs)
        return needs


class DenseHSDP(Layout):
    """FSDP2 + TP as HSDP, per pipeline stage (module docstring)."""

    def __init__(self, params: Sequence[Param], layers: int, places: Places, *, tp: int, pp: int,
                 replicate: int, shard: int) -> None:  # fmt: skip
        super().__init__(params, layers, places)
        self.name = f"hsdp tp{tp} pp{pp} dp{replicate}x{shard}"
        self.mesh = (replicate, shard, tp)
        self.world_size = replicate * shard * tp * pp
        bounds = _stages(layers, pp)
        self.stage_params = [[p for p in params if _stage_of(p, bounds) == s] for s in range(pp)]

    def placements(self, param: Param) -> tuple[Placement, ...]:
        tp = self.mesh[2]
        if param.split == "col":
            return Placement("replicate"), Placement("strided", 0, tp), Placement("shard", 0)
        if param.split == "row":
            return Placement("replicate"), Placement("shard", 0), Placement("shard", 1)
        return Placement("replicate"), Placement("shard", 0), Placement("replicate")

    def coords(self, rank: int) -> tuple[int, tuple[int, int, int]]:
        per_stage = math.prod(self.mesh)
        stage, rest = divmod(rank, per_stage)
        r, rest = divmod(rest, self.mesh[1] * self.mesh[2])
        s, t = divmod(rest, self.mesh[2])
        return stage, (r, s, t)

    def needs(self, rank: int) -> Needs:
        stage, coordinate = self.coords(rank)
        needs: Needs = {}
        for param in self.stage_params[stage]:
            held = local_intervals(param.shape, self.mesh, self.placements(param), coordinate)
            if len(param.shape) == 1:
                pieces: list[Any] = list(held[0])
            else:
                pieces = [OutBox(y0, y1, x0, x1, 0, x1 - x0) for y0, y1 in held[0]
                          for x0, x1 in held[1]]  # fmt: skip
            self._add(needs, param, pieces)
        return needs

    def loader_needs(self, rank: int) -> Needs:
        """As ``ucformat.torch.load`` hands them over: the local shard's runs
        (:func:`~ucformat.layout.placements.local_runs`: one per row of a column block)."""
        stage, coordinate = self.coords(rank)
        needs: Needs = {}
        for param in self.stage_params[stage]:
            held = local_intervals(param.shape, self.mesh, self.placements(param), coordinate)
            runs = [(r.start, r.start + r.length) for r in local_runs(param.shape, held)]
            self._add(needs, param, runs)
        return needs


class MoEZero1(Layout):
    """DeepSpeed MoE, ZeRO-1, with pipeline parallelism (module docstring)."""

    def __init__(self, params: Sequence[Param], layers: int, places: Places, *, ep: int, pp: int,
                 dp: int, experts: int = 256) -> None:  # fmt: skip
        super().__init__(params, layers, places)
        self.name = f"moe ep{ep} pp{pp} dp{dp}"
        self.pp, self.dp = pp, dp
        self.ranks = ExpertRanks(world_size=dp, ep_size=ep, num_experts=experts)
        self.world_size = pp * dp
        bounds = _stages(layers, pp)
        self.stage_params = [[p for p in params if _stage_of(p, bounds) == s] for s in range(pp)]

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one per stage
    def dense(self, stage: int) -> list[PartitionedFlatLayout]:
        members = [p for p in self.stage_params[stage] if p.expert is None]
        return [
            PartitionedFlatLayout.build(
                [(p.name, p.numel) for p in members if (len(p.shape) >= 2) == matrices], self.dp
            )
            for matrices in (True, False)
        ]

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - one per stage and EP rank
    def experts(self, stage: int, ep_rank: int) -> PartitionedFlatLayout:
        held = range(ep_rank * self.ranks.num_local, (ep_rank + 1) * self.ranks.num_local)
        members = [p for p in self.stage_params[stage] if p.expert in held]
        return PartitionedFlatLayout.build(
            [(p.name, p.numel) for p in members], self.ranks.expert_dp_size
        )

    def needs(self, rank: int) -> Needs:
        stage, d = divmod(rank, self.dp)
        by_name = {p.name: p for p in self.stage_params[stage]}
        needs: Needs = {}
        for layout in self.dense(stage):
            for f in layout.fragments(d):
                self._add(needs, by_name[f.name], [(f.param_start, f.param_stop)])
        mine = self.experts(stage, self.ranks.ep_rank(d))
        for f in mine.fragments(self.ranks.expert_dp_rank(d)):
            self._add(needs, by_name[f.name], [(f.param_start, f.param_stop)])
        return needs


class Zero3(Layout):
    """Every parameter in ``ceil(n / W)`` pieces (fp32 only: the simulated-scale table)."""

    states = ("fp32",)

    def __init__(self, params: Sequence[Param], layers: int,
                 places: Places, *, world_size: int) -> None:  # fmt: skip
        super().__init__(params, layers, places)
        self.name = f"zero3 w{world_size} (fp32)"
        self.world_size = world_size
        self.by_name = {p.name: p for p in params}
        self.layout = PerParamLayout.build([(p.name, p.numel) for p in params], world_size)

    def needs(self, rank: int) -> Needs:
        needs: Needs = {}
        for f in self.layout.fragments(rank):
            self._add(needs, self.by_name[f.name], [(f.param_start, f.param_stop)])
        return needs


# --- one configuration ----------------------------------------------------------------------------
@dataclass
class Result:
    """What one configuration gives."""

    config: str
    model: str
    world_size: int
    arrays: int
    stored_arrays: int
    manifest_bytes: int
    open_s: float
    open_mib: float
    needed: int
    sim: ReadOnceSimulation | None = None
    sim_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)


def _sample_ranks(sim: ReadOnceSimulation) -> list[int]:
    """The first and last rank, the rank home to most demands, the one sending most."""
    ranks = range(sim.world_size)
    homed = max(ranks, key=lambda r: sim.ranks[r].homed)
    busiest = max(ranks, key=lambda r: sim.ranks[r].demands)
    return sorted({0, sim.world_size - 1, homed, busiest})


def _blob(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(-1, width).view(np.uint8).reshape(-1)


class ReplayTransport:
    """A :class:`~ucformat.read.once.Transport` for one rank of a simulated job: it answers
    :func:`~ucformat.read.once.plan_shared`'s collectives with what the job's other ranks would
    send this rank (their demands to its shards, every home's rows for it, every rank's
    numbers of peers), so that the rank plans exactly as in a real load, without a network."""

    def __init__(self, rank: int, sim: ReadOnceSimulation) -> None:
        self.rank, self.world_size = rank, sim.world_size
        demands: list[list[list[int]]] = [[] for _ in range(sim.world_size)]
        for (array, _), classes in sim.homed[rank].items():
            for rects, ranks in classes.items():
                for sender in ranks:
                    demands[sender].extend([array, *rect] for rect in rects)
        rows = [[r.kind, r.array, *r.rect, r.peer, r.block] for r in sim.rows.get(rank, [])]
        empty = np.empty(0, np.uint8)
        self.answers = [
            [_blob(d, 5) for d in demands],
            [_blob(rows, 8)] + [empty] * (sim.world_size - 1),
        ]
        self.peers = [[t.fan_out, t.fan_in, 0, 0] for t in sim.ranks]

    @property
    def received_bytes(self) -> int:
        """Bytes of every blob this rank receives."""
        return sum(int(blob.nbytes) for answer in self.answers for blob in answer)

    def blobs(self, out: list[np.ndarray]) -> list[np.ndarray]:
        return self.answers.pop(0)

    def sized(self, out: list[np.ndarray], receive: list[int]) -> list[np.ndarray]:
        raise AssertionError("planning moves no data")

    def gather(self, values: list[int]) -> list[list[int]]:
        if len(values) == 4:
            return self.peers
        return [list(values)] * self.world_size


def _plan_rank(rank: int, layout: Layout, ckpt: Any, transport: ReplayTransport) -> int:
    """What one rank plans (module docstring): its needs as its loader hands them over, then
    :func:`ucformat.read.once.plan_shared` as a real load runs it (the store's stored arrays
    and grids, its demands, its homes' plan from the demands the others send it, its rows,
    its rounds); the network's answers replayed. Returns the rows it plans with."""
    paths = list(stored_arrays(ckpt.manifest))
    needs: dict[str, list[tuple[int, int]]] = {}
    for array, items in layout.loader_needs(rank).items():
        ranges = needs.setdefault(paths[array], [])
        for item in items:
            assert not isinstance(item, OutBox)  # loaders hand over flat runs
            ranges.append(item)
    plan = plan_shared(ckpt, needs, transport, mode="once")
    return len(plan.rows) + sum(map(len, plan.outgoing.values()))


def run_config(
    name: str, model: str, params: Sequence[Param], layers: int, cache: Path,
    make: Callable[..., Layout], *, samples: bool = True,
) -> Result:  # fmt: skip
    """Simulate one configuration (module docstring)."""
    store = manifest_store(model, params, cache)
    size = (store / "ucformat.json").stat().st_size
    started = time.perf_counter()
    ckpt = ucformat.open(str(store))
    open_s = time.perf_counter() - started
    tracemalloc.start()
    ucformat.open(str(store))
    open_mib = tracemalloc.get_traced_memory()[1] / MIB
    tracemalloc.stop()
    refs = stored_arrays(ckpt.manifest)
    ids = {path: number for number, path in enumerate(refs)}
    grids = {ids[path]: grid_of(ref) for path, ref in refs.items()}
    layout = make(params, layers, places(ckpt, ids))
    logical = sum(len(e.states) for e in ckpt.manifest.params.values())
    result = Result(name, model, layout.world_size, logical, len(refs), size, open_s, open_mib, 0)
    started = time.perf_counter()
    sim = simulate_read_once(grids, layout.world_size, layout.needs,
                             sample=_sample_ranks if samples else None)  # fmt: skip
    result.sim_s = time.perf_counter() - started
    result.sim = sim
    result.needed = sum(4 * p.numel for p in params) * len(layout.states)
    for rank in sorted(sim.homed):
        _clear_caches()
        transport = ReplayTransport(rank, sim)
        started = time.perf_counter()
        rows = _plan_rank(rank, layout, ckpt, transport)
        seconds = time.perf_counter() - started
        _clear_caches()
        transport = ReplayTransport(rank, sim)
        tracemalloc.start()
        _plan_rank(rank, layout, ckpt, transport)
        peak = (tracemalloc.get_traced_memory()[1] + transport.received_bytes) / MIB
        tracemalloc.stop()
        traffic = sim.ranks[rank]
        result.samples.append({"rank": rank, "seconds": round(seconds, 3),
                               "peak_mib": round(peak, 1), "rows": rows,
                               "bytes_read": traffic.bytes_read, "requests": traffic.requests,
                               "demands": traffic.demands, "homed": traffic.homed})  # fmt: skip
    return result


CONFIGS: dict[str, tuple[str, Callable[..., Layout]]] = {
    "llama405b-zero1": ("llama405b", functools.partial(DenseZero1, tp=8, pp=16, dp=128)),
    "llama405b-hsdp": (
        "llama405b",
        functools.partial(DenseHSDP, tp=8, pp=16, replicate=16, shard=8),
    ),
    "deepseek-v3-ep64": ("deepseek-v3", functools.partial(MoEZero1, ep=64, pp=16, dp=128)),
    "llama7b-zero3-w4096": ("llama7b", functools.partial(Zero3, world_size=4096)),
}
MODELS = {"llama405b": llama405b, "deepseek-v3": deepseek_v3, "llama7b": llama7b}


def _clear_caches() -> None:
    """Forget the layouts the simulation built, so that a sampled rank builds its own."""
    DenseZero1.groups.cache_clear()
    MoEZero1.dense.cache_clear()
    MoEZero1.experts.cache_clear()


def markdown(results: Sequence[Result]) -> str:
    """The results as the table in docs/benchmarks.md."""
    head = ["config", "W", "arrays (stored)", "manifest", "open s / MiB",
            "plan s / MiB (max of sample)",
            "storage / needed (own)", "requests (own)", "read per rank max / mean",
            "exchanged"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        assert r.sim is not None
        sim = r.sim
        reads = [t.bytes_read for t in sim.ranks]
        plan_s = max((s["seconds"] for s in r.samples), default=float("nan"))
        plan_mib = max((s["peak_mib"] for s in r.samples), default=float("nan"))
        cells = [
            r.config, f"{r.world_size:,}", f"{r.arrays:,} ({r.stored_arrays:,})",
            f"{r.manifest_bytes / MIB:.1f} MiB",
            f"{r.open_s:.2f} / {r.open_mib:.0f}", f"{plan_s:.2f} / {plan_mib:.0f}",
            f"{sim.storage_bytes / r.needed:.4f} ({sim.own_bytes / r.needed:.3f})",
            f"{sim.storage_requests:,} ({sim.own_requests:,})",
            f"{max(reads) / MIB:,.0f} / {statistics.mean(reads) / MIB:,.0f} MiB",
            f"{sim.exchanged_bytes / GIB:,.1f} GiB",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the configurations and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/ucf_scale_read_once"))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--no-samples", action="store_true")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    wanted = [n for n in args.only.split(",") if n] or list(CONFIGS)
    results = []
    for name in wanted:
        started = time.perf_counter()
        model, make = CONFIGS[name]
        params, layers = MODELS[model]()
        result = run_config(name, model, params, layers, args.cache, make,
                            samples=not args.no_samples)  # fmt: skip
        results.append(result)
        sim = result.sim
        assert sim is not None
        print(
            f"{name}: W={result.world_size} storage/needed {sim.storage_bytes / result.needed:.4f}"
            f" own {sim.own_bytes / result.needed:.3f} requests {sim.storage_requests} own "
            f"{sim.own_requests} sim {result.sim_s:.0f} s, total "
            f"{time.perf_counter() - started:.0f} s; samples {result.samples}",
            flush=True,
        )
    if args.markdown:
        print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
