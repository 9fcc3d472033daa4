"""The manifest: pydantic models of everything a ucformat store holds besides tensor bytes.

The manifest is data. It is written as JSON (``ucformat.json``) in the store root, validated
on read with ``extra="forbid"``, and versioned by ``format_version``. Its JSON schema is
generated from these models into ``schemas/manifest.schema.json``.

Forward compatibility (docs/format.md §5): a manifest of a newer minor version of a known major
may carry members these models do not know, at any level. It is validated with the context
:data:`IGNORE_UNKNOWN` (see :func:`ucformat.store.manifest_io.parse_manifest`), which drops
them from the model; they stay in the stored document, which the digest covers.

Values that come from Python training state (hyper-parameters, scheduler state, client state)
are kept exact with the tagged encoding of :mod:`ucformat.format.pyvalue`; such fields are typed
``JsonValue`` here.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import chain
from typing import Annotated, Literal

from pydantic import (
    Field,
    JsonValue,
    field_validator,
    model_validator,
)

from ucformat.format.base import IGNORE_UNKNOWN, ManifestModel
from ucformat.format.bounds import (
    array_shape_problem,
    component_problem,
    entry_name_problems,
    relative_path_problem,
    shape_problem,
    stack_problem,
)
from ucformat.format.experts import ExpertLayout
from ucformat.format.megatron import MegatronLayout
from ucformat.format.names import model_name
from ucformat.format.pipeline import PipelineLayout
from ucformat.format.spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    STACKED_VERSION,
    buffer_array_path,
    is_stacked_version,
    name_problem,
    stack_number,
    state_array_path,
)
from ucformat.format.tensor_parallel import TensorParallelInfo

__all__ = [
    "IGNORE_UNKNOWN",
    "ArrayRef",
    "BufferEntry",
    "CheckpointManifest",
    "ClientState",
    "LossScaler",
    "OptimizerGroup",
    "OptimizerInfo",
    "ParamEntry",
    "PartitionState",
    "ScalarState",
    "SourceFile",
    "SourceInfo",
    "StackSlot",
    "TrainingProgress",
]

#: Must list exactly :data:`ucformat.format.dtypes.DTYPE_NAMES` (a unit test checks this).
DTypeName = Literal[
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"
]


#: JSON has no NaN or infinity: a plain float field refuses them instead of losing them.
#: (Python values that may hold them go through :mod:`ucformat.format.pyvalue` as
#: ``{"$float": ...}``.)
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _refuse(problem: str | None) -> None:
    """Fail validation with ``problem`` (docs/format.md §2.4, §3.8), if any."""
    if problem is not None:
        raise ValueError(problem)


@lru_cache(maxsize=4096)
def _shapes_problem(
    shape: tuple[int, ...], chunk_shape: tuple[int, ...], shard_shape: tuple[int, ...]
) -> str | None:
    """:func:`array_shape_problem`, once per distinct triple (a manifest repeats a few)."""
    return array_shape_problem(list(shape), list(chunk_shape), list(shard_shape))


class StackSlot(ManifestModel):
    """Where a logical array lies in its stack (docs/format.md §2.5): index ``index`` of a zarr
    array of ``size`` logical arrays of the same layout, stacked on a new leading axis whose
    shards hold ``per_shard`` of them."""

    index: int = Field(ge=0, description="Position on the stack's leading axis.")
    size: int = Field(ge=1, description="Logical arrays in the stack (its leading extent).")
    per_shard: int = Field(
        ge=1, description="Logical arrays per shard object (the shard's leading extent)."
    )

    @model_validator(mode="after")
    def _check_slot(self) -> StackSlot:
        if self.index >= self.size:
            raise ValueError(f"stack index {self.index} is not below the stack size {self.size}")
        if self.per_shard > self.size:
            raise ValueError(f"per_shard {self.per_shard} exceeds the stack size {self.size}")
        return self


class ArrayRef(ManifestModel):
    """A logical array (a parameter's state or a buffer): where its values live and how they are
    chunked. Without ``stack`` (format 3.0 and older) it is the zarr array at ``path``; with it,
    index ``stack.index`` of the stack at ``path`` (docs/format.md §2.5)."""

    path: str = Field(
        description="The zarr array holding the values, relative to the store root: "
        "'stacks/<n>' (format 3.1), or 'params/<fqn>/<state>' / 'buffers/<fqn>' (older)."
    )
    dtype: DTypeName = Field(description="Logical dtype of the stored values.")
    shape: list[int] = Field(description="Array shape: the parameter's (or buffer's) real shape.")
    chunk_shape: list[int] = Field(
        description="Inner chunk shape: the unit of reads and checksums."
    )
    shard_shape: list[int] = Field(
        description="Shard shape: the unit of storage objects and writes."
    )
    nbytes: int = Field(ge=0, description="Uncompressed size of the values in bytes.")
    compressor: Literal["none", "zstd"] = "none"
    stack: StackSlot | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # absent in stores of format 3.0 and older
        description="Where in the stack at 'path' the values lie (format 3.1); absent: the "
        "array at 'path' is this one alone.",
    )

    @model_validator(mode="after")
    def _check_shapes(self) -> ArrayRef:
        _refuse(
            _shapes_problem(tuple(self.shape), tuple(self.chunk_shape), tuple(self.shard_shape))
        )
        if self.stack is not None and self.stack.per_shard > 1:
            clipped = [min(s, max(d, 1)) for s, d in zip(self.shard_shape, self.shape, strict=True)]
            if clipped != [max(d, 1) for d in self.shape]:
                raise ValueError(
                    f"a shard holds {self.stack.per_shard} arrays of the stack, but shard shape "
                    f"{self.shard_shape} does not hold the whole array {self.shape}"
                )
        return self


class ScalarState(ManifestModel):
    """A 0-d optimizer state (e.g. Adam's ``step``), kept in the manifest with its original type."""

    kind: Literal["int", "float", "bool", "tensor"] = Field(
        description="'tensor': a 0-d torch tensor (torch Adam's float32 step); else a Python value."
    )
    value: int | FiniteFloat | bool
    dtype: DTypeName | None = Field(default=None, description="Tensor dtype when kind is 'tensor'.")


class ParamEntry(ManifestModel):
    """A model parameter: its identity, training metadata and the arrays holding its states."""

    shape: list[int]
    dtype: DTypeName = Field(description="The parameter's dtype in the training module (lp dtype).")
    requires_grad: bool
    group: int | None = Field(description="Index of its optimizer param group; None if frozen.")
    states: dict[str, ArrayRef] = Field(
        description="State name -> array. 'fp32' is the fp32 master weight of a trainable "
        "parameter; 'value' is a frozen parameter's value in its own dtype (format 1 stored it "
        "under 'fp32'); other keys are the optimizer's own."
    )
    scalars: dict[str, ScalarState] = Field(
        default_factory=dict, description="0-d optimizer states, e.g. 'step'."
    )
    aliases: list[str] = Field(
        default_factory=list, description="Tied names that share this parameter's storage."
    )
    whole_states: dict[str, ArrayRef] = Field(
        default_factory=dict,
        exclude_if=lambda value: not value,  # absent unless the optimizer keeps such states
        description="Format 3.1: optimizer states kept whole, in their own shape (not the "
        "parameter's: a 1-element tensor, Adafactor-style row and column factors); they do not "
        "reshard elementwise, so only a target holding the whole parameter takes them.",
    )

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, value: list[int]) -> list[int]:
        _refuse(shape_problem(value))
        return value

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


class BufferEntry(ManifestModel):
    """A persistent module buffer (e.g. BatchNorm running stats), stored in its own dtype."""

    shape: list[int]
    dtype: DTypeName
    array: ArrayRef

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, value: list[int]) -> list[int]:
        _refuse(shape_problem(value))
        return value


