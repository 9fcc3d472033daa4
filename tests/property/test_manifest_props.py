"""Properties of the manifest: exact JSON round trips, and any edit is caught.

Random manifests are built from the pydantic models (consistent references: optimizer groups,
tied aliases), random Python values go through :mod:`ucformat.format.pyvalue`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ucformat.errors import ManifestError
from ucformat.format.dtypes import DTYPE_NAMES, itemsize
from ucformat.format.models import (
    ArrayRef,
    BufferEntry,
    CheckpointManifest,
    ClientState,
    LossScaler,
    OptimizerGroup,
    OptimizerInfo,
    ParamEntry,
    ScalarState,
    SourceInfo,
    TrainingProgress,
)
from ucformat.format.pyvalue import decode, encode
from ucformat.format.schema import SCHEMA_PATH
from ucformat.store.manifest_io import manifest_digest, parse_manifest

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMA = jsonschema.validators.validator_for(json.loads(SCHEMA_PATH.read_text()))(
    json.loads(SCHEMA_PATH.read_text())
)

finite = st.floats(allow_nan=False, allow_infinity=False)
names = st.from_regex(r"[a-z]{1,5}(\.[a-z0-9_]{1,4}){0,2}", fullmatch=True)
scalar_tensors = st.builds(
    lambda value, dtype: torch.tensor(value, dtype=dtype),
    st.integers(-100, 100),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.float64]),
) | st.builds(torch.tensor, st.floats(width=32), dtype=st.just(torch.float32))
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool])
    | scalar_tensors
)
keys = st.text(max_size=6) | st.integers(-5, 5) | st.booleans() | st.none() | st.just("$tuple")
python_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.dictionaries(st.tuples(st.integers(0, 3), st.text(max_size=2)), inner, max_size=3)
    ),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types; tensors bit for bit.

    NaN equals NaN: ``{"$float": "nan"}`` keeps NaN-ness, not a NaN's sign or payload bits.
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point() and bool(a.isnan().all()) and bool(b.isnan().all()):
            return True
        return a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(python_values)
@FAST
def test_pyvalue_round_trips_exactly_through_json_text(value: Any) -> None:
    text = json.dumps(encode(value), allow_nan=False)
    assert same(decode(json.loads(text)), value)


@given(python_values)
@FAST
def test_encoded_values_are_valid_manifest_json(value: Any) -> None:
    state = ClientState(values={"k": encode(value)})
    assert ClientState.model_validate_json(state.model_dump_json()) == state


@st.composite
def array_refs(draw: st.DrawFn, path: str, shape: list[int]) -> ArrayRef:
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    numel = math.prod(shape)
    return ArrayRef(
        path=path,
        dtype=dtype,
        shape=shape,
        chunk_shape=[max(1, d) for d in shape],
        shard_shape=[max(1, d) for d in shape],
        nbytes=numel * itemsize(dtype),
        compressor=draw(st.sampled_from(["none", "zstd"])),
    )


scalar_states = st.one_of(
    st.builds(ScalarState, kind=st.just("int"), value=st.integers(0, 2**40)),
    st.builds(ScalarState, kind=st.just("float"), value=finite),
    st.builds(ScalarState, kind=st.just("bool"), value=st.booleans()),
    st.builds(ScalarState, kind=st.just("tensor"), value=finite, dtype=st.just("float32")),
)


@st.composite
def manifests(draw: st.DrawFn) -> CheckpointManifest:
    fqns = draw(st.lists(names, min_size=0, max_size=5, unique=True))
    group_count = draw(st.integers(1, 3))
    params: dict[str, ParamEntry] = {}
    for fqn in fqns:
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        group = draw(st.none() | st.integers(0, group_count - 1))
        states = ["fp32"] + (["exp_avg", "exp_avg_sq"] if group is not None else [])
        params[fqn] = ParamEntry(
            shape=shape,
            dtype=draw(st.sampled_from(DTYPE_NAMES)),
            requires_grad=group is not None,
            group=group,
            states={s: draw(array_refs(f"params/{fqn}/{s}", shape)) for s in states},
            scalars=draw(st.dictionaries(st.sampled_from(["step", "t"]), scalar_states)),
        )
    aliases = draw(st.lists(names.filter(lambda n: n not in params), max_size=2, unique=True))
    tied = {alias: draw(st.sampled_from(fqns)) for alias in aliases} if fqns else {}
    groups = [
        OptimizerGroup(
            params=[f for f, e in params.items() if e.group == index],
            hyperparams={
                k: encode(v)
                for k, v in draw(st.dictionaries(names, python_values, max_size=3)).items()
            },
        )
        for index in range(group_count)
    ]
    buffers = {
        name: BufferEntry(
            shape=[2], dtype="float32", array=draw(array_refs(f"buffers/{name}", [2]))
        )
        for name in draw(st.lists(names.filter(lambda n: n not in params), max_size=2, unique=True))
    }
    scaler = draw(
        st.none()
        | st.builds(
            LossScaler,
            class_name=st.just("DynamicLossScaler"),
            dynamic=st.booleans(),
            cur_scale=finite,
            attributes=st.dictionaries(names, python_values.map(encode), max_size=3),
        )
    )
    return CheckpointManifest(
        created_by="hypothesis",
        source=SourceInfo(
            framework_version="0.19.8",
            path=draw(st.text(max_size=10)),
            tag="global_step4",
            zero_stage=draw(st.integers(1, 3)),
            world_size=draw(st.integers(1, 64)),
            train_dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
            optimizer_wrapper="DeepSpeedZeroOptimizer",
            files=[],
            ds_config=encode(draw(python_values)),
        ),
        params=params,
        tied=tied,
        buffers=buffers,
        optimizer=OptimizerInfo(
            name="FusedAdam",
            state_keys=["exp_avg", "exp_avg_sq"],
            scalar_keys=["step"],
            groups=groups,
        ),
        progress=TrainingProgress(
            global_steps=draw(st.integers(0, 10**9)),
            lr_scheduler=encode(draw(python_values)),
            loss_scaler=scaler,
            clip_grad=draw(st.none() | finite),
        ),
        client_state=ClientState(
            values={
                k: encode(v)
                for k, v in draw(st.dictionaries(names, python_values, max_size=3)).items()
            },
            unrepresentable=draw(st.dictionaries(names, names, max_size=2)),
        ),
    )


def _stamped_text(manifest: CheckpointManifest) -> str:
    return manifest.model_copy(update={"digest": manifest_digest(manifest)}).model_dump_json(
        indent=1
    )


@given(manifests())
@FAST
def test_manifest_round_trips_through_json_and_matches_the_schema(
    manifest: CheckpointManifest,
) -> None:
    text = _stamped_text(manifest)
    parsed = parse_manifest(text.encode(), "store")
    assert parsed.model_copy(update={"digest": None}) == manifest
    assert parsed.digest == manifest_digest(parsed)
    SCHEMA.validate(json.loads(text))


def _leaves(document: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(document, dict):
        return [leaf for key, value in document.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(document, list):
        return [leaf for i, value in enumerate(document) for leaf in _leaves(value, (*path, i))]
    return [path]


def _edited(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if abs(value) < 2**52 else value / 2
    if isinstance(value, str):
        return value + "x"
    return 0


@given(manifests(), st.data())
@FAST
def test_any_edited_value_is_refused(manifest: CheckpointManifest, data: st.DataObject) -> None:
    document = json.loads(_stamped_text(manifest))
    paths = [p for p in _leaves(document) if p != ("digest",)]
    path = data.draw(st.sampled_from(paths))
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = _edited(target[path[-1]])
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(document).encode(), "store")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused_not_lost(bad: float) -> None:
    with pytest.raises(ValidationError, match="finite number"):
        TrainingProgress(clip_grad=bad)
    with pytest.raises(ValidationError, match="finite number"):
        ScalarState(kind="float", value=bad)
    assert same(decode(json.loads(json.dumps(encode(bad)))), bad)  # pyvalue keeps them exactly
