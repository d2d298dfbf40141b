#!/usr/bin/env python
"""What a remote dataset costs around the work: labels for class weights, a pack's resume and its journal's removal.

    python benchmarks/remote_setup.py [--shards 200] [--latency 0.02] [--repeats 3]

Two steps that ask the store something about every shard, timed in fresh processes
(medians of --repeats; run it once with PYTHONPATH naming an older checkout to compare):

* labels: `open_dataset(url).labels()`, what `Sampling(class_weights=...)` reads before
  the first sample (every shard's index), over `shardstream.testing.HTTPTestServer`
  with --latency seconds added to every request;
* resume: `pack --resume`'s look at its journal (`Journal.start`), for a pack into
  moto's S3 server on this machine interrupted after every shard but the manifest:
  which of the journaled shards are there, whole;
* clear: removing that journal (`Journal.clear`, what every pack does at its end; an
  overwrite removes the old dataset's files the same way), on a copy of it each run.

The dataset is --shards tiny images of 3 classes, one a shard (`max_samples=1`), so the
requests are the cost, not the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import msgpack
kind, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import shardstream
if kind == "labels":
    source = shardstream.open_dataset(url)
    start = time.perf_counter()
    labels = source.labels()
    print(json.dumps({"seconds": time.perf_counter() - start, "items": len(labels)}))
elif kind == "resume":
    from shardstream.journal import Journal
    from shardstream.storage import Store
    journal = Journal(Store(url, options), "main")
    plan = msgpack.unpackb(journal.store.read("plan.msgpack"))
    start = time.perf_counter()
    done = journal.start(plan, resume=True)
    print(json.dumps({"seconds": time.perf_counter() - start, "items": len(done)}))
else:  # clear: a copy of the journal, made here, outside the time
    import s3fs, uuid
    from shardstream.journal import FOLDER, Journal
    from shardstream.storage import Store
    fs, copy = s3fs.S3FileSystem(**options), f"copy-{uuid.uuid4().hex}"
    root = url.removeprefix("s3://") + "/" + FOLDER
    files = fs.ls(f"{root}/main", detail=False)
    for path in files:
        fs.copy(path, f"{root}/{copy}/" + path.rsplit("/", 1)[1])
    journal = Journal(Store(url, options), copy)
    start = time.perf_counter()
    journal.clear()
    print(json.dumps({"seconds": time.perf_counter() - start, "items": len(files)}))
"""


def timed(kind: str, url: str, options: dict, repeats: int) -> tuple[float, int]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, kind, url, json.dumps(options)], capture_output=True,
                             text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return statistics.median(r["seconds"] for r in runs), runs[0]["items"]


def interrupted_pack(src: str, dst: str, options: dict, shards: int) -> None:
    """Pack `src` into `dst`, stopped (as a kill would) after every shard is journaled, before the manifest."""
    import shardstream
    from shardstream.journal import Journal

    record = Journal.record

    def stop_after_the_last(self, shard, info, skipped):
        record(self, shard, info, skipped)
        if shard == shards - 1:
            raise KeyboardInterrupt

    Journal.record = stop_after_the_last
    try:
        shardstream.pack(src, dst, max_samples=1, workers=1, progress=False, storage_options=options)
    except KeyboardInterrupt:
        pass
    finally:
        Journal.record = record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=200)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import s3fs

    import shardstream
    from shardstream.synthetic import make_image_folder
    from shardstream.testing import HTTPTestServer, MotoS3Server

    with tempfile.TemporaryDirectory() as tmp:
        src, local = os.path.join(tmp, "src"), os.path.join(tmp, "ds")
        per_class = [args.shards // 3 + (i < args.shards % 3) for i in range(3)]
        make_image_folder(src, num_classes=3, images_per_class=per_class, size_range=((24, 16), (32, 24)))
        shardstream.pack(src, local, max_samples=1, workers=1, progress=False)
        with HTTPTestServer(local, latency_s=args.latency) as server:
            seconds, items = timed("labels", server.url, {}, args.repeats)
        print(f"labels over HTTP, {args.shards} shards, {args.latency * 1000:.0f} ms a request: "
              f"{seconds:.2f} s ({items} labels)")
        with MotoS3Server() as moto:
            options = moto.storage_options
            s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="bench")
            interrupted_pack(src, "s3://bench/ds", options, args.shards)
            seconds, items = timed("resume", "s3://bench/ds", options, args.repeats)
            print(f"resume's journal on moto S3, {args.shards} shards journaled: {seconds:.2f} s "
                  f"({items} found whole)")
            seconds, items = timed("clear", "s3://bench/ds", options, args.repeats)
            print(f"the journal's removal on moto S3: {seconds:.2f} s ({items} files)")


if __name__ == "__main__":
    main()