class PartitionState(ManifestModel):
    """An optimizer state a ZeRO-1/2 job keeps once per flat partition of a param group, in a
    shape of its own (format 3.1): it belongs to a rank's partition, not to parameters."""

    partitions: int = Field(ge=1, description="The partitions (ranks) of the source's group.")
    shape: list[int] = Field(description="Each partition's tensor shape.")
    replicated: bool = Field(
        description="Whether every partition holds the same bytes (then any layout takes it)."
    )
    array: ArrayRef = Field(
        description="Partition p's tensor is row p of the array: shape [partitions, *shape]."
    )

    @model_validator(mode="after")
    def _check_array(self) -> PartitionState:
        if self.array.shape != [self.partitions, *self.shape]:
            raise ValueError(
                f"partition state array shape {self.array.shape} is not "
                f"[{self.partitions}, *{self.shape}]"
            )
        return self


class OptimizerGroup(ManifestModel):
    """One optimizer param group: hyper-parameters and members in flattening order."""

    params: list[str]
    hyperparams: dict[str, JsonValue] = Field(
        description="Every param-group key except 'params', exact (see ucformat.format.pyvalue)."
    )
    partition_states: dict[str, PartitionState] = Field(
        default_factory=dict,
        exclude_if=lambda value: not value,  # absent unless the optimizer keeps such states
        description="Format 3.1: states kept once per flat partition of this group (ZeRO-1/2), "
        "not elementwise: loadable only where the target partitions the group the same way "
        "(or, when replicated, anywhere a group is partitioned).",
    )


