"""S3 clients for the object tier, side by side against one real server: obstore (the tier's) and boto3.

Starts SeaweedFS (tests/s3_server.py) on loopback and, for each client in turn, twice: puts and gets of
chunk-sized objects (2 and 8 MiB) one at a time and 8 in flight, then the latency of 4 KiB puts and gets one at a
time (median and 99th percentile). The figures are docs/decisions.md's ("The object tier's client is obstore").
boto3 is not a dependency: ``pip install boto3`` first.

Run: ``python -m benchmarks.object_clients``. Prints its tables and writes benchmarks/results/object_clients.json
(``throughput``: a row per run, client, object size and requests in flight; ``latency_ms``: a row per run and
client), which docs/benchmarks.md renders.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import print_table, write_results
from tests.s3_server import SeaweedS3

BUCKET = "bench"
THROUGHPUT = ["mib", "in_flight", "put_gbps", "get_gbps"]
LATENCY = ["put_p50", "put_p99", "get_p50", "get_p99"]
Put = Callable[[str, bytes], object]
Get = Callable[[str], bytes]


def clients(server: SeaweedS3) -> dict[str, tuple[Put, Get]]:
    import boto3
    import botocore.config
    import obstore
    from obstore.store import S3Store

    config = botocore.config.Config(s3={"addressing_style": "path"}, max_pool_connections=16)
    b3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", config=config)
    if BUCKET not in {bucket["Name"] for bucket in b3.list_buckets()["Buckets"]}:
        b3.create_bucket(Bucket=BUCKET)
    store = S3Store(
        BUCKET,
        endpoint=server.endpoint,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    return {
        "boto3": (
            lambda key, data: b3.put_object(Bucket=BUCKET, Key=key, Body=data),
            lambda key: b3.get_object(Bucket=BUCKET, Key=key)["Body"].read(),
        ),
        "obstore": (lambda key, data: obstore.put(store, key, data), lambda key: obstore.get(store, key).bytes()),
    }


def throughput(name: str, put: Put, get: Get, size: int, count: int, threads: int) -> tuple[float, float]:
    """GB/s of ``count`` puts, then gets, of ``size`` bytes, ``threads`` at a time."""
    data = os.urandom(size)
    keys = [f"{name}/{size}/{threads}/{i}" for i in range(count)]
    with ThreadPoolExecutor(threads) as lanes:
        started = time.perf_counter()
        list(lanes.map(lambda key: put(key, data), keys))
        put_s = time.perf_counter() - started
        started = time.perf_counter()
        assert all(len(got) == size for got in lanes.map(get, keys))
        get_s = time.perf_counter() - started
    return size * count / put_s / 1e9, size * count / get_s / 1e9


def latency(name: str, put: Put, get: Get, count: int = 200) -> list[float]:
    """Milliseconds of 4 KiB puts and gets one at a time: put p50, put p99, get p50, get p99."""
    data = os.urandom(4096)
    puts, gets = [], []
    for i in range(count):
        key = f"{name}/latency/{i}"
        started = time.perf_counter()
        put(key, data)
        puts.append(time.perf_counter() - started)
        started = time.perf_counter()
        get(key)
        gets.append(time.perf_counter() - started)
    return [
        1e3 * figure
        for times in (puts, gets)
        for figure in (statistics.median(times), sorted(times)[int(0.99 * len(times))])
    ]


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        server = SeaweedS3(Path(directory))
        server.start()
        os.environ.update(server.credentials())
        try:
            rates, delays = [], []
            for run in (1, 2):
                for name, (put, get) in clients(server).items():
                    latency(name, put, get, count=20)  # connections opened, first requests paid
                    for size, count in ((2 << 20, 48), (8 << 20, 16)):
                        for threads in (1, 8):
                            rates.append(
                                (run, name, size >> 20, threads, *throughput(name, put, get, size, count, threads))
                            )
                    delays.append((run, name, *latency(name, put, get)))
        finally:
            server.stop()
    print_table("chunk objects", ["run", "client", *THROUGHPUT], rates)
    print_table("4 KiB objects, ms", ["run", "client", *LATENCY], delays)
    path = write_results(
        "object_clients",
        {
            "throughput": [dict(zip(["run", "client", *THROUGHPUT], row, strict=True)) for row in rates],
            "latency_ms": [dict(zip(["run", "client", *LATENCY], row, strict=True)) for row in delays],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
