"""Read a Megatron-Core ``torch_dist`` checkpoint (``dist_checkpointing.save``) into a
``SourceCheckpoint``.

Algorithm (docs/megatron.md; docs/format.md §8b):

1. open ``metadata.json``, ``.metadata`` and ``common.pt`` under the allow-list (:mod:`.files`);
2. sort the tensor keys (:mod:`.keys`): weights, per-parameter optimizer state,
   ``dp_reshardable`` buckets; every weight key at every index of its prepended axes (layer,
   expert) is one store parameter named by the naming contract, ordered as the TP=1 GPTModel
   orders its parameters (:mod:`.params`);
3. read which optimizers Megatron chained and their param groups and step (:mod:`.optimizers`),
   and give each parameter its group by Megatron's default rule;
4. take each parameter's fp32 master and moments: the weight itself (``FP32Optimizer``), the
   ``fp32_param`` (``Float16OptimizerWithFloat16Params``) or ``param`` (distributed,
   ``fully_reshardable``) state keys, or the ``dp_reshardable`` buckets cut by Megatron's
   bucketing rule (:mod:`.buckets`); then prove every master that is not the weight itself
   rounds to its weight (:mod:`.proof`);
5. describe fused weights (:mod:`.fused`), the source's parallel layout, and the client state
   (``args``, ``iteration``, FLOPs so far, scheduler, RNG states: :mod:`.client`).

A checkpoint without optimizer state, or whose param groups Megatron's default rule cannot tell
apart, converts model-only; ``manifest.megatron.optimizer_note`` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucformat.errors import UnsupportedCheckpointError
from ucformat.format.megatron import (
    EXPERT_AXIS,
    MegatronLayout,
    MegatronParallel,
    MegatronParam,
)
from ucformat.format.models import (
    OptimizerGroup,
    OptimizerInfo,
    ScalarState,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.pyvalue import encode
from ucformat.format.spec import FP32_STATE
from ucformat.sources.base import ArraySource, SourceCheckpoint, SourceParam, scalar_state
from ucformat.sources.dcp_metadata import METADATA_NAME
from ucformat.sources.megatron.buckets import Parallel, read_buckets
from ucformat.sources.megatron.client import client_state
from ucformat.sources.megatron.files import COMMON_NAME, METADATA_JSON, MegatronFiles
from ucformat.sources.megatron.fused import describe_fused
from ucformat.sources.megatron.keys import (
    is_weight_key,
    parse_bucket_key,
    parse_state_key,
    parse_weight_key,
)
from ucformat.sources.megatron.optimizers import (
    DISTRIBUTED,
    FLOAT16,
    GroupedParam,
    InnerOptimizer,
    assign_groups,
    read_optimizers,
)
from ucformat.sources.megatron.params import ParamSlot, chunk_boxes, order_params, subarray
from ucformat.sources.megatron.proof import check_masters
from ucformat.sources.reading import describing
from ucformat.sources.safe_unpickle import PicklePolicy

__all__ = ["MODEL_ARGS", "read_megatron_checkpoint"]

#: Megatron-LM ``args`` kept in ``manifest.megatron.model_args``: what shapes the model (its
#: fused layouts, its experts) and the parallel layout it was saved at.
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "num_query_groups", "kv_channels", "swiglu", "normalization",
    "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
    "max_position_embeddings", "padded_vocab_size", "untie_embeddings_and_output_weights",
    "add_bias_linear", "add_qkv_bias", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
    "data_parallel_size", "world_size", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_shared_expert_intermediate_size", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
    "moe_layer_freq", "bf16", "fp16", "use_distributed_optimizer", "transformer_impl",
)  # fmt: skip
#: The master's state key per optimizer kind (FP32Optimizer: the weight itself).
_MASTER = {FLOAT16: "fp32_param", DISTRIBUTED: "param"}
_MOMENTS = ("exp_avg", "exp_avg_sq")


def read_megatron_checkpoint(src: Path, *, policy: PicklePolicy | None = None) -> SourceCheckpoint:
    """Open and describe the ``torch_dist`` checkpoint in folder ``src``.

    The returned object holds open file descriptors; close it (or use it as a context manager).

    Raises:
        UCFormatError: missing or damaged files, a hostile pickle, a layout not understood, an
            optimizer state that does not match the weights (one line naming the parameter).
    """
    folder = Path(src)
    files = MegatronFiles(folder, policy)
    with describing(folder, "the torch_dist checkpoint", "Megatron-Core", files.close):
        return _Describer(files).describe()


class _Describer:
    def __init__(self, files: MegatronFiles) -> None:
        self.files = files
        self.folder = files.folder
        self.args = {k: files.args[k] for k in MODEL_ARGS if k in files.args}
        tensors = files.tensors()
        self.weights = [
            parse_weight_key(k, e.shape) for k, e in tensors.items() if is_weight_key(k)
        ]
        self.states: dict[str, dict[str, str]] = {}
        for key in tensors:
            parsed = parse_state_key(key)
            if parsed is not None:
                self.states.setdefault(parsed.weight, {})[parsed.state] = key
        self.has_buckets = any(parse_bucket_key(k) is not None for k in tensors)

    # --- the checkpoint ---------------------------------------------------------------------
    def describe(self) -> SourceCheckpoint:
        if self.files.content.get("singleton_local_shards"):
            raise UnsupportedCheckpointError(
                f"{self.folder}: saved with singleton_local_shards (one key per expert and "
                "per SwiGLU half); ucformat does not read that layout yet. Save with "
                "Megatron-LM's default metadata (singleton_local_shards False)."
            )
        slots = order_params(self.weights)
        optimizers, chained = read_optimizers(self.files)
        parallel = self._parallel(optimizers)
        params, layout_params = self._weights(slots)
        note, stored, pipeline_layers = "", False, None
        groups: list[int] | None = None
        if optimizers:
            groups = assign_groups(
                optimizers,
                [GroupedParam(s.name, s.weight.param_shape, s.weight.has_experts) for s in slots],
            )
            note = self._refusal(optimizers, groups)
        if optimizers and not note:
            pipeline_layers = self._optimizer_state(slots, params, optimizers, chained, parallel)
            stored = True
        optimizer = None
        if stored and groups is not None:
            optimizer = self._optimizer_info(slots, params, optimizers, groups)
        sharding = next((o.sharding for o in optimizers if o.sharding), None)
        megatron = MegatronLayout(
            sharded_backend=str(self.files.config.get("sharded_backend")),
            sharded_backend_version=_int(self.files.config.get("sharded_backend_version")),
            num_layers=self._num_layers(),
            optimizer_sharding=sharding,
            optimizer_stored=stored,
            optimizer_note=note,
            model_args={k: encode(v) for k, v in self.args.items()},
            params=layout_params,
            optimizers=[o.kind for o in optimizers],
            chained_prefix=chained and self._prefixed(),
            parallel=self._parallel_info(parallel, pipeline_layers),
            num_experts=self._num_experts(),
        )
        client = client_state(self.files)
        return SourceCheckpoint(
            source=self._source_info(optimizers),
            params=params,
            buffers={},
            tied={},
            optimizer=optimizer,
            progress=TrainingProgress(global_steps=_int(self.files.common.get("iteration")) or 0),
            client_state=client,
            files=self.files.handles(),
            closers=[self.files.items.close_descriptors],
            megatron=megatron,
        )

    # --- weights ------------------------------------------------------------------------------
    def _weights(
        self, slots: list[ParamSlot]
    ) -> tuple[dict[str, SourceParam], dict[str, MegatronParam]]:
        params: dict[str, SourceParam] = {}
        layout: dict[str, MegatronParam] = {}
        fc2 = {w.name(()) if not w.axes else w.key: w for w in self.weights}
        for slot in slots:
            weight = slot.weight
            entry = self.files.tensor(weight.key)
            if slot.name in params:
                raise UnsupportedCheckpointError(
                    f"{self.folder}: two checkpoint keys give the parameter '{slot.name}' "
                    f"('{layout[slot.name].key}', '{weight.key}')."
                )
            params[slot.name] = SourceParam(
                shape=weight.param_shape,
                dtype=entry.dtype,
                requires_grad=True,
                group=None,
                arrays={FP32_STATE: subarray(self.files, weight.key, slot.index)},
            )
            partner = fc2.get(weight.key.replace("linear_fc1.", "linear_fc2."))
            layout[slot.name] = MegatronParam(
                key=weight.key,
                layer=slot.layer,
                axes=list(weight.axes),  # type: ignore[arg-type]
                expert=slot.expert,
                expert_parallel=weight.has_experts,
                chunks=chunk_boxes(self.files, entry, weight.key, slot.index),
                fused=describe_fused(
                    slot.name,
                    weight.param_shape,
                    self.args,
                    partner.param_shape[-1] if partner is not None else None,
                    str(self.folder),
                ),
            )
        return params, layout

    # --- optimizer ----------------------------------------------------------------------------
    def _refusal(self, optimizers: Sequence[InnerOptimizer], groups: list[int] | None) -> str:
        """Why the optimizer state cannot be stored ("" when it can)."""
        kinds = {o.kind for o in optimizers}
        shardings = {o.sharding or "" for o in optimizers if o.kind == DISTRIBUTED}
        unread = shardings - {"fully_reshardable", "dp_reshardable"}
        if unread:
            return (
                f"the distributed optimizer's '{sorted(unread)[0]}' format is not read; save with "
                "distrib_optim_sharding_type='fully_reshardable' or 'dp_reshardable'"
            )
        if groups is None:
            return (
                "param groups that Megatron's default rule (weight decay, decoupled lr, experts) "
                "does not tell apart; the checkpoint does not list their members"
            )
        if kinds != {DISTRIBUTED} or shardings != {"dp_reshardable"}:
            if not self.states:
                return "no optimizer.state.* tensors in the checkpoint"
        elif not self.has_buckets:
            return "no dp_reshardable bucket tensors in the checkpoint"
        return ""

    def _optimizer_state(
        self,
        slots: list[ParamSlot],
        params: dict[str, SourceParam],
        optimizers: Sequence[InnerOptimizer],
        chained: bool,
        parallel: Parallel,
    ) -> list[list[list[int]]] | None:
        """Fill every parameter's master and moments; prove the masters; the pipeline layout
        the buckets showed (None when not from buckets)."""
        owner = {s.name: self._owner(s, optimizers) for s in slots}
        pipeline: list[list[list[int]]] | None = None
        checks: list[tuple[str, ArraySource, ArraySource]] = []
        bucketed = [o for o in optimizers if o.sharding == "dp_reshardable"]
        if bucketed:
            layout = read_buckets(self.files, slots, optimizers, chained, parallel)
            pipeline = layout.pipeline_layers
            for slot in slots:
                weight = params[slot.name].arrays[FP32_STATE]
                params[slot.name].arrays = dict(layout.arrays[slot.name])
                checks.append((slot.name, params[slot.name].arrays[FP32_STATE], weight))
        else:
            for slot in slots:
                kind = owner[slot.name].kind
                param = params[slot.name]
                states = self.states.get(slot.weight.key, {})
                wanted = [*(_MOMENTS), *([_MASTER[kind]] if kind in _MASTER else [])]
                missing = [s for s in wanted if s not in states]
                if missing:
                    raise UnsupportedCheckpointError(
                        f"{self.folder}: '{slot.name}' has no optimizer state "
                        f"'{missing[0]}' ({kind}); the checkpoint is incomplete."
                    )
                for state in _MOMENTS:
                    param.arrays[state] = subarray(self.files, states[state], slot.index)
                if kind in _MASTER:
                    weight = param.arrays[FP32_STATE]
                    master = subarray(self.files, states[_MASTER[kind]], slot.index)
                    param.arrays[FP32_STATE] = master
                    checks.append((slot.name, master, weight))
        check_masters(
            str(self.folder),
            checks,
            "the optimizer state does not belong to these weights (Megatron wrote it wrong, or "
            "its layout is not the one ucformat rebuilt); refused before writing anything.",
        )
        return pipeline

    @staticmethod
    def _owner(slot: ParamSlot, optimizers: Sequence[InnerOptimizer]) -> InnerOptimizer:
        if len(optimizers) > 1 and slot.weight.has_experts:
            return optimizers[-1]
        return optimizers[0]

    def _optimizer_info(
        self,
        slots: list[ParamSlot],
        params: dict[str, SourceParam],
        optimizers: Sequence[InnerOptimizer],
        groups: list[int],
    ) -> OptimizerInfo:
        flat = [(o, g) for o in optimizers for g in o.groups]
        members: list[list[str]] = [[] for _ in flat]
        for slot, index in zip(slots, groups, strict=True):
            param = params[slot.name]
            param.group = index
            members[index].append(slot.name)
            step = _step(flat[index][0], flat[index][1])
            if step is not None:
                param.scalars["step"] = step
        first = flat[0][1] if flat else {}
        decoupled = first.get("decoupled_weight_decay")
        inner = "torch.optim.AdamW" if decoupled else "Adam"
        kinds = "+".join(dict.fromkeys(o.kind for o in optimizers))
        state_keys = sorted({s for p in params.values() for s in p.arrays if s != FP32_STATE})
        return OptimizerInfo(
            name=f"megatron.core {kinds} ({inner})",
            adam_w_mode=bool(decoupled) if decoupled is not None else True,
            state_keys=state_keys,
            scalar_keys=sorted({s for p in params.values() for s in p.scalars}),
            groups=[
                OptimizerGroup(params=m, hyperparams={k: encode(v) for k, v in g.items()})
                for m, (_, g) in zip(members, flat, strict=True)
            ],
        )

    # --- layout -------------------------------------------------------------------------------
    def _parallel(self, optimizers: Sequence[InnerOptimizer]) -> Parallel:
        """The saving layout: from Megatron-LM's ``args``; without them (a plain
        ``dist_checkpointing.save``) the tensor sizes from the boxes of the vocabulary-parallel
        embedding and of the experts' row-parallel ``linear_fc2``, the pipeline and expert sizes
        from the number of ``dp_reshardable`` groups (the proof checks whatever is inferred)."""
        args = self.files.args
        experts = self._num_experts()
        tp = _int(args.get("tensor_model_parallel_size")) or self._splits(
            "embedding.word_embeddings.weight"
        )
        groups = self._bucket_groups()
        pp = _int(args.get("pipeline_model_parallel_size")) or max(
            1, len(groups.get(optimizers[0].index, ())) // tp if optimizers else 1
        )
        etp = _int(args.get("expert_tensor_parallel_size"))
        if etp is None:
            fc2 = [w.key for w in self.weights if w.has_experts and w.key.endswith("fc2.weight")]
            etp = self._splits(fc2[0]) if fc2 else 1
        ep = _int(args.get("expert_model_parallel_size"))
        if ep is None:
            expert_groups = len(groups.get(optimizers[-1].index, ())) if len(optimizers) > 1 else 0
            ep = max(1, expert_groups // (etp * pp)) if expert_groups else 1
        return Parallel(
            tp=tp,
            pp=pp,
            ep=ep,
            etp=etp if experts else 1,
            vpp=_int(args.get("virtual_pipeline_model_parallel_size")) or 1,
            te_grouped=bool(args.get("moe_grouped_gemm"))
            and not args.get("moe_use_legacy_grouped_gemm")
            and args.get("transformer_impl") != "local",
        )

    def _splits(self, key: str) -> int:
        """How many boxes one parameter of ``key`` was saved in (its tensor-parallel size)."""
        entry = self.files.metadata.entries.get(key)
        if entry is None or not hasattr(entry, "chunks"):
            return 1
        weight = parse_weight_key(key, self.files.tensor(key).shape)
        first = weight.indices()[0]
        depth = len(first)
        boxes = {
            (c.offsets[depth:], c.sizes[depth:])
            for c in self.files.tensor(key).chunks
            if all(o <= i < o + n for i, o, n in zip(first, c.offsets, c.sizes, strict=False))
        }
        return max(1, len(boxes))

    def _bucket_groups(self) -> dict[int, set[int]]:
        """Optimizer -> the ``dp_group_idx`` groups its ``dp_reshardable`` buckets name."""
        groups: dict[int, set[int]] = {}
        for key in self.files.tensors():
            parsed = parse_bucket_key(key)
            if parsed is not None:
                groups.setdefault(parsed.chained or 0, set()).add(parsed.group)
        return groups

    def _parallel_info(
        self, parallel: Parallel, pipeline_layers: list[list[list[int]]] | None
    ) -> MegatronParallel | None:
        if not self.files.args:
            return None
        dp = _int(self.files.args.get("data_parallel_size"))
        return MegatronParallel(
            tensor=parallel.tp,
            pipeline=parallel.pp,
            virtual_pipeline=parallel.vpp,
            expert=parallel.ep,
            expert_tensor=parallel.etp,
            data=dp,
            pipeline_layers=pipeline_layers,
        )

    def _prefixed(self) -> bool:
        return any(k.startswith("chained_") for k in self.files.metadata.entries)

    def _num_layers(self) -> int | None:
        layers = [w.shape[0] for w in self.weights if w.axes and w.axes[0] == "layer"]
        fixed = [w.layer for w in self.weights if w.layer is not None]
        if layers:
            if len(set(layers)) > 1:
                raise UnsupportedCheckpointError(
                    f"{self.folder}: the 'decoder.layers.*' keys have layer axes of lengths "
                    f"{sorted(set(layers))}; expected one length."
                )
            return layers[0]
        return max(fixed) + 1 if fixed else None

    def _num_experts(self) -> int | None:
        for weight in self.weights:
            if EXPERT_AXIS in weight.axes:
                return weight.shape[weight.axes.index(EXPERT_AXIS)]
        experts = [w.expert for w in self.weights if w.expert is not None]
        return max(experts) + 1 if experts else None

    def _source_info(self, optimizers: Sequence[InnerOptimizer]) -> SourceInfo:
        metadata = self.files.metadata
        names = [METADATA_NAME, *metadata.data_files, METADATA_JSON]
        if (self.folder / COMMON_NAME).is_file():
            names.append(COMMON_NAME)
        dtypes = {self.files.tensor(w.key).dtype for w in self.weights}
        train = (
            "bfloat16" if "bfloat16" in dtypes else "float16" if "float16" in dtypes else "float32"
        )
        return self.files.items.source_info(
            names,
            checkpoint_format="megatron-torch_dist",
            train_dtype=train,
            optimizer_wrapper="+".join(dict.fromkeys(o.kind for o in optimizers)),
        )


def _step(optimizer: InnerOptimizer, group: dict[str, Any]) -> ScalarState | None:
    value = group.get("step", optimizer.step)
    if value is None:
        return None
    return scalar_state(value, f"the step of optimizer {optimizer.index}")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
