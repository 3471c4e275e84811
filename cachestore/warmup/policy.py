"""What a ``POST /v1/warmup`` job may run: only what the daemon's operator allowed (pure logic, no engine).

A job is a vLLM engine started by the daemon, as the daemon's user, from a request. Whoever holds the
admin token may submit one, so the request must not be able to choose code to run or files to read:

- **Engine options** are an allowlist of ``vllm serve`` options that shape the KV (dtype, KV dtype,
  block size, context length, parallelism) or the engine's use of the machine, each value checked
  (``ENGINE_OPTIONS``). Everything else is refused, among them options that load code (``--worker-cls``,
  ``--scheduler-cls``, ``--logits-processors``...), rewrite the model's config (``--hf-overrides``) or
  read other files (``--config``). ``--trust-remote-code`` runs the model's own Python, so it passes
  only when the daemon was started with ``warmup_allow_trust_remote_code``.
- **Paths** (``model``, ``tokenizer``, ``corpus``) must be absolute and resolve, symlinks followed, to
  an existing file or folder inside one of the daemon's ``warmup_roots``; with none configured every
  job is refused. A refused path gets the same answer whether it is missing or outside the roots, so
  the API cannot be used to probe which files exist. (A folder corpus then reads only the regular
  files inside it, never through a symlink: ``corpus``.)
- **The child's environment** carries none of the daemon's secrets (``scrubbed_environment``): the
  Redis password reaches the child on its stdin.

``prefixcache warmup`` run by hand is not bound by this: it runs as the operator, with the operator's
own rights, and takes any ``vllm serve`` option.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache.indexer.errors import ConfigError

#: The daemon hands a job's tenant salt over in the environment, never in argv (visible to every user).
TENANT_ENV = "PREFIXCACHE_WARMUP_TENANT"


class WarmupRefusedError(ConfigError):
    """The request asks for something the daemon's operator did not allow (answered 400)."""


def _choice(*values: str) -> Callable[[str], bool]:
    return lambda value: value in values


def _pattern(regex: str) -> Callable[[str], bool]:
    return lambda value: re.fullmatch(regex, value) is not None


def _int_in(low: int, high: int) -> Callable[[str], bool]:
    return lambda value: value.isdigit() and low <= int(value) <= high


def _fraction(value: str) -> bool:
    try:
        return 0.0 < float(value) <= 1.0
    except ValueError:
        return False


def _gigabytes(value: str) -> bool:
    try:
        return 0.0 <= float(value) <= 1e6
    except ValueError:
        return False


_HUMAN_INT = _pattern(r"[1-9][0-9]{0,9}[kKmMgG]?")
_NAME = _pattern(r"[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,255}")
_IDENTIFIER = _pattern(r"[a-z0-9][a-z0-9_]{0,63}")
#: Options that take no value.
_FLAG = None

