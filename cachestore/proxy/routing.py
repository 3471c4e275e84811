"""The proxy's pure decisions: which instance next, what a prefill request looks like, when a prefix is complete.

Kept apart from the HTTP plumbing in ``cachestore/proxy/server.py`` so that each rule is tested on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefixcache.indexer.chunking import PROBE_TOKENS

#: Fields that would make a one-token prefill request invalid or wasteful.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "best_of")


class InstancePool:
    """Round robin over instances. One that just failed is tried last until ``cooldown_s`` has passed,
    so a dead instance costs one failed connect per cooldown, not one per request."""

    def __init__(self, urls: list[str], cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.urls = list(urls)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._next = 0
        self._failed_at: dict[str, float] = {}

    def order(self) -> list[str]:
        """Every instance, in the order to try them for the next request."""
        start = self._next % len(self.urls)
        self._next += 1
        rotation = self.urls[start:] + self.urls[:start]
        now = self._clock()
        healthy = [u for u in rotation if now - self._failed_at.get(u, -self.cooldown_s) >= self.cooldown_s]
        return healthy + [u for u in rotation if u not in healthy]

    def failed(self, url: str) -> None:
        self._failed_at[url] = self._clock()

    def succeeded(self, url: str) -> None:
        self._failed_at.pop(url, None)

    def down(self) -> list[str]:
        now = self._clock()
        return [u for u, at in self._failed_at.items() if now - at < self.cooldown_s]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill instance gets: the same prompt and sampling settings, one token, no stream.

    One generated token is the least vLLM computes per request; the prompt's KV is what matters, and
    the prefill instance's connector publishes it to the store while computing it.
    """
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in body:  # chat: takes precedence over max_tokens
        out["max_completion_tokens"] = 1
    return out


def publishable_tokens(prompt_tokens: int, chunk_tokens: int) -> int:
    """How many leading prompt tokens the store holds once a prefill instance has published the prompt:
    every full chunk, and the tail when it has at least PROBE_TOKENS tokens (shorter tails are not
    worth a load, so the connector does not publish them)."""
    tail = prompt_tokens % chunk_tokens
    return prompt_tokens if tail == 0 or tail >= PROBE_TOKENS else prompt_tokens - tail


def prompt_token_ids(path: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids when the request carries them (``/v1/completions`` with one tokenized prompt)."""
    if path != "/v1/completions":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """What vLLM's ``/tokenize`` needs to tokenize this request's prompt as the engine will, or None when it
    cannot (a batch of prompts: the proxy then treats the prefix as not cached)."""
    if path == "/v1/completions" and isinstance(body.get("prompt"), str):
        return {"model": body.get("model"), "prompt": body["prompt"]}
    if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        keys = (
            "messages",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template",
            "chat_template_kwargs",
            "tools",
        )
        return {"model": body.get("model"), **{k: body[k] for k in keys if k in body}}
    return None
