"""Secrets generated in the data dir: private files, created once, read back with clear errors."""

from __future__ import annotations

import stat

import pytest

from prefixcache.cachestore.host.secret_files import load_or_create_secret, make_private_dir, read_secret
from prefixcache.indexer.errors import ConfigError


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_secret_is_created_once_private_and_read_back(tmp_path):
    path = tmp_path / "data" / "secrets" / "admin-token"
    first = load_or_create_secret(path)
    assert len(first) == 64 and int(first, 16) >= 0
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert load_or_create_secret(path) == first, "a second start must keep the first secret"
    assert read_secret(path) == first


def test_a_wide_directory_is_tightened(tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    wide.chmod(0o755)
    make_private_dir(wide)
    assert mode(wide) == 0o700


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_secret_file_is_an_error_naming_it(tmp_path, content):
    path = tmp_path / "key"
    path.write_text(content)
    with pytest.raises(ConfigError, match=str(path)):
        read_secret(path)


def test_a_missing_secret_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="cannot read secret file .*nope"):
        read_secret(tmp_path / "nope")
