"""The expert-parallel side of a live DeepSpeed MoE engine: its parameters' global names.

An engine with ``deepspeed.moe.layer.MoE`` layers names its experts locally
(``...deepspeed_experts.{l}...``, ``l`` below the layer's ``num_local_experts``). A store holds
them under their global names (docs/parallel.md): EP rank ``e``'s local expert ``l`` is global
expert ``e * num_local_experts + l``. Renaming the engine's parameters this way is all the
loader needs: the expert optimizer group's flat partitions are then laid out, read and written
like any other group, over the group's own (expert-data-parallel) process group.
"""

from __future__ import annotations

from typing import Any

from ucformat.errors import ModelMismatchError, UnsupportedCheckpointError
from ucformat.format.models import CheckpointManifest
from ucformat.layout.experts import expert_id, with_expert_id
from ucformat.layout.tensor_parallel import ShardMap
from ucformat.sources.deepspeed.tensor_parallel import rank_shards

__all__ = ["autoep_shard_maps", "global_names", "held_elsewhere"]


def global_names(engine: Any) -> dict[int, str]:
    """``id(param) -> name`` for every parameter of ``engine.module``, experts under global ids.

    Raises:
        UnsupportedCheckpointError: an MoE layer with expert tensor parallelism.
    """
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    offsets: dict[str, int] = {}  # module prefix -> first global expert id of this rank
    for prefix, module in engine.module.named_modules():
        if not isinstance(module, MoE):  # AutoEP layers keep their names: autoep_shard_maps
            continue
        if getattr(module, "enable_expert_tensor_parallelism", False):
            raise UnsupportedCheckpointError(
                f"MoE layer '{prefix}' uses expert tensor parallelism; not supported by "
                "ucformat's loader."
            )
        ep_rank = groups._get_expert_parallel_rank(module.expert_group_name)
        offsets[f"{prefix}." if prefix else ""] = ep_rank * int(module.num_local_experts)
    names: dict[int, str] = {}
    for name, param in engine.module.named_parameters():
        names[id(param)] = _global(name, offsets)
    return names


def _global(name: str, offsets: dict[str, int]) -> str:
    parts = expert_id(name)
    if parts is None:
        return name
    for prefix, first in offsets.items():
        if name.startswith(prefix):
            return with_expert_id(name, first + parts[1])
    return name


def held_elsewhere(engine: Any, manifest: CheckpointManifest, wanted: set[str]) -> set[str]:
    """The store's expert parameters that other EP ranks of ``engine`` hold (not unexpected).

    Raises:
        ModelMismatchError: an MoE layer of the engine has another number of experts than the
            store's layer of the same name.
    """
    if manifest.experts is None or not getattr(engine, "has_moe_layers", False):
        return set()
    from deepspeed.moe.layer import MoE

    counts = {
        f"{prefix}.deepspeed_moe.experts.deepspeed_experts": int(module.num_experts)
        for prefix, module in engine.module.named_modules()
        if isinstance(module, MoE)
    }
    for layer in manifest.experts.layers:
        if layer.prefix in counts and counts[layer.prefix] != layer.num_experts:
            raise ModelMismatchError(
                f"MoE layer '{layer.prefix}' has {counts[layer.prefix]} experts in the model but "
                f"{layer.num_experts} in the store; nothing was loaded."
            )
    return {
        name
        for layer in manifest.experts.layers
        if layer.prefix in counts
        for name in (
            f"{layer.prefix}.{e}.{p}" for e in range(layer.num_experts) for p in layer.params
        )
        if name not in wanted
    }


def autoep_shard_maps(engine: Any) -> dict[str, ShardMap] | None:
    """Per AutoEP expert parameter (``<layer>.experts.w1/w2/w3``), this rank's shard of the full
    ``(num_experts, ...)`` array, from the affine map DeepSpeed attaches to it (its EP rank's
    pieces); None without AutoEP layers. A store keeps each expert parameter once in its full
    shape (:mod:`ucformat.sources.deepspeed.autoep`), so the loader reads this rank's experts
    through the map, at any EP size.

    Raises:
        UnsupportedCheckpointError: an expert parameter without DeepSpeed's affine map.
    """
    out: dict[str, ShardMap] = {}
    for prefix, module in engine.module.named_modules():
        if type(module).__name__ != "AutoEPMoELayer":
            continue
        for local, param in module.experts.named_parameters():
            name = f"{prefix}.experts.{local}" if prefix else f"experts.{local}"
            meta = getattr(param, "ds_autoep_uc_meta", None)
            if not isinstance(meta, dict) or "affine_map" not in meta:
                raise UnsupportedCheckpointError(
                    f"AutoEP expert parameter '{name}' carries no affine map "
                    "(ds_autoep_uc_meta); ucformat cannot place its experts."
                )
            raw = meta["affine_map"]
            ranks = raw["ranks"]
            shards = rank_shards(raw, len(ranks), name)
            shape, pieces = shards[int(meta["ep_rank"])]
            logical = tuple(int(d) for d in raw["logical_shape"])
            out[name] = ShardMap.build(logical, shape, pieces, f"param '{name}'")
    return out or None
