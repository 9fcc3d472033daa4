"""Object storage for real: every command against moto's S3 server on 127.0.0.1.

The server is the session's ``s3`` fixture (``tests/s3server.py``): a separate process speaking
the S3 protocol, reached by s3fs through the usual botocore settings (``AWS_ENDPOINT_URL`` and
credentials in the environment). Nothing on the client side is mocked. Each test compares with
the same operation on a local store: the objects, the values and the exported files must be
identical, byte for byte. Requests are counted on the server (moto's request recorder) and
must equal both the reader's own count and the read-cost model's prediction.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from tests.cli.helpers import assert_user_error, invoke
from tests.conftest import S3_BUCKET
from tests.helpers import chunk_offset, chunk_place, read_cost
from tests.integration.test_export_torch import check_plain_torch_load, fresh
from tests.s3server import Request, S3Server
from tests.truth import load_truth
from ucformat.errors import IncompleteStoreError, StoreWriteError
from ucformat.format.spec import MANIFEST_KEY

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
#: ZeRO-2 at 3 ranks with frozen params, a tied alias and buffers (0-d included).
CASE = "z2-fp32-dsadam-ftb-ws3"
SOURCE = DATA / CASE / "ckpt"
#: Small chunks and shards: several shards per array and several chunks per shard, so reads
#: cross shard boundaries and runs of chunks.
OPTIONS: dict[str, Any] = {"chunk_bytes": 16, "shard_bytes": 64}


def objects(server: S3Server, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` (keys relative to it), with its bytes."""
    client = server.client()
    out: dict[str, bytes] = {}
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=S3_BUCKET, Prefix=f"{prefix}/"
    ):
        for item in page.get("Contents", []):
            body = client.get_object(Bucket=S3_BUCKET, Key=item["Key"])["Body"].read()
            out[item["Key"].removeprefix(f"{prefix}/")] = body
    return out


def files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (paths relative to it), with its bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def url(prefix: str) -> str:
    return f"s3://{S3_BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def stores(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The case converted twice, with the same options: to a local folder and to S3."""
    local = tmp_path_factory.mktemp("s3-local") / "store.ucf"
    ucformat.convert(SOURCE, local, **OPTIONS)
    ucformat.convert(SOURCE, url("conv/store.ucf"), **OPTIONS)
    return local, url("conv/store.ucf")


@pytest.fixture
def auth_after(s3: S3Server) -> Iterator[Any]:
    """``auth_after(n)``: the server serves ``n`` more requests, then refuses every one."""
    yield s3.refuse_after
    s3.refuse_after(float("inf"))


def test_convert_to_s3_writes_the_local_objects(s3: S3Server, stores: tuple[Path, str]) -> None:
    local, _ = stores
    remote = objects(s3, "conv/store.ucf")
    here = files(local)
    assert sorted(remote) == sorted(here)
    assert len([k for k in here if "/c." in k]) > 20  # many shard objects
    for key in here:
        if key != MANIFEST_KEY:
            assert remote[key] == here[key], key
    mine, theirs = json.loads(remote[MANIFEST_KEY]), json.loads(here[MANIFEST_KEY])
    assert {k for k in mine if mine[k] != theirs[k]} <= {"created_at", "digest"}


def test_open_read_is_bit_exact_and_requests_are_counted_on_the_server(
    s3: S3Server, stores: tuple[Path, str]
) -> None:
    local, remote = stores
    here, there = ucformat.open(local), ucformat.open(remote)
    assert there.manifest.params == here.manifest.params
    for name, entry in here.manifest.params.items():
        for state in (*entry.states, *entry.scalars):
            want, got = here.read(name, state), there.read(name, state)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), (name, state)
            else:
                assert got == want, (name, state)
    for name in here.manifest.buffers:
        assert torch.equal(there.read(name, "buffer"), here.read(name, "buffer"))

    # One partial read across several shards: the index of each shard (a suffix request) and
    # one range request per shard for its run of chunks, exactly as the cost model says.
    name = max(here.manifest.params, key=lambda n: here.manifest.params[n].numel)
    ref = here.array_ref(name, "exp_avg")
    numel = here.manifest.params[name].numel
    start, stop = 3, numel - 2
    ckpt = ucformat.open(remote)
    s3.record()
    before = (ckpt.stats.requests, ckpt.stats.bytes_read)
    got = ckpt.read_range(name, "exp_avg", start, stop)
    requests: list[Request] = [r for r in s3.recorded() if r.method == "GET"]
    assert torch.equal(got, here.read_range(name, "exp_avg", start, stop))
    cost = read_cost(ref, [(start, stop)])
    assert cost.shards > 2 and cost.data_requests == cost.shards
    assert ckpt.stats.requests - before[0] == cost.requests == len(requests)
    assert ckpt.stats.bytes_read - before[1] == cost.total
    suffixes = [r for r in requests if r.range_bytes is None]
    ranges = [r for r in requests if r.range_bytes is not None]
    assert len(suffixes) == cost.index_requests
    assert {r.range for r in suffixes} == {f"bytes=-{cost.index_bytes // cost.shards}"}
    assert len(ranges) == cost.data_requests
    assert sum(r.range_bytes or 0 for r in ranges) == cost.data_bytes
    assert all(r.key.startswith(f"{S3_BUCKET}/conv/store.ucf/{ref.path}/c.") for r in requests)


