"""Read a Megatron-Core ``torch_dist`` checkpoint (``dist_checkpointing.save``) into a
``SourceCheckpoint``.

What Megatron-Core writes: a PyTorch DCP folder (``.metadata``, ``__<rank>_<n>.distcp``) whose
keys are its ShardedTensor keys, plus ``common.pt`` (the state that is not sharded: the
optimizer's param groups, ``iteration``, Megatron-LM's training ``args``) and ``metadata.json``
(``{"sharded_backend": "torch_dist", ...}``). Facts used (Megatron-Core 0.16.1):

* each ShardedTensor chunk is a box of the global tensor at its global offsets (DCP's chunks);
* the transformer block prepends a layer axis: ``decoder.layers.<rest>`` has shape
  ``(num_layers, *param shape)``; every layer is its own chunk row;
* ``linear_qkv`` is stored at its TP=1 layout: per query group, the group's query heads, its key
  head, its value head along dim 0 (each TP rank holds whole groups); SwiGLU ``linear_fc1`` is
  stored as the whole gate projection then the whole up projection (each half TP-split);
* the distributed optimizer's ``fully_reshardable`` format stores, per parameter, tensors of the
  parameter's shape under ``optimizer.state.<state>.<key>`` (``param`` is the fp32 master) and the
  step in ``common.pt``'s param groups; ``dp_reshardable`` stores Megatron's flat per-bucket
  buffers (``optimizer.distributed.*``), reshardable along data parallelism only.

Algorithm: decode ``.metadata`` and ``common.pt`` under the allow-list; sort tensor keys into
weights and optimizer states; split every layer-axis key into one parameter per layer
(``decoder.layers.<i>.<rest>``), whose fragments are the layer's rows of the chunks; describe
fused parameters from the training args; rebuild param group membership by Megatron's default
rule (no weight decay for biases and 1-D parameters). Only reshardable optimizer state is
converted; otherwise the store is model-only and ``manifest.megatron`` says why.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ucformat.errors import LayoutMismatchError, NotACheckpointError, UnsupportedCheckpointError
from ucformat.format.megatron import MegatronChunk, MegatronFused, MegatronLayout, MegatronParam
from ucformat.format.models import (
    ClientState,
    OptimizerGroup,
    OptimizerInfo,
    ScalarState,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.pyvalue import describe_type, encode
from ucformat.format.spec import FP32_STATE
from ucformat.format.training_values import NotStored, encode_client_state
from ucformat.layout.boxes import chunk_runs
from ucformat.sources.base import ArraySource, SourceCheckpoint, SourceFragment, SourceParam
from ucformat.sources.dcp import DcpItems
from ucformat.sources.dcp_metadata import (
    METADATA_NAME,
    DcpMetadata,
    DcpTensor,
    read_dcp_metadata,
)
from ucformat.sources.safe_unpickle import PicklePolicy, StandIn
from ucformat.sources.torchfile import open_torch_file

__all__ = ["is_megatron_folder", "read_megatron_checkpoint"]

COMMON_NAME = "common.pt"
METADATA_JSON = "metadata.json"
LAYER_PREFIX = "decoder.layers."
_OPTIMIZER_STATE = "optimizer.state."
#: The distributed optimizer's formats that hold per-parameter state in model space.
#: (``fully_sharded_model_space`` stores flattened slices instead and is not read yet.)
RESHARDABLE = frozenset({"fully_reshardable"})
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
#: Megatron-LM ``args`` kept in the manifest: what shapes the model (and its fused layouts).
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "num_query_groups", "kv_channels", "swiglu", "normalization",
    "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
    "max_position_embeddings", "padded_vocab_size", "untie_embeddings_and_output_weights",
    "add_bias_linear", "add_qkv_bias", "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)  # fmt: skip


def is_megatron_folder(path: Path) -> bool:
    """Whether ``path`` holds a ``torch_dist`` checkpoint (``metadata.json`` + ``.metadata``)."""
    folder = Path(path)
    if not (folder / METADATA_NAME).is_file() or not (folder / METADATA_JSON).is_file():
        return False
    try:
        config = json.loads((folder / METADATA_JSON).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("sharded_backend") == "torch_dist"


def read_megatron_checkpoint(src: Path, *, policy: PicklePolicy | None = None) -> SourceCheckpoint:
    """Open and describe the ``torch_dist`` checkpoint in folder ``src``.

    The returned object holds open file descriptors; close it (or use it as a context manager).

    Raises:
        UCFormatError: missing or damaged files, a hostile pickle, a layout not understood.
    """
    folder = Path(src)
    config = json.loads((folder / METADATA_JSON).read_text())
    metadata = read_dcp_metadata(folder)
    common = _read_common(folder, policy or PicklePolicy())
    items = DcpItems(folder, metadata, policy or PicklePolicy())
    try:
        return _Describer(folder, metadata, items, common, config).describe()
    except BaseException:
        items.close()
        raise


def _read_common(folder: Path, policy: PicklePolicy) -> dict[str, Any]:
    path = folder / COMMON_NAME
    if not path.is_file():
        return {}
    handle = open_torch_file(path, policy)
    try:
        common = handle.obj
    finally:
        handle.close()
    if not isinstance(common, dict):
        raise NotACheckpointError(
            f"{path}: holds {describe_type(common)}, expected the dict dist_checkpointing saves."
        )
    return common


def _attributes(value: Any) -> dict[str, Any]:
    """Megatron-LM's ``args`` (an ``argparse.Namespace`` placeholder, or a dict)."""
    if isinstance(value, StandIn):
        return value.attributes()
    return dict(value) if isinstance(value, dict) else {}


