"""Dtype names used in the manifest, and how each is stored in zarr.

The manifest names dtypes the way torch does without the ``torch.`` prefix (``float32``,
``bfloat16``, ``int64``, ``bool``). zarr v3 has no bfloat16, so bfloat16 values are stored as their
raw 16-bit patterns in a ``uint16`` array; every other dtype is stored as the numpy dtype of the
same name, little-endian.
"""

from __future__ import annotations

import numpy as np
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

_TORCH_BY_NAME: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAME_BY_TORCH = {v: k for k, v in _TORCH_BY_NAME.items()}
DTYPE_NAMES: tuple[str, ...] = tuple(_TORCH_BY_NAME)

_STORAGE_BY_NAME: dict[str, np.dtype[np.generic]] = {
    name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"
}
_STORAGE_BY_NAME["bfloat16"] = np.dtype("uint16")


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of a torch dtype; raise ``TypeError`` for unsupported ones."""
    try:
        return _NAME_BY_TORCH[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by ucformat") from None


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype of a manifest dtype name."""
    try:
        return _TORCH_BY_NAME[name]
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
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def storage_to_torch(array: np.ndarray, name: str) -> torch.Tensor:
    """Turn an array read from zarr back into a tensor of dtype ``name`` (no copy if possible)."""
    array = np.ascontiguousarray(array)
    if name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
