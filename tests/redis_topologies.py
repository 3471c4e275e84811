"""Redis Cluster and Sentinel topologies of real ``redis-server`` processes on free loopback ports, for tests.

Each node is a ``ManagedProcess`` (cachestore/host/processes.py) run from a config file in a directory of its own,
persisting as the embedded server does (AOF, ``appendfsync everysec``), with timeouts short enough that a killed
master or primary is replaced within seconds. Data nodes need a password, as deployed ones do; sentinels run
without one (the ``redis+sentinel://`` URL's password is the data nodes').
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from prefixcache.cachestore.host.processes import ManagedProcess, find_executable, free_port_block
from prefixcache.indexer.redis_clients import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S, redis_client, with_password

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384
#: How long a cluster node may be unreachable before the others mark it failed and one of its replicas takes over.
CLUSTER_NODE_TIMEOUT_MS = 2000
#: The name the sentinels monitor the primary under: the service name of the ``redis+sentinel://`` URL.
SENTINEL_SERVICE = "prefixcache"
#: How long the primary may be unreachable before a sentinel calls it down.
SENTINEL_DOWN_AFTER_MS = 1000
#: How long a failover may take before the sentinels give up on it and try again (after twice as long).
SENTINEL_FAILOVER_TIMEOUT_MS = 3000
SENTINEL_QUORUM = 2


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.05)


def data_node_config(password: str) -> list[str]:
    """The config lines every data node (cluster node, primary, replica) shares: AOF persistence, the password its
    clients give, and the same one it gives the master it replicates."""
    return [
        "appendonly yes",
        "appendfsync everysec",
        'save ""',
        f"requirepass {password}",
        f"masterauth {password}",
    ]


def free_ports(count: int) -> list[int]:
    """``count`` loopback ports free now, outside the kernel's ephemeral range.

    A topology's nodes start one after another, and every readiness probe opens outgoing connections: ports picked
    up front inside the ephemeral range can be taken by one of those before the node that was given it binds it.
    """
    base = free_port_block(count, HOST)
    return list(range(base, base + count))


class RedisNode(ManagedProcess):
    """One ``redis-server`` on loopback ``port``, its config in ``directory`` (a data node, or a sentinel with
    ``sentinel``). ``start`` again after ``kill`` starts it with the same config and the same port."""

    def __init__(
        self, directory: Path, config: Sequence[str], port: int, *, password: str | None, sentinel: bool = False
    ) -> None:
        self.port = port
        self.directory = Path(directory)
        self.password = password
        self.directory.mkdir(parents=True, exist_ok=True)
        config_path = self.directory / ("sentinel.conf" if sentinel else "redis.conf")
        config_path.write_text(
            "\n".join([f"bind {HOST}", f"port {self.port}", f'dir "{self.directory}"', "daemonize no", *config]) + "\n"
        )
        argv = [find_executable("redis-server"), str(config_path), *(["--sentinel"] if sentinel else [])]
        super().__init__(
            f"redis-server:{self.port}",
            argv,
            self.directory / "redis.log",
            self._answers,
            listens_on=[(HOST, self.port)],
        )

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    @property
    def url(self) -> str:
        """A plain ``redis://`` URL of this node alone, with its password."""
        url = f"redis://{HOST}:{self.port}/0"
        return with_password(url, self.password) if self.password else url

    def client(self) -> redis.Redis:
        """A client of this node alone (no cluster redirections, no sentinel discovery)."""
        return redis_client(self.url)

    def _answers(self) -> bool:
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.exceptions.RedisError:
            return False


@dataclass(frozen=True)
class ClusterNodeView:
    """One line of ``CLUSTER NODES``: a node as the node asked sees it."""

    port: int
    flags: frozenset[str]
    slots: int  # how many slots it serves

    @classmethod
    def parse(cls, line: str) -> ClusterNodeView:
        fields = line.split()
        address = fields[1].split("@")[0]
        slots = 0
        for field in fields[8:]:
            if field.startswith("["):  # a slot being imported or migrated: still served by its owner
                continue
            first, _, last = field.partition("-")
            slots += int(last or first) - int(first) + 1
        return cls(port=int(address.rpartition(":")[2]), flags=frozenset(fields[2].split(",")), slots=slots)

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})