class _Describer:
    def __init__(
        self,
        folder: Path,
        metadata: DcpMetadata,
        items: DcpItems,
        common: dict[str, Any],
        config: dict[str, Any],
    ) -> None:
        self.folder, self.metadata, self.items = folder, metadata, items
        self.common, self.config = common, config
        args = _attributes(common.get("args"))
        self.args = {k: args[k] for k in MODEL_ARGS if k in args}
        optim = common.get("optimizer")
        self.optim = optim if isinstance(optim, dict) else {}

    # --- keys -----------------------------------------------------------------------------
    def describe(self) -> SourceCheckpoint:
        entries = self.metadata.entries
        weights = [k for k, v in entries.items() if isinstance(v, DcpTensor) and _is_weight(k)]
        states: dict[str, dict[str, str]] = {}
        for key, entry in entries.items():
            if isinstance(entry, DcpTensor) and key.startswith(_OPTIMIZER_STATE):
                state, _, owner = key[len(_OPTIMIZER_STATE) :].partition(".")
                weight = entries.get(owner)
                if not isinstance(weight, DcpTensor) or weight.shape != entry.shape:
                    raise LayoutMismatchError(
                        f"{self.folder}: optimizer state '{key}' has shape {list(entry.shape)}; "
                        f"expected the shape of the weight '{owner}' "
                        f"({list(weight.shape) if isinstance(weight, DcpTensor) else 'absent'})."
                    )
                states.setdefault(owner, {})[state] = key
        num_layers = self._num_layers(weights)
        sharding = self.optim.get("param_state_sharding_type") if self.optim else None
        if sharding is None and any(k.startswith("optimizer.") for k in entries):
            sharding = "unknown"
        stored, note = self._optimizer_decision(sharding, states)
        params: dict[str, SourceParam] = {}
        layout: dict[str, MegatronParam] = {}
        for key, layer in _module_order(weights, num_layers):
            entry = entries[key]
            assert isinstance(entry, DcpTensor)
            name = key if layer is None else f"{LAYER_PREFIX}{layer}.{key[len(LAYER_PREFIX) :]}"
            kept = states.get(key, {}) if stored else {}
            # optimizer.state.param is the fp32 master weight (the model's copy is the lp one)
            arrays = {FP32_STATE: self._array(kept.get("param", key), layer)}
            arrays.update((s, self._array(k, layer)) for s, k in kept.items() if s != "param")
            param = SourceParam(
                shape=entry.shape if layer is None else entry.shape[1:],
                dtype=entry.dtype,
                requires_grad=True,
                group=None,
                arrays=arrays,
            )
            params[name] = param
            layout[name] = MegatronParam(
                key=key,
                layer=layer,
                chunks=self._chunks(key, layer),
                fused=self._fused(key, param.shape, entries),
            )
        optimizer = self._optimizer(params) if stored else None
        megatron = MegatronLayout(
            sharded_backend=str(self.config.get("sharded_backend")),
            sharded_backend_version=_int_or_none(self.config.get("sharded_backend_version")),
            num_layers=num_layers if any(_layered(k) for k in weights) else None,
            optimizer_sharding=sharding,
            optimizer_stored=stored,
            optimizer_note=note,
            model_args={k: encode(v) for k, v in self.args.items()},
            params=layout,
        )
        return SourceCheckpoint(
            source=self._source_info(),
            params=params,
            buffers={},
            tied={},
            optimizer=optimizer,
            progress=TrainingProgress(global_steps=_int_or_none(self.common.get("iteration")) or 0),
            client_state=self._client_state(),
            files=list(self.items.handles),
            closers=[self.items.close_descriptors],
            megatron=megatron,
        )

    def _num_layers(self, weights: list[str]) -> int:
        counts = set()
        for key in weights:
            if _layered(key):
                entry = self.metadata.entries[key]
                assert isinstance(entry, DcpTensor)
                counts.add(entry.shape[0] if entry.shape else 0)
        expected = self.args.get("num_layers")
        if len(counts) > 1 or (counts and expected is not None and counts != {expected}):
            raise UnsupportedCheckpointError(
                f"{self.folder}: the '{LAYER_PREFIX}*' keys have layer axes of lengths "
                f"{sorted(counts)} (args num_layers {expected}); expected one length. "
                "Pipeline-interleaved or heterogeneous layer stacks are not read yet."
            )
        return counts.pop() if counts else 0

    def _optimizer_decision(
        self, sharding: str | None, states: dict[str, dict[str, str]]
    ) -> tuple[bool, str]:
        if sharding is None:
            return False, ""
        if sharding not in RESHARDABLE:
            what = (
                "holds flat per-bucket buffers tied to the saving job's layout"
                if sharding.startswith("dp_")
                else "is not read yet"
            )
            return False, (
                f"the distributed optimizer's '{sharding}' format {what}; save with "
                "distrib_optim_sharding_type='fully_reshardable' to keep the optimizer"
            )
        if not states:
            return False, "no optimizer.state.* tensors in the checkpoint"
        groups = self._param_groups()
        if groups is None:
            return False, "common.pt has no optimizer param groups"
        if len(groups) > 1 and _wd_split(groups) is None:
            return False, (
                f"{len(groups)} param groups that Megatron's default rule (weight decay or "
                "not) does not tell apart; the checkpoint does not list their members"
            )
        return True, ""

    def _param_groups(self) -> list[dict[str, Any]] | None:
        inner = self.optim.get("optimizer")
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            return None
        return groups

    # --- arrays ---------------------------------------------------------------------------
    def _array(self, key: str, layer: int | None) -> ArraySource:
        if layer is None:
            array: ArraySource = self.items.array(key)
            return array
        entry = self.metadata.entries[key]
        assert isinstance(entry, DcpTensor)
        inner = entry.shape[1:]
        array = ArraySource(inner, entry.dtype)
        for chunk in entry.chunks:
            first, count = chunk.offsets[0], chunk.sizes[0]
            if not first <= layer < first + count:
                continue
            tensor = self.items.chunk_tensor(key, entry, chunk)
            skip = (layer - first) * math.prod(chunk.sizes[1:])
            for run in chunk_runs(inner, chunk.offsets[1:], chunk.sizes[1:]):
                array.fragments.append(
                    SourceFragment(tensor, skip + run.chunk_start, run.start, run.length)
                )
        return array

    def _chunks(self, key: str, layer: int | None) -> list[MegatronChunk]:
        entry = self.metadata.entries[key]
        assert isinstance(entry, DcpTensor)
        boxes = []
        for chunk in entry.chunks:
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            if layer is not None:
                if not offsets[0] <= layer < offsets[0] + sizes[0]:
                    continue
                offsets, sizes = offsets[1:], sizes[1:]
            item = self.metadata.items[(key, chunk.offsets)]
            match = _DATA_FILE.match(item.relative_path)
            rank = int(match.group(1)) if match else 0
            boxes.append(MegatronChunk(rank=rank, offsets=offsets, sizes=sizes))
        return sorted(boxes, key=lambda b: (b.rank, b.offsets))

    # --- fused parameters -----------------------------------------------------------------
    def _fused(
        self, key: str, shape: tuple[int, ...], entries: dict[str, Any]
    ) -> MegatronFused | None:
        if key.endswith("self_attention.linear_qkv.weight") or key.endswith(
            "self_attention.linear_qkv.bias"
        ):
            return self._qkv(key, shape)
        if key.endswith("mlp.linear_fc1.weight") or key.endswith("mlp.linear_fc1.bias"):
            swiglu = self.args.get("swiglu")
            fc2 = entries.get(key.replace("linear_fc1.weight", "linear_fc2.weight"))
            ffn = self.args.get("ffn_hidden_size")
            if ffn is None and isinstance(fc2, DcpTensor):
                ffn = fc2.shape[-1]
            gated = swiglu if swiglu is not None else (ffn is not None and shape[0] == 2 * ffn)
            if not gated:
                return None
            if shape[0] % 2:
                raise LayoutMismatchError(
                    f"{self.folder}: SwiGLU '{key}' has {shape[0]} rows, not gate + up halves."
                )
            half = shape[0] // 2
            return MegatronFused(kind="gate_up", parts=["gate", "up"], sizes=[half, half])
        return None

    def _qkv(self, key: str, shape: tuple[int, ...]) -> MegatronFused:
        heads = self.args.get("num_attention_heads")
        if not isinstance(heads, int) or heads <= 0:
            return MegatronFused(kind="qkv", parts=["q", "k", "v"], known=False)
        groups = (
            self.args.get("num_query_groups") if self.args.get("group_query_attention") else None
        )
        groups = groups if isinstance(groups, int) and groups > 0 else heads
        head_dim = self.args.get("kv_channels") or self.args.get("hidden_size", 0) // heads
        if heads % groups or groups * (heads // groups + 2) * head_dim != shape[0]:
            raise LayoutMismatchError(
                f"{self.folder}: '{key}' has {shape[0]} rows; the training args "
                f"({heads} heads, {groups} query groups, head size {head_dim}) call for "
                f"{groups * (heads // max(groups, 1) + 2) * head_dim}."
            )
        return MegatronFused(
            kind="qkv",
            parts=["q", "k", "v"],
            num_query_groups=groups,
            heads_per_group=heads // groups,
            head_dim=head_dim,
        )

    # --- optimizer ------------------------------------------------------------------------
    def _optimizer(self, params: dict[str, SourceParam]) -> OptimizerInfo:
        groups = self._param_groups()
        assert groups is not None
        split = _wd_split(groups) if len(groups) > 1 else None
        members: list[list[str]] = [[] for _ in groups]
        for name, param in params.items():
            index = 0
            if split is not None:
                no_wd = name.endswith(".bias") or len(param.shape) == 1
                index = split[1] if no_wd else split[0]
            param.group = index
            members[index].append(name)
            step = groups[index].get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                param.scalars["step"] = ScalarState(kind="int", value=step)
            elif isinstance(step, float):
                param.scalars["step"] = ScalarState(kind="float", value=step)
        hyper = [{k: encode(v) for k, v in g.items() if k != "params"} for g in groups]
        decoupled = groups[0].get("decoupled_weight_decay")
        state_keys = sorted({s for p in params.values() for s in p.arrays if s != FP32_STATE})
        return OptimizerInfo(
            name="megatron.core DistributedOptimizer (Adam)",
            adam_w_mode=bool(decoupled) if decoupled is not None else True,
            state_keys=state_keys,
            scalar_keys=sorted({s for p in params.values() for s in p.scalars}),
            groups=[
                OptimizerGroup(params=m, hyperparams=h) for m, h in zip(members, hyper, strict=True)
            ],
        )

    # --- the rest -------------------------------------------------------------------------
    def _client_state(self) -> ClientState:
        common = [
            (key, _attributes(value) if key == "args" else value)
            for key, value in self.common.items()
            if key != "optimizer"
        ]
        objects = [
            (key, NotStored("ShardedObject"))
            for key, entry in self.metadata.entries.items()
            if not isinstance(entry, DcpTensor) and _is_weight(key)
        ]
        return encode_client_state([*common, *objects])

    def _source_info(self) -> SourceInfo:
        names = [METADATA_NAME, *self.metadata.data_files, METADATA_JSON]
        if (self.folder / COMMON_NAME).is_file():
            names.append(COMMON_NAME)
        dtypes = {
            e.dtype
            for k, e in self.metadata.entries.items()
            if isinstance(e, DcpTensor) and _is_weight(k)
        }
        train = (
            "bfloat16" if "bfloat16" in dtypes else "float16" if "float16" in dtypes else "float32"
        )
        return self.items.source_info(
            names,
            checkpoint_format="megatron-torch_dist",
            train_dtype=train,
            optimizer_wrapper="DistributedOptimizer" if self.optim else "",
        )


def _module_order(weights: list[str], num_layers: int) -> list[tuple[str, int | None]]:
    """Keys before the layer stack, then layer by layer, then the rest (the module's order)."""
    layered = [k for k in weights if _layered(k)]
    first = weights.index(layered[0]) if layered else len(weights)
    before = [(k, None) for k in weights[:first] if not _layered(k)]
    after = [(k, None) for k in weights[first:] if not _layered(k)]
    stack = [(k, layer) for layer in range(num_layers) for k in layered]
    return [*before, *stack, *after]


def _is_weight(key: str) -> bool:
    return not key.startswith("optimizer.") and "_extra_state" not in key


def _layered(key: str) -> bool:
    return key.startswith(LAYER_PREFIX)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _wd_split(groups: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(weight-decay group, no-weight-decay group) under Megatron's default rule, if it fits."""
    if len(groups) != 2:
        return None
    mults = [g.get("wd_mult") for g in groups]
    if set(mults) != {1.0, 0.0}:
        return None
    return (mults.index(1.0), mults.index(0.0))
