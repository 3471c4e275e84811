"""The object tier: chunk objects in an S3 bucket every node shares, so that nothing persisted is lost with a machine.

A chunk is the object ``<prefix>/chunks/<key hex>`` of the bucket named by ``s3://BUCKET/PREFIX``
(``ObjectStoreAddress``). The client is obstore (docs/decisions.md, "The object tier's client is obstore"),
installed by the ``object`` extra; credentials come from the standard AWS chain, never from a flag, and appear in
no log: the environment, then the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE`` or ~/.aws/credentials,
profile ``AWS_PROFILE`` or ``default``: read here, since obstore does not), then what obstore reads itself (web
identity, container and instance-role credentials).
An ``https`` endpoint (and AWS itself) is reached over TLS; plain ``http`` only where the endpoint says so.

Every object is sealed (cachestore/chunks/seal.py): encrypted and authenticated under its name with a key derived
from the cluster secret, so that a reader of the bucket learns nothing and can forge nothing. An object that
does not open (tampered, swapped, sealed with another key) is a miss, counted in ``rejected`` (with the corrupt
chunks of ``/v1/stats``).

Errors are answers, as in every tier (cachestore/tiers/tier.py): a read not over by its deadline is a miss
(``LATE``), and a bucket that does not answer opens a circuit breaker for ``breaker_s``, during which every call
answers at once (misses, ``False`` puts, ``FAILED`` deletes) and ``health()`` says degraded. A read's object is
opened (decrypted) straight into the caller's buffer by the calling thread, as each read completes within the
deadline, while the lanes fetch the others: an abandoned read writes nowhere.
"""

from __future__ import annotations

import configparser
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from prefixcache.cachestore.chunks.codec import RejectCounts
from prefixcache.cachestore.chunks.seal import OVERHEAD, ChunkSealer, SealError
from prefixcache.cachestore.tiers.tier import Removal, StorageTier, TierHealth
from prefixcache.cachestore.tiers.usage import TierUsage
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import Tier
from prefixcache.indexer.keys import KEY_BYTES

if TYPE_CHECKING:
    from obstore.store import S3Store

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What ``get_into`` answers for an object whose read was abandoned at its deadline.
LATE = -2
#: Requests in flight at once: S3 servers move more with several objects in flight than with one.
LANES = 8
#: Keys per page when listing the bucket (S3's own maximum is 1000).
LIST_PAGE_KEYS = 1000
#: The folder of chunk objects under the configured prefix.
CHUNKS = "chunks"