class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each, created with ``redis-cli --cluster
    create`` and healthy (every slot served) when the constructor returns. ``stop`` ends every node."""

    def __init__(
        self, tmp_dir: Path, masters: int = 3, replicas: int = 1, *, password: str | None = None, timeout_s: float = 60
    ) -> None:
        self.password = password or secrets.token_hex(32)
        config = [
            *data_node_config(self.password),
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {CLUSTER_NODE_TIMEOUT_MS}",
            # CLUSTER SLOTS names a replica only once its replication offset moved; the master's pings move it
            "repl-ping-replica-period 1",
        ]
        count = masters * (1 + replicas)
        ports = free_ports(2 * count)
        self.nodes = [
            # the bus port on a free port of its own: by default it is the client port + 10000, maybe taken or > 65535
            RedisNode(
                Path(tmp_dir) / f"node{i}",
                [*config, f"cluster-port {ports[count + i]}"],
                ports[i],
                password=self.password,
            )
            for i in range(count)
        ]
        try:
            for node in self.nodes:
                node.start()
            self._create(replicas, timeout_s)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _create(self, replicas: int, timeout_s: float) -> None:
        argv = [find_executable("redis-cli"), "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes)]
        argv += ["--cluster-replicas", str(replicas), "--cluster-yes"]
        env = {**os.environ, "REDISCLI_AUTH": self.password}  # not -a: the password would show in ps
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")

    @property
    def url(self) -> str:
        """``redis+cluster://`` with the password and every live node: a client started from it discovers the cluster
        while any of them answers."""
        nodes = ",".join(f"{HOST}:{node.port}" for node in self.live_nodes())
        return with_password(f"redis+cluster://{nodes}", self.password)

    def live_nodes(self) -> list[RedisNode]:
        return [node for node in self.nodes if node.alive()]

    def node(self, port: int) -> RedisNode:
        return next(node for node in self.nodes if node.port == port)

    def view(self, node: RedisNode) -> list[ClusterNodeView]:
        """The cluster as ``node`` sees it (``CLUSTER NODES``), itself included (flag ``myself``)."""
        with node.client() as client:
            text = client.execute_command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else text
        return [ClusterNodeView.parse(line) for line in text.splitlines() if line.strip()]

    def _own_view(self, node: RedisNode) -> ClusterNodeView:
        return next(entry for entry in self.view(node) if "myself" in entry.flags)

    def _slot_replicas(self, node: RedisNode) -> set[int]:
        """The ports of the replicas ``node`` names in ``CLUSTER SLOTS``."""
        with node.client() as client:
            ranges = client.execute_command("CLUSTER SLOTS")
        return {int(replica[1]) for slot_range in ranges for replica in slot_range[3:]}

    def masters(self) -> list[RedisNode]:
        """The live nodes that are masters now, by what each says of itself."""
        return [node for node in self.live_nodes() if self._own_view(node).is_master]

    def replicas(self) -> list[RedisNode]:
        """The live nodes that are replicas now, by what each says of itself."""
        return [node for node in self.live_nodes() if not self._own_view(node).is_master]

    def kill_master(self, which: int = 0) -> RedisNode:
        """SIGKILL a master: ``which`` is its index in ``masters()`` or its port. Returns the node killed."""
        masters = self.masters()
        node = masters[which] if which < len(masters) else self.node(which)
        node.kill()
        return node

    def restart(self, node: RedisNode, timeout_s: float = 60) -> None:
        """Start a killed node again, with its config and its ``nodes.conf``: it rejoins, as a replica of the master
        that took its slots over; returns once it is one and the cluster is healthy."""
        node.start(timeout_s)

        def rejoined() -> bool:
            try:
                return not self._own_view(node).is_master
            except redis.exceptions.RedisError:  # still loading its AOF
                return False

        wait_until(rejoined, f"node {node.port} rejoining as a replica", timeout_s)
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Wait until every live node says ``cluster_state:ok``, sees every live node in the role that node gives
        itself, and sees all slots served by live masters (``CLUSTER NODES``) with all live replicas replicating
        them (``CLUSTER SLOTS``, what cluster clients read), so any node a client starts from tells it all."""
        wait_until(self._healthy, "the cluster serving every slot from live masters", timeout_s)

    def _healthy(self) -> bool:
        try:
            live = self.live_nodes()
            roles = {node.port: self._own_view(node).is_master for node in live}
            for node in live:
                with node.client() as client:
                    if client.cluster("INFO").get("cluster_state") != "ok":
                        return False
                view = [entry for entry in self.view(node) if not entry.failing]
                if {entry.port: entry.is_master for entry in view} != roles:
                    return False
                if sum(entry.slots for entry in view if entry.is_master) != CLUSTER_SLOTS:
                    return False
                if self._slot_replicas(node) != {port for port, is_master in roles.items() if not is_master}:
                    return False
        except redis.exceptions.RedisError:
            return False
        return True

    def client(self, **options: object) -> RedisCluster:
        """A ``RedisCluster`` client that starts from every live node (so one killed node does not stop it)."""
        return RedisCluster(
            startup_nodes=[ClusterNode(HOST, node.port) for node in self.live_nodes()],
            password=self.password,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            **options,
        )

    def stop(self) -> None:
        """SIGKILL every node and reap it."""
        for node in self.nodes:
            node.kill()


def named_primary(sentinel: RedisNode) -> tuple[str, int]:
    """The address ``sentinel`` gives for ``SENTINEL_SERVICE``'s primary (``SENTINEL get-master-addr-by-name``)."""
    with sentinel.client() as client:
        host, port = client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
    return host.decode() if isinstance(host, bytes) else host, int(port)


