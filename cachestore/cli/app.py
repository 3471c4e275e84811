"""The ``prefixcache`` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.logging import RichHandler

from prefixcache.cachestore.cli.admin import register_admin_commands
from prefixcache.cachestore.cli.errors import clear_errors, err
from prefixcache.cachestore.cli.option_help import field_help
from prefixcache.cachestore.cli.quotas import quota_app
from prefixcache.cachestore.cli.warmup import CONTEXT as WARMUP_CONTEXT
from prefixcache.cachestore.cli.warmup import warmup
from prefixcache.cachestore.node.settings import redis_password_from_environment
from prefixcache.cachestore.proxy.settings import AUTH_TOKEN_ENV, ProxySettings

#: The help panels of ``serve``'s options (``prefixcache serve --help``), each a table of its own.
NODE = "Node"
INDEX = "Index"
MOONCAKE = "Mooncake"
TIERS = "Tiers"
OBJECT_TIER = "Object tier"
SECURITY = "Security"
KV_EVENTS = "KV events"
WARMUP = "Warm-up jobs"

app = typer.Typer(help="prefixcache: a persistent prefix KV cache for vLLM.", no_args_is_help=True)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )


@app.command(epilog="All settings: docs/settings.md")
def serve(
    config: Annotated[Path | None, typer.Option(rich_help_panel=NODE, help="TOML or JSON settings file")] = None,
    host: Annotated[str | None, typer.Option(rich_help_panel=NODE, help=field_help("host"))] = None,
    port: Annotated[int | None, typer.Option(rich_help_panel=NODE, help=field_help("port"))] = None,
    data_dir: Annotated[Path | None, typer.Option(rich_help_panel=NODE, help=field_help("data_dir"))] = None,
    node: Annotated[str | None, typer.Option(rich_help_panel=NODE, help=field_help("node"))] = None,
    redis_url: Annotated[str | None, typer.Option(rich_help_panel=INDEX, help=field_help("redis_url"))] = None,
    redis_port: Annotated[int | None, typer.Option(rich_help_panel=INDEX, help=field_help("redis_port"))] = None,
    key_prefix: Annotated[str | None, typer.Option(rich_help_panel=INDEX, help=field_help("key_prefix"))] = None,
    chunk_tokens: Annotated[int | None, typer.Option(rich_help_panel=INDEX, help=field_help("chunk_tokens"))] = None,
    dram_bytes: Annotated[str | None, typer.Option(rich_help_panel=TIERS, help=field_help("dram_bytes"))] = None,
    nvme_bytes: Annotated[str | None, typer.Option(rich_help_panel=TIERS, help=field_help("nvme_bytes"))] = None,
    nvme_dir: Annotated[Path | None, typer.Option(rich_help_panel=TIERS, help=field_help("nvme_dir"))] = None,
    object_store_url: Annotated[
        str | None, typer.Option(rich_help_panel=OBJECT_TIER, help=field_help("object_store_url"))
    ] = None,
    object_store_endpoint: Annotated[
        str | None, typer.Option(rich_help_panel=OBJECT_TIER, help=field_help("object_store_endpoint"))
    ] = None,
    object_store_region: Annotated[
        str | None, typer.Option(rich_help_panel=OBJECT_TIER, help=field_help("object_store_region"))
    ] = None,
    object_store_path_style: Annotated[
        bool | None,
        typer.Option(
            "--object-store-path-style", rich_help_panel=OBJECT_TIER, help=field_help("object_store_path_style")
        ),
    ] = None,
    object_store_bytes: Annotated[
        str | None, typer.Option(rich_help_panel=OBJECT_TIER, help=field_help("object_store_bytes"))
    ] = None,
    object_store_max_age_s: Annotated[
        float | None, typer.Option(rich_help_panel=OBJECT_TIER, help=field_help("object_store_max_age_s"))
    ] = None,
    mooncake_master: Annotated[
        str | None, typer.Option(rich_help_panel=MOONCAKE, help=field_help("mooncake_master"))
    ] = None,
    mooncake_metadata_url: Annotated[
        str | None, typer.Option(rich_help_panel=MOONCAKE, help=field_help("mooncake_metadata_url"))
    ] = None,
    mooncake_protocol: Annotated[
        str | None, typer.Option(rich_help_panel=MOONCAKE, help=field_help("mooncake_protocol"))
    ] = None,
    mooncake_device_names: Annotated[
        str | None, typer.Option(rich_help_panel=MOONCAKE, help=field_help("mooncake_device_names"))
    ] = None,
    mooncake_host: Annotated[
        str | None, typer.Option(rich_help_panel=MOONCAKE, help=field_help("mooncake_host"))
    ] = None,
    chunk_key_file: Annotated[
        Path | None, typer.Option(rich_help_panel=SECURITY, help=field_help("chunk_key_file"))
    ] = None,
    admin_token: Annotated[str | None, typer.Option(rich_help_panel=SECURITY, help=field_help("admin_token"))] = None,
    open_reads: Annotated[
        bool | None, typer.Option("--open-reads", rich_help_panel=SECURITY, help=field_help("open_reads"))
    ] = None,
    kv_events_endpoint: Annotated[
        str | None, typer.Option(rich_help_panel=KV_EVENTS, help=field_help("kv_events_endpoint"))
    ] = None,
    kv_events_replay_endpoint: Annotated[
        str | None, typer.Option(rich_help_panel=KV_EVENTS, help=field_help("kv_events_replay_endpoint"))
    ] = None,
    cpus: Annotated[str | None, typer.Option(rich_help_panel=NODE, help=field_help("cpus"))] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(rich_help_panel=SECURITY, metavar="<name>", help=field_help("allowed_hosts", repeated=True)),
    ] = None,
    max_body_bytes: Annotated[
        str | None, typer.Option(rich_help_panel=SECURITY, help=field_help("max_body_bytes"))
    ] = None,
    warmup_root: Annotated[
        list[Path] | None,
        # no type column in this panel: beside its 32-character flag, one leaves the help no room in 80 columns
        typer.Option(rich_help_panel=WARMUP, metavar="", help=field_help("warmup_roots", repeated=True)),
    ] = None,
    warmup_allow_trust_remote_code: Annotated[
        bool,
        typer.Option(
            "--warmup-allow-trust-remote-code",
            rich_help_panel=WARMUP,
            metavar="",
            help=field_help("warmup_allow_trust_remote_code"),
        ),
    ] = False,
) -> None:
    """Run this node's daemon. With no --redis-url it starts its own redis-server under the data dir.

    A flag wins over its PREFIXCACHE_* variable, which wins over the --config file, which wins over the default."""
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
        object_store_url=object_store_url,
        object_store_endpoint=object_store_endpoint,
        object_store_region=object_store_region,
        object_store_path_style=object_store_path_style,
        object_store_bytes=object_store_bytes,
        object_store_max_age_s=object_store_max_age_s,
        mooncake_master=mooncake_master,
        mooncake_metadata_url=mooncake_metadata_url,
        mooncake_protocol=mooncake_protocol,
        mooncake_device_names=mooncake_device_names,
        mooncake_host=mooncake_host,
        admin_token=admin_token,
        open_reads=open_reads,
        chunk_key_file=chunk_key_file,
        kv_events_endpoint=kv_events_endpoint,
        kv_events_replay_endpoint=kv_events_replay_endpoint,
        cpus=cpus,
        allowed_hosts=allowed_host or None,
        max_body_bytes=max_body_bytes,
        warmup_roots=warmup_root or None,
        warmup_allow_trust_remote_code=warmup_allow_trust_remote_code or None,
    )
    with clear_errors():  # the imports too: without an extra's Mooncake they fail with one line
        from prefixcache.cachestore.node.daemon import NodeDaemon
        from prefixcache.cachestore.node.settings import load_settings

        NodeDaemon(load_settings(flags, config)).serve()


#: The help panels of ``proxy``'s options.
INSTANCES, SERVER, TIMING = "Instances", "Server", "Timing"


def proxy_help(name: str, *, repeated: bool = False) -> str:
    """The help of ``prefixcache proxy``'s option for proxy setting ``name``."""
    return field_help(name, model=ProxySettings, repeated=repeated)


