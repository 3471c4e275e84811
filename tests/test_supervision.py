"""A real ``prefixcache serve`` while each server it started is killed (``kill -9``) under a client that publishes
and fetches: the daemon brings the server back, is ready again, and what was persisted still hits."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from tests.daemon_harness import (
    Daemon,
    fetch_payloads,
    is_zombie,
    make_spec,
    publish_prompt,
    servers_of,
    wait_for,
    wait_persisted,
)

#: Generous: measured restarts take seconds (the segment owner's the longest: the master first expires the old one).
READY_BOUND_S = 60.0


def zombies_of(daemon: Daemon) -> list[int]:
    return [pid for pid in servers_of(daemon).values() if is_zombie(pid)]


def connect(daemon: Daemon) -> CacheClient:
    return CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20)


def restarts(daemon: Daemon) -> dict[str, int] | None:
    """``/v1/stats``' restart counts (None while the daemon cannot say: its index is down)."""
    try:
        answer = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers, timeout=5)
    except httpx.TransportError:
        return None
    return answer.json()["child_restarts"] if answer.status_code == 200 else None


class Traffic:
    """A client publishing new prompts and fetching old ones in a thread, as vLLM would go on doing; failures
    while a server is down are expected and counted."""

    def __init__(self, client: CacheClient, keys: list[bytes]) -> None:
        self.client, self.keys = client, keys
        self.rounds = self.failures = 0
        self.last_success = 0.0  # time.monotonic() of the last round that published and fetched everything
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                publish_prompt(self.client, [1000 + self.rounds, *range(64 * 2)], seed=self.rounds)
                assert None not in fetch_payloads(self.client, self.keys[:4])
                self.last_success = time.monotonic()
            except Exception:  # noqa: BLE001 - a publish fails (asserts) while DRAM or the index is down
                self.failures += 1
            self.rounds += 1
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.parametrize("server", ["redis-server", "mooncake_master", "mooncake_client"])
def test_a_killed_server_is_restarted_and_persisted_chunks_still_hit(daemon, server):
    client = connect(daemon)
    try:
        keys, payloads = [], []
        for prompt in range(8):
            more_keys, more_payloads = publish_prompt(client, [prompt, *range(64 * 4)], seed=prompt)
            keys += more_keys
            payloads += more_payloads
        wait_persisted(client, keys)
        time.sleep(1.5)  # past Redis's AOF fsync (every second): the kill tests the restart, not fsync
        traffic = Traffic(client, keys)
        victim = servers_of(daemon)[server]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        unready_but_live = False
        while True:
            elapsed = time.monotonic() - killed
            assert elapsed < READY_BOUND_S, f"not ready {READY_BOUND_S:.0f}s after kill -9 of {server}"
            health = httpx.get(daemon.url + "/v1/health", timeout=10)
            if health.status_code != 200:
                unready_but_live |= httpx.get(daemon.url + "/v1/live", timeout=10).status_code == 200
            elif (restarts(daemon) or {}).get(server) == 1:
                break
            time.sleep(0.1)
        print(f"\n{server}: ready again {elapsed:.1f}s after kill -9")
        assert unready_but_live, "the daemon's liveness must not follow its components' health"
        assert servers_of(daemon)[server] != victim and zombies_of(daemon) == []
        ready = time.monotonic()
        assert wait_for(lambda: traffic.last_success > ready, READY_BOUND_S), "the client does not work again"
        print(f"{server}: the client published and fetched again {traffic.last_success - killed:.1f}s after kill -9")
        traffic.stop()
        fetched = [got for start in range(0, len(keys), 8) for got in fetch_payloads(client, keys[start : start + 8])]
        hits = sum(got == want for got, want in zip(fetched, payloads, strict=True))
        print(
            f"{server}: {hits}/{len(keys)} persisted chunks hit after the restart "
            f"({traffic.failures} of {traffic.rounds} client rounds failed meanwhile)"
        )
        assert hits >= 0.99 * len(keys)
        assert restarts(daemon) == {"redis-server": 0, "mooncake_master": 0, "mooncake_client": 0, server: 1}
        metrics = httpx.get(daemon.url + "/metrics", headers=daemon.headers).text
        assert f'prefixcache_child_restarts_total{{child="{server}"}} 1.0' in metrics
        log = " ".join(daemon.log_path.read_text().split())  # rich wraps its lines
        assert f"{server} was killed by SIGKILL" in log and f"{server} restarted" in log
    finally:
        client.close()
