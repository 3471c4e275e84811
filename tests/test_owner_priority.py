"""The segment owner yields its raised priority while another node is lost (cachestore/services/owner_priority.py):
a real process reniced from the table of peers on a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from prefixcache.cachestore.host.cpu_priority import set_process_nice
from prefixcache.cachestore.services.owner_priority import CALM_NICE, OwnerPriority
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.peers import PeerRegistry
from prefixcache.indexer.redis_clients import redis_client
from tests.daemon_harness import wait_for

RAISED = -5


@pytest.fixture
def owner():
    """A stand-in for the owner: a process with threads, at ``RAISED`` (needs CAP_SYS_NICE)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        if not set_process_nice(child.pid, RAISED):
            pytest.skip("lowering a nice needs CAP_SYS_NICE")
        yield child
    finally:
        child.kill()
        child.wait()


def thread_nices(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_owner_runs_at_the_default_priority_while_a_peer_is_lost_and_a_while_after(redis_server, owner):
    client = redis_client(redis_server.url)
    registry = PeerRegistry(client, Keyspace("owner-priority"))
    registry.beat("self", ttl_s=60)
    registry.beat("b", ttl_s=60)
    registry.leave("c")  # stopped on purpose: nothing reads from it, so it is not lost
    loop = OwnerPriority(registry, "self", lambda: owner.pid, RAISED, hold_s=1.0)
    loop.start()
    try:
        time.sleep(0.5)  # a couple of the loop's rounds, with no peer lost
        assert thread_nices(owner.pid) == {RAISED}
        registry.suspect("b", for_s=0.5)
        assert wait_for(lambda: thread_nices(owner.pid) == {CALM_NICE}, timeout_s=5)
        assert wait_for(lambda: thread_nices(owner.pid) == {RAISED}, timeout_s=10)  # the mark lapsed, then 1 s
    finally:
        loop.stop()
        client.delete("owner-priority:peers")
        client.close()
