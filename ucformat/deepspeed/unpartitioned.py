"""A DeepSpeed engine without ZeRO (stage 0): its optimizer, seen as flat targets.

At ZeRO stage 0 every data-parallel rank holds every parameter whole, and DeepSpeed runs the
torch optimizer

* bare (fp32): the parameter is its own fp32 master, the optimizer keys its state by it;
* under ``FP16_UnfusedOptimizer`` (fp16 with a non-fused optimizer, or "DDP bf16"): one fp32
  master per parameter (``fp32_groups``), the state keyed by it;
* under ``FP16_Optimizer`` (fp16 with FusedAdam): one flat fp32 master per param group
  (``fp32_groups_flat``), the parameters laid end to end without padding, the state keyed by it.

The loader sees a bare or unfused parameter as one flat target of one rank
(:class:`~ucformat.layout.partition.PerParamLayout` at world size 1: no padding) and a fused
group as one flat target laid out the same way (each parameter at its offset); it writes the
masters and states, then the 16-bit weights from the masters (DeepSpeed's own rounding copy).
Loss scaling lives in the wrappers' ``loss_scale_config``. In an MoE engine the experts are
renamed to their global ids first (:mod:`ucformat.deepspeed.experts`), so each rank reads its
EP rank's experts and every dense parameter, whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ucformat.deepspeed.engine import EngineView, engine_names, name_of
from ucformat.errors import UnsupportedCheckpointError
from ucformat.layout.partition import PerParamLayout
from ucformat.read.partitions import FlatTarget

__all__ = ["UnpartitionedView", "describe_unpartitioned", "is_unpartitioned"]

#: The fp16 wrappers DeepSpeed uses without ZeRO (stage 0).
FP16_WRAPPERS = ("FP16_Optimizer", "FP16_UnfusedOptimizer")


@dataclass
class UnpartitionedView(EngineView):
    """An :class:`EngineView` of a ZeRO-0 fp32 engine: one target per trainable parameter."""

    #: The tensor of each target (same order) the optimizer keys its state by: the parameter
    #: (bare), its master (unfused) or the group's flat master (fused).
    params: list[torch.Tensor] = field(default_factory=list)
    #: Per target, the 16-bit parameters its master feeds (empty for a bare optimizer).
    low_precision: list[list[torch.nn.Parameter]] = field(default_factory=list)

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer (the engine's own, or the fp16 wrapper's)."""
        optimizer: torch.optim.Optimizer = (
            self.wrapper.optimizer if type(self.wrapper).__name__ in FP16_WRAPPERS else self.wrapper
        )
        return optimizer

    def state_key(self, index: int) -> torch.Tensor:
        """The tensor the torch optimizer keys target ``index``'s state by."""
        return self.params[index]

    def sync_low_precision(self) -> None:
        """Copy each fp32 master into its 16-bit parameters (nothing for a bare optimizer)."""
        for flat, params in zip(self.fp32, self.low_precision, strict=True):
            offset = 0
            for param in params:
                numel = param.numel()
                param.data.copy_(flat[offset : offset + numel].view(param.shape))
                offset += numel

    def holds_whole_params(self) -> bool:
        """A bare optimizer and ``FP16_UnfusedOptimizer`` step each parameter whole;
        ``FP16_Optimizer`` steps each group's flat master."""
        return type(self.wrapper).__name__ != "FP16_Optimizer"

    def scaler(self) -> Any:
        """The fp16 wrappers' loss scaling (``loss_scale_config``); None for a bare optimizer."""
        return getattr(self.wrapper, "loss_scale_config", None)


def is_unpartitioned(engine: Any) -> bool:
    """Whether ``engine`` runs without ZeRO: a bare torch optimizer, or an fp16 wrapper."""
    optimizer = getattr(engine, "optimizer", None)
    stage = getattr(engine, "zero_optimization_stage", lambda: None)()
    bare_or_fp16 = isinstance(optimizer, torch.optim.Optimizer) or (
        type(optimizer).__name__ in FP16_WRAPPERS
    )
    return bare_or_fp16 and stage == 0


def describe_unpartitioned(
    engine: Any, renames: Mapping[str, str] | None = None
) -> UnpartitionedView:
    """The :class:`UnpartitionedView` of a ZeRO-0 engine (:func:`is_unpartitioned`;
    ``renames``: :func:`ucformat.deepspeed.engine.engine_names`).

    Raises:
        UnsupportedCheckpointError: a parameter of a bare optimizer is not fp32, or a
            parameter is not in ``engine.module``.
    """
    wrapper = engine.optimizer
    names = engine_names(engine, renames)
    view = UnpartitionedView(engine, wrapper, "zero0", 0, [], [], names)
    kind = type(wrapper).__name__
    if kind == "FP16_Optimizer":
        for index, (params, flat) in enumerate(
            zip(wrapper.fp16_groups, wrapper.fp32_groups_flat, strict=True)
        ):
            members = [(name_of(names, p), p.numel()) for p in params]
            layout = PerParamLayout.build(members, 1)
            view.targets.append(FlatTarget(index, index, layout, 0, flat.numel()))
            view.fp32.append(flat.data.view(-1))
            view.params.append(flat)
            view.low_precision.append(list(params))
        return view
    if kind == "FP16_UnfusedOptimizer":
        pairs = zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True)
        for index, (params, masters) in enumerate(pairs):
            for param, master in zip(params, masters, strict=True):
                layout = PerParamLayout.build([(name_of(names, param), param.numel())], 1)
                view.targets.append(FlatTarget(len(view.targets), index, layout, 0, param.numel()))
                view.fp32.append(master.data.view(-1))
                view.params.append(master)
                view.low_precision.append([param])
        return view
    for group_index, group in enumerate(wrapper.param_groups):
        for param in group["params"]:
            name = name_of(names, param)
            if param.dtype != torch.float32:
                raise UnsupportedCheckpointError(
                    f"ZeRO-0 engine param '{name}' is {param.dtype} under a bare "
                    f"{type(wrapper).__name__}; ucformat loads a bare optimizer's parameters "
                    "in fp32 (fp16 and bf16 run under DeepSpeed's fp16 wrappers or "
                    "BF16_Optimizer, which it loads)."
                )
            layout = PerParamLayout.build([(name, param.numel())], 1)
            target = FlatTarget(len(view.targets), group_index, layout, 0, param.numel())
            view.targets.append(target)
            view.fp32.append(param.data.view(-1))
            view.params.append(param)
            view.low_precision.append([])
    return view
