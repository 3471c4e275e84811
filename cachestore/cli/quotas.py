"""``prefixcache quota list | set | delete | tenant-id``: the quotas of ``/v1/quotas`` from a terminal."""

from __future__ import annotations

import sys
from typing import Annotated, Literal

import typer

from prefixcache.cachestore.cli.admin import DEFAULT_URL, Api, AsJson, Token, Url, mib, out, table
from prefixcache.cachestore.cli.errors import fail
from prefixcache.indexer.namespace import tenant_id as tenant_id_of

Kind = Annotated[Literal["tenant", "namespace"], typer.Argument(help="tenant or namespace")]
ScopeId = Annotated[str, typer.Argument(help="tenant id (16 hex, or 'none') or namespace digest (32 hex)")]

quota_app = typer.Typer(help="Byte quotas per tenant and per namespace.", no_args_is_help=True)


@quota_app.command("list")
def list_quotas(url: Url = DEFAULT_URL, token: Token = None, as_json: AsJson = False) -> None:
    """Every quota, where it comes from, and what its scope holds."""
    quotas = Api(url, token).call("GET", "/v1/quotas")
    if as_json:
        return out.print_json(data=quotas)
    table(
        "quotas",
        ["scope", "id", "limit", "used", "chunks", "source", "at quota", "evicted"],
        [
            [q["scope"], q["id"], mib(q["limit_bytes"]), mib(q["used_bytes"]), q["used_chunks"], q["source"]]
            + ["yes" if q["at_quota"] else "no", q["evicted_chunks"]]
            for q in quotas
        ],
    )


@quota_app.command("set")
def set_quota(
    kind: Kind,
    scope_id: ScopeId,
    limit: Annotated[str, typer.Argument(help="bytes, or a size such as 8GiB")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Set a quota (in every daemon of the cluster); a scope above it loses its least recently used chunks."""
    body = {"limit_bytes": int(limit) if limit.isdigit() else limit}
    answer = Api(url, token).call("PUT", f"/v1/quotas/{kind}/{scope_id}", json=body)
    if as_json:
        return out.print_json(data=answer)
    out.print(f"{kind} {scope_id}: {mib(answer['limit_bytes'])}, holding {mib(answer['used_bytes'])}")


@quota_app.command("delete")
def delete_quota(kind: Kind, scope_id: ScopeId, url: Url = DEFAULT_URL, token: Token = None) -> None:
    """Remove a quota set through the API (the daemon's settings, if they give one, apply again)."""
    answer = Api(url, token).call("DELETE", f"/v1/quotas/{kind}/{scope_id}")
    left = f"the settings' {mib(answer['limit_bytes'])} applies" if answer else "no quota left"
    out.print(f"{kind} {scope_id}: {left}")


@quota_app.command("tenant-id")
def tenant_id() -> None:
    """Print the tenant id of the cache_salt given on standard input (never on the command line, where other
    users could read it): `prefixcache quota tenant-id < salt-file`."""
    salt = sys.stdin.read().rstrip("\r\n")
    if not salt:
        fail("give the tenant's cache_salt on standard input")
    out.print(tenant_id_of(salt))
