"""A pickle reader that never runs code from the file.

Pickles name Python callables ("globals") that the standard unpickler imports and calls; a
crafted file can name ``os.system``. This unpickler resolves every global through an explicit
table and refuses any other with :class:`~ucformat.errors.UnsafePickleError` naming the file and
the global. Nothing from the file is imported or called. The table has three kinds of entries:

* **Materialised**: inert builders that ucformat itself implements: tensor rebuilds (which only
  record where bytes are; see :class:`StorageRef`), ``torch.Size`` (a tuple), torch dtypes,
  ``collections.OrderedDict``, ``set``/``frozenset``, and ``_codecs.encode`` restricted to the
  ``latin1`` form pickle protocol 2 uses for ``bytes``.
* **DeepSpeed stand-ins**: ``LossScaler``/``DynamicLossScaler`` and ``fragment_address`` become
  :class:`StandIn` objects that just hold the pickled attributes; ``ZeroStageEnum`` becomes an int.
* **Opaque**: globals known to appear in client state but not needed by ucformat (numpy arrays
  and scalars, ``argparse.Namespace``, ...), plus any the caller adds to
  :attr:`PicklePolicy.opaque_globals`, become :class:`OpaqueObject` placeholders that record their
  name and arguments and do nothing else. They surface in the manifest as unrepresentable
  client state, listed by key and type.

* **DTensors** (a ``torch.save`` of DTensors, as torch_checkpointing writes them): the wrapper
  rebuild becomes a :class:`DTensorRef` (the local tensor's :class:`StorageRef`-backed tensor,
  the global shape, the pickled spec), the spec's classes (:data:`DTENSOR_CLASSES`: mesh,
  layout, placements, tensor meta) are :class:`StandIn` attribute holders.

A PyTorch Distributed Checkpoint's ``.metadata`` is decoded by :func:`load_dcp_metadata_pickle`
with a table of its own: DCP's metadata dataclasses as stand-ins and a few inert values, nothing
else (no tensors, no placeholders). A pickle of plain data (torch_checkpointing's
``metadata.pkl``: dicts, lists, tuples, strings, numbers) is decoded by
:func:`load_data_pickle`, which admits no global at all.

docs/format.md (security) lists the tables and why each entry is there.
"""

from __future__ import annotations

import _compat_pickle
import collections
import importlib
import io
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ucformat.errors import TruncatedFileError, UnsafePickleError
from ucformat.format.dtypes import itemsize

__all__ = [
    "DCP_METADATA_CLASSES",
    "DCP_PLAN_CLASSES",
    "DTENSOR_CLASSES",
    "DTensorRef",
    "DtypeName",
    "OpaqueObject",
    "PicklePolicy",
    "StandIn",
    "StorageRef",
    "load_data_pickle",
    "load_dcp_metadata_pickle",
    "load_pickle",
]

#: torch's storage classes, as ``torch.save`` names them, and the dtype (manifest name) of each.
_STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}

#: Globals kept as inert placeholders by default: harmless data containers seen in client state.
DEFAULT_OPAQUE_GLOBALS: frozenset[str] = frozenset(
    {
        "argparse.Namespace",
        "types.SimpleNamespace",
        "numpy.dtype",
        "numpy.ndarray",
        "numpy.core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar",
        "numpy.dtypes.Float64DType",
        "numpy.dtypes.Float32DType",
        "numpy.dtypes.Int64DType",
        "numpy.dtypes.UInt32DType",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
        "torch.device",
    }
)


@dataclass(frozen=True)
class PicklePolicy:
    """What the unpickler admits beyond its fixed table.

    Attributes:
        opaque_globals: extra ``module.qualname`` globals to keep as inert placeholders.
        all_unknown_opaque: keep *every* unknown global as a placeholder instead of refusing.
            Still executes nothing; meant for client state full of custom classes.
    """

    opaque_globals: frozenset[str] = field(default_factory=frozenset)
    all_unknown_opaque: bool = False


@dataclass(frozen=True)
class StorageRef:
    """A tensor storage named by a pickle: which archive entry holds its bytes."""

    key: str
    dtype_name: str  # as the manifest names dtypes: "float32", "bfloat16", ...
    numel: int

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return itemsize(self.dtype_name)


