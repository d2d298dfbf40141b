#!/usr/bin/env python
"""Bytes a shuffled epoch fetches over HTTP with several DataLoader workers, against the data's size.

    python benchmarks/worker_fetch.py [--samples 6000] [--sample-bytes 6000] [--workers 1,2,4] [--epochs 3]
                                      [--images 4000]

Each worker of a shardstream DataLoader reads only the samples its plan deals it, by
ranged reads (no cache): where two workers' samples share a zstd frame both fetch it,
and a read bridges gaps of up to 2 MB between a worker's runs. So how the chunks are
dealt (`plan.deal_run`) decides how many times an epoch fetches each byte. WebDataset
deals whole shards to workers (each shard fetched once an epoch), read here through
`pipe:curl` from the same server. Bytes are counted by the server (the `Content-Length`
of its answers to GETs) over --epochs shuffled epochs (another seed each; median of their ratios),
and divided by the shards' bytes: shardstream's count includes each worker's reads of the
manifest and of the indexes of the shards it reads (on the 6 KB samples, 0.34%, 0.57% and
0.63% of the shards' bytes with 1, 2 and 4 workers).

Datasets: --samples samples of --sample-bytes of noise (incompressible), in shards of
--shard-size, both formats (`pack`'s size counts tar bytes, WebDataset's `maxsize` the
samples' bytes: its tars come out larger, and fewer); with --images, also the loader benchmarks' image dataset
(`benchmarks/loader.py`'s, packed once under --data).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading

import numpy as np
import torch

import shardstream as ss
from shardstream.testing import HTTPTestServer
from shardstream.writer import parse_size

BATCH = 64


def write_noise(root: str, samples: int, sample_bytes: int, shard_size: str) -> tuple[str, list[str]]:
    """The same noise samples as shardstream shards and as WebDataset tars, under `root` (kept)."""
    import webdataset as wds

    ss_path, wds_path = os.path.join(root, "ss"), os.path.join(root, "wds")
    marker = os.path.join(root, ".complete")
    if not os.path.exists(marker):
        rng = np.random.default_rng(0)
        os.makedirs(wds_path, exist_ok=True)
        with ss.ShardWriter(ss_path, shard_size=shard_size, overwrite=True) as ours, \
                wds.ShardWriter(os.path.join(wds_path, "shard-%06d.tar"), maxsize=parse_size(shard_size),
                                verbose=0) as theirs:
            for i in range(samples):
                sample = {"__key__": f"{i:07d}", "bin": rng.bytes(sample_bytes), "cls": i % 10}
                ours.write(sample)
                theirs.write({**sample, "cls": str(sample["cls"]).encode()})
        open(marker, "w").close()
    return ss_path, sorted(os.path.join(wds_path, f) for f in os.listdir(wds_path) if f.endswith(".tar"))


class ByteCountingServer(HTTPTestServer):
    """`HTTPTestServer`, counting the body bytes its GETs announce (`Content-Length`)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.sent, lock, outer = 0, threading.Lock(), self

        class Handler(self.server.RequestHandlerClass):  # type: ignore[misc,valid-type,name-defined]
            def send_header(self, keyword: str, value: str) -> None:
                if self.command == "GET" and keyword == "Content-Length":
                    with lock:
                        outer.sent += int(value)
                super().send_header(keyword, value)

        self.server.RequestHandlerClass = Handler  # before any request


def stored(paths: list[str]) -> int:
    return sum(os.path.getsize(p) for p in paths)


def epoch_bytes(server: ByteCountingServer, loader: torch.utils.data.DataLoader, expect: int) -> int:
    before = server.sent
    n = sum(len(item[0]) if isinstance(item, (tuple, list)) else len(item["__key__"]) for item in loader)
    if n != expect:
        raise SystemExit(f"an epoch yielded {n} samples, expected {expect}")
    return server.sent - before


def shardstream_ratio(server: ByteCountingServer, root: str, path: str, workers: int, epochs: int, n: int) -> float:
    url = f"{server.url}/{os.path.relpath(path, root)}"
    size = stored([os.path.join(path, f) for f in os.listdir(path) if f.endswith((".tar.zst", ".tar"))])
    ratios = []
    for epoch in range(epochs):
        ds = ss.StreamingDataset(url, shuffle=True, seed=epoch, decode=None, fields=("__key__",), batch_size=BATCH)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        ratios.append(epoch_bytes(server, loader, n) / size)
    return statistics.median(ratios)


def webdataset_ratio(server: ByteCountingServer, root: str, tars: list[str], workers: int, epochs: int, n: int) -> float:
    import webdataset as wds

    urls = [f"pipe:curl -s {server.url}/{os.path.relpath(t, root)}" for t in tars]
    ratios = []
    for _ in range(epochs):
        pipeline = wds.WebDataset(urls, shardshuffle=len(urls)).shuffle(1000).to_tuple("__key__").batched(BATCH)
        loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=workers)
        ratios.append(epoch_bytes(server, loader, n) / stored(tars))
    return statistics.median(ratios)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--sample-bytes", type=int, default=6000)
    p.add_argument("--shard-size", default="6MB")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--images", type=int, default=0, help="also the loader benchmarks' dataset of this many images")
    p.add_argument("--data", default="~/.cache/shardstream-bench", help="cache folder for the datasets")
    args = p.parse_args()
    data = os.path.expanduser(args.data)
    workers = [int(w) for w in args.workers.split(",")]
    noise_root = os.path.join(data, f"fetch-noise-{args.samples}x{args.sample_bytes}-{args.shard_size}")
    datasets = [(f"{args.samples} samples of {args.sample_bytes} B noise, shards of {args.shard_size}", noise_root,
                 *write_noise(noise_root, args.samples, args.sample_bytes, args.shard_size), args.samples)]
    if args.images:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from loader import ensure_data

        d = ensure_data(data, args.images)
        datasets.append((f"{args.images} JPEGs (benchmarks/loader.py), shards of 32 MB", d.root, d.ss_path,
                         d.wds_files, d.n))
    print(f"bytes fetched an epoch / bytes stored, shuffled, batches of {BATCH}, HTTP without a cache; "
          f"median over {args.epochs} epochs")
    print("| dataset | workers | shardstream | WebDataset (pipe:curl) |\n|---|---:|---:|---:|")
    for name, root, ss_path, tars, n in datasets:
        with ByteCountingServer(root) as server:
            for w in workers:
                ours = shardstream_ratio(server, root, ss_path, w, args.epochs, n)
                theirs = webdataset_ratio(server, root, tars, w, args.epochs, n) if len(tars) >= w else float("nan")
                print(f"| {name} | {w} | {ours:.2f}x | {theirs:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
