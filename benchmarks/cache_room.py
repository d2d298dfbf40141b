#!/usr/bin/env python
"""What making room costs in a large shard cache: the walk under the room lock, per download.

    python benchmarks/cache_room.py [--shards 50000] [--downloads 20]

A cache folder laid out as `ShardCache` lays it out (a location folder; under it one
version folder per shard, holding the shard, its index, its lock file and its download lock; the shards
sparse files of 64 MB, so no disk is used) is made once, then `--downloads` times in a
row the room for one more shard is made, as a download does (`Room.make`
in its turn), in two cases: room to spare (the limit twice the cache), and a full cache
(the limit the cache's size: the first download must evict). Each case starts from a
copy of the layout made of hard links. The reservations are counted, not made into
files. Prints the first call's time (a walk: no ledger yet) and the median of the rest,
in a fresh process each; run it once with PYTHONPATH naming an older checkout to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SHARD = 64 << 20
INDEX = 4096

CHILD = r"""
import json, sys, time
from shardstream.cache import ShardCache
root, limit, downloads, incoming = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cache = ShardCache(root, limit)
# The room's own module from the seventeenth session on; ShardCache's methods before (for an A/B).
room = getattr(cache, "room", None)
turn, make = (room.turn, room.make) if room is not None else (cache._turn, cache._make_room)
times = []
for _ in range(downloads):
    start = time.perf_counter()
    with turn():
        make(incoming)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def make_layout(root: str, shards: int) -> None:
    location = os.path.join(root, "0123456789abcdef")
    for i in range(shards):
        version = os.path.join(location, f"{i:016x}")
        os.makedirs(version)
        name = os.path.join(version, f"shard-{i:06d}.tar.zst")
        with open(name, "wb") as f:
            f.truncate(SHARD)
        with open(name + ".idx", "wb") as f:
            f.truncate(INDEX)
        open(name + ".lock", "wb").close()
        open(name + ".dl", "wb").close()  # the download lock every downloaded shard leaves
        os.utime(name, (1_000_000 + i, 1_000_000 + i))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=50_000)
    parser.add_argument("--downloads", type=int, default=20)
    args = parser.parse_args()
    size = args.shards * (SHARD + INDEX)
    with tempfile.TemporaryDirectory() as tmp:
        layout = os.path.join(tmp, "layout")
        started = time.perf_counter()
        make_layout(layout, args.shards)
        print(f"{args.shards:,} cached shards laid out in {time.perf_counter() - started:.1f} s")
        for case, limit in (("room to spare", 2 * size), ("full: the first download evicts", size)):
            root = os.path.join(tmp, "cache")
            shutil.copytree(layout, root, copy_function=os.link)  # hard links: no bytes copied
            out = subprocess.run([sys.executable, "-c", CHILD, root, str(limit), str(args.downloads),
                                  str(SHARD + INDEX)], capture_output=True, text=True, check=True)
            times = json.loads(out.stdout)
            print(f"{case}: first {times[0]:.3f} s, then median {statistics.median(times[1:]) * 1000:.2f} ms "
                  f"(max {max(times[1:]):.3f} s) a download")
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
