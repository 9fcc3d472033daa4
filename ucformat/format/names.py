"""Names as the model knows them: the wrapper prefixes PyTorch's own state-dict helpers strip.

Wrapping a module to change how it runs adds a path component to every name below it:

* ``_checkpoint_wrapped_module``: ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``
  (activation checkpointing, torchtitan's default);
* ``_orig_mod``: ``torch.compile`` of a module (``OptimizedModule``);
* ``_fsdp_wrapped_module``: FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``).

``torch.distributed.checkpoint.state_dict.get_model_state_dict`` drops all three, so a model
saved through it carries the unwrapped names. ucformat stores these names too (on convert and on
save) and matches a live model's wrapped names against them on load. The rule: drop every
dot-separated component equal to one of the names above. DDP's ``module.`` is not dropped (a
submodule may be called ``module``). Pure: no I/O, stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from ucformat.errors import InvalidNameError

__all__ = ["WRAPPER_COMPONENTS", "model_name", "model_named"]

#: Path components a wrapper module adds (see the module docstring).
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

_T = TypeVar("_T")


def model_name(name: str) -> str:
    """``name`` without wrapper components (itself when it has none).

    Example:
        >>> model_name("layers.0._checkpoint_wrapped_module.attention.wq.weight")
        'layers.0.attention.wq.weight'
        >>> model_name("_orig_mod.head.weight")
        'head.weight'
    """
    if "_" not in name:
        return name
    parts = name.split(".")
    kept = [part for part in parts if part not in WRAPPER_COMPONENTS]
    return name if len(kept) == len(parts) else ".".join(kept)


def model_named(items: Iterable[tuple[str, _T]], what: str = "names") -> dict[str, _T]:
    """``{model_name(name): value}`` in the order given.

    Raises:
        InvalidNameError: two names differ only by wrapper components.
    """
    out: dict[str, _T] = {}
    original: dict[str, str] = {}
    for name, value in items:
        clean = model_name(name)
        if clean in out:
            raise InvalidNameError(
                f"{what}: '{original[clean]}' and '{name}' are both '{clean}' without their "
                f"wrapper components ({', '.join(sorted(WRAPPER_COMPONENTS))}); rename one of "
                "the modules."
            )
        out[clean] = value
        original[clean] = name
    return out
