"""What a quota's scope accepts, how a publisher spends a round's room, and the quota settings' checks."""

from __future__ import annotations

import pytest

from prefixcache.cachestore.node.settings import Settings
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.quotas import QuotaGate, QuotaScope

TENANT, NAMESPACE = "0123456789abcdef", bytes(range(16))


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
    """The room the quota loop last wrote, as ``QuotaStore.room`` reads it."""

    def __init__(self) -> None:
        self.round, self.room = "", {}

    def write(self, round_id: str, room: dict[QuotaScope, int]) -> None:
        self.round, self.room = round_id, dict(room)

    def room_of(self) -> tuple[str, dict[QuotaScope, int]]:
        return self.round, dict(self.room)


def gate(rounds: Rounds) -> QuotaGate:
    store = type("Store", (), {"room": lambda _self: rounds.room_of()})()
    return QuotaGate(store, refresh_s=0)  # type: ignore[arg-type]


def test_a_gate_spends_a_rounds_room_once_and_refuses_beyond_it():
    rounds = Rounds()
    publisher = gate(rounds)
    assert publisher.admit(TENANT, NAMESPACE, 100)  # no quota anywhere
    rounds.write("r1", {QuotaScope.of_tenant(TENANT): 250})
    assert [publisher.admit(TENANT, NAMESPACE, 100) for _ in range(3)] == [True, True, False]
    assert publisher.admit("fedcba9876543210", NAMESPACE, 100)  # another tenant has no quota
    assert not publisher.admit(TENANT, NAMESPACE, 100)  # the same round read again: its room is spent
    rounds.write("r2", {QuotaScope.of_tenant(TENANT): 100, QuotaScope.of_namespace(NAMESPACE): 50})
    assert not publisher.admit(TENANT, NAMESPACE, 100)  # its namespace has less room than the chunk
    assert publisher.admit(TENANT, NAMESPACE, 50) and not publisher.admit("fedcba9876543210", NAMESPACE, 1)


def test_quota_settings_name_the_bad_id():
    good = Settings(tenant_quotas={TENANT.upper(): "1GiB"}, namespace_quotas={"ab" * 16: 1 << 20})
    assert good.quotas == {QuotaScope("tenant", TENANT): 1 << 30, QuotaScope("namespace", "ab" * 16): 1 << 20}
    with pytest.raises(ValueError, match="(?s)tenant_quotas.*16 hex"):
        Settings(tenant_quotas={"alice": "1GiB"})
    with pytest.raises(ValueError, match="(?s)namespace_quotas.*32 hex"):
        Settings(namespace_quotas={TENANT: "1GiB"})
    with pytest.raises(ValueError, match="default_tenant_quota"):
        Settings(default_tenant_quota="lots")
