"""``prefixcache warmup``: the command line of a warm-up run (registered in ``prefixcache.cachestore.cli.app``).

Options it does not know are vLLM engine options, parsed by vLLM's own ``vllm serve`` parser (put
them after ``--`` to be explicit). Exit codes: 0 done (or stopped by ``--max-prompts``), 1 some
prompts' chunks never reached the index (a rerun retries them), 2 bad input or settings, 130
interrupted (SIGINT or SIGTERM; a rerun resumes).

Run by hand it takes any model, corpus and ``vllm serve`` option: it runs as the operator, with the
operator's rights. The daemon's ``POST /v1/warmup`` runs this command too, but only for requests its
operator's rules allow (``policy``: paths inside the warm-up roots, allowlisted engine options), with
its secrets scrubbed from the environment and the Redis password on stdin (``--redis-password-stdin``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import ValidationError
from rich.console import Console

from prefixcache.cachestore.cli.errors import clear_errors, err
from prefixcache.cachestore.node.settings import redis_password_from_environment
from prefixcache.cachestore.warmup.policy import TENANT_ENV
from prefixcache.indexer.errors import ConfigError

CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
#: The defaults of options whose help shows them on its line (typer would put them on a line of their own).
BATCH_SIZE, SERVICE_URL = 16, "http://127.0.0.1:8600"
ON_ERROR: Literal["skip", "fail"] = "fail"
#: The help panels of ``warmup``'s options.
RUN, JOB, FILES = "Run", "Job", "Files and output"
EXIT_CODES = {"finished": 0, "nothing_to_do": 0, "stopped": 0, "incomplete": 1, "interrupted": 130}


def warmup(
    ctx: typer.Context,
    corpus: Annotated[Path, typer.Argument(help="JSONL file (prompt or token_ids a line) or folder of text files")],
    model: Annotated[str, typer.Option(rich_help_panel=RUN, help="Model path or name, as the server loads it")],
    tokenizer: Annotated[
        str | None, typer.Option(rich_help_panel=RUN, help="Tokenizer \\[default: the model's]")
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(rich_help_panel=RUN, help="cache_salt of lines without one", envvar=TENANT_ENV, show_envvar=False),
    ] = None,
    batch_size: Annotated[
        int, typer.Option(rich_help_panel=RUN, show_default=False, help=f"Prompts a batch \\[default: {BATCH_SIZE}]")
    ] = BATCH_SIZE,
    arena_mb: Annotated[
        int | None, typer.Option(rich_help_panel=RUN, help="Arena, MiB \\[default: the connector's]")
    ] = None,
    service_url: Annotated[
        str, typer.Option(rich_help_panel=RUN, show_default=False, help=f"The daemon \\[default: {SERVICE_URL}]")
    ] = SERVICE_URL,
    state_dir: Annotated[
        Path | None, typer.Option(rich_help_panel=FILES, help="Job state files \\[default: DATA_DIR/warmup]")
    ] = None,
    max_prompts: Annotated[int | None, typer.Option(rich_help_panel=JOB, help="Compute at most this many now")] = None,
    on_error: Annotated[
        Literal["skip", "fail"],
        typer.Option(rich_help_panel=JOB, show_default=False, help=f"Bad entries \\[default: {ON_ERROR}]"),
    ] = ON_ERROR,
    redis_password_stdin: Annotated[
        bool,
        typer.Option("--redis-password-stdin", rich_help_panel=JOB, help="Index password from stdin"),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", rich_help_panel=FILES, help="Print the report as JSON only")
    ] = False,
    progress_file: Annotated[
        Path | None, typer.Option(rich_help_panel=FILES, help="Keep a JSON progress snapshot here")
    ] = None,
) -> None:
    """Precompute and store the KV of a prompt corpus, so the first real request hits. Resumable; reruns skip
    what is done. Further options go to the vLLM engine, as for `vllm serve` (e.g. --dtype bfloat16).
    PREFIXCACHE_WARMUP_TENANT gives --tenant."""

    with clear_errors():
        password = sys.stdin.readline().rstrip("\r\n") if redis_password_stdin else None
        options = _options(
            dict(
                corpus=corpus,
                model=model,
                tokenizer=tokenizer,
                tenant=tenant,
                service_url=service_url,
                state_dir=state_dir,
                batch_size=batch_size,
                max_prompts=max_prompts,
                on_error=on_error,
                arena_mb=arena_mb,
                redis_password=password or redis_password_from_environment(),
                engine_options=list(ctx.args),
                progress_file=progress_file,
            )
        )
        report = _run(options, err)
    if json_output:
        typer.echo(report.model_dump_json(indent=1))
    else:
        from prefixcache.cachestore.warmup.report import table

        Console().print(table(report))
        for problem in report.problems:
            err.print(f"[yellow]left out:[/] {problem}", highlight=False)
    raise typer.Exit(EXIT_CODES[report.outcome])


def _options(values: dict[str, Any]) -> Any:
    from prefixcache.cachestore.warmup.runner import WarmupOptions

    try:
        return WarmupOptions.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid warm-up option: {problems}") from None


def _run(options: Any, console: Console) -> Any:
    """Run with SIGTERM treated like Ctrl-C, so a cancelled job stops its engine and keeps its state."""
    from prefixcache.cachestore.warmup.progress import ProgressReporter
    from prefixcache.cachestore.warmup.runner import WarmupRun

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the progress bar, not vLLM's log, is the output
    previous = signal.signal(signal.SIGTERM, _interrupt)
    reporter = ProgressReporter(console, options.progress_file)
    try:
        with _stdout_to_stderr():
            return WarmupRun(options, reporter).run()
    finally:
        reporter.close()
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Keep stdout for the report: vLLM and its engine processes (which inherit fd 1) log to stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
