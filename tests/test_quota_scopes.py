"""What a quota's scope accepts, how a publisher spends a round's room, and the quota settings' checks."""

from __future__ import annotations

from collections import Counter

import pytest

from prefixcache.cachestore.node.settings import Settings
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.quotas import QuotaGate, QuotaScope

TENANT, OTHER, NAMESPACE = "0123456789abcdef", "fedcba9876543210", bytes(range(16))


@pytest.mark.parametrize(
    "text", ["tenant", "tenant:", "tenant:0123", "tenant:" + "a" * 32, "namespace:none", "user:0123456789abcdef"]
)
def test_a_malformed_scope_is_refused_with_its_shape(text):
    with pytest.raises(ConfigError, match="tenant|namespace"):
        QuotaScope.parse(text)


def test_scopes_hold_their_tenants_and_namespaces_chunks():
    assert QuotaScope.parse(f"tenant:{TENANT}") == QuotaScope.of_tenant(TENANT)
    assert QuotaScope.of_tenant("") == QuotaScope("tenant", "none")
    assert str(QuotaScope.of_namespace(NAMESPACE)) == "namespace:" + NAMESPACE.hex()


class Rounds:
    """The room the quota loop last wrote and what publishers spent of it, as ``QuotaStore`` keeps them."""

    def __init__(self) -> None:
        self.round, self.room = "", {}
        self.spent: Counter[tuple[str, QuotaScope]] = Counter()

    def write(self, round_id: str, room: dict[QuotaScope, int]) -> None:
        self.round, self.room = round_id, dict(room)

    def room_of(self) -> tuple[str, dict[QuotaScope, int]]:
        return self.round, dict(self.room)

    def spend(self, round_id: str, amounts: dict[QuotaScope, int]) -> dict[QuotaScope, int]:
        for scope, amount in amounts.items():
            self.spent[round_id, scope] += amount
        return {scope: self.spent[round_id, scope] for scope in amounts}


def gate(rounds: Rounds) -> QuotaGate:
    store = type("Store", (), {"room": lambda _self: rounds.room_of(), "spend": lambda _self, *a: rounds.spend(*a)})()
    return QuotaGate(store, refresh_s=0)  # type: ignore[arg-type]


def chunks(*sizes: int) -> list[tuple[bytes, int]]:
    return [(NAMESPACE, size) for size in sizes]


def test_a_gate_admits_what_a_rounds_room_holds_and_refuses_beyond_it():
    rounds = Rounds()
    publisher = gate(rounds)
    assert publisher.admit(TENANT, chunks(100)) == [True]  # no quota anywhere
    rounds.write("r1", {QuotaScope.of_tenant(TENANT): 250})
    assert publisher.admit(TENANT, chunks(100, 100, 100)) == [True, True, False]
    assert publisher.admit(OTHER, chunks(100)) == [True]  # another tenant has no quota
    assert publisher.admit(TENANT, chunks(100, 50)) == [False, True]  # the same round: 50 left of its room
    rounds.write("r2", {QuotaScope.of_tenant(TENANT): 100, QuotaScope.of_namespace(NAMESPACE): 50})
    assert publisher.admit(TENANT, chunks(100)) == [False]  # its namespace has less room than the chunk
    assert publisher.admit(TENANT, chunks(50)) == [True] and publisher.admit(OTHER, chunks(1)) == [False]
    assert rounds.spent["r2", QuotaScope.of_tenant(TENANT)] == 50  # what it refused was given back


def test_publishers_share_a_rounds_room_and_what_one_refuses_is_left_to_the_others():
    rounds = Rounds()
    first, second = gate(rounds), gate(rounds)
    rounds.write("r1", {QuotaScope.of_tenant(TENANT): 250})
    assert first.admit(TENANT, chunks(200, 200)) == [True, False]
    assert second.admit(TENANT, chunks(100, 50)) == [False, True]  # 50 left after the first's 200
    assert first.admit(TENANT, chunks(1)) == [False]


def test_quota_settings_name_the_bad_id():
    good = Settings(tenant_quotas={TENANT.upper(): "1GiB"}, namespace_quotas={"ab" * 16: 1 << 20})
    assert good.quotas == {QuotaScope("tenant", TENANT): 1 << 30, QuotaScope("namespace", "ab" * 16): 1 << 20}
    with pytest.raises(ValueError, match="(?s)tenant_quotas.*16 hex"):
        Settings(tenant_quotas={"alice": "1GiB"})
    with pytest.raises(ValueError, match="(?s)namespace_quotas.*32 hex"):
        Settings(namespace_quotas={TENANT: "1GiB"})
    with pytest.raises(ValueError, match="default_tenant_quota"):
        Settings(default_tenant_quota="lots")
