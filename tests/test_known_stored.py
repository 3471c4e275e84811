"""What the scheduler side knows to be stored (connector/known_stored.py): each key for a while, the newest kept."""

from __future__ import annotations

import pytest

from prefixcache.connector.known_stored import KnownStored


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def known(clock: Clock) -> KnownStored:
    """Keys a and b known for 30 s from now."""
    known = KnownStored(known_for_s=30.0, clock=clock)
    known.add([b"a", b"b"])
    return known


def test_keys_are_known_for_a_while_after_they_were_added_and_then_not(clock, known):
    clock.now += 10
    known.add([b"c"])
    assert known.holds([b"a", b"b", b"c"]) and known.holds([])
    assert not known.holds([b"a", b"d"])  # one unknown key: not every chunk is stored
    clock.now += 25  # a and b lapsed at 130; c holds until 140
    assert not known.holds([b"a"]) and known.holds([b"c"])
    assert len(known) == 1  # what lapsed is dropped
    clock.now += 5
    assert not known.holds([b"c"])


def test_a_key_added_again_is_known_from_then_on(clock, known):
    clock.now += 20
    known.add([b"a"])
    clock.now += 20
    assert known.holds([b"a"]) and not known.holds([b"b"])


def test_only_the_newest_keys_are_kept():
    known = KnownStored(capacity=3, clock=Clock())
    known.add([b"a", b"b", b"c"])
    known.add([b"a", b"d"])  # a is the newest but one now: b, the oldest, goes
    assert len(known) == 3
    assert known.holds([b"a", b"c", b"d"]) and not known.holds([b"b"])


def test_a_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        KnownStored(capacity=0)