@dataclass(frozen=True)
class ObjectStoreAddress:
    """Where the object tier lives: a bucket, a key prefix in it, and how to reach it."""

    bucket: str
    prefix: str
    endpoint: str | None = None  # an S3-compatible server's URL; None: AWS
    region: str | None = None
    path_style: bool = False  # ``endpoint/bucket/key`` rather than ``bucket.endpoint/key``

    @classmethod
    def parse(
        cls, url: str, *, endpoint: str | None = None, region: str | None = None, path_style: bool = False
    ) -> ObjectStoreAddress:
        """``s3://BUCKET[/PREFIX]``; a ``ConfigError`` naming what is wrong with a bad URL or endpoint."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"object store URL must be s3://BUCKET[/PREFIX], got {url!r}")
        if parts.query or parts.fragment or "@" in parts.netloc:
            raise ConfigError(f"object store URL takes no credentials, query or fragment: {url!r}")
        if endpoint is not None:
            point = urlsplit(endpoint)
            if point.scheme not in ("http", "https") or not point.netloc or "@" in point.netloc:
                raise ConfigError(
                    f"object store endpoint must be http(s)://HOST[:PORT] without credentials, got {endpoint!r}"
                )
        return cls(parts.netloc, parts.path.strip("/"), endpoint, region, path_style)

    def name_of(self, key: bytes) -> str:
        """The object a chunk is stored as."""
        return "/".join(part for part in (self.prefix, CHUNKS, key.hex()) if part)

    def key_of(self, name: str) -> bytes | None:
        """The chunk key an object name holds, or None for an object that is not a chunk of this tier."""
        head, _, leaf = name.rpartition("/")
        if head != "/".join(part for part in (self.prefix, CHUNKS) if part) or len(leaf) != 2 * KEY_BYTES:
            return None
        try:
            return bytes.fromhex(leaf)
        except ValueError:
            return None

    def open(self, request_timeout_s: float) -> S3Store:
        """A client of the bucket; a ``ConfigError`` saying how to install it if the ``object`` extra is not."""
        try:
            from obstore.store import S3Store
        except ImportError as exc:
            raise ConfigError(
                "the object tier needs obstore: pip install 'prefixcache[object]' (or leave the object store unset)"
            ) from exc
        options: dict[str, object] = {
            "timeout": timedelta(seconds=request_timeout_s),
            "connect_timeout": timedelta(seconds=2),
        }
        if self.endpoint is not None and self.endpoint.startswith("http://"):
            options["allow_http"] = True
        config: dict[str, object] = {"virtual_hosted_style_request": not self.path_style}
        if self.endpoint is not None:
            config["endpoint"] = self.endpoint
        if self.region is not None:
            config["region"] = self.region
        provider = shared_file_credentials()
        return S3Store(
            self.bucket,
            # obstore types these as TypedDicts (S3Credential, ClientConfig, S3Config) that the plain dicts built
            # here from settings do not claim to be
            credential_provider=(lambda: provider) if provider is not None else None,  # type: ignore[arg-type]
            client_options=options,  # type: ignore[arg-type]
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=request_timeout_s)},
            **config,  # type: ignore[arg-type]
        )


def shared_file_credentials() -> dict[str, str | None] | None:
    """The AWS chain's shared credentials file, where the environment names no keys: the profile's keys as obstore
    takes them, or None (no file, no such profile, no keys in it)."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    profile = os.environ.get("AWS_PROFILE") or "default"
    parser = configparser.RawConfigParser()
    try:
        found = parser.read(path)
    except configparser.Error as exc:
        raise ConfigError(f"AWS shared credentials file {path} is not readable as INI: {type(exc).__name__}") from None
    if not found or not parser.has_section(profile):
        return None
    section = parser[profile]
    if "aws_access_key_id" not in section or "aws_secret_access_key" not in section:
        return None
    return {
        "access_key_id": section["aws_access_key_id"],
        "secret_access_key": section["aws_secret_access_key"],
        "token": section.get("aws_session_token"),
        "expires_at": None,
    }