class OptimizerInfo(ManifestModel):
    """The optimizer whose state the store holds."""

    name: str = Field(description="Best knowledge of the optimizer class, e.g. 'FusedAdam'.")
    adam_w_mode: bool | None = Field(
        default=None, description="Whether the Adam math is AdamW (decoupled weight decay)."
    )
    state_keys: list[str] = Field(description="Array-valued per-element state keys.")
    scalar_keys: list[str] = Field(description="0-d state keys, e.g. ['step'].")
    whole_keys: list[str] = Field(
        default_factory=list,
        exclude_if=lambda value: not value,
        description="Format 3.1: state keys kept whole per parameter (ParamEntry.whole_states).",
    )
    groups: list[OptimizerGroup]


class LossScaler(ManifestModel):
    """fp16 loss-scaler state (static scalers are recorded too, with scale 1.0)."""

    class_name: str
    dynamic: bool
    cur_scale: FiniteFloat
    attributes: dict[str, JsonValue]


class TrainingProgress(ManifestModel):
    """Counters and small training-loop state."""

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    lr_scheduler: JsonValue = None
    loss_scaler: LossScaler | None = None
    dynamic_loss_scale: bool | None = None
    overflow: bool | None = None
    clip_grad: FiniteFloat | None = None


class ClientState(ManifestModel):
    """The client state saved with the checkpoint."""

    values: dict[str, JsonValue] = Field(
        default_factory=dict, description="Keys whose values have an exact JSON form."
    )
    unrepresentable: dict[str, str] = Field(
        default_factory=dict, description="Key -> type of values that could not be kept."
    )


class SourceFile(ManifestModel):
    """A file of the source checkpoint."""

    name: str
    size: int

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        _refuse(relative_path_problem(value))
        return value


