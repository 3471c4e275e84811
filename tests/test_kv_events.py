"""KV events from a real ``prefixcache serve``, received by a ZMQ subscriber and decoded with vLLM's own classes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.host.processes import free_port
from prefixcache.cachestore.node.settings import Settings
from tests.daemon_harness import Daemon, make_spec, publish_prompt, wait_for

CHUNK = 64
TOKENS = list(range(1000, 1000 + 3 * CHUNK + 20))  # three full chunks and a 20-token tail


class Subscriber:
    """A router's view: every message decoded, sequence numbers checked to be gapless."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)  # before the daemon binds: ZMQ connects once it does
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sequence: list[int] = []
        self.topics: set[bytes] = set()

    def events(self, timeout_s: float = 30) -> Iterator[object]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000)):
                break
            topic, seq, payload = self.socket.recv_multipart()
            self.topics.add(topic)
            self.sequence.append(int.from_bytes(seq, "big"))
            yield from self.decoder.decode(payload).events
        raise AssertionError("expected events did not arrive")

    def until(self, wanted: set[tuple]) -> list[object]:
        """Read events until every (type, hash, medium) in ``wanted`` was seen; returns all events read."""
        seen: list[object] = []
        for event in self.events():
            seen.append(event)
            wanted.discard((type(event).__name__, *_identity(event)))
            if not wanted:
                return seen
        raise AssertionError("unreachable")


