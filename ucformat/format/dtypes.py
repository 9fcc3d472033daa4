"""Dtype names used in the manifest, and how each is stored in zarr.

The manifest names dtypes the way torch does without the ``torch.`` prefix (``float32``,
``bfloat16``, ``int64``, ``bool``). zarr v3 has no bfloat16, so bfloat16 values are stored as their
raw 16-bit patterns in a ``uint16`` array; every other dtype is stored as the numpy dtype of the
same name, little-endian.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported on first use: reading a manifest must not need it
    import torch

__all__ = [
    "DTYPE_NAMES",
    "dtype_name",
    "itemsize",
    "numpy_storage_dtype",
    "storage_to_torch",
    "torch_dtype",
    "torch_to_storage",
]

#: Every dtype name a manifest may use, as torch names them without the ``torch.`` prefix.
DTYPE_NAMES: tuple[str, ...] = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool",
)  # fmt: skip

_STORAGE_BY_NAME: dict[str, np.dtype[np.generic]] = {
    name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"
}
_STORAGE_BY_NAME["bfloat16"] = np.dtype("uint16")


@functools.cache
def _torch_by_name() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


@functools.cache
def _name_by_torch() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _torch_by_name().items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of a torch dtype; raise ``TypeError`` for unsupported ones."""
    try:
        return _name_by_torch()[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by ucformat") from None


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype of a manifest dtype name."""
    try:
        return _torch_by_name()[name]
    except KeyError:
        raise TypeError(f"unknown dtype name {name!r}; expected one of {DTYPE_NAMES}") from None


def numpy_storage_dtype(name: str) -> np.dtype[np.generic]:
    """Return the (little-endian) numpy dtype that stores values of dtype ``name`` in zarr."""
    return _STORAGE_BY_NAME[name].newbyteorder("<")


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``."""
    return _STORAGE_BY_NAME[name].itemsize


def torch_to_storage(tensor: torch.Tensor) -> np.ndarray:
    """View a CPU tensor as the numpy array zarr stores (bfloat16 as uint16 bit patterns)."""
    import torch

    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def storage_to_torch(array: np.ndarray, name: str) -> torch.Tensor:
    """Turn an array read from zarr back into a tensor of dtype ``name`` (no copy if possible)."""
    import torch

    array = np.ascontiguousarray(array)
    if name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
