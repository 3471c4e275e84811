"""The least-recently-used eviction order (cachestore/tiers/eviction_policy.py)."""

from __future__ import annotations

from prefixcache.cachestore.tiers.eviction_policy import LruPolicy


def test_uses_and_callers_writes_move_a_key_last_and_a_tiers_own_copies_do_not() -> None:
    policy = LruPolicy()
    for key in (b"a", b"b", b"c", b"d"):
        policy.stored(key, used=False)
    policy.used(b"a")
    policy.stored(b"b", used=True)
    policy.stored(b"c", used=False)  # compaction's copy: its rank stays
    assert list(policy) == [b"c", b"d", b"a", b"b"]
    assert policy.coldest({b"c"}, 2) == [b"d", b"a"]
    policy.forgotten(b"d")
    policy.forgotten(b"unknown")
    assert policy.coldest(set(), 10) == [b"c", b"a", b"b"]