def _identity(event: object) -> tuple:
    if isinstance(event, AllBlocksCleared):
        return (None, None)
    return (event.block_hashes[0], event.medium)


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[tuple[Daemon, Subscriber, CacheClient]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = Daemon(
        tmp_path_factory.mktemp("events") / "data", "--chunk-tokens", str(CHUNK), "--kv-events-endpoint", endpoint
    )
    subscriber = Subscriber(endpoint)
    daemon.start()
    client = CacheClient.connect(daemon.url, make_spec(chunk_tokens=CHUNK), arena_bytes=64 << 20)
    yield daemon, subscriber, client
    client.close()
    daemon.stop()
    subscriber.socket.close(linger=0)


def test_published_chunks_are_announced_in_dram_then_on_nvme(node):
    _, subscriber, client = node
    keys, _ = publish_prompt(client, TOKENS)
    seen = subscriber.until({("BlockStored", k, medium) for k in keys for medium in ("CPU", "STORAGE")})
    stored = {(e.block_hashes[0], e.medium): e for e in seen if isinstance(e, BlockStored)}
    for i, key in enumerate(keys):
        for medium in ("CPU", "STORAGE"):
            event = stored[key, medium]
            assert event.token_ids == TOKENS[i * CHUNK : (i + 1) * CHUNK]
            assert event.parent_block_hash == (keys[i - 1] if i else None)  # a prompt's first block has none
            assert event.block_size == CHUNK and event.lora_id is None
    assert subscriber.sequence == list(range(len(subscriber.sequence)))
    assert subscriber.topics == {b""}


def test_an_eviction_is_announced_per_tier(node):
    _, subscriber, client = node
    keys, _ = publish_prompt(client, TOKENS[:CHUNK] + [7] * (2 * CHUNK), seed=5)
    subscriber.until({("BlockStored", k, "STORAGE") for k in keys[1:]})
    assert client.index.remove(keys[1:]) == 2
    seen = subscriber.until({("BlockRemoved", k, medium) for k in keys[1:] for medium in ("CPU", "STORAGE")})
    assert not [e for e in seen if isinstance(e, BlockStored)]
    assert all(isinstance(e, BlockRemoved) and e.block_hashes[0] in keys[1:] for e in seen)


def test_a_flushed_index_is_announced_as_all_blocks_cleared(node):
    _, subscriber, client = node
    client.index.flush()
    subscriber.until({("AllBlocksCleared", None, None)})


def replayed(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """What the replay endpoint answers a subscriber that asks for the batches from ``start`` on (vLLM's protocol)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        socket.send_multipart((b"", start.to_bytes(8, "big")))
        batches = []
        while socket.poll(10_000):
            _, _, seq, payload = socket.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1  # the end marker
                return batches
            batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        raise AssertionError("the replay did not end")
    finally:
        socket.close(linger=0)


def test_a_restarted_daemon_goes_on_with_the_sequence_and_replays_the_batches_missed(tmp_path):
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    daemon = Daemon(
        tmp_path / "data",
        "--chunk-tokens",
        str(CHUNK),
        "--kv-events-endpoint",
        endpoint,
        "--kv-events-replay-endpoint",
        replay,
    )
    subscriber = Subscriber(endpoint)
    try:
        daemon.start()
        client = CacheClient.connect(daemon.url, make_spec(chunk_tokens=CHUNK), arena_bytes=64 << 20)
        first, _ = publish_prompt(client, TOKENS)
        subscriber.until({("BlockStored", k, "STORAGE") for k in first})
        client.close()
        before = subscriber.sequence[-1]
        daemon.kill()
        daemon.start()  # its DRAM is new: the restart drops the DRAM copies, which are events too
        # ZMQ sends a reconnected subscriber's subscription only once the socket is used again: a router reading all
        # along gets every later batch, this test's subscriber only those after this read
        subscriber.socket.poll(500)
        client = CacheClient.connect(daemon.url, make_spec(chunk_tokens=CHUNK), arena_bytes=64 << 20)
        second, _ = publish_prompt(client, TOKENS[:CHUNK] + [9] * CHUNK, seed=3)
        client.close()
        subscriber.until({("BlockStored", k, "STORAGE") for k in second[1:]})
        after = [seq for seq in subscriber.sequence if seq > before]
        assert after == list(range(after[0], after[0] + len(after)))  # the sequence goes on, not from 0
        # what it missed since the restart (the drops, published while it was away) it asks for, and gets in order
        batches = replayed(replay, before + 1)
        assert [seq for seq, _ in batches] == list(range(before + 1, after[-1] + 1))
        events = [e for _, batch in batches for e in batch.events]
        assert {("BlockRemoved", k, "CPU") for k in first} <= {(type(e).__name__, *_identity(e)) for e in events}
        assert replayed(replay, after[-1] + 1) == []
    finally:
        daemon.stop()
        subscriber.socket.close(linger=0)


class Router(threading.Thread):
    """A router's subscriber, reading all along on a thread of its own (as llm-d's and Dynamo's do), across the
    publisher's restarts: ZMQ reconnects it by itself."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.subscriber = Subscriber(endpoint)
        self.batches: list[tuple[int, list[object]]] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        socket, decoder = self.subscriber.socket, self.subscriber.decoder
        while not self._closing.is_set():
            if socket.poll(100):
                _, seq, payload = socket.recv_multipart()
                with self._lock:
                    self.batches.append((int.from_bytes(seq, "big"), decoder.decode(payload).events))

    def seen(self) -> list[tuple[int, list[object]]]:
        with self._lock:
            return list(self.batches)

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=5)
        self.subscriber.socket.close(linger=0)


def test_a_router_subscribed_across_a_daemon_restart_gets_every_event_after_it(tmp_path):
    """Killed and restarted, the daemon goes on with its sequence, and a subscriber that was reading all along gets
    every batch of the new daemon without asking for a replay: the restart's drops of DRAM copies first."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = Daemon(tmp_path / "data", "--chunk-tokens", str(CHUNK), "--kv-events-endpoint", endpoint)
    router = Router(endpoint)
    router.start()
    try:
        daemon.start()
        client = CacheClient.connect(daemon.url, make_spec(chunk_tokens=CHUNK), arena_bytes=64 << 20)
        first, _ = publish_prompt(client, TOKENS)
        client.close()
        stored = {("BlockStored", k, "STORAGE") for k in first}
        assert wait_for(lambda: stored <= {_event(e) for _, events in router.seen() for e in events}, timeout_s=30)
        before = router.seen()[-1][0]
        daemon.kill()
        daemon.start()  # its DRAM is new: it drops every DRAM copy, which are its first events
        client = CacheClient.connect(daemon.url, make_spec(chunk_tokens=CHUNK), arena_bytes=64 << 20)
        second, _ = publish_prompt(client, TOKENS[:CHUNK] + [9] * CHUNK, seed=3)
        client.close()
        wanted = {("BlockStored", k, "STORAGE") for k in second[1:]}
        assert wait_for(lambda: wanted <= {_event(e) for _, events in router.seen() for e in events}, timeout_s=30)
        after = [(seq, events) for seq, events in router.seen() if seq > before]
        assert [seq for seq, _ in after] == list(range(before + 1, before + 1 + len(after)))  # none missed
        dropped = {_event(e) for _, events in after for e in events}
        assert {("BlockRemoved", k, "CPU") for k in first} <= dropped
    finally:
        daemon.stop()
        router.close()


def _event(event: object) -> tuple:
    return (type(event).__name__, *_identity(event))


def test_a_malformed_endpoint_stops_serve_with_a_clear_error(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixcache.cachestore",
            "serve",
            "--data-dir",
            str(tmp_path),
            "--kv-events-endpoint",
            "5557",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2
    assert "invalid setting kv_events_endpoint: must look like tcp://HOST:PORT" in result.stderr


def test_every_interface_must_be_asked_for_by_its_address(tmp_path):
    """The events carry every chunk's token ids: ``tcp://*`` (what vLLM's examples use) is refused, naming the
    addresses to give instead; ``0.0.0.0`` is taken as meant."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixcache.cachestore",
            "serve",
            "--data-dir",
            str(tmp_path),
            "--kv-events-endpoint",
            "tcp://*:5557",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2
    assert "tcp://*:5557 would publish every cached chunk's token ids on every interface" in result.stderr
    assert "tcp://127.0.0.1:5557" in result.stderr and "tcp://0.0.0.0:5557" in result.stderr
    assert not (tmp_path / "redis").exists()  # refused before anything started
    assert Settings(kv_events_endpoint="tcp://0.0.0.0:5557").kv_events_endpoint == "tcp://0.0.0.0:5557"
    assert Settings(kv_events_endpoint="ipc:///run/prefixcache/events").kv_events_endpoint
