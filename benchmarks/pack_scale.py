#!/usr/bin/env python
"""What `pack` costs before its first frame, against the number of source files.

    python benchmarks/pack_scale.py [--files 100000 1000000] [--part 0/1000] [--data /tmp/pack-scale]

For each size, a folder of that many files in 1,000 class folders is made of 300 tiny
real JPEGs hard-linked under distinct names (no extra disk; about 15 s a million), then,
in a fresh process, pack's steps before the first frame are timed one by one, as
pack.py runs them: listing, ordering, the listing's fingerprint, (a part's slice,)
looking up (stat) the files it packs, cutting frames, the sizes-and-times stamp for
`--resume`, the frames' planned bytes, and threads-or-processes; with the process's memory after them (tracemalloc would double
the times, so RSS only). Every one is linear in the files; what the table shows is the
constant: a part lists, sorts and shuffles the whole source, whatever its share, and
looks up (stats) only the files of its share.
The folders it makes (one per size, under `--data`) are removed at the end unless
`--keep`; nothing else there is touched.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time


def make_folder(root: str, files: int) -> None:
    from PIL import Image

    bases = os.path.join(root, "_bases")
    os.makedirs(bases, exist_ok=True)
    paths = []
    for i in range(300):
        path = os.path.join(bases, f"{i}.jpg")
        Image.new("RGB", (16 + i % 7, 16), (i % 256, 40, 90)).save(path, quality=80)
        paths.append(path)
    source = os.path.join(root, "src")
    made = 0
    for c in range(1000):  # `files` in all, the remainder over the first classes
        folder = os.path.join(source, f"n{c:08d}")
        os.makedirs(folder)
        for j in range(files // 1000 + (c < files % 1000)):
            os.link(paths[made % len(paths)], os.path.join(folder, f"n{c:08d}_{j}.JPEG"))
            made += 1
    open(os.path.join(root, ".complete"), "w").close()  # a folder cut short by an interruption is made again


def measure(source: str, part: tuple[int, int] | None) -> dict[str, float]:
    """One fresh process's steps (run by `--child`)."""
    pack = importlib.import_module("shardstream.pack")
    from shardstream.listing import list_source, look_up_files
    from shardstream.packplan import PackOptions, order, part_slice, plan_frames
    from shardstream.shardfile import FRAME_SIZE

    out: dict[str, float] = {}

    def step(name, run):
        start = time.perf_counter()
        result = run()
        out[name + "_s"] = round(time.perf_counter() - start, 3)
        return result

    opts = PackOptions(256 << 20, None, "zstd", 3, 0, True, FRAME_SIZE, "shard")
    listing = step("list", lambda: list_source(source))
    entries = step("order", lambda: order(listing, opts))
    step("fingerprint", lambda: pack.listing_fingerprint(entries))
    if part is not None:
        entries = part_slice(entries, *part)
    step("look_up", lambda: look_up_files(entries, listing.root))
    step("plan_frames", lambda: plan_frames(entries, opts))  # with each frame's size, counted there
    step("files_stamp", lambda: pack._files_stamp(entries))
    step("threads_pay", lambda: pack.threads_pay(entries))
    with open("/proc/self/statm") as f:
        out["rss_mb"] = round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--part", help="I/N: time a part's steps (it lists the whole source, and stats its share)")
    parser.add_argument("--data", default="/tmp/pack-scale")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        part = tuple(int(x) for x in args.child[1].split("/")) if args.child[1] != "-" else None
        print(json.dumps(measure(args.child[0], part)))
        return
    made = []  # the folders this run made: removed at the end, and nothing else of --data
    try:
        for files in args.files:
            root = os.path.join(args.data, str(files))
            if not os.path.exists(os.path.join(root, ".complete")):
                shutil.rmtree(root, ignore_errors=True)
                made.append(root)
                make_folder(root, files)
            done = subprocess.run([sys.executable, __file__, "--child", os.path.join(root, "src"), args.part or "-"],
                                  capture_output=True, text=True, check=True)
            row = json.loads(done.stdout)
            total = sum(v for k, v in row.items() if k.endswith("_s"))
            print(f"{files:>10,} files: {total:6.1f} s before the first frame, RSS {row['rss_mb']:,} MB  {row}")
    finally:
        if not args.keep:
            for root in made:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
