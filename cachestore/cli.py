"""The ``prefixcache`` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler

from cachestore.admin_cli import register_admin_commands
from cachestore.warmup.command import CONTEXT as WARMUP_CONTEXT
from cachestore.warmup.command import warmup
from indexer.errors import PrefixCacheError

app = typer.Typer(help="prefixcache: a persistent prefix KV cache for vLLM.", no_args_is_help=True)
err = Console(stderr=True)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )


@app.command()
def serve(
    config: Annotated[Optional[Path], typer.Option(help="TOML or JSON settings file")] = None,  # noqa: UP045
    host: Annotated[Optional[str], typer.Option(help="REST bind address [default: 127.0.0.1]")] = None,  # noqa: UP045
    port: Annotated[Optional[int], typer.Option(help="REST port [default: 8600]")] = None,  # noqa: UP045
    data_dir: Annotated[Optional[Path], typer.Option(help="data directory")] = None,  # noqa: UP045
    node: Annotated[Optional[str], typer.Option(help="this node's name [default: hostname]")] = None,  # noqa: UP045
    redis_url: Annotated[Optional[str], typer.Option(help="shared Redis index; unset: embedded")] = None,  # noqa: UP045
    redis_port: Annotated[Optional[int], typer.Option(help="embedded redis-server port")] = None,  # noqa: UP045
    key_prefix: Annotated[Optional[str], typer.Option(help="prefix of every index key")] = None,  # noqa: UP045
    chunk_tokens: Annotated[Optional[int], typer.Option(help="tokens per chunk [default: 256]")] = None,  # noqa: UP045
    dram_bytes: Annotated[Optional[str], typer.Option(help="DRAM added to the pool, e.g. 4GiB [default: 2GiB]")] = None,  # noqa: UP045
    nvme_bytes: Annotated[Optional[str], typer.Option(help="NVMe tier capacity [default: 16GiB]")] = None,  # noqa: UP045
    nvme_dir: Annotated[Optional[Path], typer.Option(help="NVMe tier directory [default: DATA_DIR/nvme]")] = None,  # noqa: UP045
    mooncake_master: Annotated[Optional[str], typer.Option(help="external master host:port; unset: embedded")] = None,  # noqa: UP045
    mooncake_metadata_url: Annotated[Optional[str], typer.Option(help="external Mooncake metadata server")] = None,  # noqa: UP045
    mooncake_protocol: Annotated[Optional[str], typer.Option(help="tcp or rdma [default: tcp]")] = None,  # noqa: UP045
    mooncake_device_names: Annotated[Optional[str], typer.Option(help="RDMA NICs, e.g. mlx5_0")] = None,  # noqa: UP045
    mooncake_host: Annotated[Optional[str], typer.Option(help="this node's address in the pool")] = None,  # noqa: UP045
    chunk_key_file: Annotated[Optional[Path], typer.Option(help="the cluster's chunk-signing key file")] = None,  # noqa: UP045
    admin_token: Annotated[Optional[str], typer.Option(help="bearer token admin calls need")] = None,  # noqa: UP045
    open_reads: Annotated[Optional[bool], typer.Option("--open-reads", help="reads need no token")] = None,  # noqa: UP045
    kv_events_endpoint: Annotated[Optional[str], typer.Option(help="KV events: ZMQ tcp://ADDRESS:PORT")] = None,  # noqa: UP045
    cpus: Annotated[Optional[str], typer.Option(help="run the daemon and its servers on CPUs: 1, 2-3")] = None,  # noqa: UP045
    allowed_host: Annotated[Optional[list[str]], typer.Option(help="also answer this Host name (repeat)")] = None,  # noqa: UP045
    max_body_bytes: Annotated[Optional[str], typer.Option(help="larger bodies get 413 [default: 16MiB]")] = None,  # noqa: UP045
    warmup_root: Annotated[Optional[list[Path]], typer.Option(help="warm-up jobs' files lie here (repeat)")] = None,  # noqa: UP045
    warmup_allow_trust_remote_code: Annotated[bool, typer.Option(help="jobs may pass --trust-remote-code")] = False,
) -> None:
    """Run this node's daemon. With no --redis-url it starts its own redis-server under the data dir."""
    from cachestore.daemon import NodeDaemon
    from cachestore.settings import load_settings

    flags = dict(
        host=host, port=port, data_dir=data_dir, node=node, redis_url=redis_url,
        redis_port=redis_port, key_prefix=key_prefix, chunk_tokens=chunk_tokens, dram_bytes=dram_bytes,
        nvme_bytes=nvme_bytes, nvme_dir=nvme_dir, mooncake_master=mooncake_master,
        mooncake_metadata_url=mooncake_metadata_url, mooncake_protocol=mooncake_protocol,
        mooncake_device_names=mooncake_device_names, mooncake_host=mooncake_host, admin_token=admin_token,
        open_reads=open_reads, chunk_key_file=chunk_key_file,
        kv_events_endpoint=kv_events_endpoint, cpus=cpus, allowed_hosts=allowed_host or None,
        max_body_bytes=max_body_bytes, warmup_roots=warmup_root or None,
        warmup_allow_trust_remote_code=warmup_allow_trust_remote_code or None,
    )  # fmt: skip
    with _clear_errors():
        NodeDaemon(load_settings(flags, config)).serve()


