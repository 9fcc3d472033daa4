"""ucformat: universal checkpoints for DeepSpeed ZeRO.

Convert per-rank ZeRO shards into a zarr v3 store of per-parameter arrays described by a
pydantic manifest, then load it at any world size and ZeRO stage, each rank reading only the
bytes of its own partition.

>>> manifest = ucformat.convert("runs/gpt/global_step800", "ckpt.ucf")  # doctest: +SKIP
>>> ckpt = ucformat.open("ckpt.ucf")  # doctest: +SKIP
>>> ckpt.read("layers.0.weight", "exp_avg")  # doctest: +SKIP
>>> ucformat.verify("ckpt.ucf", against="runs/gpt/global_step800").ok  # doctest: +SKIP
True
"""

from __future__ import annotations

from ucformat._version import __version__
from ucformat.convert import convert
from ucformat.errors import UCFormatError
from ucformat.models import CheckpointManifest
from ucformat.reader import UniversalCheckpoint
from ucformat.reader import open_checkpoint as open
from ucformat.verify import VerifyReport, verify

#: Submodules imported on first access (``ucformat.deepspeed.load``), so that ``import ucformat``
#: stays light and never imports DeepSpeed.
_LAZY_SUBMODULES = frozenset({"deepspeed", "export", "torch"})


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"ucformat.{name}")
    raise AttributeError(f"module 'ucformat' has no attribute {name!r}")


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
