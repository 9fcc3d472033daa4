"""What a source reader produces: a format-neutral description of a checkpoint.

A reader (today only DeepSpeed ZeRO) opens its files, decodes their metadata and describes, for
every array the store will hold, which runs of which on-disk tensors fill which flat ranges of
it. No tensor bytes are read here; the converter's planner and writer do that.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ucformat.errors import LayoutMismatchError
from ucformat.format.dtypes import dtype_name
from ucformat.format.experts import ExpertLayout
from ucformat.format.megatron import MegatronLayout
from ucformat.format.models import (
    ClientState,
    OptimizerInfo,
    ScalarState,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.pyvalue import describe_type
from ucformat.format.spec import VALUE_STATE
from ucformat.format.tensor_parallel import TensorParallelInfo
from ucformat.sources.torchfile import TensorRef, TorchFile

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "ArraySource",
    "FragmentTensor",
    "PartitionSource",
    "SourceCheckpoint",
    "SourceFragment",
    "SourceParam",
    "frozen_param",
    "optimizer_steps",
    "scalar_state",
    "split_state",
]


class FragmentTensor(Protocol):
    """What the writer needs of a fragment's tensor.

    A :class:`~ucformat.sources.torchfile.TensorRef` (bytes in a file), or a tensor in memory
    (a live save: :class:`ucformat.sources.live.MemoryTensor`).
    """

    @property
    def dtype_name(self) -> str:
        """The manifest's name of the tensor's dtype."""
        ...

    def is_contiguous(self) -> bool:
        """Whether the elements are one row-major run."""
        ...

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy flat elements ``[start, stop)`` into ``out`` (storage dtype)."""
        ...

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Copy flat elements from ``start`` on into the byte ``views``, one after another."""
        ...

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        ...


@dataclass(frozen=True)
class SourceFragment:
    """Flat elements ``[start, start + length)`` of an array come from ``tensor[tensor_start:]``."""

    tensor: FragmentTensor
    tensor_start: int
    start: int
    length: int


@dataclass
class ArraySource:
    """One array to write: its shape, dtype and the fragments that fill it."""

    shape: tuple[int, ...]
    dtype: str
    fragments: list[SourceFragment] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass
class SourceParam:
    """A parameter of the source model with its state arrays and scalars.

    ``arrays`` hold elementwise states (the parameter's shape); ``whole`` the optimizer states
    kept whole in a shape of their own (format 3.1 ``whole_states``).
    """

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    group: int | None
    arrays: dict[str, ArraySource] = field(default_factory=dict)
    scalars: dict[str, ScalarState] = field(default_factory=dict)
    whole: dict[str, ArraySource] = field(default_factory=dict)


@dataclass
class PartitionSource:
    """A state kept once per flat partition of a param group (format 3.1 ``partition_states``):
    partition ``p``'s tensor is row ``p`` of ``array``; ``replicated`` when all rows are equal."""

    array: ArraySource
    replicated: bool


def optimizer_steps(params: Mapping[str, SourceParam]) -> int:
    """The optimizer steps a checkpoint has taken, from its parameters' ``step`` states: the
    largest (a parameter added to the optimizer later has fewer); 0 when none records one."""
    steps = [
        scalar.value for param in params.values() for key, scalar in param.scalars.items()
        if key == "step" and not isinstance(scalar.value, bool)
    ]  # fmt: skip
    return int(max(steps, default=0))


@dataclass
class SourceCheckpoint:
    """A whole source checkpoint, described but not yet read."""

    source: SourceInfo
    params: dict[str, SourceParam]
    buffers: dict[str, ArraySource]
    tied: dict[str, str]
    optimizer: OptimizerInfo | None
    progress: TrainingProgress
    client_state: ClientState
    files: list[TorchFile] = field(default_factory=list, repr=False)
    #: Expert-parallel (MoE) layout; None for a dense checkpoint.
    experts: ExpertLayout | None = None
    #: Called by :meth:`close` after the files: releases what a reader shares between them
    #: (the DCP reader's one descriptor per data file).
    closers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    #: The Megatron-Core layout (``manifest.megatron``), for a ``torch_dist`` source.
    megatron: MegatronLayout | None = None
    #: How the source split parameters over tensor-parallel ranks (None: it did not).
    tensor_parallel: TensorParallelInfo | None = None
    #: Per optimizer group, its states kept once per flat partition (ZeRO-1/2), by key.
    partition_states: dict[int, dict[str, PartitionSource]] = field(default_factory=dict)

    def check_integrity(self) -> int:
        """Check every storage member read so far against its file's zip CRC-32.

        Returns the number of members checked.

        Raises:
            SourceChecksumError: a source file was damaged after it was written.
        """
        return sum(handle.check_integrity() for handle in self.files)

    def close(self) -> None:
        """Close every open source file."""
        for handle in self.files:
            handle.close()
        for closer in self.closers:
            closer()
        self.closers.clear()

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def frozen_param(array: ArraySource) -> SourceParam:
    """A parameter the optimizer does not train: its value only, no group, no state."""
    return SourceParam(
        shape=array.shape,
        dtype=array.dtype,
        requires_grad=False,
        group=None,
        arrays={VALUE_STATE: array},
    )


def scalar_state(value: Any, where: str) -> ScalarState:
    """Describe a 0-d optimizer state (python number or 0-d tensor) exactly.

    Raises:
        TypeError: ``value`` is neither (the message names ``where``).
    """
    if isinstance(value, bool):
        return ScalarState(kind="bool", value=value)
    if isinstance(value, int):
        return ScalarState(kind="int", value=value)
    if isinstance(value, float):
        return ScalarState(kind="float", value=value)
    if isinstance(value, TensorRef) and value.numel == 1 and not value.shape:
        return _tensor_scalar(value.item(), value.dtype_name)
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    if torch is not None and isinstance(value, torch.Tensor) and value.dim() == 0:
        return _tensor_scalar(value.item(), dtype_name(value.dtype))
    raise TypeError(f"{where}: expected a scalar optimizer state, found {describe_type(value)}")


def split_state(
    state: Mapping[Any, Any], where: str, size: int | None = None
) -> tuple[dict[str, Any], dict[str, ScalarState]]:
    """One parameter group's (or flat partition's) optimizer state: 1-D tensors, then scalars.

    A 1-D value (:class:`TensorRef` in a file, or a live ``torch.Tensor``) is a flat state and
    must have ``size`` elements where ``size`` is given; every other value must be a scalar
    state (:func:`scalar_state`).

    Raises:
        LayoutMismatchError: a flat state of another length, or a value that is neither; the
            message starts with ``where`` and names the key.
    """
    arrays: dict[str, Any] = {}
    scalars: dict[str, ScalarState] = {}
    for key, value in state.items():
        length = _flat_length(value)
        if length is None:
            try:
                scalars[str(key)] = scalar_state(value, f"{where} '{key}'")
            except TypeError as exc:
                raise LayoutMismatchError(str(exc)) from None
            continue
        if size is not None and length != size:
            raise LayoutMismatchError(f"{where} '{key}' has {length} elements, expected {size}.")
        arrays[str(key)] = value
    return arrays, scalars


def _flat_length(value: Any) -> int | None:
    """The element count of a 1-D tensor (file or live), None for anything else."""
    if isinstance(value, TensorRef):
        return value.numel if len(value.shape) == 1 else None
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    if torch is not None and isinstance(value, torch.Tensor) and value.dim() == 1:
        return int(value.numel())
    return None


def _tensor_scalar(value: Any, dtype: str) -> ScalarState:
    """A 0-d tensor's state; pydantic checks that ``dtype`` is a manifest dtype name."""
    return ScalarState.model_validate({"kind": "tensor", "value": value, "dtype": dtype})