class StandIn:
    """Attribute holder standing in for a pickled class named by ``ucformat_qualname``."""

    ucformat_qualname: ClassVar[str] = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_init_args"] = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def attributes(self) -> dict[str, Any]:
        """The pickled attributes."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __repr__(self) -> str:
        return f"<{self.ucformat_qualname} {self.attributes()}>"


class OpaqueObject(StandIn):
    """Placeholder for an admitted-but-unneeded global; records arguments, runs nothing."""

    def append(self, item: Any) -> None:
        """Record list-style contents."""
        self.__dict__.setdefault("_items", []).append(item)

    def extend(self, items: Any) -> None:
        """Record list-style contents."""
        self.__dict__.setdefault("_items", []).extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("_mapping", {})[key] = value


def _stand_in(qualname: str, base: type[StandIn] = StandIn) -> type[StandIn]:
    name = qualname.rpartition(".")[2]
    return type(name, (base,), {"ucformat_qualname": qualname, "__module__": "ucformat.standin"})


_DEEPSPEED_STAND_INS: dict[str, type[StandIn]] = {
    name: _stand_in(name)
    for name in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    )
}


#: The classes a PyTorch Distributed Checkpoint ``.metadata`` pickle is made of (torch 2.x).
DCP_METADATA_CLASSES: tuple[str, ...] = (
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
)

#: DCP's planner dataclasses: ``Metadata.all_local_plans`` holds every rank's ``SavePlan`` when
#: the saver keeps them (Megatron-Core's ``torch_dist`` strategy does, to reuse plans). Read as
#: attribute holders and never used: the storage entries say where every item is.
DCP_PLAN_CLASSES: tuple[str, ...] = (
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.TensorWriteData",
)

_DCP_STAND_INS: dict[str, type[StandIn]] = {
    name: _stand_in(name) for name in (*DCP_METADATA_CLASSES, *DCP_PLAN_CLASSES)
}


#: The classes a pickled DTensor's spec is made of (torch 2.x): read as attribute holders.
DTENSOR_CLASSES: tuple[str, ...] = (
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types.Partial",
)

_DTENSOR_STAND_INS: dict[str, type[StandIn]] = {name: _stand_in(name) for name in DTENSOR_CLASSES}


@dataclass(frozen=True, eq=False)
class DTensorRef:
    """A pickled DTensor: its local tensor (as ``make_tensor`` made it), its global shape and
    dtype, and the pickled ``DTensorSpec`` (a :class:`StandIn`: mesh, placements)."""

    local: Any
    shape: tuple[int, ...]
    dtype: Any
    spec: Any


@dataclass(frozen=True)
class _WrapperArgs:
    """``_rebuild_wrapper_subclass``'s arguments: the subclass's global geometry."""

    kind: Any
    dtype: Any
    shape: tuple[int, ...]


def _mem_format(value: Any) -> int:
    """``_MEM_FORMAT_ENCODING(n)`` (an Enum call) is just its number."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise UnsafePickleError(f"_MEM_FORMAT_ENCODING called with {type(value).__name__}")
    return value


def _write_item_type(value: Any) -> int:
    """``WriteItemType(n)`` (an Enum call) is just its number."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise UnsafePickleError(f"WriteItemType called with {type(value).__name__}")
    return value


def _layout_name(name: Any) -> str:
    """``torch.serialization._get_layout("torch.strided")``: keep the layout's name."""
    if not isinstance(name, str):
        raise UnsafePickleError(f"_get_layout called with {type(name).__name__}")
    return name


def _path_text(*parts: Any) -> str:
    """A pickled ``pathlib`` path, as text (never touched as a path)."""
    if not all(isinstance(part, str) for part in parts):
        raise UnsafePickleError("a pickled path has non-text parts")
    return "/".join(parts)


def _zero_stage(value: Any) -> int:
    """``ZeroStageEnum(n)`` is just the stage number."""
    return int(value)


