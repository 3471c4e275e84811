"""The kernel's CPU list format, as ``serve --cpus`` and the connector's ``io_cpus`` read it."""

from __future__ import annotations

import pytest

from prefixcache.cachestore.host.cpus import cpu_list, format_cpu_list


def test_ids_and_ranges_round_trip():
    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list(" 5 ") == {5}
    assert format_cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert format_cpu_list(cpu_list("7")) == "7"


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,2", "1-", "0-3;5"])
def test_anything_else_is_an_error_naming_the_text(text):
    with pytest.raises(ValueError, match="is not a CPU list"):
        cpu_list(text)
