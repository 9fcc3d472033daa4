"""A store in Megatron-Core's own terms (pure): what a Megatron job calls each stored array, and
the optimizer state every Megatron optimizer keeps outside its tensors.

Used by both ways back into Megatron, the ``export megatron`` files and the live
``ucformat.megatron.load``:

* **keys** (:func:`megatron_keys`): a parameter converted from a Megatron-Core checkpoint records
  its ShardedTensor key and its place on the axes Megatron prepends to it (the layer, then the
  expert) in ``manifest.megatron.params``. Every stored parameter of one key has the same
  shape; together they tile the key's global tensor ``(*axes, *shape)``;
* **optimizer state names**: Megatron's ShardedTensor keys of optimizer state are
  ``optimizer.state.<state>.<model key>``; ``param`` (the distributed optimizer) and
  ``fp32_param`` (``Float16OptimizerWithFloat16Params``) are the fp32 master weight, the
  store's ``fp32``; the others (``exp_avg``, ``exp_avg_sq``) keep their names;
* **param groups and step** (:func:`megatron_param_groups`, :func:`common_step`): Megatron
  matches a checkpoint's param groups to a job's by :data:`GROUP_KEYS`; the distributed
  optimizer keeps the (one, shared) step in every group, the other optimizers as
  ``state["common_step"]``;
* **content metadata** (:func:`content_metadata`): what Megatron-LM saves as ``common.pt``'s
  ``content_metadata`` and passes to ``sharded_state_dict(metadata=...)``: the distributed
  optimizer's checkpoint format and no ``chained_<i>.`` key prefixes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ucformat.errors import UnsupportedExportError
from ucformat.format.megatron import EXPERT_AXIS, LAYER_AXIS, MegatronParam
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE, STEP_STATE

__all__ = [
    "FULLY_RESHARDABLE",
    "GROUP_KEYS",
    "MASTER_STATES",
    "OPTIMIZER_STATE_PREFIX",
    "MegatronEntry",
    "MegatronKeys",
    "common_step",
    "content_metadata",
    "group_identity",
    "job_param_groups",
    "megatron_keys",
    "megatron_param_groups",
    "optimizer_common",
    "store_state",
]

OPTIMIZER_STATE_PREFIX = "optimizer.state."
#: Megatron's optimizer state names that hold the fp32 master weight (the store's ``fp32``).
MASTER_STATES = frozenset({"param", "fp32_param"})
#: The param-group keys Megatron matches a checkpoint's groups to a job's by.
GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
#: A key of one layer (no layer axis): ``decoder.layers.<L>.<rest>``.
_PER_LAYER = re.compile(r"^decoder\.layers\.\d+\.")
#: The distributed optimizer's checkpoint format that holds its state in model space.
FULLY_RESHARDABLE = "fully_reshardable"


@dataclass(frozen=True)
class MegatronEntry:
    """One stored parameter as Megatron sees it: ``key`` at ``index`` on the prepended axes;
    its global ``layer`` and ``expert`` (on an axis or spelled out in the key), if any."""

    name: str
    key: str
    index: tuple[int, ...]
    shape: tuple[int, ...]
    layer: int | None = None
    expert: int | None = None


@dataclass(frozen=True)
class MegatronKeys:
    """Every Megatron key of a store, and which stored parameter each piece of it is.

    Attributes:
        entries: store name -> its entry, in the store's order.
        axes: key -> the sizes of the axes Megatron prepends (``(layers,)``,
            ``(layers, experts)`` or ``()``), in first-seen order.
        by_index: ``(key, index)`` -> store name.
    """

    entries: dict[str, MegatronEntry]
    axes: dict[str, tuple[int, ...]]
    by_index: dict[tuple[str, tuple[int, ...]], str]

    def global_shape(self, key: str) -> tuple[int, ...]:
        """The global tensor's shape of ``key``: prepended axes, then the parameter's shape."""
        first = self.by_index[(key, tuple(0 for _ in self.axes[key]))]
        return (*self.axes[key], *self.entries[first].shape)


def _axis_names(meta: MegatronParam) -> list[str]:
    """The axes Megatron prepends to the parameter's key (format 3.0: the layer axis if any)."""
    axes: list[str] = list(meta.axes)
    if not axes and meta.layer is not None and not _PER_LAYER.match(meta.key):
        axes = [LAYER_AXIS]
    return axes


