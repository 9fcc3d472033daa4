"""The stages of a ZeRO-0 pipeline (no optimizer shards): each stage's positional optimizer named.

Without ZeRO, each stage of a ``PipelineModule`` saves its optimizer's ``state_dict()`` by
position in its ``mp_rank_{s:02d}_model_states.pt`` (a bare torch optimizer in fp32,
``FP16_UnfusedOptimizer`` / ``FP16_Optimizer`` in fp16: :mod:`.positional`), with
``param_shapes`` None: no stage names its parameters. The layer files
(``layer_{i:02d}-model_states.pt``, the 16-bit weights under each layer's own names) give the
candidates, named ``"<i>.<local>"`` (:mod:`ucformat.layout.pipeline`) and in layer order, the
order a ``PipelineModule`` registers them.

Algorithm: per stage, :func:`.positional.read_positional` names every position among all the
layers' parameters (fp16: each master's digest finds its weight; fp32: shapes, module order
inside one consistent group, refused where the files do not decide). A name two stages take is
a tied module (``TiedLayerSpec``) both stages hold; the caller compares the copies. DeepSpeed
saves a tied module's parameters in the layer file of its first use and never saves its key, so
they keep that layer's name (``"0.weight"`` rather than ``"tied_modules.<key>.weight"``);
the loader maps a ``PipelineEngine``'s tied names to it (:mod:`ucformat.deepspeed.pipeline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ucformat.errors import NotACheckpointError, UnsupportedCheckpointError
from ucformat.format.models import LossScaler
from ucformat.sources.deepspeed.positional import (
    decode_positional,
    loss_scale_config,
    read_positional,
)
from ucformat.sources.deepspeed.states import FlatStates
from ucformat.sources.torchfile import TensorRef, TorchFile

__all__ = ["Zero0Stages", "read_zero0_stages"]


class Zero0Stages:
    """What :func:`read_zero0_stages` recovers: per stage its named states, the wrapper's
    loss scale (fp16) and gradient clipping."""

    def __init__(
        self, flats: list[FlatStates], loss_scaler: LossScaler | None, clip_grad: float | None
    ) -> None:
        self.flats = flats
        self.loss_scaler = loss_scaler
        self.clip_grad = clip_grad


def _layer_weights(layers: Mapping[int, TorchFile], buffer_names: set[str]) -> dict[str, TensorRef]:
    weights: dict[str, TensorRef] = {}
    for index, handle in sorted(layers.items()):
        state = handle.obj
        if not isinstance(state, Mapping):
            raise NotACheckpointError(f"{handle.path}: not a layer state dict.")
        for local, value in state.items():
            name = f"{index}.{local}"
            if isinstance(value, TensorRef) and name not in buffer_names:
                weights[name] = value
    return weights


def read_zero0_stages(
    metas: Sequence[Mapping[str, Any]],
    models: Sequence[TorchFile],
    layers: Mapping[int, TorchFile],
    train_dtype: str,
) -> Zero0Stages:
    """Name each stage's positional optimizer state among the layer files' parameters.

    Raises:
        UnsupportedCheckpointError: a stage saved no optimizer, or the files leave a name
            ambiguous (:func:`.positional.read_positional`).
        LayoutMismatchError: the files contradict each other.
    """
    buffers = {str(n) for meta in metas for n in meta.get("buffer_names") or []}
    weights = _layer_weights(layers, buffers)
    flats: list[FlatStates] = []
    scaler: LossScaler | None = None
    clip: float | None = None
    for meta, handle in zip(metas, models, strict=True):
        if meta.get("optimizer") is None:
            raise UnsupportedCheckpointError(
                f"{handle.path}: no optimizer shards and no 'optimizer' entry; the stage was "
                "saved without an optimizer, ucformat converts training checkpoints."
            )
        opt = decode_positional(meta["optimizer"], handle)
        flats.append(read_positional(opt, weights, train_dtype, handle).flat)
        if opt.loss_scale and scaler is None:
            scaler, clip = loss_scale_config(opt.loss_scale), opt.clip_grad
    return Zero0Stages(flats, scaler, clip)