@app.command()
def proxy(
    prefill: Annotated[
        list[str], typer.Option(rich_help_panel=INSTANCES, metavar="<url>", help=proxy_help("prefill", repeated=True))
    ],
    decode: Annotated[
        list[str], typer.Option(rich_help_panel=INSTANCES, metavar="<url>", help=proxy_help("decode", repeated=True))
    ],
    host: Annotated[str | None, typer.Option(rich_help_panel=SERVER, help=proxy_help("host"))] = None,
    port: Annotated[int | None, typer.Option(rich_help_panel=SERVER, help=proxy_help("port"))] = None,
    routing: Annotated[str | None, typer.Option(rich_help_panel=INSTANCES, help=proxy_help("routing"))] = None,
    service_url: Annotated[str | None, typer.Option(rich_help_panel=INSTANCES, help=proxy_help("service_url"))] = None,
    timeout_s: Annotated[float | None, typer.Option(rich_help_panel=TIMING, help=proxy_help("timeout_s"))] = None,
    publish_wait_s: Annotated[
        float | None, typer.Option(rich_help_panel=TIMING, help=proxy_help("publish_wait_s"))
    ] = None,
    retry_after_s: Annotated[
        float | None, typer.Option(rich_help_panel=TIMING, help=proxy_help("retry_after_s"))
    ] = None,
    auth_token_file: Annotated[
        Path | None, typer.Option(rich_help_panel=SERVER, help="A file holding the bearer token")
    ] = None,
) -> None:
    """OpenAI-compatible front for disaggregated prefill: each request is prefilled on a prefill instance,
    which publishes the prompt's KV, then generated on a decode instance, which loads it from the store. Secrets come
    from the environment or files, never flags: PREFIXCACHE_PROXY_TOKEN (or --auth-token-file) is the bearer token
    clients must send, PREFIXCACHE_REDIS_PASSWORD the index's password (cache-aware routing, where the daemon's
    password file cannot be read). docs/settings.md describes every setting."""
    import os

    from prefixcache.cachestore.host.secret_files import read_secret
    from prefixcache.cachestore.proxy.server import serve

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
        auth_token=os.environ.get(AUTH_TOKEN_ENV),
        redis_password=redis_password_from_environment(),
    )
    with clear_errors():
        if auth_token_file is not None:
            flags["auth_token"] = read_secret(auth_token_file)
        serve(ProxySettings.parse(flags))


app.command(context_settings=WARMUP_CONTEXT)(warmup)


register_admin_commands(app)
app.add_typer(quota_app, name="quota")