def _index(meta: MegatronParam) -> tuple[int, ...]:
    """The parameter's index on its key's prepended axes."""
    axes = _axis_names(meta)
    values: dict[str, int | None] = {LAYER_AXIS: meta.layer, EXPERT_AXIS: meta.expert}
    index = tuple(values[axis] for axis in axes)
    if any(i is None for i in index):
        raise UnsupportedExportError(
            f"Megatron key {meta.key}: axes {axes} but layer {meta.layer}, expert {meta.expert}."
        )
    return tuple(int(i) for i in index if i is not None)


def megatron_keys(manifest: CheckpointManifest) -> MegatronKeys:
    """The Megatron keys of a store converted from a Megatron-Core checkpoint.

    Raises:
        UnsupportedExportError: the store is not from Megatron-Core, a parameter has no key, or
            the parameters of one key do not tile its global tensor (shapes differ, an index
            is missing or taken twice).
    """
    layout = manifest.megatron
    if layout is None:
        raise UnsupportedExportError(
            "this store was not converted from a Megatron-Core checkpoint "
            f"({manifest.source.checkpoint_format or manifest.source.framework}): it records no "
            "Megatron keys."
        )
    entries: dict[str, MegatronEntry] = {}
    by_index: dict[tuple[str, tuple[int, ...]], str] = {}
    seen: dict[str, list[MegatronEntry]] = {}
    names: dict[str, set[tuple[str, ...]]] = {}
    for name, param in manifest.params.items():
        meta = layout.params.get(name)
        if meta is None:
            raise UnsupportedExportError(
                f"'{name}': manifest.megatron records no Megatron key for it; the store's "
                "parameters do not all come from the Megatron-Core checkpoint."
            )
        entry = MegatronEntry(
            name, meta.key, _index(meta), tuple(param.shape), meta.layer, meta.expert
        )
        other = by_index.get((entry.key, entry.index))
        if other is not None:
            raise UnsupportedExportError(
                f"'{name}' and '{other}' are both {entry.key} at index {list(entry.index)}."
            )
        entries[name] = entry
        by_index[(entry.key, entry.index)] = name
        seen.setdefault(entry.key, []).append(entry)
        names.setdefault(entry.key, set()).add(tuple(_axis_names(meta)))
    known = {LAYER_AXIS: layout.num_layers or 0, EXPERT_AXIS: layout.num_experts or 0}
    axes: dict[str, tuple[int, ...]] = {}
    for key, members in seen.items():
        shapes = {m.shape for m in members}
        if len(names[key]) > 1 or len(shapes) > 1:
            raise UnsupportedExportError(
                f"Megatron key {key}: its parameters ({members[0].name}, ...) differ in shape "
                f"({sorted(list(s) for s in shapes)}) or in their prepended axes."
            )
        (axis_names,) = names[key]
        size = tuple(
            max(known[axis], *(m.index[d] + 1 for m in members))
            for d, axis in enumerate(axis_names)
        )
        if len(members) != math.prod(size):
            raise UnsupportedExportError(
                f"Megatron key {key}: {len(members)} parameters do not fill its axes {list(size)} "
                f"(first: {members[0].name}); a layer or an expert is missing."
            )
        axes[key] = size
    return MegatronKeys(entries, axes, by_index)


def store_state(state: str) -> str:
    """The store's state name of Megatron's optimizer state ``state``."""
    return FP32_STATE if state in MASTER_STATES else state


def common_step(manifest: CheckpointManifest) -> int | float | None:
    """The optimizer step every parameter shares (Megatron keeps one), or None if none is stored.

    Raises:
        UnsupportedExportError: parameters have different steps.
    """
    steps: set[int | float] = set()
    for param in manifest.params.values():
        scalar = param.scalars.get(STEP_STATE)
        if scalar is not None and scalar.kind != "bool":
            value = scalar.value
            steps.add(int(value) if scalar.kind == "int" else float(value))
    if len(steps) > 1:
        raise UnsupportedExportError(
            f"the store's parameters have different optimizer steps ({sorted(steps)}); "
            "Megatron-Core keeps one step shared by every parameter."
        )
    return steps.pop() if steps else None