#: ``vllm serve`` options a daemon warm-up job may pass, with a check of their value (None: a flag, no value).
ENGINE_OPTIONS: dict[str, Callable[[str], bool] | None] = {
    "dtype": _choice("auto", "bfloat16", "float", "float16", "float32", "half"),
    "kv-cache-dtype": _IDENTIFIER,
    "block-size": _int_in(1, 4096),
    "max-model-len": _HUMAN_INT,
    "tensor-parallel-size": _int_in(1, 256),
    "pipeline-parallel-size": _int_in(1, 256),
    "enforce-eager": _FLAG,
    "no-enforce-eager": _FLAG,
    "gpu-memory-utilization": _fraction,
    "max-num-seqs": _int_in(1, 1 << 20),
    "max-num-batched-tokens": _HUMAN_INT,
    "seed": _int_in(0, 2**32 - 1),
    "enable-prefix-caching": _FLAG,
    "no-enable-prefix-caching": _FLAG,
    "enable-chunked-prefill": _FLAG,
    "no-enable-chunked-prefill": _FLAG,
    "prefix-caching-hash-algo": _choice("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
    "quantization": _IDENTIFIER,
    "served-model-name": _NAME,
    "tokenizer-mode": _choice("auto", "slow", "mistral", "hf"),
    "max-logprobs": _int_in(0, 1 << 20),
    "cpu-offload-gb": _gigabytes,
    "swap-space": _gigabytes,
    "disable-sliding-window": _FLAG,
    "no-disable-sliding-window": _FLAG,
    "disable-cascade-attn": _FLAG,
    "no-disable-cascade-attn": _FLAG,
    "no-trust-remote-code": _FLAG,
}
#: Short spellings vLLM accepts for allowed options.
_ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size"}
TRUST_REMOTE_CODE = "trust-remote-code"
_ALLOWED = ", ".join(f"--{name}" for name in ENGINE_OPTIONS if not name.startswith("no-"))


def check_engine_options(options: Sequence[str], allow_trust_remote_code: bool = False) -> None:
    """Refuse unless every option is allowed and its value passes its check. Values are separate tokens
    (``--dtype bfloat16``) or joined (``--dtype=bfloat16``); a value never starts with ``-``, so it cannot be
    read as an option by vLLM's parser, and nothing else (a positional, a ``--config`` file) is accepted."""
    tokens = list(options)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        spelled, joined, value = token.partition("=")
        if re.fullmatch(r"--[A-Za-z0-9][A-Za-z0-9_\-]*", spelled):
            name = spelled[2:].replace("_", "-")
        elif spelled[1:] in _ALIASES and spelled.startswith("-"):
            name = _ALIASES[spelled[1:]]
        elif not token.startswith("-"):
            raise WarmupRefusedError(f"engine option {_shown(token)}: expected an option such as --dtype")
        else:
            name = ""
        if name == TRUST_REMOTE_CODE and allow_trust_remote_code:
            check: Callable[[str], bool] | None = _FLAG
        elif name in ENGINE_OPTIONS:
            check = ENGINE_OPTIONS[name]
        elif name == TRUST_REMOTE_CODE:
            raise WarmupRefusedError(
                "engine option --trust-remote-code runs the model's own code: the daemon must "
                "be started with --warmup-allow-trust-remote-code to accept it"
            )
        else:
            raise WarmupRefusedError(
                f"engine option {_shown(token.partition('=')[0])} is not allowed in daemon "
                f"warm-up jobs (allowed: {_ALLOWED}, and their --no- forms)"
            )
        if check is None:
            if joined:
                raise WarmupRefusedError(f"engine option --{name} takes no value")
            continue
        if not joined:
            if i >= len(tokens) or tokens[i].startswith("-"):
                raise WarmupRefusedError(f"engine option --{name} needs a value")
            value, i = tokens[i], i + 1
        if not check(value):
            raise WarmupRefusedError(f"engine option --{name}: value not accepted")


def _shown(token: str) -> str:
    """An option's name for a message: short, printable (never a whole submitted value)."""
    text = token if len(token) <= 64 else token[:61] + "..."
    return repr(text) if not text.isprintable() else text


@dataclass(frozen=True)
class WarmupPolicy:
    """The operator's rules for daemon warm-up jobs (settings ``warmup_roots``, ``warmup_allow_trust_remote_code``)."""

    roots: tuple[Path, ...] = ()
    allow_trust_remote_code: bool = False

    def resolve(self, field: str, value: str) -> str:
        """``value`` as an absolute path with symlinks resolved, if it names an existing file or folder inside a
        root; else refused, with one message for missing and outside alike."""
        if not self.roots:
            raise WarmupRefusedError(
                "this daemon accepts no warm-up jobs by path: start it with --warmup-root "
                "FOLDER (PREFIXCACHE_WARMUP_ROOTS), where models and corpora lie"
            )
        refused = WarmupRefusedError(
            f"{field} must be an absolute path to an existing file or folder inside the daemon's warm-up roots"
        )
        path = Path(value)
        if not path.is_absolute() or "\0" in value:
            raise refused
        try:
            resolved = path.resolve(strict=True)
            inside = any(resolved.is_relative_to(root.resolve()) for root in self.roots)
            usable = inside and (resolved.is_file() or resolved.is_dir())
        except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, unreadable
            usable = False
        if not usable:
            raise refused
        return str(resolved)

    def check_options(self, options: Sequence[str]) -> None:
        check_engine_options(options, self.allow_trust_remote_code)


#: Words that mark a ``PREFIXCACHE_*`` variable as a secret.
_SECRET_WORDS = ("TOKEN", "PASSWORD", "SECRET", "KEY")
#: Secrets by name: the settings that are (or may hold) credentials.
_SECRET_VARIABLES = frozenset({"PREFIXCACHE_ADMIN_TOKEN", "PREFIXCACHE_REDIS_PASSWORD", "PREFIXCACHE_REDIS_URL"})


def is_secret_variable(name: str) -> bool:
    upper = name.upper()
    return upper in _SECRET_VARIABLES or (upper.startswith("PREFIXCACHE_") and any(w in upper for w in _SECRET_WORDS))


def scrubbed_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The daemon's environment for a warm-up child, without its secrets: the admin token, the Redis password
    and URL (which may hold one), and every ``PREFIXCACHE_*`` variable named like a token, password, secret or
    key. The child attaches with ``/v1/config`` and the password the daemon writes to its stdin."""
    return {name: value for name, value in environ.items() if not is_secret_variable(name)}
