"""A chat through vLLM's OpenAI server, each turn's prompt the last one's, its answer and a new message: the KV of
an answer, published when its request finished (the connector's ``publish_output``), is loaded by the next turn, on
the instance that computed it (turns 2 and 3) and on a fresh one of the same daemon (turn 4). The third answer is in
the store only because its request's finish published it; each earlier one is in the next turn's prompt too, which
the first instance published as it computed it, so the fresh instance would find those whole.

The model is the tiny Llama with a word-level tokenizer and a chat template (``build_tiny_chat_llama``), so that an
answer is tokenized in the next turn's prompt as it was generated. Both instances run with vLLM's own prefix cache
off, so every hit vLLM counts (``vllm:external_prefix_cache_hits``) is the connector's. The reference answers are
the same conversation's on the first instance with the cache off for each request (``{"prefixcache": {"load":
false, "publish": false}}``): computed cold, and nothing of them stored.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import httpx
import pytest

from tests.daemon_harness import Daemon, connector_config, stored_tokens, wait_for
from tests.e2e.compare import same_greedy_output
from tests.e2e.openai_server import MODEL, Server, external_hits, metric, vllm_server
from tests.e2e.tinymodel import build_tiny_chat_llama, chat_words

pytestmark = pytest.mark.e2e

CHUNK = 256  # the daemon's default chunk size: two 128-token CPU blocks
#: Every answer's length: the first turn's answer completes the first chunk (its prompt is 205 tokens)
ANSWER_TOKENS = 128
_rng = random.Random("chat-e2e")
#: The user's messages, of 200, 40, 40 and 40 words (a token each): three turns on one instance, one on the fresh one
MESSAGES = [" ".join(_rng.choices(chat_words(), k=words)) for words in (200, 40, 40, 40)]
FIRST_INSTANCE_TURNS = 3
NO_CACHE = {"prefixcache": {"load": False, "publish": False}}
LOADED_CHUNKS = "vllm:prefixcache_loaded_chunks_total"
#: In bf16 an answer's KV computed by its decode steps rounds differently from a prefill of the same tokens (the
#: reference recomputes the answer in the next turn's prefill), enough to change a greedy answer of the tiny model
#: (docs/connector.md, "An answer's KV is what its decode steps computed"); in float32 it is not: a wrong or shifted
#: page still is.
DTYPE = ("--dtype", "float32")


@dataclass
class Turn:
    prompt_ids: list[int]  # the turn's prompt, as the chat template renders and the tokenizer encodes it
    output: dict  # the answer's token ids and top logprobs, as tests/e2e/compare.py reads them
    hits: float  # the prompt tokens vLLM counted as the connector's hit
    loaded_chunks: float  # the chunks the connector loaded for it


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama"))


@pytest.fixture(scope="module")
def conversations(chat_model, tmp_path_factory) -> dict[str, list[Turn]]:
    """The conversation without the cache, then with it for three turns, on one instance; then its fourth turn on a
    fresh instance of the same daemon (one instance at a time)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    logs = tmp_path_factory.mktemp("chat-e2e")
    daemon = Daemon(logs / "data", dram="512MiB", nvme="1GiB").start()
    transfer = connector_config(daemon, publish_output=True)
    try:
        first = vllm_server("first", chat_model, transfer, logs, *DTYPE).wait_ready()
        try:
            reference = converse(first, tokenizer, [], MESSAGES, None, NO_CACHE)
            history: list[dict[str, str]] = []
            cached = converse(first, tokenizer, history, MESSAGES[:FIRST_INSTANCE_TURNS], daemon)
        finally:
            first.kill()
        fresh_server = vllm_server("fresh", chat_model, transfer, logs, *DTYPE).wait_ready()
        try:
            fresh = converse(fresh_server, tokenizer, history, MESSAGES[FIRST_INSTANCE_TURNS:], daemon)
        finally:
            fresh_server.kill()
    finally:
        daemon.stop()
    return {"reference": reference, "cached": cached + fresh}


def converse(
    server: Server,
    tokenizer,
    history: list[dict[str, str]],
    messages: list[str],
    daemon: Daemon | None,
    params: dict | None = None,
) -> list[Turn]:
    """A turn per user message after ``history``, each answer sent back as the assistant's message (both added to
    ``history``). With ``daemon``, each turn waits until the daemon finds its prompt and answer stored (all but the
    answer's last token, whose KV no step computed): the request's finish is published a step after its answer came
    back; and until vLLM has freed the blocks it kept for that (its KV cache is empty again, as no other request
    runs and its own prefix cache is off)."""
    turns = []
    for message in messages:
        history.append({"role": "user", "content": message})
        prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        hits, loaded = external_hits(server), metric(server, LOADED_CHUNKS)
        response = chat(server, history, params)
        assert response["usage"]["prompt_tokens"] == len(prompt_ids)
        output = as_output(response["choices"][0]["logprobs"]["content"])
        turns.append(
            Turn(
                prompt_ids,
                output,
                external_hits(server) - hits,
                metric(server, LOADED_CHUNKS) - loaded,
            )
        )
        history.append({"role": "assistant", "content": response["choices"][0]["message"]["content"]})
        if daemon is not None:
            stored = prompt_ids + output["token_ids"][:-1]
            assert wait_for(lambda stored=stored: stored_tokens(daemon, stored) == len(stored), timeout_s=30)
            assert wait_for(lambda: metric(server, "vllm:kv_cache_usage_perc") == 0, timeout_s=30)
    return turns


def chat(server: Server, messages: list[dict[str, str]], params: dict | None) -> dict:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "skip_special_tokens": False,  # a special token generated stays in the answer's text, as generated
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
        **({"kv_transfer_params": params} if params else {}),
    }
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def as_output(content: list[dict]) -> dict:
    """Chat logprobs (``token_id:N`` strings) in the form tests/e2e/compare.py reads."""
    return {
        "token_ids": [int(position["token"].removeprefix("token_id:")) for position in content],
        "logprobs": [
            {top["token"].removeprefix("token_id:"): top["logprob"] for top in position["top_logprobs"]}
            for position in content
        ],
    }


def loads_the_previous_turn(before: Turn, turn: Turn) -> None:
    """``turn``'s prompt begins with ``before``'s prompt and answer, and its hit is all of them but the answer's last
    token, loaded in as many chunks as cover it."""
    answer = before.output["token_ids"]
    assert turn.prompt_ids[: len(before.prompt_ids) + len(answer)] == before.prompt_ids + answer
    assert turn.hits == len(before.prompt_ids) + len(answer) - 1
    assert turn.loaded_chunks == -(-turn.hits // CHUNK)


def test_each_turn_loads_the_previous_prompt_and_answer_on_either_instance(conversations):
    turns = conversations["cached"]
    assert (turns[0].hits, turns[0].loaded_chunks) == (0, 0)
    for before, turn in itertools.pairwise(turns):
        loads_the_previous_turn(before, turn)
    # the second turn loaded the whole first prompt and past the end of the chunk its answer completed
    first_boundary = -(-len(turns[0].prompt_ids) // CHUNK) * CHUNK
    assert turns[1].hits > first_boundary > len(turns[0].prompt_ids)


def test_answers_are_those_of_the_conversation_without_the_cache(conversations):
    for number, (reference, turn) in enumerate(zip(conversations["reference"], conversations["cached"], strict=True)):
        assert reference.hits == 0
        ok, reason = same_greedy_output(reference.output, turn.output)
        assert ok, f"turn {number + 1} (hit {turn.hits:.0f} tokens): {reason}"