def test_torch_load_from_s3(s3: S3Server, stores: tuple[Path, str]) -> None:
    _, remote = stores
    truth = load_truth(DATA / CASE)
    check_plain_torch_load(remote, truth)  # type: ignore[arg-type]  # a URL is a store too
    model, optimizer = fresh(truth["case"])
    s3.record()
    report = uctorch.load(model, optimizer, remote)
    gets = [r for r in s3.recorded() if r.method == "GET"]
    assert report.requests == len(gets) - 1  # the manifest is read by open, before the load
    assert report.bytes_read > 0


def test_inspect_and_verify_from_s3(stores: tuple[Path, str]) -> None:
    local, remote = stores
    shown_local, shown_remote = invoke("inspect", local), invoke("inspect", remote)
    assert shown_remote.exit_code == 0, shown_remote.stderr
    assert shown_remote.stdout.replace(remote, "STORE") == shown_local.stdout.replace(
        str(local), "STORE"
    )
    checked = invoke("verify", remote, "--against", SOURCE)
    assert checked.exit_code == 0, checked.stderr
    assert checked.stdout.startswith(f"ok: {remote}:") and "compared with" in checked.stdout


def test_verify_finds_a_damaged_object_on_s3(s3: S3Server) -> None:
    copy = url("damaged/store.ucf")
    ucformat.convert(SOURCE, copy)
    stored = objects(s3, "damaged/store.ucf")
    manifest = ucformat.open(copy).manifest
    name = max(manifest.params, key=lambda n: manifest.params[n].numel)
    ref = manifest.params[name].states["exp_avg"]
    key, entry, entries = chunk_place(ref, (0,) * len(ref.shape))  # the array's first chunk
    data = bytearray(stored[key])
    data[chunk_offset(bytes(data), entry, entries)] ^= 0xFF
    s3.client().put_object(Bucket=S3_BUCKET, Key=f"damaged/store.ucf/{key}", Body=bytes(data))
    report = ucformat.verify(copy)
    assert not report.ok
    assert [(p.kind, p.path) for p in report.problems] == [("checksum", ref.path)]
    assert f"params/{name}/exp_avg" in report.problems[0].message


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("safetensors", ()),
        ("deepspeed-universal", ()),
        ("deepspeed", ("--world-size", "2", "--stage", "3")),
    ],
)
def test_exports_from_and_to_s3(
    s3: S3Server,
    stores: tuple[Path, str],
    tmp_path: Path,
    command: str,
    options: tuple[str, ...],
) -> None:
    """Local store -> local folder is the reference; an S3 store -> local folder and an
    S3 store -> S3 prefix give the same files, byte for byte."""
    local, remote = stores
    runs = {
        "local": (local, tmp_path / "from-local"),
        "from-s3": (remote, tmp_path / "from-s3"),
        "to-s3": (remote, url(f"exports/{command}")),
    }
    for label, (store, out) in runs.items():
        done = invoke("export", command, store, out, *options, "--quiet")
        assert done.exit_code == 0, (label, done.stderr)
        assert str(out) in done.stdout, done.stdout
    want = files(tmp_path / "from-local")
    assert want
    assert files(tmp_path / "from-s3") == want
    assert objects(s3, f"exports/{command}") == want
    again = invoke("export", command, remote, url(f"exports/{command}"), *options)
    assert_user_error(again, url(f"exports/{command}"), "--overwrite")
    replaced = invoke("export", command, remote, url(f"exports/{command}"), *options, "--overwrite")
    assert replaced.exit_code == 0, replaced.stderr
    assert objects(s3, f"exports/{command}") == want