class SourceInfo(ManifestModel):
    """Provenance: what wrote the state the store holds.

    ``framework`` names the training framework, ``written_by`` how the store was made:
    ``convert`` (an offline pass over checkpoint files at ``path``) or ``save`` (written by the
    live training job itself, every rank its own part). ``checkpoint_format`` names the file
    format that was converted (``deepspeed-zero``, ``torch-dcp``); None for live saves.
    """

    framework: Literal["deepspeed", "pytorch"] = "deepspeed"
    framework_version: str
    written_by: Literal["convert", "save"] = "convert"
    checkpoint_format: str | None = Field(
        default="deepspeed-zero",
        description="Converted file format ('deepspeed-zero', 'torch-dcp'); None for live saves.",
    )
    path: str
    tag: str
    zero_stage: int | None = Field(
        default=None, ge=0, le=3, description="DeepSpeed only (0: no ZeRO, MoE checkpoints)."
    )
    world_size: int = Field(ge=1, description="Data-parallel world size that wrote the state.")
    train_dtype: DTypeName
    optimizer_wrapper: str = ""
    sub_groups: int | None = Field(default=None, description="ZeRO-3 sub-group count.")
    mesh_shape: list[int] | None = Field(
        default=None, description="Device mesh shape of sharded (DTensor) parameters."
    )
    mesh_dim_names: list[str] | None = Field(default=None, description="Names of the mesh dims.")
    files: list[SourceFile] = Field(default_factory=list)
    ds_config: JsonValue = None
    pipeline: PipelineLayout | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # absent unless the source was a pipeline
        description="Pipeline-parallel layout of the source; absent: no pipeline.",
    )

    @model_validator(mode="after")
    def _check_framework(self) -> SourceInfo:
        if self.framework == "deepspeed" and self.zero_stage is None:
            raise ValueError("a DeepSpeed source must record its zero_stage")
        if self.tag:  # exports name folders and files by it (DCP sources and live saves: "")
            _refuse(component_problem(self.tag))
        return self

    def describe(self) -> str:
        """One line: framework, version, layout, world size, dtype (for inspect and repr)."""
        if self.framework == "deepspeed":
            what = f"DeepSpeed {self.framework_version} ZeRO-{self.zero_stage}"
        else:
            what = f"PyTorch {self.framework_version}"
            if self.checkpoint_format:
                what += f" {self.checkpoint_format}"
        if self.mesh_shape:
            what += f" mesh {'x'.join(str(n) for n in self.mesh_shape)}"
        how = "saved live" if self.written_by == "save" else "converted"
        return f"{what}, world size {self.world_size}, {self.train_dtype} ({how})"


def _array_paths(entry: ParamEntry) -> list[tuple[str, str, bool]]:
    """(state, array path, stacked) of every array of a parameter, elementwise and whole."""
    return [
        (s, ref.path, ref.stack is not None)
        for s, ref in chain(entry.states.items(), entry.whole_states.items())
    ]


