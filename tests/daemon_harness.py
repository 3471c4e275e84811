"""A real ``prefixcache serve`` process for integration tests, plus helpers to publish test chunks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from prefixcache.cachestore.api.auth import admin_token_path
from prefixcache.cachestore.chunks.codec import ChunkMeta, encode, read_meta
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.config import fetch_config, index_url
from prefixcache.cachestore.client.node_requests import locate
from prefixcache.cachestore.host.processes import free_port_block
from prefixcache.cachestore.host.secret_files import read_secret, secrets_dir
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.cachestore.tiers.dram import MooncakeTier, split_offset
from prefixcache.cachestore.tiers.mooncake_servers import MooncakeMaster, leads, master_health
from prefixcache.cachestore.tiers.nvme import Extent
from prefixcache.cachestore.tiers.nvme_io import read_size
from prefixcache.cachestore.warmup.plan import storable_tokens
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.keys import PrefixHasher, chunk_key
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.tokens import pack_tokens
from tests.etcd_server import EtcdServer
from tests.netns import Host, process_state


@dataclass(frozen=True)
class ClusterServers:
    """What every node of a cluster joins: the index's Redis, the Mooncake master (its RPC, metadata and metrics
    ports) on ``host``, and the chunk-signing key file every node is given."""

    host: str
    redis_port: int
    redis_password: str
    master_port: int
    metadata_port: int
    metrics_port: int
    chunk_key_file: Path


@contextmanager
def cluster_servers(directory: Path, host: str) -> Iterator[ClusterServers]:
    """A cluster's Redis and Mooncake master of their own on ``host``, outside every node (as a deployment with
    an external index and master runs them), and a chunk-signing key file; stopped on exit."""
    redis_server = EmbeddedRedis(directory / "redis", host=host)
    master = MooncakeMaster(directory / "mooncake", host=host)
    key_file = directory / "chunk-key"
    ChunkMacKey.load_or_create(key_file)
    with ExitStack() as running:
        for server in (redis_server, master):
            server.start()
            running.callback(server.stop)
        yield ClusterServers(
            host,
            redis_server.port,
            redis_server.password,
            master.rpc_port,
            master.metadata_port,
            master.metrics_port,
            key_file,
        )


@dataclass(frozen=True)
class HaClusterServers:
    """What every node of a cluster whose Mooncake masters run in high-availability mode joins: the index's Redis,
    the etcd the masters elect their leader in (and keep the pool's transfer endpoints in), the masters, and the
    chunk-signing key file. A test may kill and start again any of ``masters``."""

    host: str
    redis_port: int
    redis_password: str
    etcd: EtcdServer
    masters: list[MooncakeMaster]
    cluster_id: str
    chunk_key_file: Path

    @property
    def master_url(self) -> str:
        """What a node is given as ``--mooncake-master``."""
        return f"etcd://{self.etcd.endpoint}/{self.cluster_id}"

    @property
    def metrics_urls(self) -> str:
        """Every master's ``/metrics``, as ``PREFIXCACHE_MOONCAKE_METRICS_URL`` names them."""
        return ",".join(f"{master.admin_url}/metrics" for master in self.masters)

    def role(self, master: MooncakeMaster) -> str | None:
        """What ``master`` says it is (``leader``, ``standby``...); None while it does not answer."""
        state = master_health(master.admin_url)
        return state.get("role") if isinstance(state, dict) else None

    def leader(self, timeout_s: float = 30) -> MooncakeMaster:
        """The master that leads and serves, once one does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for master in self.masters:
                if master.alive() and leads(master_health(master.admin_url)):
                    return master
            time.sleep(0.1)
        raise AssertionError(f"no Mooncake master leads after {timeout_s:.0f}s")


@contextmanager
def ha_cluster_servers(
    directory: Path, host: str = "127.0.0.1", masters: int = 2, cluster_id: str = "prefixcache-test"
) -> Iterator[HaClusterServers]:
    """A cluster's Redis, an etcd, and ``masters`` Mooncake masters in high-availability mode on ``host`` (one of
    them leading when this yields), and a chunk-signing key file; stopped on exit."""
    redis_server = EmbeddedRedis(directory / "redis", host=host)
    etcd = EtcdServer(directory / "etcd", host=host)
    group = [
        MooncakeMaster(
            directory / "mooncake",
            host=host,
            etcd_endpoints=[etcd.endpoint],
            cluster_id=cluster_id,
            log_name=f"mooncake_master-{i}.log",
        )
        for i in range(masters)
    ]
    key_file = directory / "chunk-key"
    ChunkMacKey.load_or_create(key_file)
    with ExitStack() as running:
        for server in (redis_server, etcd, *group):
            server.start()
            running.callback(server.stop)
        servers = HaClusterServers(host, redis_server.port, redis_server.password, etcd, group, cluster_id, key_file)
        servers.leader()
        yield servers


class Daemon:
    def __init__(
        self,
        data_dir: Path,
        *extra: str,
        dram: str = "256MiB",
        nvme: str = "512MiB",
        node: str = "node-a",
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        launcher: Sequence[str] = (),
    ) -> None:
        """``env``: variables set for the daemon on top of this process's. ``host``: the node's address, its REST
        API's and its Mooncake segment's (loopback unless given); ``launcher``: what the command runs under (a
        host of tests/netns.py's: ``Host.launcher``)."""
        self.data_dir = data_dir
        self.host = host
        self.port = free_port_block(7)
        addresses = ["--host", host, "--mooncake-host", host] if host != "127.0.0.1" else []
        self.args = [
            *launcher,
            sys.executable,
            "-m",
            "prefixcache.cachestore",
            "serve",
            "--data-dir",
            str(data_dir),
            "--port",
            str(self.port),
            "--dram-bytes",
            dram,
            "--nvme-bytes",
            nvme,
            "--node",
            node,
            *addresses,
            *extra,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.index_password: str | None = None  # what its clients pass as redis_password, where they need one

    @classmethod
    def joining(cls, servers: ClusterServers, data_dir: Path, node: str, *extra: str, **options: Any) -> Daemon:
        """A node of the cluster of ``servers``: its own DRAM segment and NVMe tier, their Redis and master."""
        at = servers.host
        master = ("--mooncake-master", f"{at}:{servers.master_port}")
        metadata = ("--mooncake-metadata-url", f"http://{at}:{servers.metadata_port}/metadata")
        metrics = f"http://{at}:{servers.metrics_port}/metrics"
        return cls._joined(servers, data_dir, node, (*master, *metadata, *extra), metrics, options)

    @classmethod
    def joining_ha(cls, servers: HaClusterServers, data_dir: Path, node: str, *extra: str, **options: Any) -> Daemon:
        """A node of the cluster of ``servers``: its own DRAM segment and NVMe tier, their Redis, and their masters
        in high-availability mode, found through etcd (which keeps the transfer endpoints too)."""
        master = ("--mooncake-master", servers.master_url)
        return cls._joined(servers, data_dir, node, (*master, *extra), servers.metrics_urls, options)

    @classmethod
    def _joined(
        cls,
        servers: ClusterServers | HaClusterServers,
        data_dir: Path,
        node: str,
        args: Sequence[str],
        metrics_urls: str,
        options: dict[str, Any],
    ) -> Daemon:
        """A daemon on the cluster's Redis and chunk key, with ``args`` (its master's, then the caller's)."""
        index = f"redis://:{servers.redis_password}@{servers.host}:{servers.redis_port}/0"
        joined = cls(
            data_dir,
            "--redis-url",
            index,
            "--chunk-key-file",
            str(servers.chunk_key_file),
            *args,
            node=node,
            env={"PREFIXCACHE_MOONCAKE_METRICS_URL": metrics_urls},
            **options,
        )
        joined.index_password = servers.redis_password  # its clients are given it: the index is not its own
        return joined

    def joined_by(self, data_dir: Path, node: str, *extra: str) -> Daemon:
        """Another node of this daemon's cluster: its own DRAM segment and NVMe tier, this daemon's Redis
        and Mooncake master (ports ``PORT+1``, ``+4``, ``+5``, ``+6``, as ``serve`` derives them); ``extra``:
        more options of its ``serve``."""
        servers = ClusterServers(
            "127.0.0.1",
            self.port + 1,
            self.redis_password(),
            self.port + 4,
            self.port + 5,
            self.port + 6,
            self.chunk_key_file,
        )
        return Daemon.joining(servers, data_dir, node, *extra)

    @property
    def chunk_key_file(self) -> Path:
        """The chunk-signing key this daemon generated at its first start (every node of its cluster shares it)."""
        return self.data_dir / "secrets" / "chunk-key"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def redis_password(self) -> str:
        """The embedded redis-server's password, which the daemon generated at its first start."""
        return read_secret(secrets_dir(self.data_dir) / "redis-password")

    @property
    def token(self) -> str:
        """The admin token: the one given with ``--admin-token``, else the one the daemon generated (a started
        daemon's, read from its data dir as the CLI reads it)."""
        if "--admin-token" in self.args:
            return self.args[self.args.index("--admin-token") + 1]
        return read_secret(admin_token_path(secrets_dir(self.data_dir)))

    @property
    def headers(self) -> dict[str, str]:
        """What an authorised admin call sends."""
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def log_path(self) -> Path:
        """The daemon's stdout and stderr, every start's appended."""
        return self.data_dir.parent / f"daemon-{self.port}.log"

    def start(self, timeout_s: float = 60) -> Daemon:
        """Start (or restart) the daemon and wait until it reports ready; a failed start leaves nothing running."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited: {self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/v1/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError("daemon never became ready")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        time.sleep(0.2)  # children follow their parent (PR_SET_PDEATHSIG)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def node_on(host: Host, servers: ClusterServers, data_dir: Path, *extra: str, **options: Any) -> Daemon:
    """A node of the cluster of ``servers`` on ``host`` (tests/netns.py), at the host's address, named
    ``node-<host>``."""
    return Daemon.joining(
        servers, data_dir, f"node-{host.name}", *extra, host=host.address, launcher=host.launcher, **options
    )


def run_cli(
    daemon: Daemon, *args: str, token: str | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """``prefixcache ARGS`` against ``daemon``, with ``token`` as PREFIXCACHE_ADMIN_TOKEN (none: the CLI finds
    its own) and ``stdin`` as its standard input."""
    env = {**os.environ, "COLUMNS": "200", "PREFIXCACHE_URL": daemon.url}
    env.pop("PREFIXCACHE_ADMIN_TOKEN", None)
    if token:
        env["PREFIXCACHE_ADMIN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "prefixcache.cachestore", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def connect(daemon: Daemon, spec: NamespaceSpec | None = None) -> CacheClient:
    """A client of ``daemon``'s node, as a connector attaches (a 64 MiB arena)."""
    return CacheClient.connect(daemon.url, spec or make_spec(), arena_bytes=64 << 20)


def chunk_meta(
    client: CacheClient, parent: bytes, tokens: list[int], bytes_per_token: int = 2048, tenant_salt: str | None = None
) -> ChunkMeta:
    """The metadata of a chunk of ``tokens`` after ``parent``, its payload ``bytes_per_token`` per token."""
    return ChunkMeta(
        namespace=client.spec.digest,
        root=client.spec.root(tenant_salt),
        parent=parent,
        tokens=pack_tokens(tokens),
        dtype="uint8",
        shape=(len(tokens), bytes_per_token),
    )


def chunk_object_bytes(client: CacheClient) -> int:
    """The stored size of a full chunk ``publish_prompt`` publishes: its header and payload."""
    root = client.spec.root(None)
    return chunk_meta(client, root, [0] * client.spec.chunk_tokens).encoded_size


def make_chunk(
    client: CacheClient,
    parent: bytes,
    tokens: list[int],
    seed: int,
    bytes_per_token: int = 2048,
    tenant_salt: str | None = None,
) -> tuple[ChunkMeta, memoryview, bytes]:
    """A chunk of ``tokens`` after ``parent`` with a random payload, staged in an arena slot."""
    meta = chunk_meta(client, parent, tokens, bytes_per_token, tenant_salt)
    payload = bytes([seed % 256]) * 16 + os.urandom(meta.payload_bytes - 16)
    slot = client.stage(meta)
    slot[meta.payload_offset : meta.encoded_size] = payload
    return meta, slot, payload


def publish_prompt(
    client: CacheClient,
    tokens: list[int],
    seed: int = 0,
    bytes_per_token: int = 2048,
    tenant_salt: str | None = None,
    stored: list[bool] | None = None,
) -> tuple[list[bytes], list[bytes]]:
    """Publish every chunk of a prompt (full chunks and the tail); returns keys and payloads. Every chunk must be
    stored, unless ``stored`` is given: it receives what the publish says of each."""
    c = client.spec.chunk_tokens
    parent, chunks = client.spec.root(tenant_salt), []
    for start in range(0, len(tokens), c):
        part = tokens[start : start + c]
        meta, slot, payload = make_chunk(client, parent, part, seed + start, bytes_per_token, tenant_salt)
        chunks.append((meta, slot, payload))
        parent = chunk_key(parent, meta.tokens)
    try:
        outcome = client.publish([(m, s) for m, s, _ in chunks], tenant_salt)
        if stored is None:
            assert all(outcome)
        else:
            stored[:] = outcome
    finally:
        for _, slot, _ in chunks:
            client.release(slot)
    return [m.key for m, _, _ in chunks], [p for _, _, p in chunks]


def fetch_payloads(
    client: CacheClient, keys: list[bytes], store_disk_reads: bool = False, across_network: bool = False
) -> list[bytes | None]:
    """Fetch ``keys`` into fresh slots; ``store_disk_reads`` stores those read from NVMe into DRAM, as loads do;
    ``across_network``: as a load of chunks the lookup found in other nodes' DRAM (with a deadline). Such a read's
    deadline follows its slots' bytes, so their slots are sized to ``publish_prompt``'s chunks, as the connector
    sizes its slots to its chunks."""
    size = read_size(chunk_object_bytes(client)) if across_network else 4 << 20
    slots = [client.slot(size) for _ in keys]
    try:
        with client.load() as load:
            fetched = load.fetch(keys, slots, across_network=across_network)
        payloads = [bytes(view) if view is not None else None for view in fetched.payloads]
        if store_disk_reads:
            client.store_disk_reads(fetched.from_disk)
        return payloads
    finally:
        for slot in slots:
            client.release(slot)


def make_spec(chunk_tokens: int = 64) -> NamespaceSpec:
    return NamespaceSpec(
        model="test-model", model_fingerprint="fp", kv_dtype="uint8", kv_layout="test-v1", chunk_tokens=chunk_tokens
    )


def niceness(pid: int) -> dict[str, int | str]:
    """The nice of every thread of ``pid``, and its session's (its autogroup's, where the kernel has them)."""
    threads = {tid: os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
    autogroup = Path(f"/proc/{pid}/autogroup")
    return {**threads, "session": autogroup.read_text().split()[-1] if autogroup.exists() else "none"}


def servers_of(daemon: Daemon) -> dict[str, int]:
    """The daemon's child processes by command name (``/proc/<pid>/task/*/children``): its servers."""
    assert daemon.proc is not None
    pids = [
        pid
        for task in Path(f"/proc/{daemon.proc.pid}/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]
    return {Path(f"/proc/{pid}/comm").read_text().strip(): int(pid) for pid in pids}


def is_zombie(pid: int) -> bool:
    """Whether process ``pid`` has exited and its parent has not reaped it (False once it is gone)."""
    return process_state(pid) == "Z"


def damage_dram_copy(dram: MooncakeTier, key: bytes, max_bytes: int = 8 << 20) -> None:
    """Flip the last byte of chunk ``key``'s DRAM copy (an object of at most ``max_bytes``), in the pool,
    under its own name: what a bad DIMM or a stray write would leave for the next reader."""
    slot = dram.arena.alloc(max_bytes)
    try:
        size = dram.get_into([key], [slot])[0]
        assert size > 0, f"chunk {key.hex()} is not in DRAM"
        slot[size - 1] ^= 0xFF
        at = split_offset(read_meta(slot)) or 0  # the last byte lies in the second part of a copy cut in two
        address = dram.arena.address + dram.arena.offset_of(slot)
        name = dram._names(key)[bool(at)]
        assert dram._store.batch_upsert_from([name], [address + at], [size - at]) == [0]
    finally:
        dram.arena.free(slot)


def damage_dram_copies(
    daemon: Daemon, keys: list[bytes], damage: Callable[[MooncakeTier, bytes], object] = damage_dram_copy
) -> None:
    """``damage`` (``damage_dram_copy``, or ``forge_dram_copy``) each of ``keys`` in ``daemon``'s pool, through a
    client of the test's own."""
    config = fetch_config(daemon.url)
    dram = MooncakeTier(config.mooncake.shm_address, arena_bytes=16 << 20, object_prefix=config.key_prefix)
    try:
        for key in keys:
            damage(dram, key)
    finally:
        dram.close()


def nvme_extent(daemon: Daemon, key: bytes) -> Extent:
    """Where ``daemon``'s NVMe tier holds chunk ``key``, as the daemon itself answers a client."""
    config = fetch_config(daemon.url)
    client = redis.Redis.from_url(index_url(config))
    try:
        (extent,) = locate(client, Keyspace(config.key_prefix), config.node, [key], timeout_s=5)
    finally:
        client.close()
    assert extent is not None, f"chunk {key.hex()} is not on {config.node}'s NVMe tier"
    return extent


def damage_nvme_copy(daemon: Daemon, key: bytes) -> None:
    """Flip the last byte of chunk ``key``'s copy in ``daemon``'s NVMe tier, in its pack file (where the
    daemon itself says it lies): a disk that returns bad data for the next reader."""
    extent = nvme_extent(daemon, key)
    with open(extent.path, "r+b") as pack:
        pack.seek(extent.offset + extent.length - 1)
        last = pack.read(1)[0]
        pack.seek(extent.offset + extent.length - 1)
        pack.write(bytes([last ^ 0xFF]))


#: What an attacker signs with: any key but the cluster's.
ATTACKER_KEY = ChunkMacKey(bytes(32))


def forged(obj: bytes | memoryview, payload: bytes | None = None) -> bytearray:
    """A forgery of chunk object ``obj``: the same, self-consistent header (identity, tokens, header checksum)
    over another payload (``payload``, default zeros), signed with a key that is not the cluster's: what a process
    that can write into the pool or a pack file, but does not hold the key, can make."""
    meta = read_meta(obj)
    return encode(meta, payload if payload is not None else bytes(meta.payload_bytes), ATTACKER_KEY)


def forge_dram_copy(dram: MooncakeTier, key: bytes, max_bytes: int = 8 << 20) -> bytes:
    """Replace chunk ``key``'s DRAM copy with ``forged`` under its own name (both parts); returns the forgery."""
    slot = dram.arena.alloc(max_bytes)
    try:
        size = dram.get_into([key], [slot])[0]
        assert size > 0, f"chunk {key.hex()} is not in DRAM"
        fake = forged(slot[:size])
    finally:
        dram.arena.free(slot)
    dram.delete([key])
    assert dram.put([(key, fake)]) == [True]
    return bytes(fake)


def forge_nvme_copy(daemon: Daemon, key: bytes) -> bytes:
    """Replace chunk ``key``'s object in ``daemon``'s NVMe pack file with ``forged``, where the daemon says it
    lies; returns the forgery."""
    extent = nvme_extent(daemon, key)
    with open(extent.path, "r+b") as pack:
        pack.seek(extent.offset)
        fake = forged(pack.read(extent.length))
        pack.seek(extent.offset)
        pack.write(fake)
    return bytes(fake)


def connector_config(
    daemon: Daemon, role: str = "kv_both", probe: bool = False, by_entry_point: bool = False, **extra: object
) -> dict:
    """The connector's kv_transfer_config, as the README gives it (the class and the installed module); ``probe``
    loads the recording subclass (tests/e2e/probe_connector.py) instead; ``by_entry_point`` names the class alone,
    which vLLM then finds through prefixcache's ``vllm.general_plugins`` entry point (connector/registration.py);
    ``extra``: more of its settings. ``publish_output`` is off unless ``extra`` turns it on: the e2e tests count and
    compare what prompts publish, and tests/e2e/test_chat_e2e.py what finished requests do."""
    if probe and by_entry_point:
        raise ValueError("the probe connector has no entry point: it is loaded by its module path")
    if probe:
        named = {"kv_connector": "ProbeConnector", "kv_connector_module_path": "tests.e2e.probe_connector"}
    elif by_entry_point:
        named = {"kv_connector": "PrefixCacheConnector"}
    else:
        named = {"kv_connector": "PrefixCacheConnector", "kv_connector_module_path": "prefixcache.connector"}
    return {
        **named,
        "kv_role": role,
        "kv_connector_extra_config": {"service_url": daemon.url, "arena_mb": 128, "publish_output": False, **extra},
    }


def tiers_of(daemon: Daemon, key: str) -> list[str]:
    """The tiers the daemon lists chunk ``key`` (hex) in."""
    return httpx.get(f"{daemon.url}/v1/chunks/{key}", headers=daemon.headers).json()["tiers"]


def corrupt_chunks(daemon: Daemon, reason: str | None = None) -> int:
    """Chunks the daemon and its clients have found damaged so far (of ``reason``, if given: "mac", "damaged")."""
    stats = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()
    return stats["corrupt_chunks"] if reason is None else stats["corrupt_by_reason"][reason]


def client_stats(daemon: Daemon) -> dict[str, int]:
    """What the daemon's clients have recorded so far: lookups, hits, matched tokens... (``/v1/stats``'s
    ``clients``; clients report every second)."""
    return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()["clients"]


def wait_for_corrupt_chunks(daemon: Daemon, count: int, timeout_s: float = 10, reason: str | None = None) -> int:
    """The daemon's count of damaged chunks (of ``reason``) once it reaches ``count`` (clients report every second),
    or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (found := corrupt_chunks(daemon, reason)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def stored_chunk_keys(root: bytes, prompt: list[int], chunk_tokens: int) -> list[bytes]:
    """The keys the connector stores a prompt's KV under: one per full chunk, and its tail's when the tail is
    long enough to be found (``storable_tokens``)."""
    hasher = PrefixHasher(root, ChunkGeometry(chunk_tokens)).extend(prompt)
    keys = list(hasher.keys)
    if storable_tokens(len(prompt), chunk_tokens) > len(keys) * chunk_tokens:
        keys.append(hasher.tail_key())
    return keys


def wait_persisted(client: CacheClient, keys: list[bytes], timeout_s: float = 15) -> float:
    """Seconds until every key has an NVMe location (the daemon's write-behind persisted it)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(e is not None and any(loc.tier == "nvme" for loc in e.locations) for e in client.index.get(keys)):
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError("chunks were not persisted in time")


def wait_for(condition: Callable[[], bool], timeout_s: float = 10) -> bool:
    """Whether ``condition`` came true within ``timeout_s``, asked every 50 ms."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class CallCounter:
    """A tier's Mooncake client (``MooncakeTier._store``), counting the calls that read: how many round trips a
    read took."""

    def __init__(self, store: Any) -> None:
        self.store, self.reads = store, 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("batch_get"):
            self.reads += 1
        return getattr(self.store, name)


def stored_tokens(daemon: Daemon, token_ids: list[int]) -> int:
    """How much of ``token_ids`` the daemon finds stored in the instances' namespace (0 before it has one)."""
    namespaces = httpx.get(daemon.url + "/v1/namespaces", headers=daemon.headers).json()
    if not namespaces:
        return 0
    body = {"namespace": namespaces[0]["namespace"], "token_ids": token_ids}
    return httpx.post(daemon.url + "/v1/lookup", json=body, headers=daemon.headers).json()["matched_tokens"]
