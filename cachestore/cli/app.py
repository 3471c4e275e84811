"""The ``prefixcache`` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from prefixcache.cachestore.cli.admin import register_admin_commands
from prefixcache.cachestore.cli.errors import clear_errors, err
from prefixcache.cachestore.cli.warmup import CONTEXT as WARMUP_CONTEXT
from prefixcache.cachestore.cli.warmup import warmup
from rich.logging import RichHandler

app = typer.Typer(help="prefixcache: a persistent prefix KV cache for vLLM.", no_args_is_help=True)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(help="TOML or JSON settings file")] = None,
    host: Annotated[str | None, typer.Option(help="REST bind address [default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="REST port [default: 8600]")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="data directory")] = None,
    node: Annotated[str | None, typer.Option(help="this node's name [default: hostname]")] = None,
    redis_url: Annotated[str | None, typer.Option(help="shared Redis index; unset: embedded")] = None,
    redis_port: Annotated[int | None, typer.Option(help="embedded redis-server port")] = None,
    key_prefix: Annotated[str | None, typer.Option(help="prefix of every index key")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(help="tokens per chunk [default: 256]")] = None,
    dram_bytes: Annotated[str | None, typer.Option(help="DRAM added to the pool, e.g. 4GiB [default: 2GiB]")] = None,
    nvme_bytes: Annotated[str | None, typer.Option(help="NVMe tier capacity [default: 16GiB]")] = None,
    nvme_dir: Annotated[Path | None, typer.Option(help="NVMe tier directory [default: DATA_DIR/nvme]")] = None,
    mooncake_master: Annotated[str | None, typer.Option(help="external master host:port; unset: embedded")] = None,
    mooncake_metadata_url: Annotated[str | None, typer.Option(help="external Mooncake metadata server")] = None,
    mooncake_protocol: Annotated[str | None, typer.Option(help="tcp or rdma [default: tcp]")] = None,
    mooncake_device_names: Annotated[str | None, typer.Option(help="RDMA NICs, e.g. mlx5_0")] = None,
    mooncake_host: Annotated[str | None, typer.Option(help="this node's address in the pool")] = None,
    chunk_key_file: Annotated[Path | None, typer.Option(help="the cluster's chunk-signing key file")] = None,
    admin_token: Annotated[str | None, typer.Option(help="bearer token admin calls need")] = None,
    open_reads: Annotated[bool | None, typer.Option("--open-reads", help="reads need no token")] = None,
    kv_events_endpoint: Annotated[str | None, typer.Option(help="KV events: ZMQ tcp://ADDRESS:PORT")] = None,
    cpus: Annotated[str | None, typer.Option(help="run the daemon and its servers on CPUs: 1, 2-3")] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(help="also answer this Host name (repeat)")] = None,
    max_body_bytes: Annotated[str | None, typer.Option(help="larger bodies get 413 [default: 16MiB]")] = None,
    warmup_root: Annotated[list[Path] | None, typer.Option(help="warm-up jobs' files lie here (repeat)")] = None,
    warmup_allow_trust_remote_code: Annotated[bool, typer.Option(help="jobs may pass --trust-remote-code")] = False,
) -> None:
    """Run this node's daemon. With no --redis-url it starts its own redis-server under the data dir."""
    from prefixcache.cachestore.node.daemon import NodeDaemon
    from prefixcache.cachestore.node.settings import load_settings

    flags = dict(
        host=host,
        port=port,
        data_dir=data_dir,
        node=node,
        redis_url=redis_url,
        redis_port=redis_port,
        key_prefix=key_prefix,
        chunk_tokens=chunk_tokens,
        dram_bytes=dram_bytes,
        nvme_bytes=nvme_bytes,
        nvme_dir=nvme_dir,
        mooncake_master=mooncake_master,
        mooncake_metadata_url=mooncake_metadata_url,
        mooncake_protocol=mooncake_protocol,
        mooncake_device_names=mooncake_device_names,
        mooncake_host=mooncake_host,
        admin_token=admin_token,
        open_reads=open_reads,
        chunk_key_file=chunk_key_file,
        kv_events_endpoint=kv_events_endpoint,
        cpus=cpus,
        allowed_hosts=allowed_host or None,
        max_body_bytes=max_body_bytes,
        warmup_roots=warmup_root or None,
        warmup_allow_trust_remote_code=warmup_allow_trust_remote_code or None,
    )
    with clear_errors():
        NodeDaemon(load_settings(flags, config)).serve()


@app.command()
def proxy(
    prefill: Annotated[list[str], typer.Option(help="prefill instance URL (repeat, or comma-separated)")],
    decode: Annotated[list[str], typer.Option(help="decode instance URL (repeat, or comma-separated)")],
    host: Annotated[str | None, typer.Option(help="bind address [default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="port [default: 8000]")] = None,
    routing: Annotated[str | None, typer.Option(help="round-robin or cache-aware [default: round-robin]")] = None,
    service_url: Annotated[str | None, typer.Option(help="a prefixcache daemon, for cache-aware routing")] = None,
    timeout_s: Annotated[float | None, typer.Option(help="longest request to an instance [default: 600]")] = None,
    publish_wait_s: Annotated[float | None, typer.Option(help="wait for a prefill's chunks [default: 2]")] = None,
    retry_after_s: Annotated[float | None, typer.Option(help="a failed instance goes last [default: 10]")] = None,
    auth_token_file: Annotated[Path | None, typer.Option(help="bearer token clients send: its file")] = None,
) -> None:
    """OpenAI-compatible front for disaggregated prefill: each request is prefilled on a prefill instance,
    which publishes the prompt's KV, then generated on a decode instance, which loads it from the store. Secrets come
    from the environment or files, never flags: PREFIXCACHE_PROXY_TOKEN (or --auth-token-file) is the bearer token
    clients must send, PREFIXCACHE_REDIS_PASSWORD the index's password (cache-aware routing, where the daemon's
    password file cannot be read)."""
    import os

    from prefixcache.cachestore.host.secret_files import read_secret
    from prefixcache.cachestore.proxy.server import ProxySettings, serve

    flags = dict(
        prefill=prefill,
        decode=decode,
        host=host,
        port=port,
        routing=routing,
        service_url=service_url,
        timeout_s=timeout_s,
        publish_wait_s=publish_wait_s,
        retry_after_s=retry_after_s,
        auth_token=os.environ.get("PREFIXCACHE_PROXY_TOKEN"),
        redis_password=os.environ.get("PREFIXCACHE_REDIS_PASSWORD"),
    )
    with clear_errors():
        if auth_token_file is not None:
            flags["auth_token"] = read_secret(auth_token_file)
        serve(ProxySettings.parse(flags))


app.command(context_settings=WARMUP_CONTEXT)(warmup)


register_admin_commands(app)
