"""A node's client in a process of its own, driven over its stdin and stdout, for tests whose clients must run on
another host than the test: a namespace of tests/netns.py's (``HostClient``), where the node's segment owner
and its shared memory are.

    python -m tests.host_client SERVICE_URL

It connects as tests/daemon_harness.py's ``connect`` does (the index's password, where the node names none of
its own, in ``PREFIXCACHE_REDIS_PASSWORD``), then answers each JSON line it reads with one JSON line: keys are
hex, payloads base64, a failure ``{"error": TRACEBACK}``.

    {"call": "publish", "tokens": [...], "seed": 0}  -> {"keys": [...], "payloads": [...]}   (publish_prompt)
    {"call": "fetch", "keys": [...], "across": false} -> {"payloads": [... | null]}         (fetch_payloads)
    {"call": "persisted", "keys": [...]}             -> {"waited_s": ...}                   (wait_persisted)
    {"call": "demote", "keys": [...]}                -> {"demoted": [true | false...]}
    {"call": "counters"}                             -> the client's counters (fetched, missing, promoted...)
    {"call": "lookup", "tokens": [...]}              -> {"keys": [...]} the full chunks found, down nodes avoided
    {"call": "down"}                                 -> {"nodes": [...]} the nodes the client avoids now
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import traceback

from prefixcache.cachestore.client.cache_client import CacheClient
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_persisted
from tests.e2e.launch import REPO
from tests.netns import Host


def _encoded(payload: bytes | None) -> str | None:
    return None if payload is None else base64.b64encode(payload).decode()


def _decoded(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def answer(client: CacheClient, request: dict) -> dict:
    keys = [bytes.fromhex(key) for key in request.get("keys", ())]
    if request["call"] == "publish":
        published, payloads = publish_prompt(client, request["tokens"], seed=request.get("seed", 0))
        return {"keys": [key.hex() for key in published], "payloads": [_encoded(p) for p in payloads]}
    if request["call"] == "fetch":
        payloads = fetch_payloads(client, keys, across_network=request.get("across", False))
        return {"payloads": [_encoded(p) for p in payloads]}
    if request["call"] == "persisted":
        return {"waited_s": wait_persisted(client, keys)}
    if request["call"] == "demote":  # as the daemon's demotion does: DRAM copies go, their NVMe copies stay
        gone = [removal.gone for removal in client.dram.delete(keys)]
        client.index.drop_location([key for key, g in zip(keys, gone, strict=True) if g], client.location)
        return {"demoted": gone}
    if request["call"] == "counters":
        return {f.name: getattr(client.counters, f.name) for f in dataclasses.fields(client.counters) if f.compare}
    if request["call"] == "lookup":
        hasher = client.hasher()
        hasher.extend(request["tokens"])
        return {"keys": [key.hex() for key in client.lookup(hasher.query()).keys]}
    if request["call"] == "down":
        return {"nodes": sorted(client.peers.down)}
    raise ValueError(f"unknown call {request['call']!r}")


def main(service_url: str) -> None:
    password = os.environ.get("PREFIXCACHE_REDIS_PASSWORD")
    client = CacheClient.connect(service_url, make_spec(), arena_bytes=64 << 20, redis_password=password)
    try:
        for line in sys.stdin:
            try:
                reply = answer(client, json.loads(line))
            except Exception:
                reply = {"error": traceback.format_exc()}
            print(json.dumps(reply), flush=True)
    finally:
        client.close()


class HostClient:
    """A client of ``daemon``'s node in a process running on ``host``; ``close`` ends it."""

    def __init__(self, host: Host, daemon: Daemon) -> None:
        env = {**os.environ, **({"PREFIXCACHE_REDIS_PASSWORD": daemon.index_password} if daemon.index_password else {})}
        self.process = subprocess.Popen(
            host.command([sys.executable, "-m", "tests.host_client", daemon.url]),
            cwd=REPO,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def call(self, call: str, **arguments: object) -> dict:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps({"call": call, **arguments}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the client process exited ({self.process.wait(10)}) during {call}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"{call} failed in the client process:\n{reply['error']}")
        return reply

    def publish(self, tokens: list[int], seed: int = 0) -> tuple[list[bytes], list[bytes]]:
        """``publish_prompt`` on the client's host: the prompt's keys and payloads."""
        reply = self.call("publish", tokens=tokens, seed=seed)
        return [bytes.fromhex(key) for key in reply["keys"]], [base64.b64decode(p) for p in reply["payloads"]]

    def fetch(self, keys: list[bytes], across_network: bool = False) -> list[bytes | None]:
        """``fetch_payloads`` on the client's host."""
        reply = self.call("fetch", keys=[key.hex() for key in keys], across=across_network)
        return [_decoded(p) for p in reply["payloads"]]

    def wait_persisted(self, keys: list[bytes]) -> None:
        self.call("persisted", keys=[key.hex() for key in keys])

    def demote(self, keys: list[bytes]) -> list[bool]:
        """Drop the DRAM copies of ``keys`` from this client's node and from the index, as its daemon's demotion
        does (their NVMe copies stay); whether each went."""
        return self.call("demote", keys=[key.hex() for key in keys])["demoted"]

    def counters(self) -> dict[str, int]:
        return self.call("counters")

    def lookup(self, tokens: list[int]) -> list[bytes]:
        """The full chunks of ``tokens`` the client's lookup finds, avoiding the nodes it takes for down."""
        return [bytes.fromhex(key) for key in self.call("lookup", tokens=tokens)["keys"]]

    def down(self) -> set[str]:
        """The nodes the client avoids now (indexer/peers.py)."""
        return set(self.call("down")["nodes"])

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    main(sys.argv[1])
