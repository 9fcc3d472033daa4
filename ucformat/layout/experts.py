"""Expert-parallel arithmetic of DeepSpeed native MoE: which rank holds which global experts.

``deepspeed.moe.layer.MoE(num_experts=E, ep_size=ep)`` gives every rank ``E / ep`` *local*
experts, named ``...deepspeed_experts.{l}...`` for ``l`` in ``[0, E / ep)``. A rank's
expert-parallel (EP) rank ``e`` decides which global experts they are: ``e * (E / ep) + l``.
With ``W`` ranks, DeepSpeed's default order ("E + D") puts EP groups on consecutive ranks, so
rank ``r`` has EP rank ``r % ep`` and expert-data-parallel rank ``r // ep``;
``use_data_before_expert_parallelism`` ("D + E") swaps them: EP rank ``r // (W / ep)``,
expert-data-parallel rank ``r % (W / ep)``.
The expert parameters of one EP rank are replicated (ZeRO-0) or ZeRO-partitioned over its
``W / ep`` expert-data-parallel ranks.

Plain integer and string arithmetic: no files, tensors or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ucformat.errors import LayoutMismatchError

__all__ = [
    "EXPERTS_KEY",
    "ExpertRanks",
    "expert_id",
    "with_expert_id",
]

#: The module path component before an expert's id in DeepSpeed MoE parameter names.
EXPERTS_KEY = ".deepspeed_experts."


def expert_id(name: str) -> tuple[str, int, str] | None:
    """Split an expert parameter name into (layer prefix, expert id, param suffix); None if
    ``name`` is not an expert parameter.

    >>> expert_id("moe1.deepspeed_moe.experts.deepspeed_experts.3.up.weight")
    ('moe1.deepspeed_moe.experts.deepspeed_experts', 3, 'up.weight')
    """
    head, sep, tail = name.partition(EXPERTS_KEY)
    if not sep:
        return None
    index, dot, rest = tail.partition(".")
    if not index.isdigit() or not dot or not rest:
        return None
    return head + EXPERTS_KEY[:-1], int(index), rest


def with_expert_id(name: str, new_id: int) -> str:
    """``name`` with its expert id replaced by ``new_id`` (unchanged if not an expert param)."""
    parts = expert_id(name)
    if parts is None:
        return name
    prefix, _, rest = parts
    return f"{prefix}.{new_id}.{rest}"


@dataclass(frozen=True)
class ExpertRanks:
    """The expert-parallel layout of ``world_size`` ranks with ``ep_size`` and ``num_experts``
    experts per MoE layer."""

    world_size: int
    ep_size: int
    num_experts: int
    data_before_expert: bool = False

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise LayoutMismatchError(
                f"ep_size {self.ep_size} does not divide the world size {self.world_size}."
            )
        if self.num_experts % self.ep_size:
            raise LayoutMismatchError(
                f"ep_size {self.ep_size} does not divide the {self.num_experts} experts of a layer."
            )

    @property
    def num_local(self) -> int:
        """Experts per rank and layer."""
        return self.num_experts // self.ep_size

    @property
    def expert_dp_size(self) -> int:
        """Ranks sharing one EP rank's experts (their ZeRO partition count)."""
        return self.world_size // self.ep_size

    def ep_rank(self, rank: int) -> int:
        """The EP rank of global rank ``rank``."""
        if self.data_before_expert:
            return rank // self.expert_dp_size
        return rank % self.ep_size

    def expert_dp_rank(self, rank: int) -> int:
        """The rank's index among the ranks holding the same experts."""
        if self.data_before_expert:
            return rank % self.expert_dp_size
        return rank // self.ep_size

    def global_id(self, ep_rank: int, local_id: int) -> int:
        """The global id of EP rank ``ep_rank``'s local expert ``local_id``."""
        if not 0 <= local_id < self.num_local:
            raise LayoutMismatchError(
                f"local expert id {local_id} is outside [0, {self.num_local}) "
                f"({self.num_experts} experts over ep_size {self.ep_size})."
            )
        return ep_rank * self.num_local + local_id

    def global_name(self, rank: int, local_name: str) -> str:
        """Global name of a local expert parameter name of rank ``rank`` (others unchanged)."""
        parts = expert_id(local_name)
        if parts is None:
            return local_name
        return with_expert_id(local_name, self.global_id(self.ep_rank(rank), parts[1]))
