"""Secrets a node keeps in files: generated at first start, private to the daemon's user, never sent.

A single-node start needs no set-up: the daemon creates each secret it needs (the admin token, the
embedded Redis password, the cluster's chunk-signing key) under ``<data_dir>/secrets`` with mode 0600
in a 0700 directory, and local clients run as the same user read them from there. The API names where
a secret lives (``/v1/config``), never its value. Operators of several nodes give every daemon the
same file instead (a Kubernetes Secret, say), through the settings that name the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

from prefixcache.indexer.errors import ConfigError

log = logging.getLogger("prefixcache.secrets")

SECRETS_DIR = "secrets"
#: Owner-only permissions for everything the daemon writes under its data dir.
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def secrets_dir(data_dir: Path) -> Path:
    return Path(data_dir) / SECRETS_DIR


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) owner-only, and tighten it if it exists with wider permissions."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def read_secret(path: Path) -> str:
    """The secret in ``path`` (surrounding whitespace stripped), with an error that names the file."""
    path = Path(path)
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"secret file {path} is not text") from None
    if not value:
        raise ConfigError(f"secret file {path} is empty")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("secret file %s is readable by other users (mode %04o); make it 0600", path, mode)
    return value


def load_or_create_secret(path: Path, *, nbytes: int = 32) -> str:
    """The secret in ``path``; created first (``nbytes`` random bytes as hex, mode 0600) if there is none.

    Creation is exclusive (``O_EXCL``), so two processes racing to create it agree on one value.
    """
    path = Path(path)
    make_private_dir(path.parent)
    value = secrets.token_hex(nbytes)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        return read_secret(path)
    except OSError as exc:
        raise ConfigError(f"cannot create secret file {path}: {exc.strerror}") from exc
    try:
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    os.close(fd)
    log.info("generated a new secret in %s", path)
    return value
