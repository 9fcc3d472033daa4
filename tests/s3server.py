"""A real S3-protocol server on loopback for the tests: moto's standalone server, in a process.

The server is ``python -m moto.server`` (from the ``moto[server]`` test dependency), bound to
127.0.0.1 on a free port and started and stopped by the tests (``tests/conftest.py``'s
``s3`` fixture). Clients reach it the usual way, with no client-side mocking: the botocore
settings in :meth:`S3Server.env` (``AWS_ENDPOINT_URL`` and dummy credentials) go into the
environment of the test process and of every process it starts (torchrun jobs, CLI runs), and
s3fs / fsspec pick them up like any other AWS configuration.

Used on its own::

    with S3Server() as server:
        server.create_bucket("ckpts")
        os.environ.update(server.env())
        ucformat.convert("run/global_step4", "s3://ckpts/run.ucf")
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["Request", "S3Server", "free_port"]

#: Dummy credentials: moto accepts any, and real AWS has no such key.
ACCESS_KEY = "ucformat-test"
SECRET_KEY = "ucformat-test-secret"
REGION = "us-east-1"


@dataclass(frozen=True)
class Request:
    """One request as moto's recorder saw it."""

    method: str
    key: str  # "bucket/key", percent-decoded
    range: str | None  # the Range header ("bytes=0-99", "bytes=-20"), if any
    user_agent: str

    @classmethod
    def parse(cls, entry: dict[str, Any]) -> Request:
        """From one line of the recording."""
        headers = {k.lower(): v for k, v in entry["headers"].items()}
        path = unquote(urlsplit(entry["url"]).path).lstrip("/")
        return cls(entry["method"], path, headers.get("range"), headers.get("user-agent", ""))

    @property
    def range_bytes(self) -> int | None:
        """Bytes an explicit ``bytes=a-b`` range asks for (None for suffix or no range)."""
        if self.range is None or not self.range.startswith("bytes="):
            return None
        first, _, last = self.range.removeprefix("bytes=").partition("-")
        return int(last) - int(first) + 1 if first and last else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class S3Server:
    """``python -m moto.server`` on 127.0.0.1, as a child process.

    Args:
        extra_env: environment for the server process only (e.g. moto's
            ``INITIAL_NO_AUTH_ACTION_COUNT``, which makes it refuse requests after a number of
            them: a store that fails mid-write).
    """

    def __init__(
        self, extra_env: Mapping[str, str] | None = None, recording: Path | None = None
    ) -> None:
        self.extra_env = dict(extra_env or {})
        if recording is not None:  # where moto's request recorder writes, when switched on
            self.extra_env["MOTO_RECORDER_FILEPATH"] = str(recording)
        self.recording = recording
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The client settings that point botocore (and so s3fs) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            # nothing of the machine's own AWS setup, and no instance-metadata probes
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def start(self, timeout_s: float = 60.0) -> S3Server:
        """Start the server and wait until it answers (a port clash is retried)."""
        for _ in range(3):
            self.port = free_port()
            env = {**os.environ, **self.extra_env}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self._proc.poll() is None:
                if self._answers():
                    return self
                time.sleep(0.1)
            self.stop()
        raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1 within {timeout_s} s")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stop the server (and forget everything it stored)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def _api(self, path: str, body: str = "") -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/{path}",
            data=body.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def refuse_after(self, count: float) -> None:
        """Serve ``count`` more requests, then refuse every one (``PermissionError`` for the
        client: moto's ``INITIAL_NO_AUTH_ACTION_COUNT``, after which it checks credentials and
        knows none); ``float("inf")`` serves everything again."""
        self._api("reset-auth", str(count))

    def record(self) -> None:
        """Start recording requests, from an empty recording (needs ``recording``)."""
        self._api("recorder/reset-recording")
        self._api("recorder/start-recording")

    def recorded(self) -> list[Request]:
        """Stop recording; the S3 requests the server received since :meth:`record`."""
        self._api("recorder/stop-recording")
        if self.recording is None or not self.recording.exists():
            return []
        lines = self.recording.read_text().splitlines()
        return [Request.parse(json.loads(line)) for line in lines if line.strip()]

    def client(self) -> Any:
        """A boto3 S3 client for this server (for test set-up and checks)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name``; return ``s3://name``."""
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