class CheckpointManifest(ManifestModel):
    """Root of ``ucformat.json``."""

    format: Literal["ucformat"] = FORMAT_NAME
    format_version: str = FORMAT_VERSION
    created_by: str
    source: SourceInfo
    params: dict[str, ParamEntry] = Field(
        description="fqn -> parameter, in module order. Tied aliases are not keys here."
    )
    tied: dict[str, str] = Field(default_factory=dict, description="alias fqn -> owner fqn.")
    buffers: dict[str, BufferEntry] = Field(default_factory=dict)
    optimizer: OptimizerInfo | None = None
    progress: TrainingProgress = Field(default_factory=TrainingProgress)
    client_state: ClientState = Field(default_factory=ClientState)
    megatron: MegatronLayout | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # absent unless the source is Megatron-Core
        description="Megatron-Core source layout (ucformat.format.megatron); absent otherwise.",
    )
    tensor_parallel: TensorParallelInfo | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="How the source split parameters over tensor-parallel ranks (absent: none).",
    )
    experts: ExpertLayout | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="Expert-parallel (MoE) layout; absent for dense checkpoints.",
    )
    digest: str | None = Field(
        default=None, description="sha256 of the canonical manifest JSON without this field."
    )

    @field_validator("format_version")
    @classmethod
    def _check_version_syntax(cls, value: str) -> str:
        major, _, minor = value.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError(f"format_version must look like '1.0', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_references(self) -> CheckpointManifest:
        _refuse(
            entry_name_problems(
                ((fqn, _array_paths(entry), entry.aliases) for fqn, entry in self.params.items()),
                ((fqn, entry.array.path, entry.array.stack is not None)
                 for fqn, entry in self.buffers.items()),
                self.tied.items(),
            )
        )  # fmt: skip
        named = self.arrays()
        _refuse(stack_problem(named))
        stacked = next((name for name, ref in named if ref.stack is not None), None)
        if stacked is not None and not is_stacked_version(self.format_version):
            raise ValueError(
                f"{stacked} is stacked, which format {self.format_version} does not allow "
                f"(stacks are format {STACKED_VERSION})"
            )
        for alias, owner in self.tied.items():
            if owner not in self.params:
                raise ValueError(f"tied alias {alias!r} points to unknown param {owner!r}")
            if alias in self.params:
                raise ValueError(f"tied alias {alias!r} is also listed as a param")
        for fqn, param in self.params.items():
            both = sorted(set(param.states) & set(param.whole_states))
            if both:
                raise ValueError(f"param {fqn!r} state {both[0]!r} is both elementwise and whole")
        if self.optimizer is not None:
            for index, group in enumerate(self.optimizer.groups):
                for name in group.params:
                    entry = self.params.get(name)
                    if entry is None:
                        raise ValueError(f"optimizer group {index} lists unknown param {name!r}")
                    if entry.group != index:
                        raise ValueError(
                            f"param {name!r} is in optimizer group {index} but records "
                            f"group {entry.group}"
                        )
                self._check_partition_states(index, group)
        if self.tensor_parallel is not None:
            for name, split in self.tensor_parallel.params.items():
                entry = self.params.get(name)
                if entry is None:
                    raise ValueError(f"tensor_parallel lists unknown param {name!r}")
                if split.logical_shape != entry.shape:
                    raise ValueError(
                        f"tensor_parallel.params[{name!r}].logical_shape {split.logical_shape} "
                        f"is not the param's shape {entry.shape}"
                    )
        return self

    def _check_partition_states(self, index: int, group: OptimizerGroup) -> None:
        """A group's partition states are named under its first member (§2), each under a key
        the member holds no array of; stored there (format 3.0) or in a stack (3.1)."""
        if not group.partition_states:
            return
        if not group.params:
            raise ValueError(f"optimizer group {index} has partition states but no params")
        first = group.params[0]
        entry = self.params[first]
        for key, state in group.partition_states.items():
            _refuse(name_problem(key, "state"))
            own = state_array_path(first, key)
            stacked = state.array.stack is not None
            if (stack_number(state.array.path) is None) if stacked else state.array.path != own:
                raise ValueError(
                    f"optimizer group {index} partition state {key!r} points to "
                    f"{state.array.path!r}, not {'a stack' if stacked else repr(own)}"
                )
            if key in entry.states or key in entry.whole_states:
                raise ValueError(
                    f"optimizer group {index} partition state {key!r} collides with an array "
                    f"of {first!r}"
                )

    def arrays(self) -> list[tuple[str, ArrayRef]]:
        """Every logical array, ``(name, ref)``, in plan order: per parameter its elementwise
        states then its whole ones (``params/<fqn>/<state>``), then buffers
        (``buffers/<fqn>``), then optimizer groups' partition states (under the group's first
        member): the names format 3.0 gave their arrays, which name them in messages whatever
        their stack."""
        named = [
            (state_array_path(fqn, state), ref)
            for fqn, entry in self.params.items()
            for state, ref in chain(entry.states.items(), entry.whole_states.items())
        ]
        named += [(buffer_array_path(fqn), entry.array) for fqn, entry in self.buffers.items()]
        groups = self.optimizer.groups if self.optimizer is not None else []
        named += [
            (state_array_path(group.params[0], key), state.array)
            for group in groups
            if group.params
            for key, state in group.partition_states.items()
        ]
        return named

    def resolve(self, name: str) -> str:
        """Return the owner fqn of ``name`` (itself unless it is a tied alias).

        A name with wrapper components (``_checkpoint_wrapped_module.``, ``_orig_mod.``,
        ``_fsdp_wrapped_module.``: :mod:`ucformat.format.names`) that the store does not hold
        resolves as the name without them.
        """
        if name not in self.params and name not in self.tied:
            name = model_name(name)
        return self.tied.get(name, name)
