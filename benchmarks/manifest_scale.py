"""What a dataset of many shards costs every process before its first sample.

Every rank reads the manifest, and DataLoader workers started by spawn receive the
resolved source pickled, so per-shard costs multiply. This script writes a manifest
listing N shards (the entries are made up: nothing here opens a shard), then, each in a
fresh process, times opening the dataset, `len()` with shuffling, `state_dict()`, and pickling the
resolved dataset, and measures the Python memory the opened dataset holds.

    python benchmarks/manifest_scale.py [--shards 100000 400000] [--samples-per-shard 35]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

from shardstream.format import MANIFEST_NAME, Manifest, ShardInfo


def write_manifest(folder: str, shards: int, per_shard: int) -> None:
    digest = hashlib.sha256(b"shard").hexdigest()
    infos = [ShardInfo(name=f"shard-{i:06d}.tar.zst", samples=per_shard, bytes=2_000_000 + i, raw_bytes=2_100_000 + i,
                       sha256=digest, index=f"shard-{i:06d}.tar.zst.idx", index_bytes=600 + per_shard * 20,
                       index_sha256=digest, fields=("cls", "jpg"))
             for i in range(shards)]
    classes = tuple(f"n{c:08d}" for c in range(1000))
    total = shards * per_shard
    counts = tuple(total // 1000 + (c < total % 1000) for c in range(1000))
    manifest = Manifest(shards=tuple(infos), compression="zstd", classes=classes, class_counts=counts)
    with open(os.path.join(folder, MANIFEST_NAME), "wb") as f:
        f.write(manifest.to_bytes())


def measure(folder: str) -> dict[str, float]:
    """One fresh process's costs (run by `--child`)."""
    from shardstream import StreamingDataset

    out: dict[str, float] = {}
    ds = StreamingDataset(folder, shuffle=True, rank=0, world_size=8)
    start = time.perf_counter()
    ds.resolve()
    out["open_s"] = time.perf_counter() - start
    start = time.perf_counter()
    len(ds)
    out["len_s"] = time.perf_counter() - start
    start = time.perf_counter()
    ds.state_dict()
    out["state_dict_s"] = time.perf_counter() - start
    start = time.perf_counter()
    data = pickle.dumps(ds)
    out["pickle_s"] = time.perf_counter() - start
    out["pickle_mb"] = len(data) / 1e6
    start = time.perf_counter()
    pickle.loads(data)
    out["unpickle_s"] = time.perf_counter() - start
    del ds, data
    tracemalloc.start()
    ds = StreamingDataset(folder, shuffle=True, rank=0, world_size=8)
    ds.resolve()
    out["held_mb"] = tracemalloc.get_traced_memory()[0] / 1e6
    out["peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[100_000, 400_000])
    parser.add_argument("--samples-per-shard", type=int, default=35)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    print("shards | manifest MB | open s | len() s | state_dict() s | pickle s | pickled MB | unpickle s | held MB | "
          "peak MB")
    for shards in args.shards:
        with tempfile.TemporaryDirectory() as folder:
            write_manifest(folder, shards, args.samples_per_shard)
            size = os.path.getsize(os.path.join(folder, MANIFEST_NAME)) / 1e6
            runs = [json.loads(subprocess.run([sys.executable, __file__, "--child", folder], check=True,
                                              capture_output=True, text=True).stdout)
                    for _ in range(args.runs)]
            m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{shards:>6} | {size:>11.1f} | {m['open_s']:>6.2f} | {m['len_s']:>7.3f} | {m['state_dict_s']:>14.3f} | "
                  f"{m['pickle_s']:>8.2f} | "
                  f"{m['pickle_mb']:>10.1f} | {m['unpickle_s']:>10.2f} | {m['held_mb']:>7.0f} | {m['peak_mb']:>7.0f}")


if __name__ == "__main__":
    main()
