"""A described checkpoint under the names the model knows (wrapper components dropped).

Readers report names as their files or the live module give them; a checkpoint-wrapped,
compiled or FSDP1-wrapped model gives ``..._checkpoint_wrapped_module...``, ``_orig_mod...``,
``..._fsdp_wrapped_module...``. :func:`unwrap_names` renames params, buffers, tied aliases and
optimizer group members by :func:`ucformat.format.names.model_name`, before anything is planned.
"""

from __future__ import annotations

from ucformat.format.names import model_name, model_named
from ucformat.sources.base import SourceCheckpoint, SourceParam

__all__ = ["unwrap_names"]


def unwrap_names(ckpt: SourceCheckpoint) -> SourceCheckpoint:
    """Rename ``ckpt``'s entries in place (a no-op without wrapper components); return it.

    On an error ``ckpt`` is closed.

    Raises:
        InvalidNameError: two names differ only by wrapper components.
    """
    names = [*ckpt.params, *ckpt.buffers, *ckpt.tied]
    if all(model_name(n) == n for n in names):
        return ckpt
    where = ckpt.source.path or "checkpoint"
    try:
        _rename(ckpt, where)
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def _without_copies(params: dict[str, SourceParam]) -> list[tuple[str, SourceParam]]:
    """Drop a frozen entry that is a trainable parameter's copy under its unwrapped name.

    A DeepSpeed checkpoint of a checkpoint-wrapped model lists the parameter under its wrapped
    name (``param_shapes``, from ``named_parameters()``) and under the unwrapped one (the module
    file, from ``state_dict()``, whose wrapper hook strips the component): one tensor, two
    names.
    """
    trainable = {
        model_name(name): param
        for name, param in params.items()
        if param.group is not None and model_name(name) != name
    }
    return [
        (name, param)
        for name, param in params.items()
        if not (name in trainable and param.group is None and param.shape == trainable[name].shape)
    ]


def _rename(ckpt: SourceCheckpoint, where: str) -> None:
    ckpt.params = model_named(_without_copies(ckpt.params), where)
    ckpt.buffers = model_named(ckpt.buffers.items(), where)
    ckpt.tied = {model_name(a): model_name(o) for a, o in ckpt.tied.items()}
    model_named([(n, None) for n in [*ckpt.params, *ckpt.buffers, *ckpt.tied]], where)
    if ckpt.optimizer is not None:  # frozen models: renamed copies
        groups = [
            group.model_copy(update={"params": [model_name(n) for n in group.params]})
            for group in ckpt.optimizer.groups
        ]
        ckpt.optimizer = ckpt.optimizer.model_copy(update={"groups": groups})
