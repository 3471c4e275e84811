"""Keep Mooncake's listeners on the address they are given: an LD_PRELOAD shim (``bind_shim.c``).

Mooncake (0.3.13) binds these to the wildcard whatever its flags say, and none has a setting of its own:

- the master's HTTP metadata server: ``HttpMetadataServer`` builds its ``coro_http_server(4, port)``
  without the host, so ``-http_metadata_server_host`` only reaches a log line (mooncake-store,
  ``http_metadata_server.cpp``);
- the segment owner's (any non-dummy client's) transfer engine: the handshake/RPC port
  (``findAvailableTcpPort`` and ``SocketHandShakePlugin::startDaemon`` bind ``INADDR_ANY``) and the TCP
  transport's data port (``TcpContext`` binds ``tcp::v6()`` dual-stack, else ``0.0.0.0``)
  (mooncake-transfer-engine, ``transfer_metadata_plugin.cpp``, ``tcp_transport.cpp``).
  ``MC_TCP_BIND_ADDRESS`` only sets the address the engine *advertises* for them.

The transfer protocol has no authentication: a 24-byte header sent to the data port reads or writes any
address of the segment. So every Mooncake server a node starts runs with this shim preloaded and
``PREFIXCACHE_BIND_ADDRESS`` set to the address it should listen on (``bind_env``); a wildcard bind then
binds that address instead. Processes that attach with ``setup_dummy`` (the daemon, vLLM workers) open
no listener and need nothing.

The shim is compiled once per source version with the system C compiler, into a directory beside this
module if a build step put it there (``python -m prefixcache.cachestore.tiers.bind_shim build``, as the Dockerfile
does) or
else into ``~/.cache/prefixcache`` (``$XDG_CACHE_HOME``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from prefixcache.indexer.errors import ConfigError

SOURCE = Path(__file__).with_name("bind_shim.c")
#: The variable the shim reads.
ADDRESS_VARIABLE = "PREFIXCACHE_BIND_ADDRESS"


def _file_name() -> str:
    return f"bind-shim-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}.so"


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefixcache"


def build(directory: Path) -> Path:
    """Compile the shim into ``directory`` (atomically: concurrent builds each rename a whole file)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ConfigError(
            "building the bind shim (cachestore/tiers/bind_shim.c) needs a C compiler (cc) once; "
            "install gcc and libc6-dev (deploy/setup.sh does)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / _file_name()
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ConfigError(f"cannot build the bind shim with {compiler}: {done.stderr.strip()}")
        partial.chmod(0o755)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def shim_path() -> Path:
    """The compiled shim: a prebuilt one beside this module, else one in the user's cache (built if absent)."""
    name = _file_name()
    prebuilt = Path(__file__).with_name(name)
    if prebuilt.is_file():
        return prebuilt
    cached = _cache_dir() / name
    return cached if cached.is_file() else build(_cache_dir())


def numeric_address(host: str) -> str:
    """``host`` as an IP literal (a name resolved to its first address), what the shim binds."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return host
    except OSError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise ConfigError(f"cannot resolve {host!r} to an address to bind: {exc}") from None


def bind_env(host: str) -> dict[str, str]:
    """Variables that make a Mooncake server listen on ``host`` only (added to its environment)."""
    preload = " ".join(p for p in (str(shim_path()), os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, ADDRESS_VARIABLE: numeric_address(host)}


def main(argv: list[str]) -> None:
    """``build [DIR]``: compile the shim into DIR (default: beside this module), as an image's build step does;
    ``run ADDRESS COMMAND...``: exec a Mooncake server that listens on ADDRESS only (deploy/docker-compose.yml)."""
    if argv[:1] == ["build"] and len(argv) <= 2:
        print(build(Path(argv[1]) if len(argv) > 1 else Path(__file__).parent))
    elif argv[:1] == ["run"] and len(argv) >= 3:
        os.execvpe(argv[2], argv[2:], {**os.environ, **bind_env(argv[1])})
    else:
        sys.exit("usage: python -m prefixcache.cachestore.tiers.bind_shim build [DIR] | run ADDRESS COMMAND [ARGS...]")


if __name__ == "__main__":
    main(sys.argv[1:])
