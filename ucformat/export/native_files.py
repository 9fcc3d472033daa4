"""Build the contents of each native DeepSpeed file, one rank at a time.

Every rank's flat buffers are filled by reading exactly the flat ranges its fragments cover
(``read_range``), with zeros everywhere else (ZeRO-1/2 alignment and tail padding, ZeRO-3
per-parameter padding). Only one rank's partitions are in memory at a time.

Dict keys and their order follow what DeepSpeed 0.19.8 writes for each optimizer wrapper
(``DeepSpeedZeroOptimizer.state_dict``, ``BF16_Optimizer.state_dict``,
``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict``; see the shared reference, sections 3 and 5).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ucformat.export.deepspeed_common import DeepSpeedClasses, flat_group_step
from ucformat.export.native_target import BF16_OPTIMIZER, FlatGroup, NativePlan
from ucformat.format.dtypes import torch_dtype
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE
from ucformat.layout.partition import PartitionedFlatLayout, ceil_div
from ucformat.read.checkpoint import UniversalCheckpoint

__all__ = ["RankFiles", "frozen_fragments"]


class RankFiles:
    """Builds the optimizer-states dict of each rank for one :class:`NativePlan`."""

    def __init__(
        self,
        ckpt: UniversalCheckpoint,
        plan: NativePlan,
        classes: DeepSpeedClasses,
        scaler: Any,
        dynamic: bool,
    ) -> None:
        self.ckpt = ckpt
        self.plan = plan
        self.classes = classes
        self.scaler = scaler
        self.dynamic = dynamic
        manifest = ckpt.manifest
        assert manifest.optimizer is not None
        self.state_keys = list(manifest.optimizer.state_keys)
        self.steps = [flat_group_step(manifest, g.members, "") for g in plan.flat_groups]
        self.hyperparams = [
            {k: decode(v) for k, v in group.hyperparams.items()}
            for group in manifest.optimizer.groups
        ]

    # --- flat buffers -------------------------------------------------------------------------
    def _flat(self, flat: FlatGroup, rank: int, state: str) -> torch.Tensor:
        """A rank's flat partition of ``state``: fragments read from the store, zeros elsewhere."""
        out = torch.zeros(flat.layout.partition_size, dtype=torch.float32)
        for fragment in flat.layout.fragments(rank):
            values = self.ckpt.read_range(
                fragment.name, state, fragment.param_start, fragment.param_stop
            )
            window = out[fragment.partition_start : fragment.partition_start + fragment.length]
            window.copy_(values)
        return out

    def _state(self, flat: FlatGroup, rank: int) -> dict[str, Any]:
        state: dict[str, Any] = {}
        step = self.steps[flat.index]
        if step is not None:
            state["step"] = step.clone() if isinstance(step, torch.Tensor) else step
        for key in self.state_keys:
            state[key] = self._flat(flat, rank, key)
        return state

    def _param_groups(self) -> list[dict[str, Any]]:
        members: list[list[int]] = [[] for _ in self.hyperparams]
        for flat in self.plan.flat_groups:
            members[flat.group].append(flat.index)
        return [{**hp, "params": ids} for hp, ids in zip(self.hyperparams, members, strict=True)]

    @property
    def payload_per_rank(self) -> int:
        """Tensor bytes of one rank's optimizer file (for progress)."""
        per_rank = sum(g.layout.partition_size for g in self.plan.flat_groups)
        return per_rank * 4 * (1 + len(self.state_keys))

    # --- one file -----------------------------------------------------------------------------
    def optimizer_file(self, rank: int) -> dict[str, Any]:
        """``{'optimizer_state_dict': ..., 'ds_config': ..., 'ds_version': ...}`` of ``rank``."""
        target = self.plan.target
        if target.stage == 3:
            inner = self._zero3(rank)
        elif target.wrapper == BF16_OPTIMIZER:
            inner = self._zero12(rank, bf16_optimizer=True)
        else:
            inner = self._zero12(rank, bf16_optimizer=False)
        return {
            "optimizer_state_dict": inner,
            "ds_config": target.ds_config,
            "ds_version": self.classes.version,
        }

    def _zero12(self, rank: int, *, bf16_optimizer: bool) -> dict[str, Any]:
        target = self.plan.target
        address = self.classes.fragment_address
        state: dict[int, dict[str, Any]] = {}
        fp32_parts: list[torch.Tensor] = []
        paddings: list[int] = []
        mappings: list[OrderedDict[str, Any]] = []
        last = rank == target.world_size - 1
        for flat in self.plan.flat_groups:
            layout = flat.layout
            assert isinstance(layout, PartitionedFlatLayout)  # ZeRO-1/2 plans hold only these
            fp32 = self._flat(flat, rank, FP32_STATE)
            valid = layout.valid_length(rank)
            if bf16_optimizer:  # unstripped; padding reported on the last rank only
                fp32_parts.append(fp32)
                paddings.append(layout.total - layout.used if last else 0)
            else:  # stripped of its tail padding
                fp32_parts.append(fp32[:valid].clone())
                paddings.append(layout.partition_size - valid)
            mappings.append(
                OrderedDict(
                    (f.name, address(numel=f.length, start=f.partition_start))
                    for f in layout.fragments(rank)
                )
            )
            state[flat.index] = self._state(flat, rank)
        base = {"state": state, "param_groups": self._param_groups()}
        groups = len(self.plan.flat_groups)
        if bf16_optimizer:
            return {
                "clip_grad": target.clip_grad,
                "base_optimizer_state": base,
                "single_partition_of_fp32_groups": fp32_parts,
                "group_paddings": paddings,
                "partition_count": [target.world_size] * groups,
                "ds_version": self.classes.version,
                "param_slice_mappings": mappings,
            }
        progress = self.ckpt.manifest.progress
        return {
            "loss_scaler": self.scaler,
            "dynamic_loss_scale": self.dynamic,
            "overflow": bool(progress.overflow),
            "clip_grad": target.clip_grad,
            "base_optimizer_state": base,
            "single_partition_of_fp32_groups": fp32_parts,
            "zero_stage": self.classes.zero_stage(target.stage),
            "group_paddings": paddings,
            "param_alignment_paddings": [list(g.paddings) for g in self.plan.flat_groups],
            "partition_count": [target.world_size] * groups,
            "ds_version": self.classes.version,
            "param_slice_mappings": mappings,
        }

    def _zero3(self, rank: int) -> dict[str, Any]:
        target = self.plan.target
        state = {flat.index: self._state(flat, rank) for flat in self.plan.flat_groups}
        fp32 = [self._flat(flat, rank, FP32_STATE) for flat in self.plan.flat_groups]
        return {
            "zero_stage": self.classes.zero_stage(3),
            "loss_scaler": self.scaler,
            "dynamic_loss_scale": self.dynamic,
            "overflow": bool(self.ckpt.manifest.progress.overflow),
            "partition_count": target.world_size,
            "optimizer_state_dict": {"state": state, "param_groups": self._param_groups()},
            "fp32_flat_groups": fp32,
        }


def frozen_fragments(
    ckpt: UniversalCheckpoint, names: list[str], lp_dtype: str, world_size: int, rank: int
) -> OrderedDict[str, torch.Tensor]:
    """ZeRO-3 ``frozen_param_fragments`` of ``rank``: each piece of ``ceil(n / ws)`` elements.

    Trailing padding of a piece (DeepSpeed leaves it uninitialised) is written as zeros.
    """
    dtype = torch_dtype(lp_dtype)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in names:
        numel = ckpt.manifest.params[name].numel
        piece = ceil_div(numel, world_size)
        values = torch.zeros(piece, dtype=dtype)
        lo, hi = min(rank * piece, numel), min((rank + 1) * piece, numel)
        if lo < hi:
            values[: hi - lo] = ckpt.read_range(name, FP32_STATE, lo, hi).to(dtype)
        out[name] = values
    return out
