"""The tensors a live save describes: where each fragment's bytes are while the job runs.

A live save (:mod:`ucformat.deepspeed.save`, :mod:`ucformat.torch.save`) is planned as a
conversion whose source is memory. Every rank describes every fragment of the job; a fragment
this rank holds points at a :class:`MemoryTensor` (a zero-copy byte view of a host tensor, read
by the shard writer as a file tensor is), one held by another rank at a :class:`RemoteTensor`
(planned with, never read here: the writer receives its bytes). :class:`HostCopies` brings this
rank's tensors to host memory first (device tensors always; every tensor for an asynchronous
save, which must not see later training steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ucformat.format.dtypes import itemsize

if TYPE_CHECKING:
    import torch

__all__ = ["HostCopies", "MemoryTensor", "RemoteTensor"]


class MemoryTensor:
    """A 1-D tensor in this rank's host memory, read by the shard writer as a file tensor is.

    ``data`` is the tensor's bytes (a ``uint8`` view: no copy); ``rank`` is the rank holding it.
    """

    def __init__(self, data: np.ndarray, dtype_name: str, rank: int) -> None:
        self.data = data
        self.rank = rank
        self._dtype_name = dtype_name
        self.item = itemsize(dtype_name)
        self.numel = data.size // self.item

    @classmethod
    def of(cls, tensor: torch.Tensor, rank: int) -> MemoryTensor:
        """Wrap a contiguous CPU tensor (its bytes are shared, not copied)."""
        import torch

        from ucformat.format.dtypes import dtype_name

        flat = tensor.detach().reshape(-1)
        if flat.device.type != "cpu" or not flat.is_contiguous():
            raise ValueError("MemoryTensor needs a contiguous CPU tensor")
        return cls(flat.view(torch.uint8).numpy(), dtype_name(tensor.dtype), rank)

    @property
    def dtype_name(self) -> str:
        """The manifest's name of the dtype."""
        return self._dtype_name

    def is_contiguous(self) -> bool:
        """Always: the bytes are one run."""
        return True

    def _span(self, start: int, count: int) -> np.ndarray:
        if not 0 <= start <= start + count <= self.numel:
            raise ValueError(
                f"elements [{start}, {start + count}) requested from a tensor of {self.numel}"
            )
        return self.data[start * self.item : (start + count) * self.item]

    def memory_span(self, start: int, count: int) -> np.ndarray:
        """The bytes of elements ``[start, start + count)`` in place (``uint8``, no copy): the
        shard encoder reads box chunks straight from them."""
        return self._span(start, count)

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy elements ``[start, stop)`` into ``out`` (storage dtype)."""
        out.reshape(-1).view(np.uint8)[:] = self._span(start, stop - start)

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Copy elements from ``start`` on into ``views``, one after another."""
        source = self._span(start, sum(len(v) for v in views) // self.item)
        at = 0
        for view in views:
            np.frombuffer(view, dtype=np.uint8)[:] = source[at : at + len(view)]
            at += len(view)

    def load(self) -> torch.Tensor:
        """A copy of the whole tensor."""
        import torch

        from ucformat.format.dtypes import torch_dtype

        return torch.frombuffer(bytearray(self.data.tobytes()), dtype=torch_dtype(self.dtype_name))

    def segment(self, start: int, count: int) -> np.ndarray:
        """The bytes of elements ``[start, start + count)`` (a view)."""
        return self._span(start, count)


class RemoteTensor:
    """A tensor held by another rank: planned with, never read here."""

    def __init__(self, rank: int, dtype_name: str) -> None:
        self.rank = rank
        self._dtype_name = dtype_name

    @property
    def dtype_name(self) -> str:
        """The manifest's name of the dtype."""
        return self._dtype_name

    def is_contiguous(self) -> bool:
        """As the holder's tensor."""
        return True

    def _refuse(self) -> None:
        raise RuntimeError(
            f"bytes held by rank {self.rank} were read before they were received (a bug)"
        )

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Never: the bytes are on another rank."""
        self._refuse()

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Never: the bytes are on another rank."""
        self._refuse()

    def load(self) -> torch.Tensor:
        """Never: the bytes are on another rank."""
        self._refuse()
        raise AssertionError


@dataclass
class HostCopies:
    """How this rank's tensors reach host memory for the writer.

    ``always``: copy every tensor (an asynchronous save must not see later training steps);
    otherwise CPU tensors are used in place and only device tensors are copied. Copies of
    device tensors go to pinned (page-locked) memory when ``pin`` says so (default: CUDA is
    available), copied asynchronously (``non_blocking``) and waited for once, in :meth:`wait`.
    """

    always: bool
    nbytes: int = 0
    #: Bytes of the copies in pinned memory (device tensors staged for the writer).
    pinned_bytes: int = 0
    #: Whether copies of device tensors are pinned; None: when CUDA is available.
    pin: bool | None = None
    _pending: list[torch.Tensor] = field(default_factory=list)

    def host(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor`` flattened, in host memory, in ``dtype`` (default its own; a copy when
        needed)."""
        import torch

        flat = tensor.detach().reshape(-1)
        target = flat.dtype if dtype is None else dtype
        local = flat.device.type == "cpu" and flat.dtype == target and flat.is_contiguous()
        if local and not self.always:
            return flat
        pin = torch.cuda.is_available() if self.pin is None else self.pin
        pinned = flat.device.type != "cpu" and pin
        copy = torch.empty(flat.numel(), dtype=target, pin_memory=pinned)
        copy.copy_(flat, non_blocking=pinned)
        size = copy.numel() * copy.element_size()
        self.nbytes += size
        if pinned:
            self.pinned_bytes += size
            self._pending.append(copy)
        return copy

    def wait(self) -> None:
        """Wait for the device-to-host copies still in flight."""
        if self._pending:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._pending.clear()
