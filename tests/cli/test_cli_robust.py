"""The CLI a newcomer reads (issue #21 items 7, 8, 10): help, usage errors, explicit distributed
convert, unreachable object stores, the schema tool. Messages are checked verbatim."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from ucformat.errors import StoreExistsError

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"


def test_help_shows_defaults_and_readable_metavars() -> None:
    result = invoke("convert", "--help")
    assert result.exit_code == 0
    text = result.stdout
    assert text.startswith("Usage: ucformat convert [OPTIONS] SRC DST\n")
    assert "--compress TEXT       Chunk compression: none or zstd.  [default: none]" in text
    assert "--chunk-kib N" in text and "--distributed" in text
    assert "<str>" not in text and "<bool>" not in text and "{src}" not in text
    assert "╭" not in text  # no Rich boxes
    export = invoke("export", "dcp", "--help").stdout
    assert "Usage: ucformat export dcp [OPTIONS] STORE OUT" in export
    assert "[default: flat]" in export


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["convert", "a", "b", "--compress", "lz4"],
            "error: Invalid value for --compress: must be 'none' or 'zstd' (see 'ucformat "
            "convert --help')",
        ),
        (
            ["export", "deepspeed", "a", "b", "--world-size", "0", "--stage", "2"],
            "error: Invalid value for '--world-size': Input should be greater than or equal to 1 "
            "(see 'ucformat export deepspeed --help')",
        ),
        (
            ["convert", "a", "b", "--bogus"],
            "error: No such option: --bogus (see 'ucformat convert --help')",
        ),
    ],
)
def test_usage_errors_are_one_line(args: list[str], line: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [line]


def test_distributed_convert_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's environment (a training job's rank 0) does not make a plain convert join it."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    for key, value in {
        "WORLD_SIZE": "4",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    done = invoke("convert", SOURCE / "ckpt", tmp_path / "s.ucf", "-q")
    assert done.exit_code == 0, done.stderr
    assert ucformat.verify(tmp_path / "s.ucf").ok
    monkeypatch.delenv("WORLD_SIZE")
    result = invoke("convert", "--distributed", SOURCE / "ckpt", tmp_path / "t.ucf")
    assert result.stderr.splitlines() == [
        "error: Invalid value for --distributed: needs torchrun's environment (WORLD_SIZE > 1, "
        "RANK, MASTER_ADDR); launch it as 'torchrun --nproc_per_node N -m ucformat_cli convert "
        "--distributed SRC DST' (see 'ucformat convert --help')"
    ]


def test_unreachable_object_store_is_one_store_write_error(monkeypatch: pytest.MonkeyPatch) -> None:
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches clients across endpoints
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # closed when the block ends: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(s3fs.S3FileSystem, "_cache", {})  # and not reused after it
    line = assert_user_error(
        invoke("convert", SOURCE / "ckpt", "s3://bucket/x.ucf", "-q"),
        "error: s3://bucket/x.ucf: locking the destination failed (EndpointConnectionError: ",
        "nothing was committed. The object store did not answer (endpoint, network, server): "
        "check it, then re-run with --overwrite.",
    )
    assert "FsspecStore" not in line


def test_api_messages_name_the_keyword(tmp_path: Path) -> None:
    ucformat.convert(SOURCE / "ckpt", tmp_path / "s.ucf")
    with pytest.raises(StoreExistsError) as info:
        ucformat.convert(SOURCE / "ckpt", tmp_path / "s.ucf")
    assert str(info.value) == (
        f"{tmp_path / 's.ucf'}: already exists and is not empty; pass overwrite=True to replace it."
    )
    assert_user_error(
        invoke("convert", SOURCE / "ckpt", tmp_path / "s.ucf"),
        "already exists and is not empty; pass --overwrite to replace it.",
    )


def test_schema_tool_never_writes_by_accident(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "ucformat.format.schema"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    shown = subprocess.run([*run, "--help"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and "usage:" in shown.stdout
    printed = subprocess.run([*run, "--stdout"], cwd=tmp_path, capture_output=True, text=True)
    assert printed.returncode == 0 and '"$schema"' in printed.stdout
    bad = subprocess.run([*run, "oops.json"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2
    assert list(tmp_path.iterdir()) == []
