"""``prefixcache stats | ls | lookup | evict | pin | unpin``: the admin API from a terminal (``quota``: quotas.py).

Each command is one or a few HTTP calls to a daemon (``--url``, env ``PREFIXCACHE_URL``), with the
admin token from ``--token`` or ``PREFIXCACHE_ADMIN_TOKEN``, else from the file the daemon generated
it in (``GET /v1/config`` names it; readable by the daemon's user only); it prints a table, or the
API's JSON with ``--json``. A refused or failed call prints the daemon's reason and exits with 2.
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from prefixcache.cachestore.api.models import MAX_PAGE
from prefixcache.cachestore.cli.errors import fail
from prefixcache.cachestore.host.secret_files import read_secret
from prefixcache.indexer.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8600"
out = Console()

Url = Annotated[str, typer.Option("--url", envvar="PREFIXCACHE_URL", help="the daemon's API")]
Token = Annotated[
    str | None, typer.Option("--token", envvar="PREFIXCACHE_ADMIN_TOKEN", help="admin token", show_default=False)
]
AsJson = Annotated[bool, typer.Option("--json", help="print the API's JSON answer")]
Namespace = Annotated[str | None, typer.Option(help="namespace digest (see `prefixcache stats`)")]
Tokens = Annotated[str | None, typer.Option("--tokens", help="prompt token ids, comma-separated")]
Text = Annotated[str | None, typer.Option("--text", help="prompt text, for the model's tokenizer")]
Salt = Annotated[str | None, typer.Option("--cache-salt", help="the tenant's cache_salt")]


class Api:
    def __init__(self, url: str, token: str | None) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the answer
        self.url = url.rstrip("/")
        #: why no token could be found (said if the daemon refuses the call); None: a token is sent
        self.missing: str | None = None
        if token is None:
            token, self.missing = self._generated_token()
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _generated_token(self) -> tuple[str | None, str | None]:
        """The token the daemon generated, read from the file ``/v1/config`` names; or why there is none."""
        given = "pass --token or set PREFIXCACHE_ADMIN_TOKEN"
        config = self._get("/v1/config")
        path = (config.get("secret_files") or {}).get("admin_token") if isinstance(config, dict) else None
        if not path:
            return None, f"the daemon at {self.url} has an operator-set admin token: {given}"
        try:
            return read_secret(Path(path)), None
        except ConfigError as exc:
            return None, f"{exc} (it is readable by the daemon's user only): run as that user, or {given}"

    def _get(self, path: str) -> Any:
        try:
            response = httpx.get(self.url + path, timeout=60)
        except httpx.HTTPError as exc:
            fail(f"cannot reach the daemon at {self.url}: {exc}")
        try:
            return response.json() if response.status_code == 200 else None
        except ValueError:
            return None

    def call(self, method: str, path: str, **options: Any) -> Any:
        try:
            response = httpx.request(method, self.url + path, headers=self.headers, timeout=600, **options)
        except httpx.HTTPError as exc:
            fail(f"cannot reach the daemon at {self.url}: {exc}")
        if response.status_code == 401 and self.missing:
            fail(f"401: no admin token: {self.missing}")
        if response.status_code >= 400:
            fail(f"{response.status_code}: {_reason(response)}")
        return response.json()


def _reason(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text
    if isinstance(detail, list):  # a validation error: field and message of each problem
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail)
    return str(detail)


def _prompt(namespace: str | None, tokens: str | None, text: str | None, salt: str | None) -> dict[str, Any]:
    if namespace is None or (tokens is None) == (text is None):
        fail("a prompt needs --namespace and exactly one of --tokens or --text")
    body: dict[str, Any] = {"namespace": namespace, "cache_salt": salt}
    if tokens is not None:
        try:
            body["token_ids"] = [int(t) for t in tokens.replace(" ", "").split(",") if t]
        except ValueError:
            fail("--tokens takes integers separated by commas, e.g. 1,2,3")
    else:
        body["text"] = text
    return {k: v for k, v in body.items() if v is not None}


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.1f} MiB"


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    out.print(table)


def stats(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False) -> None:
    """Tiers, client hits and tokens served, evictions, queues, and usage per namespace."""
    s = Api(url, token).call("GET", "/v1/stats")
    if as_json:
        return out.print_json(data=s)
    table(
        f"node {s['node']}",
        ["tier", "used", "capacity", "chunks"],
        [
            [
                t,
                mib(s[t]["bytes_used"]),
                mib(s[t]["capacity_bytes"]),
                s[t]["chunks"] if s[t]["chunks"] is not None else "-",
            ]
            for t in ("dram", "nvme")
        ],
    )
    c, e, q = s["clients"], s["evictions"], s["queues"]
    table(
        "activity",
        ["what", "count"],
        [
            ["lookups (hits / misses)", f"{c['lookups']} ({c['hits']} / {c['misses']})"],
            ["tokens served / requested", f"{c['matched_tokens']} / {c['requested_tokens']}"],
            ["chunks fetched / published", f"{c['fetched_chunks']} / {c['published_chunks']}"],
            [
                "evicted (requested / NVMe full / demoted)",
                f"{e['requested_chunks']} / {e['nvme_capacity']} / {e['dram_demoted']}",
            ],
            ["corrupt chunks found", s["corrupt_chunks"]],
            ["queues (promotion / write-behind)", f"{q['promotion']} / {q['write_behind']}"],
        ],
    )
    namespaces = {n["namespace"]: n for n in Api(url, token).call("GET", "/v1/namespaces")}
    table(
        "namespaces",
        ["namespace", "model", "dtype", "chunk", "chunks", "bytes", "hits", "tokens served"],
        [
            [
                ns[:12],
                namespaces.get(ns, {}).get("spec", {}).get("model", "?"),
                namespaces.get(ns, {}).get("spec", {}).get("kv_dtype", "?"),
                namespaces.get(ns, {}).get("spec", {}).get("chunk_tokens", "?"),
                n["chunks"],
                mib(n["bytes"]),
                n["clients"]["hits"],
                n["clients"]["matched_tokens"],
            ]
            for ns, n in s["namespaces"].items()
        ],
    )


def ls(
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    namespace: Namespace = None,
    model: Annotated[str | None, typer.Option(help="every namespace of this model")] = None,
    tenant: Annotated[str | None, typer.Option(help="tenant id (16 hex) or 'none'")] = None,
    tier: Annotated[str | None, typer.Option(help="dram or nvme")] = None,
    pinned: Annotated[bool | None, typer.Option("--pinned/--unpinned", show_default=False)] = None,
    older_than: Annotated[float | None, typer.Option(help="created more than SECONDS ago")] = None,
    newer_than: Annotated[float | None, typer.Option(help="created less than SECONDS ago")] = None,
    min_hits: Annotated[int | None, typer.Option(help="hit at least this often")] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_PAGE, help="entries per page")] = 50,
    cursor: Annotated[str | None, typer.Option(help="next_cursor of a previous page")] = None,
) -> None:
    """List cached chunks, filtered, one page at a time."""
    params = {
        "namespace": namespace,
        "model": model,
        "tenant": tenant,
        "tier": tier,
        "pinned": pinned,
        "older_than_s": older_than,
        "newer_than_s": newer_than,
        "min_hits": min_hits,
        "limit": limit,
        "cursor": cursor,
    }
    page = Api(url, token).call("GET", "/v1/chunks", params={k: v for k, v in params.items() if v is not None})
    if as_json:
        return out.print_json(data=page)
    table(
        f"{len(page['chunks'])} chunks",
        ["key", "namespace", "tokens", "bytes", "where", "hits", "created", "pin"],
        [
            [
                c["key"],
                c["namespace"][:12],
                c["tokens"],
                c["bytes"],
                " ".join(c["locations"]),
                c["hits"],
                _when(c["created_s"]),
                ("until " + _when(c["pinned_until_s"]) if c["pinned_until_s"] else "yes") if c["pinned"] else "",
            ]
            for c in page["chunks"]
        ],
    )
    if page["next_cursor"]:
        out.print(f"more: --cursor {page['next_cursor']}")


def lookup(
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    namespace: Namespace = None,
    tokens: Tokens = None,
    text: Text = None,
    cache_salt: Salt = None,
) -> None:
    """How much of a prompt is cached, and where (does not count as a hit)."""
    found = Api(url, token).call("POST", "/v1/lookup", json=_prompt(namespace, tokens, text, cache_salt))
    if as_json:
        return out.print_json(data=found)
    title = (
        f"{found['matched_tokens']} of {found['requested_tokens']} tokens cached in {found['matched_chunks']} chunks"
    )
    table(
        title,
        ["key", "tokens", "of", "where"],
        [[c["key"], c["matched_tokens"], c["stored_tokens"], " ".join(c["locations"])] for c in found["chunks"]],
    )


def evict(
    keys: Annotated[list[str] | None, typer.Argument(help="chunk keys", show_default=False)] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    namespace: Namespace = None,
    tokens: Tokens = None,
    text: Text = None,
    cache_salt: Salt = None,
    model: Annotated[str | None, typer.Option(help="every chunk of this model")] = None,
    tenant: Annotated[str | None, typer.Option(help="tenant id (16 hex) or 'none'")] = None,
    tier: Annotated[str | None, typer.Option(help="chunks with a copy in dram or nvme")] = None,
    older_than: Annotated[float | None, typer.Option(help="created more than SECONDS ago")] = None,
    everything: Annotated[bool, typer.Option("--all", help="every chunk")] = False,
    force: Annotated[bool, typer.Option(help="pinned chunks too")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show what would go, remove nothing")] = False,
) -> None:
    """Evict KEYS, a prompt prefix (--namespace with --tokens/--text) and all below it, matching chunks, or --all."""
    body: dict[str, Any] = {"force": force, "dry_run": dry_run}
    where = {"namespace": namespace, "model": model, "tenant": tenant, "tier": tier, "older_than_s": older_than}
    if keys:
        body["keys"] = keys
    elif tokens is not None or text is not None:
        body["prefix"] = _prompt(namespace, tokens, text, cache_salt)
    elif everything:
        body["all"] = True
    elif any(v is not None for v in where.values()):
        body["where"] = {k: v for k, v in where.items() if v is not None}
    else:
        fail("say what to evict: KEYS, a prefix (--namespace with --tokens or --text), filters, or --all")
    result = Api(url, token).call("POST", "/v1/evict", json=body)
    if as_json:
        return out.print_json(data=result)
    verb = "would evict" if result["dry_run"] else "evicted"
    out.print(
        f"{verb} {result['chunks']} chunks ({mib(result['bytes'])}); pinned and kept: "
        f"{result['pinned_skipped']}; kept on other nodes: {result['kept_elsewhere']}; failed: "
        f"{result['failed']}",
        highlight=False,
    )
    if result["pending_nodes"]:
        out.print(
            f"not confirmed yet by {', '.join(result['pending_nodes'])}: their daemons delete those copies "
            "when they next run",
            highlight=False,
        )
    for key in result["sample_keys"]:
        out.print(f"  {key}", highlight=False)


def _pin(
    path: str,
    keys: list[str] | None,
    url: str,
    token: str | None,
    as_json: bool,
    namespace: str | None,
    tokens: str | None,
    text: str | None,
    salt: str | None,
    ttl: float | None,
) -> None:
    body: dict[str, Any] = {"keys": keys} if keys else {"prefix": _prompt(namespace, tokens, text, salt)}
    if ttl is not None:
        body["ttl_s"] = ttl
    result = Api(url, token).call("POST", path, json=body)
    if as_json:
        return out.print_json(data=result)
    until = f" until {_when(result['pinned_until_s'])}" if result["pinned_until_s"] else ""
    out.print(f"{path.rsplit('/', 1)[1]}ned {result['chunks']} chunks{until}", highlight=False)


Keys = Annotated[list[str] | None, typer.Argument(help="chunk keys", show_default=False)]


def pin(
    keys: Keys = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    namespace: Namespace = None,
    tokens: Tokens = None,
    text: Text = None,
    cache_salt: Salt = None,
    ttl: Annotated[float | None, typer.Option(help="seconds; unset: until unpinned")] = None,
) -> None:
    """Pin KEYS, or the chunks of a prompt prefix, so eviction pressure leaves them alone."""
    _pin("/v1/pin", keys, url, token, as_json, namespace, tokens, text, cache_salt, ttl)


def unpin(
    keys: Keys = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
    namespace: Namespace = None,
    tokens: Tokens = None,
    text: Text = None,
    cache_salt: Salt = None,
) -> None:
    """Unpin KEYS, or the chunks of a prompt prefix."""
    _pin("/v1/unpin", keys, url, token, as_json, namespace, tokens, text, cache_salt, None)


def register_admin_commands(app: typer.Typer) -> None:
    for command in (stats, ls, lookup, evict, pin, unpin):
        app.command()(command)
