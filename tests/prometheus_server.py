"""A real Prometheus for tests: a config of its own in a temp dir, loopback, a free port, a short scrape interval,
and its HTTP API's instant queries."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from prefixcache.cachestore.host.processes import ManagedProcess, free_port

SCRAPE_INTERVAL_S = 1


class Prometheus:
    """Prometheus's HTTP API at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` gives now: a list of ``{"metric": labels, "value": [time, "text"]}``."""
        answer = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).raise_for_status().json()
        assert answer["data"]["resultType"] == "vector", f"{expr} is no instant vector: {answer['data']}"
        return answer["data"]["result"]

    def has_numbers(self, expr: str) -> bool:
        """Whether ``expr`` gives at least one sample that is a number (not NaN)."""
        return any(not math.isnan(float(sample["value"][1])) for sample in self.query(expr))

    def alerts(self) -> list[dict]:
        """The alerts pending or firing now, each with its ``labels`` and ``state``."""
        answer = httpx.get(self.url + "/api/v1/alerts", timeout=10).raise_for_status().json()
        return answer["data"]["alerts"]

    def label_values(self, label: str, metric: str) -> list[str]:
        """Grafana's ``label_values(metric, label)``."""
        params = {"match[]": metric}
        answer = httpx.get(f"{self.url}/api/v1/label/{label}/values", params=params, timeout=10)
        return answer.raise_for_status().json()["data"]

    def metric_names(self) -> set[str]:
        answer = httpx.get(self.url + "/api/v1/label/__name__/values", timeout=10).raise_for_status().json()
        return set(answer["data"])


@dataclass(frozen=True)
class ScrapeJob:
    """A scrape job: its name (the ``job`` label), its targets (host:port), and the bearer token it sends, if any."""

    name: str
    targets: Sequence[str]
    bearer_token: str | None = None
    #: Seconds between scrapes, and the longest a scrape may take (Prometheus's default, 10 s, needs as long)
    interval_s: float = SCRAPE_INTERVAL_S

    def config(self) -> dict:
        job: dict = {
            "job_name": self.name,
            "static_configs": [{"targets": list(self.targets)}],
            "scrape_interval": f"{self.interval_s}s",
            "scrape_timeout": f"{self.interval_s}s",
        }
        if self.bearer_token is not None:
            job["authorization"] = {"credentials": self.bearer_token}
        return job


@contextmanager
def prometheus(directory: Path, jobs: Sequence[ScrapeJob], rule_files: Sequence[Path] = ()) -> Iterator[Prometheus]:
    """A Prometheus scraping ``jobs`` and evaluating the rules of ``rule_files`` every ``SCRAPE_INTERVAL_S``;
    stopped on exit."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (deploy/setup.sh installs Debian's)"
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [job.config() for job in jobs],
        "rule_files": [str(path) for path in rule_files],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(url + "/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    server = ManagedProcess(
        "prometheus",
        [
            binary,
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        directory / "prometheus.log",
        ready,
        listens_on=[("127.0.0.1", port)],
    )
    server.start()
    try:
        yield Prometheus(url)
    finally:
        server.stop()
