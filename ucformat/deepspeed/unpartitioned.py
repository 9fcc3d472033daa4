"""A DeepSpeed engine without ZeRO (stage 0, fp32): its torch optimizer, seen as flat targets.

At ZeRO stage 0 in fp32 DeepSpeed hands the client's torch optimizer to the engine unwrapped:
every data-parallel rank holds every parameter whole, its fp32 values are the parameter
itself and the optimizer keys its state by the parameter (param-shaped tensors). The loader
sees each parameter as one flat target of one rank (:class:`~ucformat.layout.partition.
PerParamLayout` at world size 1: no padding), written straight into ``param.data``. In an MoE
engine the experts are renamed to their global ids first (:mod:`ucformat.deepspeed.experts`),
so each rank reads its EP rank's experts and every dense parameter, whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.deepspeed.engine import EngineView
from ucformat.deepspeed.experts import global_names
from ucformat.errors import UnsupportedCheckpointError
from ucformat.layout.partition import PerParamLayout
from ucformat.read.partitions import FlatTarget

__all__ = ["UnpartitionedView", "describe_unpartitioned", "is_unpartitioned"]


@dataclass
class UnpartitionedView(EngineView):
    """An :class:`EngineView` of a ZeRO-0 fp32 engine: one target per trainable parameter."""

    #: The parameter of each target (same order): the key of its optimizer state.
    params: list[torch.nn.Parameter] = field(default_factory=list)

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The engine's optimizer itself (no ZeRO wrapper)."""
        optimizer: torch.optim.Optimizer = self.wrapper
        return optimizer

    def state_key(self, index: int) -> torch.Tensor:
        """The parameter: the torch optimizer keys its state by it."""
        return self.params[index]

    def sync_low_precision(self) -> None:
        """Nothing to do: the parameters are the fp32 masters."""


def is_unpartitioned(engine: Any) -> bool:
    """Whether ``engine`` runs its optimizer without a ZeRO (or mixed-precision) wrapper."""
    optimizer = getattr(engine, "optimizer", None)
    stage = getattr(engine, "zero_optimization_stage", lambda: None)()
    return isinstance(optimizer, torch.optim.Optimizer) and stage == 0


def describe_unpartitioned(engine: Any) -> UnpartitionedView:
    """The :class:`UnpartitionedView` of a ZeRO-0 engine (:func:`is_unpartitioned`).

    Raises:
        UnsupportedCheckpointError: a trainable parameter is not fp32, or is not in
            ``engine.module``.
    """
    optimizer: torch.optim.Optimizer = engine.optimizer
    if getattr(engine, "has_moe_layers", False):
        names = global_names(engine)
    else:
        names = {id(p): name for name, p in engine.module.named_parameters()}
    targets: list[FlatTarget] = []
    fp32: list[torch.Tensor] = []
    params: list[torch.nn.Parameter] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise UnsupportedCheckpointError(
                    "the engine's optimizer holds a parameter that is not in engine.module; "
                    "ucformat matches parameters by name and cannot load it."
                )
            if param.dtype != torch.float32:
                raise UnsupportedCheckpointError(
                    f"ZeRO-0 engine param '{name}' is {param.dtype}; ucformat loads ZeRO-0 "
                    "engines trained in fp32 (bf16 ones use BF16_Optimizer, which it loads)."
                )
            layout = PerParamLayout.build([(name, param.numel())], 1)
            targets.append(FlatTarget(len(targets), group_index, layout, 0, param.numel()))
            fp32.append(param.data.view(-1))
            params.append(param)
    return UnpartitionedView(engine, optimizer, "zero0", 0, targets, fp32, names, params=params)