def _latin1_bytes(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it to store ``bytes``."""
    if encoding != "latin1" or not isinstance(text, str):
        raise UnsafePickleError(f"_codecs.encode called with encoding {encoding!r}")
    return text.encode("latin1")


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    return tuple(int(d) for d in dims)


class _TypeMarker:
    """Stands for ``torch.Tensor``/``torch.nn.Parameter`` in ``_rebuild_from_type_v2``."""

    def __init__(self, name: str) -> None:
        self.name = name


_DTENSOR = _TypeMarker("DTensor")


def _dtensor(source: str, wrapper: _WrapperArgs, new_type: Any, state: Any) -> DTensorRef:
    """A DTensor rebuilt from ``_rebuild_wrapper_subclass`` and its pickled state."""
    if wrapper.kind is not _DTENSOR or new_type is not _DTENSOR:
        raise UnsafePickleError(
            f"{source}: _rebuild_wrapper_subclass of {getattr(new_type, 'name', new_type)!r}, "
            "not a DTensor; ucformat reads no other tensor subclass."
        )
    if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
        state = {**(state[0] or {}), **(state[1] or {})}
    if not isinstance(state, dict) or "_local_tensor" not in state or "_spec" not in state:
        raise UnsafePickleError(f"{source}: a pickled DTensor without its local tensor and spec.")
    return DTensorRef(state["_local_tensor"], wrapper.shape, wrapper.dtype, state["_spec"])


class _StorageType:
    def __init__(self, dtype_name: str) -> None:
        self.dtype_name = dtype_name


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """Map Python 2 names (pickle protocol 2 writes ``__builtin__``) to Python 3 ones."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        mapped: tuple[str, str] = _compat_pickle.NAME_MAPPING[(module, name)]
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


MakeTensor = Callable[[StorageRef, int, tuple[int, ...], tuple[int, ...]], Any]


def load_pickle(
    payload: bytes, *, source: str, policy: PicklePolicy, make_tensor: MakeTensor
) -> Any:
    """Decode ``payload`` (a ``data.pkl``) under the allow-list.

    Args:
        payload: the pickle bytes.
        source: the file name used in error messages.
        policy: extra admissions (see :class:`PicklePolicy`).
        make_tensor: called with ``(storage, offset, shape, stride)`` for every tensor.
    """

    def rebuild_tensor(storage: StorageRef, offset: int, size: Any, stride: Any, *_: Any) -> Any:
        return make_tensor(storage, int(offset), _torch_size(size), _torch_size(stride))

    def rebuild_parameter(data: Any, *_: Any) -> Any:
        return data

    def rebuild_wrapper(kind: Any, dtype: Any, size: Any, *_: Any) -> _WrapperArgs:
        return _WrapperArgs(kind, dtype, _torch_size(size))

    def rebuild_from_type(func: Callable[..., Any], new_type: Any, args: Any, state: Any) -> Any:
        if func is rebuild_wrapper:
            return _dtensor(source, func(*args), new_type, state)
        if func not in (rebuild_tensor, rebuild_parameter):
            raise UnsafePickleError(f"{source}: _rebuild_from_type_v2 wraps a foreign function.")
        return func(*args)

    table: dict[str, Any] = {
        "torch._utils._rebuild_tensor_v2": rebuild_tensor,
        "torch._utils._rebuild_tensor": rebuild_tensor,
        "torch._utils._rebuild_parameter": rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": rebuild_from_type,
        "torch._utils._rebuild_wrapper_subclass": rebuild_wrapper,
        "torch.distributed.tensor.DTensor": _DTENSOR,
        "torch.distributed.tensor._api.DTensor": _DTENSOR,
        "torch.serialization._get_layout": _layout_name,
        **_DTENSOR_STAND_INS,
        "torch.Tensor": _TypeMarker("Tensor"),
        "torch.nn.parameter.Parameter": _TypeMarker("Parameter"),
        "torch.Size": _torch_size,
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "_codecs.encode": _latin1_bytes,
        "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
        **_DEEPSPEED_STAND_INS,
    }

    def persistent_load(pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{source}: unknown persistent id {pid!r:.80}.")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise UnsafePickleError(f"{source}: unknown storage type {storage_type!r:.80}.")
        return StorageRef(str(key), storage_type.dtype_name, int(numel))

    return _restricted_load(payload, source, table, policy, persistent_load, torch_file=True)


def load_data_pickle(payload: bytes, *, source: str) -> Any:
    """Decode a pickle of plain data (dicts, lists, tuples, strings, numbers, None).

    No global is admitted (not even a placeholder), no persistent id: anything else is refused
    with :class:`~ucformat.errors.UnsafePickleError`.
    """

    def persistent_load(pid: Any) -> Any:
        raise UnsafePickleError(f"{source}: unexpected persistent id {pid!r:.80}.")

    return _restricted_load(
        payload, source, {}, PicklePolicy(), persistent_load, torch_file=False, plain=True
    )


def load_dcp_metadata_pickle(payload: bytes, *, source: str) -> Any:
    """Decode a PyTorch Distributed Checkpoint ``.metadata`` pickle under its own allow-list.

    Admitted: the DCP metadata dataclasses of :data:`DCP_METADATA_CLASSES` and the planner
    dataclasses of :data:`DCP_PLAN_CLASSES` (as attribute-holding :class:`StandIn` objects),
    ``_MEM_FORMAT_ENCODING`` and ``WriteItemType`` (Enum calls: ints), ``torch.serialization.
    _get_layout`` (the layout's name), ``torch.Size`` (a tuple), torch dtypes (as
    :class:`DtypeName`: torch is not imported), ``pathlib``
    paths (text) and ``collections.OrderedDict``. No tensor, no persistent id, no placeholder:
    any other global is refused with :class:`~ucformat.errors.UnsafePickleError`.
    """
    table: dict[str, Any] = {
        **_DCP_STAND_INS,
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": _mem_format,
        "torch.distributed.checkpoint.planner.WriteItemType": _write_item_type,
        "torch.serialization._get_layout": _layout_name,
        "torch.Size": _torch_size,
        "collections.OrderedDict": collections.OrderedDict,
        "pathlib.PosixPath": _path_text,
        "pathlib.PurePosixPath": _path_text,
        "pathlib.WindowsPath": _path_text,
        "pathlib.PureWindowsPath": _path_text,
    }

    def persistent_load(pid: Any) -> Any:
        raise UnsafePickleError(f"{source}: unexpected persistent id {pid!r:.80}.")

    return _restricted_load(
        payload, source, table, PicklePolicy(), persistent_load, torch_file=False
    )


#: torch dtype attribute names (and aliases) -> the manifest's dtype name, for ``.metadata``.
_DTYPE_ATTRIBUTES: dict[str, str] = {
    "float64": "float64", "double": "float64", "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64",
    "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8", "bool": "bool",
}  # fmt: skip


_DTYPE_LIKE = re.compile(r"^(float|bfloat|int|uint|complex|qint|quint)[0-9a-z_]*$")


class DtypeName(str):
    """A pickled torch dtype, by name only (``.metadata`` is read without importing torch)."""

    __slots__ = ()


def _restricted_load(
    payload: bytes,
    source: str,
    table: dict[str, Any],
    policy: PicklePolicy,
    persistent_load: Callable[[Any], Any],
    *,
    torch_file: bool,
    plain: bool = False,
) -> Any:
    """Unpickle ``payload`` resolving globals through ``table`` (+ torch dtypes, placeholders;
    ``plain``: nothing but ``table``)."""
    opaque_classes: dict[str, type[StandIn]] = {}
    admit_opaque = torch_file  # the .metadata reader admits no placeholders at all

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            module, name = _python3_name(module, name)
            qualname = f"{module}.{name}"
            if qualname in table:
                return table[qualname]
            if plain:
                pass
            elif module == "torch" and not torch_file:
                if name in _DTYPE_ATTRIBUTES or _DTYPE_LIKE.match(name):  # a name, nothing more
                    return DtypeName(_DTYPE_ATTRIBUTES.get(name, name))
            elif module == "torch":
                if name in _STORAGE_DTYPES:
                    return _StorageType(_STORAGE_DTYPES[name])
                torch = importlib.import_module("torch")  # a pickled dtype: rare, so lazy
                attribute = getattr(torch, name, None)
                if isinstance(attribute, torch.dtype):
                    return attribute
            if admit_opaque and (
                qualname in DEFAULT_OPAQUE_GLOBALS
                or qualname in policy.opaque_globals
                or policy.all_unknown_opaque
            ):
                if qualname not in opaque_classes:
                    opaque_classes[qualname] = _stand_in(qualname, OpaqueObject)
                return opaque_classes[qualname]
            advice = (
                " If this is trusted client state, pass --opaque-global "
                f"{qualname} to keep it as an inert placeholder."
                if torch_file
                else ""
            )
            raise UnsafePickleError(
                f"{source}: refusing to load: the pickle references the global '{qualname}', "
                f"which is not on ucformat's allow-list (nothing was executed).{advice}"
            )

        def persistent_load(self, pid: Any) -> Any:
            return persistent_load(pid)

    try:
        return _Unpickler(io.BytesIO(payload)).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise TruncatedFileError(
            f"{source}: the pickle inside is damaged ({type(exc).__name__}: {exc})."
        ) from None
