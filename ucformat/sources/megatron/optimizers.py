"""Megatron-Core's optimizers as ``common.pt`` records them: which ones, their param groups, their
step, and which group each parameter belongs to.

``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of one optimizer for the dense
parameters and, in an MoE model, a second one for the expert parameters; each is an
``FP32Optimizer`` (fp32 training), a ``Float16OptimizerWithFloat16Params`` (bf16/fp16: fp32 main
params) or a ``DistributedOptimizer``. ``common.pt``'s ``optimizer`` holds one optimizer's
non-sharded state, or ``{index: state}`` for several (Megatron-Core 0.16.1):

* ``FP32Optimizer``: ``{"state": {"common_step": step}, "param_groups": [...]}``;
* ``Float16OptimizerWithFloat16Params``: ``{"optimizer": {"state": {"common_step"}, "param_groups"},
  ["grad_scaler"]}`` (its fp32 main params are ShardedTensors ``optimizer.state.fp32_param.*``);
* ``DistributedOptimizer``: ``{"param_state_sharding_type": format, ["optimizer":
  {"param_groups": [...]}]}``, each group with its ``step``; in the ``dp_reshardable`` format the
  param groups are a ShardedObject instead,
  ``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>.optimizer`` (the same on every ``g``).

Groups never list their members (Megatron saves ``params`` as a non-persistent object), so each
parameter's group follows Megatron's own default rule (``_get_param_groups`` with the standard
overrides): a group is keyed by whether it decays weights (``wd_mult`` 0: biases and 1-D
parameters), whether it has the decoupled learning rate (``default_config`` false: the embedding
and output layer, with ``--decoupled-lr``) and whether it holds expert parameters
(``is_expert_parallel``). A parameter that matches no group, or several, makes the membership
unknown (:func:`assign_groups` returns None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucformat.errors import NotACheckpointError
from ucformat.sources.megatron.files import MegatronFiles

__all__ = [
    "DISTRIBUTED",
    "FLOAT16",
    "FP32",
    "InnerOptimizer",
    "assign_groups",
    "read_optimizers",
]

FP32 = "FP32Optimizer"
FLOAT16 = "Float16OptimizerWithFloat16Params"
DISTRIBUTED = "DistributedOptimizer"
#: Keys of a group that are bookkeeping of Megatron's, not the optimizer's hyper-parameters.
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class InnerOptimizer:
    """One optimizer of the chain, as ``common.pt`` records it."""

    index: int
    kind: str
    #: The distributed optimizer's checkpoint format, None for the others.
    sharding: str | None
    groups: list[dict[str, Any]] = field(default_factory=list)
    #: The step every parameter shares (a number or a 0-d tensor), None if not recorded.
    step: Any = None
    grad_scaler: Any = None


def read_optimizers(files: MegatronFiles) -> tuple[list[InnerOptimizer], bool]:
    """The chained optimizers ``common.pt`` records, and whether they are several (each a
    ``{index: state}`` entry). Empty when the checkpoint has no optimizer.

    Raises:
        NotACheckpointError: an optimizer entry of a shape Megatron-Core does not write.
    """
    saved = files.common.get("optimizer")
    if saved is None:
        return [], False
    if not isinstance(saved, dict):
        raise NotACheckpointError(f"{files.folder}: common.pt's 'optimizer' is not a dict.")
    chained = bool(saved) and all(isinstance(k, int) for k in saved)
    entries = sorted(saved.items()) if chained else [(0, saved)]
    out = [_inner(files, index, state, chained) for index, state in entries]
    return out, chained


def _inner(files: MegatronFiles, index: int, state: Any, chained: bool) -> InnerOptimizer:
    where = f"{files.folder}: common.pt's optimizer {index}"
    if not isinstance(state, dict):
        raise NotACheckpointError(f"{where} is not a dict.")
    if "param_state_sharding_type" in state:
        sharding = str(state["param_state_sharding_type"])
        inner = state.get("optimizer")
        if inner is None:
            inner = _distributed_object(files, index, chained, "optimizer")
        groups = _groups(inner, where)
        steps = {g.get("step") for g in groups if g.get("step") is not None}
        scaler = state.get("grad_scaler")
        if scaler is None:
            scaler = _distributed_object(files, index, chained, "grad_scaler", required=False)
        return InnerOptimizer(
            index, DISTRIBUTED, sharding, groups, steps.pop() if len(steps) == 1 else None, scaler
        )
    if isinstance(state.get("optimizer"), dict):  # Float16OptimizerWithFloat16Params
        inner = state["optimizer"]
        groups = _groups(inner, where)
        step = _common_step(inner)
        return InnerOptimizer(index, FLOAT16, None, groups, step, state.get("grad_scaler"))
    return InnerOptimizer(index, FP32, None, _groups(state, where), _common_step(state))


def _groups(inner: Any, where: str) -> list[dict[str, Any]]:
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise NotACheckpointError(f"{where} has no list of param groups.")
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _common_step(inner: Mapping[str, Any]) -> Any:
    state = inner.get("state")
    return state.get("common_step") if isinstance(state, dict) else None


def _distributed_object(
    files: MegatronFiles, index: int, chained: bool, name: str, *, required: bool = True
) -> Any:
    """The ShardedObject ``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>.<name>`` of the
    lowest group ``g`` (every group saves the same one)."""
    prefix = f"chained_{index}." if chained else ""
    head = f"{prefix}optimizer.distributed.dp_group_idx_"
    found = sorted(
        (int(key[len(head) :].partition(".")[0]), key)
        for key in files.objects()
        if key.startswith(head) and key[len(head) :].partition(".")[2].partition("/")[0] == name
    )
    if not found:
        if required:
            raise NotACheckpointError(
                f"{files.folder}: no '{head}<g>.{name}' object; the distributed optimizer's "
                "dp_reshardable state is incomplete."
            )
        return None
    value = files.value(found[0][1])
    # dist_checkpointing saves a ShardedObject's value in a one-element list
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@dataclass(frozen=True)
class GroupedParam:
    """What Megatron's default grouping rule looks at in a parameter."""

    name: str
    shape: tuple[int, ...]
    expert: bool


def _decays(param: GroupedParam) -> bool:
    return not (len(param.shape) == 1 or param.name.endswith(".bias"))


def _signature(group: Mapping[str, Any]) -> tuple[bool, bool]:
    decays = group.get("wd_mult", group.get("pre_wd_mult", 1.0)) != 0.0
    decoupled = group.get("default_config") is False or bool(group.get("is_decoupled_lr"))
    return decays, decoupled


def assign_groups(
    optimizers: Sequence[InnerOptimizer], params: Sequence[GroupedParam]
) -> list[int] | None:
    """Each parameter's group index in the chain's group list (the optimizers' groups one after
    another), or None when Megatron's default rule does not tell every parameter's group."""
    groups = [(o.index, g) for o in optimizers for g in o.groups]
    decoupled_run = any(_signature(g)[1] for _, g in groups)
    expert_optimizer = len(optimizers) > 1
    out: list[int] = []
    for param in params:
        if expert_optimizer:
            owner = optimizers[-1].index if param.expert else optimizers[0].index
        else:
            owner = optimizers[0].index if optimizers else 0
        decoupled = decoupled_run and param.name.endswith(_EMBEDDING_OR_OUTPUT)
        matches = [
            i
            for i, (index, group) in enumerate(groups)
            if index == owner
            and _signature(group) == (_decays(param), decoupled)
            and bool(group.get("is_expert_parallel", param.expert)) == param.expert
        ]
        if len(matches) != 1:
            return None
        out.append(matches[0])
    return out
