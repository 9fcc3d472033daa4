"""ucformat: universal checkpoints for DeepSpeed ZeRO, Megatron-Core and PyTorch DCP/FSDP2.

Convert per-rank checkpoint shards into a zarr v3 store of per-parameter arrays described by a
pydantic manifest, then load it at any world size and layout, each rank reading only the bytes
of its own part.

>>> manifest = ucformat.convert("runs/gpt/global_step800", "ckpt.ucf")  # doctest: +SKIP
>>> ckpt = ucformat.open("ckpt.ucf")  # doctest: +SKIP
>>> ckpt.read("layers.0.weight", "exp_avg")  # doctest: +SKIP
>>> ucformat.verify("ckpt.ucf", against="runs/gpt/global_step800").ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from ucformat._version import __version__

if TYPE_CHECKING:
    from ucformat.errors import UCFormatError
    from ucformat.format.models import CheckpointManifest
    from ucformat.read.checkpoint import UniversalCheckpoint
    from ucformat.read.checkpoint import open_checkpoint as open
    from ucformat.verify import VerifyReport, verify
    from ucformat.write.convert import convert

#: The public names, each imported from its module on first access, so that ``import ucformat``
#: costs nothing until something is used: ``ucformat inspect`` imports neither torch nor zarr,
#: and nothing here ever imports DeepSpeed.
_LAZY_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "CheckpointManifest": ("ucformat.format.models", "CheckpointManifest"),
    "UCFormatError": ("ucformat.errors", "UCFormatError"),
    "UniversalCheckpoint": ("ucformat.read.checkpoint", "UniversalCheckpoint"),
    "VerifyReport": ("ucformat.verify", "VerifyReport"),
    "convert": ("ucformat.write.convert", "convert"),
    "open": ("ucformat.read.checkpoint", "open_checkpoint"),
    "verify": ("ucformat.verify", "verify"),
}

#: Submodules reached as attributes (``ucformat.deepspeed.load``) and imported on first access.
_LAZY_SUBMODULES = frozenset({"deepspeed", "export", "megatron", "torch"})


def __getattr__(name: str) -> object:
    if name in _LAZY_ATTRIBUTES:
        module, attribute = _LAZY_ATTRIBUTES[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"ucformat.{name}")
    raise AttributeError(f"module 'ucformat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_ATTRIBUTES, *_LAZY_SUBMODULES})


class _Package(types.ModuleType):
    """``ucformat.convert`` and ``ucformat.verify`` are the functions, as the API promises.

    Importing the submodule of the same name (``from ucformat.write.convert import ConvertHooks``)
    makes Python set the package attribute to the submodule; that assignment is dropped here,
    so the lazy :func:`__getattr__` keeps answering with the function.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY_ATTRIBUTES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "CheckpointManifest",
    "UCFormatError",
    "UniversalCheckpoint",
    "VerifyReport",
    "__version__",
    "convert",
    "open",
    "verify",
]
