#!/usr/bin/env python
"""CPU per MB of ranged reads: fsspec's clients against shardstream's direct ones.

    python benchmarks/clients.py [--mb 96] [--threads 6] [--repeats 5] [--latency 0.05] [--out results.json]

Reads the same ranges of one random object, 8 MB each, `--threads` at a time (as the
prefetch threads of a worker do), through each client in turn, round by round:

* HTTP, from `shardstream.testing.HTTPTestServer` (in a process of its own, `--latency`
  seconds a request): fsspec's `cat_file` (aiohttp, with the library's timeouts) against
  `shardstream.http_ranges.read_range` (urllib3);
* S3, from moto's server (a process of its own): s3fs's `cat_file` against
  `shardstream.s3_ranges.read_range` (botocore).

Reported: CPU seconds of this process per MB received (every thread, the event loop's
too) and wall time per MB, medians of --repeats rounds, and the ratio within each round.
The servers' own CPU is not counted: it runs in their processes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import loadavg, machine, write_results  # noqa: E402

PIECE = 8 << 20


def measure(read: Callable[[int, int], bytes], ranges: list[tuple[int, int]], threads: int) -> tuple[float, float]:
    """(CPU ms per MB, wall ms per MB) of reading every range."""
    read(0, 16)  # connect and warm up, untimed
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(len(data) for data in pool.map(lambda r: read(*r), ranges))
    mb = total / 1e6
    return (time.process_time() - cpu0) * 1e3 / mb, (time.perf_counter() - wall0) * 1e3 / mb


def http_server(root: str, latency: float) -> tuple[subprocess.Popen, str]:
    code = (f"import sys\nfrom shardstream.testing import HTTPTestServer\n"
            f"s = HTTPTestServer({root!r}, latency_s={latency!r})\nprint(s.url, flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=96,
                   help="MB read per client per round (whole passes of 32 MB: rounded down)")
    p.add_argument("--threads", type=int, default=6, help="ranges in flight")
    p.add_argument("--repeats", type=int, default=5, help="rounds (medians reported)")
    p.add_argument("--latency", type=float, default=0.05, help="HTTP server's added latency per request, s")
    p.add_argument("--out", default=None, help="JSON results file")
    args = p.parse_args(argv)

    import fsspec
    import s3fs

    from shardstream import http_ranges, s3_ranges
    from shardstream.storage import _with_timeouts
    from shardstream.testing import MotoS3Server

    size = 32 << 20
    blob = os.urandom(size)
    ranges = [(s, s + PIECE) for s in range(0, size, PIECE)] * max(1, args.mb // 32)
    read_mb = len(ranges) * PIECE >> 20  # whole passes over the 32 MB file: what is read, not what was asked
    rows: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as root, MotoS3Server() as moto:
        with open(os.path.join(root, "blob"), "wb") as f:
            f.write(blob)
        proc, url = http_server(root, args.latency)
        s3 = s3fs.S3FileSystem(**moto.storage_options)
        s3.call_s3("create_bucket", Bucket="bench")
        s3.pipe("bench/blob", blob)
        try:
            http_fs = fsspec.filesystem("http", skip_instance_cache=True, **_with_timeouts(url, {}))
            s3_fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto.storage_options)
            clients = {
                "HTTP: fsspec (aiohttp)": lambda a, b: http_fs.cat_file(f"{url}/blob", start=a, end=b),
                "HTTP: shardstream (urllib3)": lambda a, b: http_ranges.read_range(f"{url}/blob", a, b),
                "S3: s3fs (aiobotocore)": lambda a, b: s3_fs.cat_file("bench/blob", start=a, end=b),
                "S3: shardstream (botocore)": lambda a, b: s3_ranges.read_range("s3://bench/blob", a, b,
                                                                              moto.storage_options),
            }
            for r in range(args.repeats):
                for name, read in clients.items():
                    rows.setdefault(name, []).append(measure(read, ranges, args.threads))
                    cpu, wall = rows[name][-1]
                    print(f"  round {r + 1}/{args.repeats}  {name:<30} CPU {cpu:5.2f} ms/MB  wall {wall:5.2f} ms/MB",
                          flush=True)
        finally:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(timeout=30)

    print(f"\n{read_mb} MB in {PIECE >> 20} MB ranges, {args.threads} at a time, median of {args.repeats}\n")
    print("| client | CPU ms/MB | wall ms/MB | fsspec's CPU / this one's, per round |")
    print("|---|---:|---:|---:|")
    results = {}
    for name, runs in rows.items():
        base = rows["HTTP: fsspec (aiohttp)" if name.startswith("HTTP") else "S3: s3fs (aiobotocore)"]
        ratio = statistics.median(b[0] / c[0] for c, b in zip(runs, base))
        cpu, wall = statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs)
        print(f"| {name} | {cpu:.2f} | {wall:.2f} | {ratio:.2f}x |")
        results[name] = {"cpu_ms_per_mb": cpu, "wall_ms_per_mb": wall, "runs": runs, "cpu_ratio_vs_fsspec": ratio}
    out = {"date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
           "machine": machine(), "loadavg": loadavg(), "args": vars(args), "read_mb": read_mb, "clients": results}
    if args.out:
        print(f"\nwrote {write_results(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
