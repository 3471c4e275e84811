"""A Mooncake master and one segment owner on this machine, started together, for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

from prefixcache.cachestore.tiers.mooncake_servers import MooncakeMaster, SegmentOwner


class LocalMooncakePool:
    """A master and one segment owner on this machine, started together (tests, benchmarks)."""

    def __init__(self, directory: Path, segment_bytes: int = 256 << 20) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.master = MooncakeMaster(directory)
        self.master.start()
        self.owner = SegmentOwner(
            directory, segment_bytes=segment_bytes, master=self.master.address, metadata_url=self.master.metadata_url
        )
        self.owner.start()

    @property
    def metrics_url(self) -> str:
        return f"http://{self.master.host}:{self.master.metrics_port}/metrics"

    def restart_master(self) -> None:
        """Stop the master and start a new one on the same ports (it comes back empty)."""
        self.master.stop()
        old = self.master
        self.master = MooncakeMaster(
            self.directory, rpc_port=old.rpc_port, metadata_port=old.metadata_port, metrics_port=old.metrics_port
        )
        self.master.start()

    def stop(self) -> None:
        self.owner.stop()
        self.master.stop()
