"""The golden stores read bit-exactly (a) through ucformat and (b) through tensorstore.

tensorstore is an independent zarr v3 implementation (C++): reading every array of every golden
store through it, with nothing but the store path (and, for a format-3.1 stack, the index the
manifest gives), checks that the stores are plain zarr v3 as docs/format.md §2 promises
(sharding codec, crc32c, default key encoding with '/' or, for stacks, '.', little-endian,
bfloat16 as uint16 bit patterns); zarr-python opens the format-3.1 stores as a hierarchy.
The digest is recomputed with ``rfc8785``, another independent implementation, from the
manifest bytes alone (§3.7). Expected values come from the DeepSpeed
engine's own dump (see make_golden.py), never from the stores.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rfc8785
import tensorstore as ts
import torch

import ucformat
from tests.conformance.make_golden import EXPECTED, GOLDEN, GOLDENS, Golden
from ucformat.format.dtypes import DTYPE_NAMES
from ucformat.format.spec import FORMAT_VERSION, buffer_array_path, state_array_path

STORES = [pytest.param(g, id=g.name) for g in GOLDENS]


def expected(golden: Golden) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((EXPECTED / golden.name / "values.json").read_text())
    return document


def want_bits(golden: Golden, entry: dict[str, Any]) -> np.ndarray:
    values: np.ndarray = np.load(EXPECTED / golden.name / entry["npy"], allow_pickle=False)
    return values


def want_tensor(golden: Golden, entry: dict[str, Any]) -> torch.Tensor:
    """The expected values as a tensor of the logical dtype (bfloat16 from its bit patterns)."""
    values = torch.from_numpy(want_bits(golden, entry).copy())
    return values.view(torch.bfloat16) if entry["dtype"] == "bfloat16" else values


def bits(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<")).tobytes()


def torch_bits(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


@pytest.mark.parametrize("golden", STORES)
def test_golden_through_ucformat(golden: Golden) -> None:
    want = expected(golden)
    ckpt = ucformat.open(GOLDEN / golden.name)
    manifest = ckpt.manifest
    assert manifest.format_version == (golden.version or FORMAT_VERSION)
    seen = set()
    stacked = golden.version is None  # the current writer: format 3.1's stacks
    for name, entry in manifest.params.items():
        for state, ref in entry.states.items():
            path = state_array_path(name, state)
            assert (ref.stack is not None) == stacked and (stacked or ref.path == path), path
            seen.add(path)
            target = want["arrays"][path]
            assert ref.dtype == target["dtype"] and ref.shape == target["shape"], path
            if state == "fp32" and not entry.requires_grad:  # format 1's name: read upcast
                assert golden.legacy, ref.path
                got = ckpt.read(name, state)
                assert bits(got.numpy()) == bits(want_tensor(golden, target).float().numpy())
                continue
            assert bits(torch_bits(ckpt.read(name, state))) == bits(want_bits(golden, target))
        for state, scalar in entry.scalars.items():
            target = want["scalars"][name][state]
            assert scalar.kind == target["kind"] and scalar.value == target["value"]
            assert scalar.dtype == target.get("dtype")
        if not entry.requires_grad:  # "fp32" of a frozen parameter: its value upcast, both formats
            value = ckpt.read(name, "fp32")
            assert value.dtype == torch.float32
            frozen = want["arrays"][state_array_path(name, "fp32" if golden.legacy else "value")]
            assert bits(value.numpy()) == bits(want_tensor(golden, frozen).float().numpy()), name
    for name, buffer in manifest.buffers.items():
        path = buffer_array_path(name)
        assert (buffer.array.stack is not None) == stacked, path
        seen.add(path)
        target = want["arrays"][path]
        assert bits(torch_bits(ckpt.read(name, "buffer"))) == bits(want_bits(golden, target))
    assert seen == set(want["arrays"]), "the store holds exactly the expected arrays"
    assert manifest.tied == want["tied"]
    assert manifest.optimizer is not None
    assert [g.params for g in manifest.optimizer.groups] == want["groups"]
    assert ucformat.verify(GOLDEN / golden.name).ok


@pytest.mark.parametrize("golden", STORES)
def test_golden_through_tensorstore(golden: Golden) -> None:
    want = expected(golden)
    root = GOLDEN / golden.name
    refs = dict(ucformat.open(root).manifest.arrays())
    for path, target in want["arrays"].items():
        ref = refs[path]
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / ref.path)}}
        array = ts.open(spec, open=True, read=True).result()
        if ref.stack is not None:  # index i of the stack (§2.5)
            assert list(array.shape) == [ref.stack.size, *target["shape"]], path
            array = array[ref.stack.index]
        values = np.asarray(array.read().result())
        stored = "uint16" if target["dtype"] == "bfloat16" else target["dtype"]
        assert values.dtype == np.dtype("bool" if stored == "bool" else stored), path
        assert list(values.shape) == target["shape"], path
        assert bits(values) == bits(want_bits(golden, target)), path
        attributes = json.loads((root / ref.path / "zarr.json").read_text())["attributes"]
        assert attributes == {"ucformat": {"dtype": target["dtype"]}}, path


@pytest.mark.parametrize(
    "golden", [pytest.param(g, id=g.name) for g in GOLDENS if g.version is None]
)
def test_zarr_python_opens_stacks_as_a_hierarchy(golden: Golden) -> None:
    """A format-3.1 store is a zarr v3 hierarchy zarr-python walks from its root: the group
    ``stacks`` holds every stack, and index ``i`` of a stack is the logical array there."""
    import zarr

    want = expected(golden)
    root = zarr.open_group(str(GOLDEN / golden.name), mode="r", zarr_format=3)
    stacks = root["stacks"]
    assert isinstance(stacks, zarr.Group)
    members = dict(stacks.arrays())
    refs = dict(ucformat.open(GOLDEN / golden.name).manifest.arrays())
    assert set(members) == {ref.path.removeprefix("stacks/") for ref in refs.values()}
    for path, target in want["arrays"].items():
        ref = refs[path]
        assert ref.stack is not None
        values = np.asarray(members[ref.path.removeprefix("stacks/")][ref.stack.index])
        assert bits(values) == bits(want_bits(golden, target)), path


@pytest.mark.parametrize("golden", STORES)
def test_golden_digest_independently(golden: Golden) -> None:
    raw = (GOLDEN / golden.name / "ucformat.json").read_bytes()
    document = json.loads(raw)
    body = {**document, "digest": None}
    if golden.legacy:  # format 1's rule (§3.7)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    else:
        canonical = rfc8785.dumps(body)
    assert document["digest"] == "sha256:" + hashlib.sha256(canonical).hexdigest()


def test_golden_stores_cover_the_format() -> None:
    """The set of golden stores holds every case the issue lists (so it cannot shrink silently)."""
    dtypes: set[str] = set()
    compressors: set[str] = set()
    frozen: set[str] = set()
    kinds: set[str] = set()
    overhang, tied, buffers, groups = False, 0, 0, 0
    for golden in GOLDENS:
        manifest = ucformat.open(GOLDEN / golden.name).manifest
        refs = [r for e in manifest.params.values() for r in e.states.values()]
        refs += [b.array for b in manifest.buffers.values()]
        for ref in refs:
            dtypes.add(ref.dtype)
            compressors.add(ref.compressor)
            overhang |= any(
                dim % chunk or dim % shard
                for dim, chunk, shard in zip(
                    ref.shape, ref.chunk_shape, ref.shard_shape, strict=True
                )
            )
        frozen |= {e.dtype for e in manifest.params.values() if not e.requires_grad}
        tied += len(manifest.tied)
        buffers += len(manifest.buffers)
        kinds |= {s.kind for e in manifest.params.values() for s in e.scalars.values()}
        groups = max(groups, len(manifest.optimizer.groups if manifest.optimizer else []))
    assert dtypes == set(DTYPE_NAMES), "every dtype of §2.3"
    assert compressors == {"none", "zstd"}
    assert overhang and tied and buffers and groups >= 2
    assert {"float16", "bfloat16", "float32"} <= frozen
    assert {"int", "tensor"} <= kinds


def test_tensorstore_reads_names_with_dots_and_unicode(tmp_path: Path) -> None:
    """§2.4: in a store of format 3.0 or older a name's key is its UTF-8, unescaped; another
    zarr reader finds it by that key."""
    from ucformat.format.stacks import StoredArray
    from ucformat.store.arrays import create_array, write_region
    from ucformat.store.keys import open_store

    store = open_store(tmp_path / "s", read_only=False)
    names = ["layers.0.attn.q_proj.weight", "ü.größe", "层.权重", "emoji😀.w", "a-b_c~d(e)"]
    for index, name in enumerate(names):
        ref = StoredArray(state_array_path(name, "fp32"), "float32", (3, 2), (1, 2), (2, 2))
        array = create_array(store, ref)
        write_region(array, (slice(0, 3), slice(0, 2)), np.full((3, 2), index, np.float32))
    for index, name in enumerate(names):
        directory = Path(store.root) / "params" / name / "fp32"  # (staged: uncommitted)
        assert directory.is_dir(), name  # the key is the name itself, no escaping
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(directory)}}
        values = ts.open(spec, open=True, read=True).result().read().result()
        assert (np.asarray(values) == index).all(), name


def test_inspect_names_states_for_what_they_hold() -> None:
    """Item 6: a frozen fp16 parameter's value is `value (float16)`; format 1's `fp32` name for
    it is shown with what it holds; master weights and Adam states are plain float32."""
    from tests.cli.helpers import invoke

    def row(store: str, name: str) -> str:
        result = invoke("inspect", GOLDEN / store, "--param", name)
        assert result.exit_code == 0, result.output
        (line,) = [line for line in result.stdout.splitlines() if line.startswith(name + " ")]
        return line

    assert "frozen  value (float16) " in row("z1-fp16-tadam-ftb", "frozen.weight")
    assert "value (bfloat16)" in row("z3-bf16-dsadam-ftb-zstd", "frozen.weight")
    assert "value  " in row("z2-fp32-dsadam-ftb", "frozen.weight")
    legacy = row("v1.0-z1-fp16-tadam-ftb", "frozen.weight")
    assert "fp32 (float16 value, format-1 name)" in legacy
    assert "fp32, exp_avg, exp_avg_sq, step" in row("z1-fp16-tadam-ftb", "down.weight")