@app.command()
def proxy(
    prefill: Annotated[list[str], typer.Option(help="prefill instance URL (repeat, or comma-separated)")],
    decode: Annotated[list[str], typer.Option(help="decode instance URL (repeat, or comma-separated)")],
    host: Annotated[Optional[str], typer.Option(help="bind address [default: 127.0.0.1]")] = None,  # noqa: UP045
    port: Annotated[Optional[int], typer.Option(help="port [default: 8000]")] = None,  # noqa: UP045
    routing: Annotated[Optional[str], typer.Option(help="round-robin or cache-aware [default: round-robin]")] = None,  # noqa: UP045
    service_url: Annotated[Optional[str], typer.Option(help="a prefixcache daemon, for cache-aware routing")] = None,  # noqa: UP045
    timeout_s: Annotated[Optional[float], typer.Option(help="longest request to an instance [default: 600]")] = None,  # noqa: UP045
    publish_wait_s: Annotated[Optional[float], typer.Option(help="wait for a prefill's chunks [default: 2]")] = None,  # noqa: UP045
    retry_after_s: Annotated[Optional[float], typer.Option(help="a failed instance goes last [default: 10]")] = None,  # noqa: UP045
    auth_token_file: Annotated[Optional[Path], typer.Option(help="bearer token clients send: its file")] = None,  # noqa: UP045
) -> None:
    """OpenAI-compatible front for disaggregated prefill: each request is prefilled on a prefill instance,
    which publishes the prompt's KV, then generated on a decode instance, which loads it from the store. Secrets come
    from the environment or files, never flags: PREFIXCACHE_PROXY_TOKEN (or --auth-token-file) is the bearer token
    clients must send, PREFIXCACHE_REDIS_PASSWORD the index's password (cache-aware routing, where the daemon's
    password file cannot be read)."""
    import os

    from cachestore.proxy import ProxySettings, serve
    from cachestore.secrets_store import read_secret

    flags = dict(prefill=prefill, decode=decode, host=host, port=port, routing=routing, service_url=service_url,
                 timeout_s=timeout_s, publish_wait_s=publish_wait_s, retry_after_s=retry_after_s,
                 auth_token=os.environ.get("PREFIXCACHE_PROXY_TOKEN"),
                 redis_password=os.environ.get("PREFIXCACHE_REDIS_PASSWORD"))  # fmt: skip
    with _clear_errors():
        if auth_token_file is not None:
            flags["auth_token"] = read_secret(auth_token_file)
        serve(ProxySettings.parse(flags))


app.command(context_settings=WARMUP_CONTEXT)(warmup)


register_admin_commands(app)


class _clear_errors:
    """Turn prefixcache's own errors into one red line and exit code 2, without a traceback."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, PrefixCacheError):
            err.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(2)
        return False
