"""Every storage tier keeps ``StorageTier``'s contract (cachestore/tiers/tier.py): the same calls, the same answers,
run against the DRAM tier (a real Mooncake master and segment owner) and the NVMe tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.cachestore.tiers.tier import Removal, StorageTier


@pytest.fixture(params=["dram", "nvme"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageTier]:
    if request.param == "dram":
        dram = request.getfixturevalue("mooncake").tier()
        yield dram
        dram.close()
    else:
        nvme = NvmeTier(tmp_path, 4 << 20, pack_file_bytes=1 << 20)
        yield nvme
        nvme.close()


def test_put_read_ask_delete_and_measure(tier: StorageTier) -> None:
    stored, absent = os.urandom(16), os.urandom(16)
    data = os.urandom(10_000)
    assert tier.put([(stored, data)]) == [True]
    assert tier.contains([stored, absent]) == [True, False]
    out = memoryview(bytearray(16384))
    assert tier.get_into([stored, absent], [out, memoryview(bytearray(16384))])[0] == len(data)
    assert bytes(out[: len(data)]) == data
    assert tier.get_into([absent], [out])[0] < 0
    assert tier.usage().tier == tier.tier
    health = tier.health()
    assert health.ok and not health.degraded, health
    assert tier.delete([stored, absent]) == [Removal.REMOVED, Removal.ABSENT]
    assert tier.contains([stored]) == [False]
    assert tier.delete([stored]) == [Removal.ABSENT]


def test_a_removal_is_gone_unless_it_failed() -> None:
    assert [removal.gone for removal in Removal] == [True, True, False]