class RedisSentinelServers:
    """A primary, one replica of it (``replicaof``) and ``sentinels`` sentinels monitoring it as ``SENTINEL_SERVICE``
    with quorum ``SENTINEL_QUORUM``; the constructor returns once the replica is in sync and every sentinel knows
    the replica and the other sentinels (without those, no failover can be agreed on). ``stop`` ends them all."""

    def __init__(
        self, tmp_dir: Path, sentinels: int = 3, *, password: str | None = None, timeout_s: float = 60
    ) -> None:
        self.password = password or secrets.token_hex(32)
        tmp_dir = Path(tmp_dir)
        self.data_nodes: list[RedisNode] = []
        self.sentinels: list[RedisNode] = []
        ports = free_ports(2 + sentinels)
        try:
            first = RedisNode(tmp_dir / "primary", data_node_config(self.password), ports[0], password=self.password)
            first.start()
            replica_config = [*data_node_config(self.password), f"replicaof {HOST} {first.port}"]
            self.data_nodes = [first, RedisNode(tmp_dir / "replica", replica_config, ports[1], password=self.password)]
            self.data_nodes[1].start()
            sentinel_config = [
                f"sentinel monitor {SENTINEL_SERVICE} {HOST} {first.port} {SENTINEL_QUORUM}",
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {SENTINEL_DOWN_AFTER_MS}",
                f"sentinel failover-timeout {SENTINEL_SERVICE} {SENTINEL_FAILOVER_TIMEOUT_MS}",
                f"sentinel auth-pass {SENTINEL_SERVICE} {self.password}",
            ]
            for i in range(sentinels):
                self.sentinels.append(
                    RedisNode(tmp_dir / f"sentinel{i}", sentinel_config, ports[2 + i], password=None, sentinel=True)
                )
                self.sentinels[-1].start()
            wait_until(self._ready, "the replica's sync and the sentinels' discovery of each other", timeout_s)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            with self.data_nodes[1].client() as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
            for sentinel in self.sentinels:
                with sentinel.client() as client:
                    others = client.sentinel_sentinels(SENTINEL_SERVICE)
                    known_replicas = client.sentinel_slaves(SENTINEL_SERVICE)
                if len(others) != len(self.sentinels) - 1 or len(known_replicas) != 1:
                    return False
        except redis.exceptions.RedisError:
            return False
        return True

    @property
    def url(self) -> str:
        """``redis+sentinel://`` with the data nodes' password, every sentinel and the service name."""
        hosts = ",".join(f"{HOST}:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{SENTINEL_SERVICE}"

    def primary(self) -> tuple[str, int]:
        """The primary's address, as the first live sentinel that answers names it."""
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            try:
                return named_primary(sentinel)
            except redis.exceptions.RedisError:
                continue
        raise RuntimeError("no sentinel answers")

    def node(self, address: tuple[str, int]) -> RedisNode:
        return next(node for node in self.data_nodes if node.address == address)

    def kill_primary(self, replicated_within_s: float = 10) -> tuple[str, int]:
        """SIGKILL the data node the sentinels name as primary, once every replica has acknowledged its writes
        (``WAIT``: replication is asynchronous, and a replica promoted without them lacks them, as a real failover
        loses them); returns its address."""
        address = self.primary()
        node = self.node(address)
        replicas = len(self.data_nodes) - 1
        with node.client() as client:
            acknowledged = client.execute_command("WAIT", replicas, int(replicated_within_s * 1000))
        if acknowledged < replicas:
            raise RuntimeError(f"{acknowledged} of {replicas} replicas had the primary's writes")
        node.kill()
        return address

    def wait_failover(self, old_primary: tuple[str, int], timeout_s: float = 60) -> tuple[str, int]:
        """Wait until every live sentinel names a primary other than ``old_primary`` that says ``ROLE`` master;
        returns its address."""
        promoted: list[tuple[str, int]] = []

        def failed_over() -> bool:
            try:
                named = set()
                for sentinel in self.sentinels:
                    if sentinel.alive():
                        named.add(named_primary(sentinel))
                if len(named) != 1 or old_primary in named:
                    return False
                address = named.pop()
                with self.node(address).client() as client:
                    role = client.execute_command("ROLE")[0]
            except redis.exceptions.RedisError:
                return False
            promoted[:] = [address]
            return role in (b"master", "master")

        wait_until(failed_over, f"a failover away from {old_primary[0]}:{old_primary[1]}", timeout_s)
        return promoted[0]

    def sentinel(self, **options: object) -> redis.Sentinel:
        """A redis-py ``Sentinel`` of every sentinel; its ``master_for(SENTINEL_SERVICE)`` gets the data nodes'
        password."""
        return redis.Sentinel(
            [sentinel.address for sentinel in self.sentinels],
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            password=self.password,
            **options,
        )

    def stop(self) -> None:
        """SIGKILL every node and sentinel and reap it."""
        for node in [*self.sentinels, *self.data_nodes]:
            node.kill()
