#!/usr/bin/env python
"""Side-by-side benchmark: shardstream vs WebDataset, packing and raw reading.

    python benchmarks/run.py [--images 4000] [--repeats 3] [--only pack,read]
                             [--data ~/.cache/shardstream-bench] [--out results.json]

* Data: a synthetic ImageNet-like ImageFolder (`shardstream.synthetic`, JPEGs of about
  110 KB, 10 classes), generated once and cached under --data.
* pack: `shardstream.pack(..., workers=2)` with zstd and without compression, against
  `webdataset.ShardWriter` writing the same files (bytes + class label, plain tar,
  256 MB shards) in one process, and reading every file's bytes (`cat`) as a ceiling.
* read: every sample of the packed datasets in one process (no decoding, one core),
  against `webdataset.WebDataset(urls, shardshuffle=False)` over its own shards, and
  reading the shard files' bytes in 4 MB chunks as a ceiling.

Every run reads warm files: one untimed warm-up round comes first, then `--repeats`
rounds in which the contenders take turns (so that slow drift of a noisy machine hits
all of them alike); each figure is the median of its rounds. Outputs are removed
before, and flushed with sync() after, each pack run, outside the timed region.
Ratios are against WebDataset measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders as c  # noqa: E402
from _reference import reference_paths  # noqa: E402

PACK_ZSTD = "shardstream pack zstd ({} workers)"
TARGETS = {
    # (section, contender, minimum ratio vs WebDataset, pack workers it holds for: None for any)
    "pack .tar.zst on 2 cores >= 2x webdataset.ShardWriter": ("pack", PACK_ZSTD.format(2), 2.0, 2),
    "raw read .tar.zst on one core >= 10x webdataset.WebDataset": ("read", "shardstream .tar.zst", 10.0, None),
}


# -- data -------------------------------------------------------------------------------


def ensure_images(data: str, n: int, workers: int) -> str:
    """The cached image folder of `n` images (n // 10 per class), made if missing."""
    from shardstream.synthetic import make_image_folder

    per_class = n // 10
    root = os.path.join(data, f"images-{per_class * 10}")
    marker = os.path.join(root, ".complete")
    if os.path.exists(marker):
        return root
    partial = root + ".partial"
    c.reset(partial)
    print(f"generating {per_class * 10} synthetic JPEGs under {root} (once; cached) ...", flush=True)
    start = time.perf_counter()
    make_image_folder(partial, num_classes=10, images_per_class=per_class, seed=0, workers=workers)
    with open(os.path.join(partial, ".complete"), "w") as f:
        json.dump({"num_classes": 10, "images_per_class": per_class, "seed": 0}, f)
    c.reset(root)
    os.rename(partial, root)
    print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    return root


def dataset_stats(root: str) -> dict:
    sizes = [os.path.getsize(p) for p, _, _ in c.image_files(root)]
    return {"path": root, "images": len(sizes), "bytes": sum(sizes), "mean_bytes": sum(sizes) / len(sizes)}


# -- timing -----------------------------------------------------------------------------


def _reference(fn: Callable[..., int], *args: object) -> int:
    with reference_paths():
        return fn(*args)


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Contender:
    def __init__(self, name: str, run: Callable[[], int], *, prepare: Callable[[], None] | None = None,
                 after: Callable[[], None] | None = None, count: int | None = None, note: str = ""):
        self.name, self.run_fn, self.prepare, self.after = name, run, prepare, after
        self.count = count  # samples a run stands for, when run() returns something else
        self.note = note
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.samples = 0

    def once(self, record: bool) -> None:
        if self.prepare:
            self.prepare()
        cpu0, t0 = _cpu(), time.perf_counter()
        got = self.run_fn()
        wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
        if self.after:
            self.after()
        self.samples = self.count if self.count is not None else got
        if record:
            self.wall.append(wall)
            self.cpu.append(cpu)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def rate(self) -> float:
        return self.samples / self.median


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: on a shared machine, what else was running."""
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except (OSError, ValueError):
        return None


def measure(section: str, group: list[Contender], repeats: int, warmup: bool = True) -> None:
    rounds = ([False] if warmup else []) + [True] * repeats
    for r, record in enumerate(rounds):
        label = "warm-up" if not record else f"round {r + (0 if warmup else 1)}/{repeats}"
        for con in group:
            con.once(record)
            shown = f"{con.wall[-1]:.3f} s" if record else "done"
            print(f"  [{section}] {label:>11}  {con.name:<44} {shown}", flush=True)


def table(title: str, group: list[Contender], baseline: str, unit: str, total_bytes: int) -> list[dict]:
    """Print a markdown table; ratios are against `baseline` measured in the same run.

    Wall-clock rates are the figures of record. CPU seconds (this process plus its
    finished child processes) are shown beside them: on a shared, noisy machine they
    vary less than wall time, and their ratio says how much work each contender does.
    """
    base = next(g for g in group if g.name == baseline)
    base_cpu = statistics.median(base.cpu)
    rows = []
    print(f"\n{title}")
    header = (f"| {'contender':<44} | {'median s':>8} | {unit:>10} | {'MB/s':>7} | {'vs WebDataset':>13} "
              f"| {'CPU s':>6} | {'CPU vs WDS':>10} | runs (s) |")
    print(header)
    print("|" + "|".join("-" * (len(p)) for p in header.split("|")[1:-1]) + "|")
    for g in group:
        ratio = g.rate / base.rate
        cpu = statistics.median(g.cpu)
        cpu_ratio = base_cpu / cpu if cpu > 0 else float("inf")
        runs = ", ".join(f"{w:.2f}" for w in g.wall)
        mbs = total_bytes / g.median / 1e6
        print(f"| {g.name:<44} | {g.median:8.3f} | {g.rate:10,.0f} | {mbs:7,.0f} | {ratio:12.2f}x "
              f"| {cpu:6.2f} | {cpu_ratio:9.2f}x | {runs} |")
        rows.append({
            "contender": g.name, "note": g.note, "samples": g.samples, "runs_s": g.wall, "cpu_s": g.cpu,
            "median_s": g.median, "rate": g.rate, "unit": unit, "payload_MB_per_s": mbs,
            "ratio_vs_webdataset": ratio, "median_cpu_s": cpu, "cpu_ratio_vs_webdataset": cpu_ratio,
            # The rounds take turns, so each round's pair ran minutes apart at most: steadier
            # than the ratio of medians when the machine drifts during the run.
            "ratio_per_round": statistics.median(b / w for w, b in zip(g.wall, base.wall)),
        })
    return rows


# -- machine ----------------------------------------------------------------------------


def write_results(path: str, results: dict) -> str:
    """Write a benchmark's results as JSON (values JSON does not know become strings)."""
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    return path


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for pkg in ("shardstream", "webdataset", "torch", "zstandard", "numpy", "Pillow", "msgpack"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "../shardstream"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "git_commit": commit + ("+dirty" if dirty else ""),
    }


def peers() -> dict:
    out = {}
    for label, module in (("LitData", "litdata"), ("MosaicML Streaming", "streaming")):
        try:
            __import__(module)
        except Exception:  # ImportError, or a broken install (see BENCHMARKS.md)
            out[label] = "skipped (not installed)"
        else:
            out[label] = "installed: compare with benchmarks/peers.py"
        print(f"{label}: {out[label]}")
    return out


# -- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4000, help="images in the synthetic folder (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per contender (median reported), >= 1")
    p.add_argument("--only", default="pack,read", help="comma-separated sections: pack, read")
    p.add_argument("--data", default="~/.cache/shardstream-bench", help="cache folder for images and outputs")
    p.add_argument("--out", default=None, help="JSON results file (default: <data>/results-<images>.json)")
    p.add_argument("--workers", type=int, default=2, help="shardstream pack workers (and image generation)")
    p.add_argument("--reference", action="store_true",
                   help="also time shardstream with its fast paths switched off (benchmarks/_reference.py): "
                        "before vs after the hot-path work, in the same run")
    args = p.parse_args(argv)
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    if not sections <= {"pack", "read"} or not sections:
        p.error("--only takes pack, read or both")
    if args.repeats < 1 or args.images < 10:
        p.error("need --repeats >= 1 and --images >= 10")

    data = os.path.expanduser(args.data)
    os.makedirs(data, exist_ok=True)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, "
          f"torch {info['versions']['torch']}, webdataset {info['versions']['webdataset']}, "
          f"shardstream {info['versions']['shardstream']} ({info['git_commit']})")
    src = ensure_images(data, args.images, args.workers)
    stats = dataset_stats(src)
    n = stats["images"]
    print(f"images: {n} files, {stats['bytes'] / 1e6:,.1f} MB, mean {stats['mean_bytes'] / 1e3:.1f} KB ({src})")
    print("all contenders read warm files (page cache): one untimed warm-up round, then timed rounds\n")

    work = os.path.join(data, f"out-{n}")
    out_zst, out_tar, out_wds, out_ref = (os.path.join(work, d) for d in ("ss-zstd", "ss-tar", "wds", "ss-ref"))
    results: dict = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": info,
        "dataset": stats,
        "repeats": args.repeats,
        "page_cache": "warm: untimed warm-up round first; pack outputs removed before and sync()ed after each run",
    }

    if "pack" in sections:
        group = [
            Contender(PACK_ZSTD.format(args.workers),
                      lambda: c.pack_shardstream(src, out_zst, "zstd", args.workers),
                      prepare=lambda: (c.reset(out_zst), os.sync()), after=os.sync),
            Contender(f"shardstream pack none ({args.workers} workers)",
                      lambda: c.pack_shardstream(src, out_tar, "none", args.workers),
                      prepare=lambda: (c.reset(out_tar), os.sync()), after=os.sync),
            Contender("webdataset.ShardWriter (1 process)", lambda: c.pack_webdataset(src, out_wds),
                      prepare=lambda: (c.reset(out_wds), os.sync()), after=os.sync),
            *([Contender(f"  reference paths: pack zstd ({args.workers} workers)",
                         lambda: _reference(c.pack_shardstream, src, out_ref, "zstd", args.workers),
                         prepare=lambda: (c.reset(out_ref), os.sync()), after=os.sync)] if args.reference else []),
            Contender("cat: read all files (1 process, ceiling)", lambda: c.read_files_ceiling(src)),
        ]
        results["loadavg_before_pack"] = loadavg()
        measure("pack", group, args.repeats)
        results["loadavg_after_pack"] = loadavg()
        for g in group:
            assert g.samples == n, f"{g.name} handled {g.samples} samples, expected {n}"
        results["pack"] = table(f"pack, {n} images ({stats['bytes'] / 1e6:,.0f} MB), img/s, median of "
                                f"{args.repeats}", group, "webdataset.ShardWriter (1 process)", "img/s",
                                stats["bytes"])
        results["output_bytes"] = {name: c.folder_bytes(d) for name, d in
                                   (("shardstream zstd", out_zst), ("shardstream none", out_tar), ("webdataset", out_wds))}
        print("output bytes:", ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in results["output_bytes"].items()))

    if "read" in sections:
        # The datasets the pack section writes; made once (untimed) if it did not run.
        if not os.path.exists(os.path.join(out_zst, "manifest.msgpack")):
            c.pack_shardstream(src, out_zst, "zstd", args.workers)
        if not os.path.exists(os.path.join(out_tar, "manifest.msgpack")):
            c.pack_shardstream(src, out_tar, "none", args.workers)
        wds_urls = c.shard_files(out_wds, ".tar") if os.path.isdir(out_wds) else []
        if not wds_urls:
            c.pack_webdataset(src, out_wds)
            wds_urls = c.shard_files(out_wds, ".tar")
        zst_files, wds_files = c.shard_files(out_zst, ".tar.zst"), wds_urls
        group = [
            Contender("shardstream .tar.zst", lambda: c.read_shardstream(out_zst)),
            Contender("shardstream .tar", lambda: c.read_shardstream(out_tar)),
            Contender("webdataset.WebDataset (its .tar, no decode)", lambda: c.read_webdataset(wds_urls)),
            *([Contender("  reference paths: .tar.zst", lambda: _reference(c.read_shardstream, out_zst)),
               Contender("  reference paths: .tar", lambda: _reference(c.read_shardstream, out_tar))]
              if args.reference else []),
            Contender("raw bytes of the .tar.zst files (4 MB reads)", lambda: c.read_bytes_ceiling(zst_files),
                      count=n, note="ceiling: no parsing"),
            Contender("raw bytes of webdataset's .tar (4 MB reads)", lambda: c.read_bytes_ceiling(wds_files),
                      count=n, note="ceiling: no parsing"),
        ]
        results["loadavg_before_read"] = loadavg()
        measure("read", group, args.repeats)
        results["loadavg_after_read"] = loadavg()
        for g in group:
            assert g.samples == n, f"{g.name} read {g.samples} samples, expected {n}"
        results["read"] = table(f"raw read, one process, no decode, {n} samples, samples/s, median of {args.repeats}",
                                group, "webdataset.WebDataset (its .tar, no decode)", "samples/s", stats["bytes"])

    print()
    results["peers"] = peers()
    results["targets"] = {}
    for label, (section, name, want, workers) in TARGETS.items():
        if section not in results or workers not in (None, args.workers):
            continue  # not run, or run with other pack workers than the target's
        row = next(r for r in results[section] if r["contender"] == name)
        met = row["ratio_vs_webdataset"] >= want
        results["targets"][label] = {"ratio": row["ratio_vs_webdataset"], "met": met,
                                     "ratio_per_round": row["ratio_per_round"]}
        print(f"target: {label}: {row['ratio_vs_webdataset']:.2f}x (per round {row['ratio_per_round']:.2f}x) -> "
              f"{'MET' if met else 'NOT MET'}")

    out = write_results(args.out or os.path.join(data, f"results-{n}.json"), results)
    print(f"load average (1, 5, 15 min) before/after: pack {results.get('loadavg_before_pack')} / "
          f"{results.get('loadavg_after_pack')}, read {results.get('loadavg_before_read')} / "
          f"{results.get('loadavg_after_read')}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