class ObjectTier(StorageTier):
    """The object tier of one node: a ``StorageTier`` (cachestore/tiers/tier.py) over a shared bucket."""

    tier: Tier = "object"

    def __init__(
        self,
        address: ObjectStoreAddress,
        sealer: ChunkSealer,
        *,
        read_deadline_s: float = 2.0,
        request_timeout_s: float = 30.0,
        breaker_s: float = 5.0,
    ) -> None:
        """``read_deadline_s``: how long a ``get_into`` waits for its objects; ``request_timeout_s``: how long any
        one request may take before the client gives it up (puts and listings wait for it)."""
        self.address = address
        self._sealer = sealer
        self._store = address.open(request_timeout_s)
        self._read_deadline_s = read_deadline_s
        self._breaker_s = breaker_s
        self._down_until = 0.0
        self._last_error = ""
        self._lanes = ThreadPoolExecutor(LANES, thread_name_prefix="prefixcache-object")
        self.late_reads = 0  # reads abandoned at their deadline
        self.rejected = RejectCounts()  # objects that did not open: tampered, swapped, sealed with another key

    # ---- StorageTier ------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Store each object sealed (one PUT each, in parallel); True where the bucket acknowledged it."""
        import obstore

        def put(item: tuple[bytes, bytes | memoryview]) -> bool:
            key, data = item
            name = self.address.name_of(key)
            obstore.put(self._store, name, self._sealer.seal(name, memoryview(data).cast("B")))
            return True

        return self._each(put, items, False)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read each object into its buffer; its length, -1 for a miss (absent, too large for the buffer, the
        bucket failing, an object that does not open), ``LATE`` for a read not over by the read deadline."""
        if len(keys) != len(buffers):
            raise ValueError("one buffer per key")
        if not keys or not self.available:
            return [-1] * len(keys)
        calls = {self._lanes.submit(self._fetch, key): i for i, key in enumerate(keys)}
        lengths = [LATE] * len(keys)
        try:
            for call in as_completed(calls, timeout=self._read_deadline_s):
                i = calls[call]
                lengths[i] = self._opened(keys[i], call, memoryview(buffers[i]).cast("B"))
        except TimeoutError:
            pass  # the reads not over are LATE
        late = lengths.count(LATE)
        if late:
            self.late_reads += 1
            log.info(
                "a read of %d objects from the bucket passed its %.2f s deadline: misses", late, self._read_deadline_s
            )
        return lengths

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the bucket holds its object (one HEAD each); False while the bucket fails."""
        return self._each(self._exists, keys, False)

    def delete(self, keys: Sequence[bytes]) -> list[Removal]:
        """Remove each key's object (a HEAD, then a DELETE where it was there)."""
        import obstore

        def remove(key: bytes) -> Removal:
            if not self._exists(key):
                return Removal.ABSENT
            obstore.delete(self._store, self.address.name_of(key))
            return Removal.REMOVED

        return self._each(remove, keys, Removal.FAILED)

    def usage(self) -> TierUsage:
        """What the bucket holds under this tier's prefix, from a listing (every node's chunks, not this one's)."""
        used = chunks = 0
        for page in self.list_pages():
            used += sum(size for _, size, _ in page)
            chunks += len(page)
        return TierUsage(self.tier, used, used, 0, chunks)

    def health(self) -> TierHealth:
        """Degraded while the circuit breaker is open: the node serves, without the bucket."""
        where = f"s3://{self.address.bucket}/{self.address.prefix}"
        if not self.available:
            return TierHealth(ok=True, degraded=True, detail=f"{where} unreachable ({self._last_error}); retrying")
        return TierHealth(ok=True, detail=where)

    # ---- beyond the contract ----------------------------------------------------------------------

    def list_pages(self, page_keys: int = LIST_PAGE_KEYS) -> Iterator[list[tuple[bytes, int, float]]]:
        """Every chunk the bucket holds, a page at a time: (key, sealed size, last modified as a Unix time).
        Objects under the prefix that are not chunks are skipped."""
        import obstore

        prefix = "/".join(part for part in (self.address.prefix, CHUNKS) if part)
        for page in obstore.list(self._store, prefix, chunk_size=page_keys):
            found = []
            for meta in page:
                key = self.address.key_of(meta["path"])
                if key is not None:
                    found.append((key, meta["size"], meta["last_modified"].timestamp()))
            yield found

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open after the bucket failed to answer."""
        return time.monotonic() >= self._down_until

    def close(self) -> None:
        self._lanes.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, key: bytes) -> memoryview:
        """One object as the bucket holds it, sealed (on a lane: the caller opens it into its buffer)."""
        import obstore

        return memoryview(obstore.get(self._store, self.address.name_of(key)).bytes())

    def _opened(self, key: bytes, call: Future[memoryview], buffer: memoryview) -> int:
        """A fetched object opened into ``buffer``: its length, or -1 (absent, the bucket failing, too large for the
        buffer, an object that does not open)."""
        try:
            sealed = call.result()
        except FileNotFoundError:
            return -1
        except Exception as exc:  # noqa: BLE001 - obstore's errors are many; each is a miss
            self._failed(exc)
            return -1
        if len(sealed) - OVERHEAD > len(buffer):
            return -1
        try:
            return self._sealer.open_into(self.address.name_of(key), sealed, buffer)
        except SealError as exc:
            self.rejected.count(exc)
            log.warning("an object in the bucket did not open (%s): a miss", exc)
            return -1

    def _exists(self, key: bytes) -> bool:
        import obstore

        try:
            obstore.head(self._store, self.address.name_of(key))
        except FileNotFoundError:
            return False
        return True

    def _each(self, call: Callable[[T], object], items: Sequence[T], failed: object) -> list[Any]:
        """``call`` on each item on the lanes; ``failed`` for those that raised (the breaker opened), and for all
        while it is open."""
        if not items:
            return []
        if not self.available:
            return [failed] * len(items)
        results = []
        for future in [self._lanes.submit(call, item) for item in items]:
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001 - obstore's errors are many; each fails its item
                self._failed(exc)
                results.append(failed)
        return results

    def _failed(self, error: Exception) -> None:
        """A request failed: the breaker opens (the message names the error's kind, never a credential)."""
        self._last_error = type(error).__name__
        if self.available:
            log.warning(
                "object store unreachable (%s): answering without it for %.1f s", self._last_error, self._breaker_s
            )
        self._down_until = time.monotonic() + self._breaker_s
