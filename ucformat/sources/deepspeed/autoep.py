"""DeepSpeed AutoEP checkpoints (``expert_parallel.autoep_size``): the experts in full arrays.

AutoEP (DeepSpeed 0.19.8) replaces each MoE layer of a Hugging Face model with an
``AutoEPMoELayer`` whose experts are three fused parameters, ``<prefix>.experts.w1/w2/w3``, each
rank holding the ``num_experts / autoep_size`` experts of its EP rank along dim 0. Its checkpoint
is an ordinary ZeRO one plus, in the model states, ``ds_autoep_layers``: per layer its EP size,
expert placement and an *affine map* per expert parameter (the logical shape, every EP rank's
shard of it: the AutoTP encoding). The expert parameters form one optimizer param group (ZeRO-1/2,
``'moe': True``) or sub-groups (ZeRO-3, family ``autoep_expert`` in ``ds_zero_partition_groups``)
partitioned over each EP rank's expert-data-parallel ranks; everything else over all ranks.
The per-expert ``layer_*_expert_*`` files hold only 16-bit copies and are not needed.

Algorithm: the dense groups are read as any ZeRO checkpoint's; each EP rank's expert group is read
over its own ranks' shards (ZeRO-1/2: DeepSpeed's rank order, :class:`~ucformat.layout.experts.
ExpertRanks`; ZeRO-3: the ranks its files name) in shard coordinates, then placed through that
rank's affine map into the full logical array (``(num_experts, ...)``), as AutoTP shards are
(:mod:`.tensor_parallel`); the EP ranks' scalars must agree. A store holds each expert parameter
once, under the name it has in the model, in its full shape: any EP size reads its slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ucformat.errors import LayoutMismatchError, UnsupportedCheckpointError
from ucformat.layout.experts import ExpertRanks
from ucformat.layout.tensor_parallel import ShardMap
from ucformat.sources.deepspeed.experts import expert_group
from ucformat.sources.deepspeed.states import FlatStates, read_zero3_states, read_zero12_states
from ucformat.sources.deepspeed.tensor_parallel import place_shards, rank_shards
from ucformat.sources.torchfile import TorchFile

__all__ = ["AUTOEP_KEY", "read_autoep_states", "router_aliases"]

#: The model-states key of AutoEP's layer descriptions.
AUTOEP_KEY = "ds_autoep_layers"


def read_autoep_states(
    metas: Sequence[Mapping[str, Any]],
    optim: Sequence[TorchFile],
    world_size: int,
    stage: int,
    model: TorchFile,
) -> FlatStates:
    """Every trainable array of an AutoEP checkpoint, the experts in their logical shape.

    ``metas``: the model states (one at ZeRO-1/2; every rank's at ZeRO-3, in rank order);
    ``model``: the first model-states file (named in refusals).

    Raises:
        UnsupportedCheckpointError: AutoEP with AutoTP folding (``folding_metadata``), several
            EP sizes, an expert parameter without an affine map.
        LayoutMismatchError: the shards disagree with the layout.
    """
    meta = metas[0]
    layers = list(meta.get(AUTOEP_KEY) or [])
    where = str(optim[0].path)
    needed = ("ep_size", "num_experts", "affine_maps")
    broken = [i for i, layer in enumerate(layers) if not all(k in layer for k in needed)]
    if broken or not layers:
        raise UnsupportedCheckpointError(
            f"{model.path}: {AUTOEP_KEY} (AutoEP) lacks {', '.join(needed)} for layer "
            f"{broken[0] if broken else 0}; ucformat reads the AutoEP layout DeepSpeed 0.19.8 "
            "writes."
        )
    if "folding_metadata" in meta or int((meta.get("checkpoint_parallel_dimensions") or {})
                                          .get("tp_degree", 1)) != 1:  # fmt: skip
        raise UnsupportedCheckpointError(
            f"{where}: AutoEP folded with AutoTP (tensor-parallel experts); ucformat reads AutoEP "
            "checkpoints without tensor parallelism only."
        )
    sizes = {int(layer["ep_size"]) for layer in layers}
    if len(sizes) != 1:
        raise UnsupportedCheckpointError(
            f"{where}: AutoEP layers with EP sizes {sorted(sizes)}; ucformat reads one EP size."
        )
    ep_size = sizes.pop()
    maps: dict[str, Mapping[str, Any]] = {}
    for layer in layers:
        maps.update(layer["affine_maps"]["params"])
    if stage == 3:
        dense, per_ep = _zero3(metas, optim, world_size, ep_size, where)
    else:
        dense, per_ep = _zero12(meta, optim, world_size, ep_size, layers, where)
    for name in per_ep[0].groups:
        if name not in maps:
            raise UnsupportedCheckpointError(
                f"{where}: AutoEP expert parameter '{name}' has no affine map in "
                f"{AUTOEP_KEY}; its experts cannot be placed."
            )
        raw = maps[name]
        logical = tuple(int(d) for d in raw["logical_shape"])
        shards = rank_shards(raw, ep_size, name)
        shard_maps = [
            ShardMap.build(logical, shape, pieces, f"param '{name}' EP rank {e}")
            for e, (shape, pieces) in enumerate(shards)
        ]
        dense.groups[name] = per_ep[0].groups[name]
        dense.arrays[name] = {}
        for key in per_ep[0].arrays[name]:
            arrays = [flat.arrays[name][key] for flat in per_ep]
            for e, held in enumerate(arrays):
                if held.shape != shard_maps[e].shard_shape:
                    raise LayoutMismatchError(
                        f"{where}: AutoEP param '{name}' is {list(held.shape)} on EP rank {e}, "
                        f"its affine map says {list(shard_maps[e].shard_shape)}."
                    )
            dense.arrays[name][key] = place_shards(logical, arrays, shard_maps)
        for e, flat in enumerate(per_ep[1:], start=1):
            if flat.scalars.get(name) != per_ep[0].scalars.get(name):
                raise LayoutMismatchError(
                    f"{where}: AutoEP param '{name}': optimizer scalars differ between EP ranks "
                    f"0 and {e}; shards from different steps are mixed."
                )
        dense.scalars[name] = dict(per_ep[0].scalars.get(name, {}))
    return dense


def _zero12(
    meta: Mapping[str, Any],
    optim: Sequence[TorchFile],
    world_size: int,
    ep_size: int,
    layers: Sequence[Mapping[str, Any]],
    where: str,
) -> tuple[FlatStates, list[FlatStates]]:
    groups = optim[0].obj["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    g = expert_group(optim[0], "AutoEP")
    others = frozenset(range(len(groups))) - {g}
    dense = read_zero12_states(meta, optim, world_size, skip_groups=frozenset({g}))
    data_before = bool((meta.get("ds_config") or {}).get("use_data_before_expert_parallelism"))
    ranks = ExpertRanks(world_size, ep_size, int(layers[0]["num_experts"]), data_before)
    per_ep = []
    for e in range(ep_size):
        members = sorted(
            (r for r in range(world_size) if ranks.ep_rank(r) == e), key=ranks.expert_dp_rank
        )
        shards = [optim[r] for r in members]
        per_ep.append(read_zero12_states(meta, shards, len(shards), skip_groups=others))
    return dense, per_ep


def _zero3(
    metas: Sequence[Mapping[str, Any]],
    optim: Sequence[TorchFile],
    world_size: int,
    ep_size: int,
    where: str,
) -> tuple[FlatStates, list[FlatStates]]:
    """ZeRO-3: the files name each sub-group's partition ranks (``ds_zero_partition_groups``)
    and each rank's model states its EP rank."""
    described = optim[0].obj["optimizer_state_dict"].get("ds_zero_partition_groups") or []
    expert = frozenset(
        int(entry["sub_group"])
        for entry in described
        if "autoep_expert" in (entry.get("families") or [])
    )
    if not expert:
        raise UnsupportedCheckpointError(
            f"{where}: an AutoEP ZeRO-3 checkpoint without expert sub-groups in "
            "ds_zero_partition_groups; ucformat reads DeepSpeed 0.19.8's 'zero3_partitioned' "
            "AutoEP format."
        )
    dense_sub_groups = frozenset(range(len(metas[0]["param_shapes"]))) - expert
    dense = read_zero3_states(metas[0], optim, world_size, dense_sub_groups)
    by_ep: dict[int, list[int]] = {}
    for rank, meta in enumerate(metas):
        ep_rank = int((meta.get(AUTOEP_KEY) or [{}])[0].get("ep_rank", -1))
        by_ep.setdefault(ep_rank, []).append(rank)
    if sorted(by_ep) != list(range(ep_size)):
        raise LayoutMismatchError(
            f"{where}: the ranks' model states name EP ranks {sorted(by_ep)}, expected "
            f"0..{ep_size - 1}; files from different runs are mixed."
        )
    per_ep = []
    for e in range(ep_size):
        members = sorted(by_ep[e], key=lambda r: _edp_rank(optim[r], expert))
        shards = [optim[r] for r in members]
        per_ep.append(read_zero3_states(metas[0], shards, len(shards), expert))
    return dense, per_ep


def _edp_rank(handle: TorchFile, expert: frozenset[int]) -> int:
    """A rank's index among its EP rank's expert-data-parallel ranks (its files say)."""
    for entry in handle.obj["optimizer_state_dict"].get("ds_zero_partition_groups") or []:
        if int(entry["sub_group"]) in expert:
            return int(entry["partition_rank"])
    return 0


def router_aliases(meta: Mapping[str, Any], trainable: Sequence[str]) -> dict[str, str]:
    """``{alias: owner}``: AutoEP registers each layer's router a second time under the name the
    model's output recorders expect (Mixtral: ``<layer>.gate`` for ``<layer>.router``), so
    ``module.state_dict()`` holds its parameters twice; DeepSpeed saves the copies apart and
    records no ``shared_params``. A module key ``<layer>.<x>.<rest>`` that is not trained while
    ``<layer>.router.<rest>`` is, is that alias."""
    owners = set(trainable)
    aliases: dict[str, str] = {}
    for layer in meta.get(AUTOEP_KEY) or []:
        prefix = f"{layer['module_path']}." if layer.get("module_path") else ""
        for name in meta.get("module") or {}:
            if name in owners or not name.startswith(prefix):
                continue
            head, dot, rest = name[len(prefix) :].partition(".")
            owner = f"{prefix}router.{rest}"
            if dot and head != "router" and owner in owners:
                aliases[str(name)] = owner
    return aliases
