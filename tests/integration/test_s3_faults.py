"""An S3 server stopped in the middle of a convert (issue #21 item 8): one ``StoreWriteError``
line naming the URL (never a store's repr), nothing committed, no traceback from the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import s3fs

import ucformat
from tests.s3server import S3Server
from ucformat.errors import StoreWriteError
from ucformat.write.convert import ConvertHooks

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"


def test_server_stopped_mid_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches clients across endpoints
    server = S3Server().start()
    try:
        server.create_bucket("faults")
        for key, value in {**server.env(), "AWS_MAX_ATTEMPTS": "1"}.items():
            monkeypatch.setenv(key, value)
        stopped: list[int] = []

        def stop_after_first_shard(count: int) -> None:
            if not stopped:
                stopped.append(count)
                server.stop()

        with pytest.raises(StoreWriteError) as info:
            ucformat.convert(
                SOURCE / "ckpt",
                "s3://faults/run.ucf",
                chunk_bytes=64,
                shard_bytes=256,
                workers=1,
                hooks=ConvertHooks(on_bytes=stop_after_first_shard),
            )
    finally:
        server.stop()
    message = str(info.value)
    assert stopped and "\n" not in message
    assert re.match(
        r"s3://faults/run\.ucf: writing \S+ failed \(EndpointConnectionError: ", message
    )
    assert message.endswith(
        "nothing was committed. The object store did not answer (endpoint, network, server): "
        "check it, then re-run with overwrite=True."
    )
    assert "FsspecStore" not in message and "<" not in message
