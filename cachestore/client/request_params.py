"""What one request asks of the cache: ``kv_transfer_params={"prefixcache": {"load": ..., "publish": ...,
"publish_output": ...}}``.

vLLM hands a request's ``kv_transfer_params`` (OpenAI API: the request body's ``kv_transfer_params``; offline:
``SamplingParams.extra_args["kv_transfer_params"]``) to the connector as ``request.kv_transfer_params``. Under the
key ``prefixcache``, a request can turn off loading (recompute everything, e.g. to check an answer without the
cache) or publishing (keep a prompt that must not be shared, or a one-off, out of the store), or only the
publishing of its answer (a last turn, whose answer no next turn will extend). Other connectors'
keys beside it are left alone, so the same request can pass through a ``MultiConnector``.

A request whose ``prefixcache`` entry is malformed neither loads nor publishes: a request that meant to keep its
prompt out of the store must not publish it because of a typo. The engine cannot refuse a request from a
connector hook, so the connector logs the problem and computes the request as if there were no cache; the
proxy (cachestore/proxy/server.py), which can refuse it, answers 400.

It lives outside the ``connector`` package, which imports vLLM, because the proxy reads it too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from prefixcache.indexer.errors import validation_problems

PARAMS_KEY = "prefixcache"


class RequestCacheParams(BaseModel):
    """Keys of ``kv_transfer_params["prefixcache"]``. Unknown keys are errors, as in the connector's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load: StrictBool = True
    publish: StrictBool = True
    #: whether its generated tokens' KV is published when it finishes; None: as the connector's ``publish_output``
    publish_output: StrictBool | None = None


#: What a request with a malformed ``prefixcache`` entry gets: no cache, either way.
NO_CACHE = RequestCacheParams(load=False, publish=False)


def request_cache_params(kv_transfer_params: Any) -> tuple[RequestCacheParams, str | None]:
    """The request's choices, and what was wrong with them (None if nothing was)."""
    if not isinstance(kv_transfer_params, dict) or PARAMS_KEY not in kv_transfer_params:
        return RequestCacheParams(), None
    try:
        return RequestCacheParams.model_validate(kv_transfer_params[PARAMS_KEY]), None
    except ValidationError as exc:
        problems = validation_problems(exc, PARAMS_KEY)
        return NO_CACHE, f'kv_transfer_params["{PARAMS_KEY}"] is invalid ({problems})'
