"""Which flattened keys of a DCP checkpoint are model weights, optimizer states, param groups.

DCP's default planner flattens the saved dict with dots, so the user's top-level keys are
prefixes. Accepted layouts (docs/format.md, "Sources: PyTorch DCP"):

* ``{"model": get_model_state_dict(m), "optimizer" | "optim": get_optimizer_state_dict(m, o)}``
  with the optimizer dict nested (``state.<fqn>.<state>``, ``param_groups.<i>.<hp>`` with a
  ``params`` list of FQNs) or flattened (``flatten_optimizer_state_dict=True``:
  ``state.<fqn>.<state>``, ``param_groups.<fqn>.<hp>``);
* torchtitan's: the model's keys at the top level, next to ``"optimizer"``;
* Lightning's (``ModelParallelStrategy.save_checkpoint``): ``{"state_dict": ..., "optimizer_0":
  ...}`` (its ``meta.pt`` beside the folder holds the loop state);
* Accelerate's FSDP2 ``save_state``: two folders, ``pytorch_model_fsdp_0/`` (``{"model"}``) and
  ``optimizer_0/`` (``{"optimizer"}``), read as one key space
  (:mod:`~ucformat.sources.accelerate`).

``--model-key``/``--optimizer-key`` name other prefixes (``.`` for the top level). State and
hyper-parameter names never contain dots, so ``<fqn>.<name>`` splits at its last dot. Pure: no
I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ucformat.errors import NotACheckpointError, UnsupportedCheckpointError

__all__ = ["KNOWN_LAYOUTS", "TOP_LEVEL", "DcpLayout", "resembles", "split_layout"]

#: ``--model-key`` value naming the top level (torchtitan's model keys).
TOP_LEVEL = "."
_OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_0")
_MODEL_KEYS = ("model", "state_dict")
#: The framework layouts an unknown layout is compared with: name -> its top-level keys.
KNOWN_LAYOUTS: dict[str, frozenset[str]] = {
    "dcp.save of {'model', 'optimizer'} (FSDP2, HF Trainer)": frozenset({"model", "optimizer"}),
    "{'model', 'optim'}": frozenset({"model", "optim"}),
    "torchtitan (model keys at the top level + 'optimizer')": frozenset({"optimizer"}),
    "Lightning ModelParallelStrategy ('state_dict', 'optimizer_0')": frozenset(
        {"state_dict", "optimizer_0"}
    ),
    "Accelerate FSDP2 save_state (pytorch_model_fsdp_0/ 'model', optimizer_0/ 'optimizer')": (
        frozenset({"model", "optimizer"})
    ),
}


@dataclass
class DcpLayout:
    """The roles of a checkpoint's keys.

    Attributes:
        model_key: the model prefix (``"."``: top level).
        optimizer_key: the optimizer prefix, None if the checkpoint has no optimizer.
        nested: the optimizer's param groups are a list (``param_groups.<i>.*``).
        params: fqn -> key of its weight, in saving order.
        states: fqn -> optimizer state name -> key.
        groups: flat layout: fqn -> hyper-parameter -> key; nested: ``str(i)`` -> ... (with
            ``params``), both in saving order.
        other: every other key (client state).
        fused: owner -> the split weights it fuses (torchtitan's fuse_qkv, given a head
            dimension): the owner's state is in ``states``, its weights in ``params``.
        head_dim: the head dimension that rejoins fused weights (None: they are refused).
    """

    model_key: str
    optimizer_key: str | None
    nested: bool = False
    head_dim: int | None = None
    fused: dict[str, list[str]] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    states: dict[str, dict[str, str]] = field(default_factory=dict)
    groups: dict[str, dict[str, str]] = field(default_factory=dict)
    other: list[str] = field(default_factory=list)


def _under(keys: list[str], prefix: str) -> list[str]:
    return [k for k in keys if k.startswith(prefix + ".")]


def _top_level(keys: list[str]) -> list[str]:
    return sorted({k.split(".", 1)[0] for k in keys})


def resembles(top: list[str]) -> list[str]:
    """The known layouts sharing a top-level key with ``top`` (all of them if none does)."""
    found = set(top)
    close = [name for name, known in KNOWN_LAYOUTS.items() if known & found]
    return close or list(KNOWN_LAYOUTS)


def _unknown(where: str, keys: list[str], why: str) -> NotACheckpointError:
    top = _top_level(keys)
    shown = ", ".join(top[:12]) + (f" (+{len(top) - 12} more)" if len(top) > 12 else "")
    return NotACheckpointError(
        f"{where}: unknown DCP layout ({why}); top-level keys found: {shown or 'none'}; known "
        f"layouts it resembles: {'; '.join(resembles(top))}. Pass --model-key KEY and "
        "--optimizer-key KEY to name yours ('.' for the top level)."
    )


def _optimizer_key(keys: list[str], given: str | None, where: str) -> str | None:
    if given is not None:
        if not _under(keys, given):
            raise _unknown(where, keys, f"no keys under the optimizer key '{given}'")
        return given
    for name in _OPTIMIZER_KEYS:
        if any(k.startswith((f"{name}.state.", f"{name}.param_groups.")) for k in keys):
            return name
    return None


def _model_key(keys: list[str], tensors: set[str], optim: str | None) -> str | None:
    """``model``, ``state_dict`` (Lightning) or the top level: the one holding the FQNs the
    optimizer state names.

    Without optimizer state, the first of ``model``, ``state_dict`` that holds tensors. (An HF
    model saved torchtitan-style has top-level FQNs such as ``model.layers.0...``: the
    optimizer's FQNs tell them apart.)
    """
    owners = {
        k[len(f"{optim}.state.") :].rpartition(".")[0]
        for k in keys
        if optim and k.startswith(f"{optim}.state.")
    }
    holding = []
    for name in _MODEL_KEYS:
        nested = [k for k in _under(keys, name) if k in tensors]
        if owners and owners <= {k[len(name) + 1 :] for k in nested}:
            return name
        if nested:
            holding.append(name)
    if owners and owners <= tensors:
        return TOP_LEVEL
    return holding[0] if holding else None


def split_layout(
    keys: list[str],
    tensors: set[str],
    where: str,
    *,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    head_dim: int | None = None,
) -> DcpLayout:
    """Sort ``keys`` (flattened, in saving order; ``tensors`` are the tensor entries) by role.

    ``head_dim``: rejoin weights saved split under an optimizer state kept fused (torchtitan's
    ``fuse_qkv``) with heads of this many rows; None refuses such a checkpoint.

    Raises:
        NotACheckpointError: no layout fits (the message names the keys found and the options).
    """
    optim = _optimizer_key(keys, optimizer_key, where)
    optim_keys = set(_under(keys, optim)) if optim else set()
    if model_key is None:
        model_key = _model_key(keys, tensors, optim)
    if model_key is None and optim is not None:
        model_key = TOP_LEVEL  # torchtitan, if the optimizer's fqns are top-level tensors
    if model_key is None:
        raise _unknown(where, keys, "no 'model' weights and no optimizer")
    if model_key == TOP_LEVEL:
        params = {k: k for k in keys if k in tensors and k not in optim_keys}
    else:
        params = {k[len(model_key) + 1 :]: k for k in _under(keys, model_key) if k in tensors}
    if not params:
        raise _unknown(where, keys, f"no tensors under the model key '{model_key}'")
    layout = DcpLayout(model_key, optim, params=params, head_dim=head_dim)
    kinds: set[str] = set()
    for key in keys:
        if key in optim_keys:
            _optimizer_entry(layout, key, key[len(str(optim)) + 1 :], kinds, where, keys)
        elif key not in params.values():
            layout.other.append(key)
    if len(kinds) > 1:
        raise _unknown(where, keys, "param groups are both a list and keyed by FQN")
    layout.nested = kinds == {"nested"}
    if model_key == TOP_LEVEL and optim is not None and not (layout.states or layout.groups):
        raise _unknown(where, keys, f"the '{optim}' key holds no state or param groups")
    return layout


def _fused_siblings(owner: str, params: dict[str, str]) -> list[str]:
    """Weights that ``owner`` fuses: ``a.wq.weight``, ``a.wk.weight``, ``a.wv.weight`` for
    ``a.wqkv.weight`` (same parent and leaf, module names ``<p><s1>``, ``<p><s2>``, ... whose
    suffixes, in saving order, spell the owner's ``<p><s1><s2>...``)."""
    parent, _, rest = owner.rpartition(".")
    module_path, _, leaf = parent.rpartition(".")
    fused = leaf
    siblings = [
        name
        for name in params
        if name.rpartition(".")[2] == rest
        and name.rpartition(".")[0].rpartition(".")[0] == module_path
    ]
    modules = [name.rpartition(".")[0].rpartition(".")[2] for name in siblings]
    for cut in range(1, len(fused)):
        stem, left = fused[:cut], fused[cut:]
        parts = []
        for index, module in enumerate(modules):
            suffix = module[cut:]
            if module.startswith(stem) and suffix and left.startswith(suffix):
                parts.append(siblings[index])
                left = left[len(suffix) :]
        if len(parts) > 1 and not left:
            return parts
    return []


def _optimizer_entry(
    layout: DcpLayout, key: str, rest: str, kinds: set[str], where: str, keys: list[str]
) -> None:
    section, _, body = rest.partition(".")
    owner, _, name = body.rpartition(".")
    if section == "state" and owner:
        if owner not in layout.params and owner not in layout.fused:
            fused = _fused_siblings(owner, layout.params)
            if fused and layout.head_dim is None:
                raise UnsupportedCheckpointError(
                    f"{where}: the weights are saved split ({', '.join(fused)}) but the optimizer "
                    f"state is under the fused '{owner}' (torchtitan's fuse_qkv state-dict hook: "
                    "the fused rows interleave per KV head, which the checkpoint does not record); "
                    "pass --head-dim N (the model's head dimension, torchtitan's dim // n_heads) "
                    "to rejoin them."
                )
            if fused:
                layout.fused[owner] = fused
                layout.states.setdefault(owner, {})[name] = key
                return
            raise NotACheckpointError(
                f"{where}: optimizer state '{key}' belongs to '{owner}', which is not a weight of "
                f"the model section '{layout.model_key}'"
                + (
                    "; the optimizer state is keyed by parameter index (optimizer.state_dict()): "
                    "save it with get_optimizer_state_dict(model, optimizer) instead."
                    if owner.isdigit()
                    else "; pass --model-key to name the model's prefix."
                )
            )
        layout.states.setdefault(owner, {})[name] = key
    elif section == "param_groups" and owner:
        if owner not in layout.params and layout.head_dim is not None:
            fused = _fused_siblings(owner, layout.params)
            if fused:
                layout.fused.setdefault(owner, fused)
        if owner in layout.params or owner in layout.fused:
            kinds.add("flat")
        elif owner.isdigit():
            kinds.add("nested")
        else:
            raise _unknown(where, keys, f"param group entry '{key}' names no model weight")
        layout.groups.setdefault(owner, {})[name] = key
    else:
        layout.other.append(key)