def megatron_param_groups(
    manifest: CheckpointManifest, *, distributed: bool
) -> list[dict[str, Any]]:
    """The store's param groups as the Megatron optimizer keeps them (``params`` left out).

    ``distributed``: the distributed optimizer's form, the step in every group; else the step
    is left out of the groups (``state["common_step"]`` holds it).

    Raises:
        UnsupportedExportError: no optimizer state, or a group lacks Megatron's group keys.
    """
    optimizer = manifest.optimizer
    if optimizer is None:
        raise UnsupportedExportError("this store holds no optimizer state.")
    step = common_step(manifest)
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(optimizer.groups):
        hyper = {k: decode(v) for k, v in group.hyperparams.items() if k != "params"}
        missing = [k for k in GROUP_KEYS if k not in hyper and f"pre_{k}" not in hyper]
        if missing:
            raise UnsupportedExportError(
                f"param group {index} ({len(group.params)} params) lacks Megatron-Core's group "
                f"keys {', '.join(missing)}; Megatron matches param groups by "
                f"{', '.join(GROUP_KEYS)}."
            )
        hyper.pop(STEP_STATE, None)
        if distributed and step is not None:
            hyper[STEP_STATE] = step
        groups.append(hyper)
    return groups


def job_param_groups(
    manifest: CheckpointManifest, *, distributed: bool, expert_parallel: bool
) -> list[dict[str, Any]]:
    """The param groups a job at another layout has, from the store's.

    Megatron puts expert parameters in groups of their own (``is_expert_parallel``) only with
    expert parallelism (EP > 1); at EP = 1 they join the dense groups. So for a job without it
    every group loses the flag and groups that become the same are one; for a job with it, a
    store saved at EP = 1 gets a copy of each group that holds experts, flagged.

    Raises:
        UnsupportedExportError: groups that become one differ in another hyper-parameter.
    """
    groups = megatron_param_groups(manifest, distributed=distributed)
    if expert_parallel:
        assert manifest.optimizer is not None
        if any(g.get("is_expert_parallel") for g in groups):
            return groups
        expert_groups: set[int] = set()
        for name, meta in (manifest.megatron.params if manifest.megatron else {}).items():
            index = manifest.params[name].group if name in manifest.params else None
            if meta.expert is not None and index is not None:
                expert_groups.add(index)
        copies = [{**groups[i], "is_expert_parallel": True} for i in sorted(expert_groups)]
        return [*groups, *copies]
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for hyper in groups:
        flat = {**hyper, "is_expert_parallel": False}
        identity = group_identity(flat)
        first = merged.setdefault(identity, flat)
        if first != flat:
            raise UnsupportedExportError(
                f"the expert and dense param groups {identity} differ "
                f"({sorted(k for k in flat if first.get(k) != flat.get(k))}); without expert "
                "parallelism Megatron keeps them as one group. Export with --ep > 1."
            )
    return list(merged.values())


def group_identity(group: dict[str, Any]) -> tuple[Any, ...]:
    """A param group's identity as Megatron matches it (``pre_<key>``: NeMo's spelling)."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in GROUP_KEYS)


def content_metadata(distributed: bool) -> dict[str, Any]:
    """``common.pt``'s ``content_metadata`` for a job with or without the distributed optimizer."""
    metadata: dict[str, Any] = {}
    if distributed:
        metadata["distrib_optim_sharding_type"] = FULLY_RESHARDABLE
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    return metadata


def optimizer_common(
    groups: list[dict[str, Any]], *, distributed: bool, float16: bool, step: Any
) -> dict[str, Any]:
    """One Megatron optimizer's state that is not sharded (``common.pt`` holds it).

    Args:
        groups: its param groups (:func:`megatron_param_groups` of the same form).
        distributed: a ``DistributedOptimizer`` (``fully_reshardable``).
        float16: a ``Float16OptimizerWithFloat16Params`` (its torch optimizer one level down).
        step: ``state["common_step"]`` of a non-distributed optimizer (None: left out).
    """
    if distributed:
        return {
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": FULLY_RESHARDABLE,
        }
    state = {} if step is None else {"common_step": step}
    inner = {"state": state, "param_groups": groups}
    return {"optimizer": inner} if float16 else inner