def test_a_failing_put_mid_convert_is_one_typed_error_and_nothing_commits(
    s3: S3Server, auth_after: Any
) -> None:
    def shard_puts(options: dict[str, Any]) -> list[int]:
        """Where the shard PUTs fall in a convert's requests: a recorded run, fresh prefix."""
        s3.record()
        ucformat.convert(SOURCE, url(f"fail/reference-{len(options)}.ucf"), workers=1, **options)
        recorded = s3.recorded()
        return [i for i, r in enumerate(recorded) if r.method == "PUT" and "/c." in r.key]

    puts = shard_puts(OPTIONS)
    assert len(puts) > 10
    auth_after(puts[len(puts) // 2])  # the same convert elsewhere: its middle shard PUT fails
    with pytest.raises(StoreWriteError, match=r"^s3://ucformat-tests/fail/api\.ucf: writing "):
        ucformat.convert(SOURCE, url("fail/api.ucf"), workers=1, **OPTIONS)
    auth_after(float("inf"))
    cli_puts = shard_puts({})  # the CLI's default chunking
    auth_after(cli_puts[len(cli_puts) // 2])
    done = invoke("convert", SOURCE, url("fail/cli.ucf"), "--workers", "1")
    line = assert_user_error(done, url("fail/cli.ucf"), "nothing was committed")
    assert "PermissionError" in line
    auth_after(float("inf"))

    written = objects(s3, "fail/api.ucf")
    assert MANIFEST_KEY not in written
    assert 0 < len([k for k in written if "/c." in k]) < len(puts)  # it failed mid-write
    with pytest.raises(IncompleteStoreError):
        ucformat.open(url("fail/api.ucf"))
    assert MANIFEST_KEY not in objects(s3, "fail/cli.ucf")


def test_missing_bucket_and_s3_sources_are_one_line(s3: S3Server) -> None:
    assert_user_error(
        invoke("convert", SOURCE, "s3://no-such-bucket-here/x.ucf"),
        "s3://no-such-bucket-here/x.ucf",
        "nothing was committed",
    )
    assert_user_error(
        invoke("convert", url("conv/store.ucf"), url("other.ucf")),
        url("conv/store.ucf"),
        "local folder",
    )
    assert_user_error(invoke("inspect", url("nothing-here.ucf")), url("nothing-here.ucf"))


def test_torch_save_and_save_async_to_s3_equal_a_local_save(s3: S3Server, tmp_path: Path) -> None:
    """``ucformat.torch.save`` / ``save_async`` to an ``s3://`` URL write the objects a local
    save writes (byte for byte; the manifest apart from its provenance), and load back."""
    from tests.fixtures.models import BASE_LR, build_model

    model, groups = build_model("multi", seed=1)
    optimizer = torch.optim.AdamW(groups, lr=BASE_LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    for param in model.parameters():  # a step, so that every optimizer state exists
        param.grad = torch.ones_like(param)
    optimizer.step()
    scheduler.step()
    local = tmp_path / "local.ucf"
    uctorch.save(model, optimizer, local, scheduler=scheduler, **OPTIONS)
    uctorch.save(model, optimizer, url("torch/sync.ucf"), scheduler=scheduler, **OPTIONS)
    handle = uctorch.save_async(model, optimizer, url("torch/async.ucf"), scheduler=scheduler,
                                **OPTIONS)  # fmt: skip
    handle.result(timeout=120)
    want = files(local)
    want_manifest = ucformat.open(local).manifest.model_dump(mode="json")
    for prefix in ("torch/sync.ucf", "torch/async.ucf"):
        got = objects(s3, prefix)
        assert set(got) == set(want)
        assert {k: v for k, v in got.items() if k != MANIFEST_KEY} == {
            k: v for k, v in want.items() if k != MANIFEST_KEY
        }
        manifest = ucformat.open(url(prefix)).manifest.model_dump(mode="json")
        for key in set(manifest) - {"source", "digest"}:
            assert manifest[key] == want_manifest[key], key
    fresh_model, fresh_groups = build_model("multi", seed=2)
    fresh_optimizer = torch.optim.AdamW(fresh_groups, lr=BASE_LR)
    uctorch.load(fresh_model, fresh_optimizer, url("torch/async.ucf"))
    for key, value in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[key], value), key


def test_export_dcp_to_s3(s3: S3Server, stores: tuple[Path, str], tmp_path: Path) -> None:
    """``ucformat export dcp STORE s3://...`` uploads the files a local export writes (the
    ``.metadata`` naming its URL), refuses an existing export without ``--overwrite``, and
    stock DCP reads the uploaded metadata."""
    local, remote = stores
    done = invoke("export", "dcp", local, tmp_path / "dcp", "--quiet")
    assert done.exit_code == 0, done.stderr
    target = url("exports/dcp")
    done = invoke("export", "dcp", remote, target, "--quiet")
    assert done.exit_code == 0, done.stderr
    assert target in done.stdout
    want = files(tmp_path / "dcp")
    got = objects(s3, "exports/dcp")
    assert set(got) == set(want) and ".metadata" in got
    assert {k: v for k, v in got.items() if k != ".metadata"} == {
        k: v for k, v in want.items() if k != ".metadata"
    }
    import pickle

    ours, theirs = pickle.loads(got[".metadata"]), pickle.loads(want[".metadata"])
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert str(ours.storage_meta.checkpoint_id) == target
    again = invoke("export", "dcp", remote, target)
    assert_user_error(again, target, "--overwrite")
    assert invoke("export", "dcp", remote, target, "--overwrite", "--quiet").exit_code == 0
