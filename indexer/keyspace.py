"""Every Redis key prefixcache uses, named in one place: the contract between processes, versions and Lua.

A deployment's keys all lie under its configured key prefix ``P`` (the ``key_prefix`` setting, default ``pc``):
``R = "P:"``. ``Keyspace`` is built from ``P`` alone (never from ``R``, so the ``':'`` is added here and nowhere
else) and names each key. The index's own keys have two more levels, for a Redis Cluster (``redis_shards.py``):
``C``, where one chain's keys live (``R`` on one Redis, ``R{<anchor>}:`` on a Cluster), and ``S``, where one
shard keeps the keys chains share (``R``, or ``R{<tag>}:``). The Lua scripts spell no key name: they are handed
``S`` and ``script_names`` (``R``, the hash tag's delimiters and each name they add to ``R``, ``S`` or ``C``),
and ``tests/test_keyspace.py`` fails when a script spells one.

``LAYOUT`` also generates the key table of docs/architecture.md and the layout comment of
``indexer/lua/common.lua`` (``tests/test_keyspace.py`` fails when either drifts), and ``acl_pattern`` the key
pattern of the least-privileged Redis user (deploy/GUIDE.md).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from prefixcache.indexer.errors import ConfigError

#: What a Cluster's keys carry their hash tag between, after R: a chain's anchor or a shard's tag.
TAG_OPEN, TAG_CLOSE = "{", "}:"


@dataclass(frozen=True)
class KeyKind:
    """One kind of key: where it lives (``R``, ``S`` or ``C``), its name after that, its type and what it holds."""

    level: str  # R: once per index; S: once per shard; C: per chain
    pattern: str  # the name after the level's prefix, placeholders in <>
    type: str
    holds: str
    module: str = ""  # where it is read and written, when not the index itself


#: Every key, in the order the docs list them.
LAYOUT: tuple[KeyKind, ...] = (
    KeyKind(
        "C",
        "e:<key>",
        "hash",
        "one chunk entry: parent, root, ns, tenant, ntok, size, ctime, atime, hits, pin, probe, one field "
        "`l:<tier>@<node>` per location (value: ms it was added), `dram`, how many of those are DRAM copies, and "
        "`counted` once the entry is in its tenant's usage",
    ),
    KeyKind("C", "k:<parent>", "set", "keys registered directly below a parent (evict-by-prefix walks this)"),
    KeyKind("C", "b:<probe>", "hash", "probe bucket: key -> packed tokens of chunks sharing parent and first tokens"),
    KeyKind("R", "ns", "hash", "namespace digest -> canonical description (JSON)"),
    KeyKind("S", "keys", "sorted set", "every entry's key (score 0): listings page through keys in order"),
    KeyKind(
        "S",
        "u",
        "hash",
        'usage per namespace: "<ns>:chunks" and "<ns>:bytes" count entries, "<ns>:<tier>:chunks" and '
        '"<ns>:<tier>:bytes" count copies in a tier',
    ),
    KeyKind(
        "S",
        "tu",
        "hash",
        'usage per tenant id over every namespace: "<tenant>:chunks" and "<tenant>:bytes" count the entries marked '
        '"counted" ("" is the tenant of chunks without a salt); entries an earlier version left unmarked join it '
        "through tenants.lua",
    ),
    KeyKind(
        "S",
        "f:<node>",
        "stream",
        "change feed of the locations on <node>: entries {op=add|drop, tier, key} (write-behind and KV events, "
        "one consumer group each)",
    ),
    KeyKind("S", "lease", "sorted set", "chunk key -> lease expiry, Unix seconds", "indexer/leases.py"),
    KeyKind("S", "a", "hash", "(Cluster only) key -> anchor: which chain holds the entries this shard has"),
    KeyKind(
        "R",
        "peers",
        "hash",
        "which nodes answer: beat:<node>, suspect:<node>, strikes:<node>, marks:<node>, left:<node> -> ms",
        "indexer/peers.py",
    ),
    KeyKind("R", "quotas", "hash", "quotas set through /v1/quotas: tenant:<id> / namespace:<digest> -> bytes"),
    KeyKind("R", "quota:room", "string", "the room each scope had at the quota loop's last round (JSON)"),
    KeyKind("R", "quota:spent:<round>:<scope>", "integer", "bytes publishers spent of a scope's room (10 s TTL)"),
    KeyKind("R", "quota:lock", "string", "which node runs the quota loop (a lease, set NX PX)", "indexer/quotas.py"),
    KeyKind("R", "kvseq:<node>", "string", "the sequence number of the node's last KV-event batch"),
    KeyKind("R", "cs:<node>", "hash", "client statistics summed per node: lookups, hits, tokens, latency buckets"),
    KeyKind("R", "pq:<node>", "list", "promotion requests to one node's daemon"),
    KeyKind("R", "pr:<id>", "list", "one promotion request's streamed answers"),
    KeyKind("R", "xq:<node>", "list", '"where on your NVMe are these chunks?" requests to one node\'s daemon'),
    KeyKind("R", "xr:<id>", "list", "the answer to one extents request"),
    KeyKind("R", "dq:<node>", "list", "eviction orders to one node's daemon"),
    KeyKind("R", "dr:<id>", "list", "how many copies one eviction order removed"),
    KeyKind("R", "deployment-probe", "none", "read (never written) to check the deployment answers reads and writes"),
)


@dataclass(frozen=True)
class Keyspace:
    """The key names of one deployment, under the configured key prefix ``name`` (``"pc"``, without ``':'``)."""

    name: str = "pc"

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " {}"):
            raise ConfigError(f"key_prefix must be non-empty without spaces or braces, got {self.name!r}")

    @property
    def root(self) -> str:
        """R: the prefix of every key, with its ``':'``."""
        return self.name + ":"

    @property
    def acl_pattern(self) -> str:
        """The key pattern of a Redis ACL that allows exactly this deployment's keys."""
        return f"~{self.root}*"

    # Per chain and per shard (``C`` and ``S``): the prefixes the Lua scripts are handed, and the names under them.

    def chain(self, anchor: str) -> str:
        """C: where the keys of the chain anchored at ``anchor`` live ('' on one Redis: R)."""
        return f"{self.root}{TAG_OPEN}{anchor}{TAG_CLOSE}" if anchor else self.root

    def shard(self, tag: str) -> str:
        """S: where the shard serving ``tag`` keeps the keys chains share ('' on one Redis: R)."""
        return self.chain(tag)

    @staticmethod
    def entry(chain: str, key_hex: str) -> str:
        return f"{chain}e:{key_hex}"

    @staticmethod
    def entry_key_hex(name: bytes) -> bytes:
        """The key (hex) of the entry named ``name``, under any chain."""
        return name.rpartition(Keyspace.entry("", "").encode())[2]

    @staticmethod
    def children(chain: str, parent_hex: str) -> str:
        return f"{chain}k:{parent_hex}"

    @staticmethod
    def bucket(chain: str, probe_hex: str) -> str:
        return f"{chain}b:{probe_hex}"

    @staticmethod
    def listing(shard: str) -> str:
        return f"{shard}keys"

    @staticmethod
    def lease(shard: str) -> str:
        return f"{shard}lease"

    @staticmethod
    def usage(shard: str) -> str:
        return f"{shard}u"

    @staticmethod
    def tenant_usage(shard: str) -> str:
        return f"{shard}tu"

    @staticmethod
    def feed(shard: str, node: str) -> str:
        return f"{shard}f:{node}"

    @staticmethod
    def directory(shard: str) -> str:
        return f"{shard}a"

    @property
    def script_names(self) -> str:
        """ARGV[1] of the index's scripts (indexer/lua): R, the hash tag's delimiters, and each name the scripts
        add to R, S or C, as words ``name=value`` that common.lua reads into its table ``K``."""
        names = {
            "root": self.root,
            "tag_open": TAG_OPEN,
            "tag_close": TAG_CLOSE,
            "entry": self.entry("", ""),
            "children": self.children("", ""),
            "bucket": self.bucket("", ""),
            "listing": self.listing(""),
            "usage": self.usage(""),
            "tenant_usage": self.tenant_usage(""),
            "feed": self.feed("", ""),
            "directory": self.directory(""),
        }
        return " ".join(f"{name}={value}" for name, value in names.items())

    def entry_pattern(self, clustered: bool) -> str:
        """A SCAN pattern matching every entry."""
        return self.entry(self.chain("*") if clustered else self.root, "*")

    @property
    def everything(self) -> str:
        """A SCAN pattern matching every key of the deployment."""
        return self.root + "*"

    # Once per index (``R``).

    @property
    def namespaces(self) -> str:
        return self.root + "ns"

    @property
    def peers(self) -> str:
        return self.root + "peers"

    @property
    def quotas(self) -> str:
        return self.root + "quotas"

    @property
    def quota_room(self) -> str:
        return self.root + "quota:room"

    def quota_spent(self, round_id: str, scope: str) -> str:
        return f"{self.root}quota:spent:{round_id}:{scope}"

    @property
    def quota_lock(self) -> str:
        return self.root + "quota:lock"

    def kv_sequence(self, node: str) -> str:
        return f"{self.root}kvseq:{node}"

    def client_stats(self, node: str) -> str:
        return f"{self.root}cs:{node}"

    def promotion_queue(self, node: str) -> str:
        return f"{self.root}pq:{node}"

    def promotion_reply(self, reply_id: str) -> str:
        return f"{self.root}pr:{reply_id}"

    def extents_queue(self, node: str) -> str:
        return f"{self.root}xq:{node}"

    def extents_reply(self, reply_id: str) -> str:
        return f"{self.root}xr:{reply_id}"

    def eviction_queue(self, node: str) -> str:
        return f"{self.root}dq:{node}"

    def eviction_reply(self, reply_id: str) -> str:
        return f"{self.root}dr:{reply_id}"

    @property
    def deployment_probe(self) -> str:
        return self.root + "deployment-probe"

    def cluster_probe(self, tag: int) -> str:
        """``deployment_probe`` under hash tag ``tag``: probes spread over a Cluster's slots."""
        return f"{self.deployment_probe}{{{tag}}}"


def docs_table() -> list[str]:
    """The key table of docs/architecture.md."""
    where = {"R": "once", "S": "once per shard", "C": "per chain"}
    lines = ["| key | type | on a Cluster | holds |", "|---|---|---|---|"]
    for kind in LAYOUT:
        source = f" (`{kind.module}`)" if kind.module else ""
        holds = kind.holds.replace("|", "\\|")
        lines.append(f"| `P:{kind.pattern}` | {kind.type} | {where[kind.level]} | {holds}{source} |")
    return lines


def lua_layout() -> list[str]:
    """The layout comment of indexer/lua/common.lua (without the ``--`` of each line)."""
    width = max(len(kind.pattern) for kind in LAYOUT)
    lines = []
    for kind in LAYOUT:
        head = f"  {kind.level} {kind.pattern:<{width}}  {kind.type:<10}  "
        holds = kind.holds.replace("`", "") + (f" ({kind.module})" if kind.module else "")
        lines += textwrap.wrap(holds, 114, initial_indent=head, subsequent_indent=" " * len(head))
    return lines
