"""A warm-up corpus: a JSONL file or a folder of text files, parsed and checked before anything runs.

JSONL: one object per line with ``prompt`` (text) or ``token_ids`` (a list of ints), optionally ``id``
and ``tenant`` (vLLM's ``cache_salt``); blank lines are ignored, any other key is an error so a typo
never goes unnoticed. A folder: every non-hidden regular file below it, in path order, is one prompt,
its text taken byte for byte (a trailing newline is part of the prompt). Symlinks in a folder are
never followed (neither to files nor to folders), so a folder corpus reads only files inside it.

Every problem names its place (``corpus.jsonl:17``) and the whole corpus is read before a single
token is computed, so a job told to fail on bad input fails with nothing written, and a job told to
skip it lists every skipped line. Checks that need the model (tokenizing, vocabulary, context length)
run in ``check_against_model`` once the engine is up, before the first batch, under the same rule.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prefixcache.indexer.chunking import PROBE_TOKENS
from prefixcache.indexer.errors import ConfigError

MAX_TOKEN_ID = (1 << 32) - 1


class CorpusError(ConfigError):
    """The corpus cannot be read (missing, unreadable, empty), or holds bad entries and the job fails on them."""


@dataclass(frozen=True)
class Problem:
    where: str  # "corpus.jsonl:17" or a file's path
    message: str
    key: str | None = None  # the prompt's key, once the entry parsed (found by the model checks)

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(frozen=True)
class CorpusPrompt:
    """One prompt as written in the corpus (text or token ids; tokenized later by the engine's tokenizer)."""

    key: str  # unique within the corpus: the line's id, else "line N", or the file's relative path
    where: str
    text: str | None
    token_ids: tuple[int, ...] | None
    tenant: str | None


@dataclass(frozen=True)
class Corpus:
    prompts: list[CorpusPrompt]
    problems: list[Problem]
    digest: str  # of the raw bytes: a job is the same job only for the very same corpus


class _Line(BaseModel):
    """One JSONL line. Strict: ``"12"`` is not a token id and ``true`` is not an int."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | int | None = None
    prompt: str | None = Field(default=None, min_length=1)
    token_ids: list[int] | None = Field(default=None, min_length=1)
    tenant: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> _Line:
        if (self.prompt is None) == (self.token_ids is None):
            raise ValueError("needs exactly one of 'prompt' (text) or 'token_ids' (list of ints)")
        if self.token_ids is not None and not all(0 <= t <= MAX_TOKEN_ID for t in self.token_ids):
            bad = next(t for t in self.token_ids if not 0 <= t <= MAX_TOKEN_ID)
            raise ValueError(f"token id {bad} is outside 0..{MAX_TOKEN_ID}")
        return self


def read_corpus(path: Path, default_tenant: str | None = None) -> Corpus:
    """Parse ``path`` (JSONL file or folder); bad entries become problems, never exceptions."""
    if path.is_dir():
        corpus = _read_folder(path, default_tenant)
    elif path.is_file():
        corpus = _read_jsonl(path, default_tenant)
    else:
        raise CorpusError(f"corpus {path} is neither a file nor a folder")
    if not corpus.prompts and not corpus.problems:
        raise CorpusError(f"corpus {path} holds no prompts")
    return corpus


def _read_jsonl(path: Path, default_tenant: str | None) -> Corpus:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror}") from exc
    prompts: list[CorpusPrompt] = []
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for number, line in enumerate(raw.splitlines(), start=1):
        where = f"{path.name}:{number}"
        if not line.strip():
            continue
        try:
            parsed = _Line.model_validate(json.loads(line))
        except UnicodeDecodeError:
            problems.append(Problem(where, "not UTF-8"))
            continue
        except json.JSONDecodeError as exc:
            problems.append(Problem(where, f"not JSON ({exc.msg} at column {exc.colno})"))
            continue
        except ValidationError as exc:
            problems.append(Problem(where, _describe(exc)))
            continue
        key = f"line {number}" if parsed.id is None else str(parsed.id)
        if key in seen:
            problems.append(Problem(where, f"id {key!r} is already used at {seen[key]}"))
            continue
        seen[key] = where
        token_ids = tuple(parsed.token_ids) if parsed.token_ids is not None else None
        prompts.append(CorpusPrompt(key, where, parsed.prompt, token_ids, parsed.tenant or default_tenant))
    return Corpus(prompts, problems, xxhash.xxh3_128_hexdigest(raw))


def _read_folder(root: Path, default_tenant: str | None) -> Corpus:
    digest = xxhash.xxh3_128()
    prompts: list[CorpusPrompt] = []
    problems: list[Problem] = []
    for name, raw in _folder_files(root):
        if isinstance(raw, OSError):
            problems.append(Problem(name, f"cannot read: {raw.strerror}"))
            continue
        digest.update(f"{name}\0{len(raw)}\0".encode() + raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(Problem(name, f"not UTF-8 (byte {exc.start})"))
            continue
        if not text.strip():
            problems.append(Problem(name, "empty"))
            continue
        prompts.append(CorpusPrompt(name, name, text, None, default_tenant))
    return Corpus(prompts, problems, digest.hexdigest())


def _folder_files(root: Path) -> list[tuple[str, bytes | OSError]]:
    """(relative path, contents or the error reading it) of every non-hidden regular file below ``root``, in path
    order. Walks with directory descriptors and opens with O_NOFOLLOW, so no symlink is followed, even one put
    in place while the folder is read; a symlink or anything but a regular file is left out."""
    found: list[tuple[str, bytes | OSError]] = []
    for folder, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        relative = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if _hidden(relative):
            continue
        for file in files:
            if file.startswith("."):
                continue
            name = (relative / file).as_posix()
            try:
                fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # ELOOP: a symlink, left out
                    found.append((name, exc))
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                with os.fdopen(fd, "rb", closefd=False) as handle:
                    found.append((name, handle.read()))
            except OSError as exc:
                found.append((name, exc))
            finally:
                os.close(fd)
    return sorted(
        found, key=lambda item: Path(item[0]).parts
    )  # by path parts: the job digest's order, stable across releases


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (expected prompt or token_ids, optional id and tenant)"
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)


@dataclass(frozen=True)
class ModelLimits:
    """What the engine accepts: token ids up to ``max_token_id`` and prompts leaving room for one output token."""

    max_token_id: int
    max_model_len: int


@dataclass(frozen=True)
class TokenizedPrompt:
    prompt: CorpusPrompt
    token_ids: list[int]


def check_against_model(
    prompts: Sequence[CorpusPrompt], encode: Callable[[str], list[int]], limits: ModelLimits
) -> tuple[list[TokenizedPrompt], list[Problem]]:
    """Tokenize text prompts (as vLLM does for a completion) and check every prompt fits the model.

    A prompt shorter than PROBE_TOKENS can never be found in the cache, so it is a problem too:
    warming it would store nothing.
    """
    ready: list[TokenizedPrompt] = []
    problems: list[Problem] = []
    for prompt in prompts:
        ids = list(prompt.token_ids) if prompt.token_ids is not None else encode(prompt.text or "")
        if len(ids) < PROBE_TOKENS:
            problem = f"{len(ids)} tokens: a cached prefix needs at least {PROBE_TOKENS}"
        elif len(ids) >= limits.max_model_len:
            problem = f"{len(ids)} tokens: the engine's max_model_len is {limits.max_model_len} (one must be generated)"
        elif max(ids) > limits.max_token_id:
            problem = f"token id {max(ids)} is outside the model's vocabulary (0..{limits.max_token_id})"
        else:
            ready.append(TokenizedPrompt(prompt, ids))
            continue
        problems.append(Problem(prompt.where, problem, prompt.key))
    return ready, problems
