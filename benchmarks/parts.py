#!/usr/bin/env python
"""Packing in parts: 2 parts as 2 processes against one part, and the Ray executor against parts by hand.

    python benchmarks/parts.py [--images 4000] [--copies 1] [--repeats 3] [--no-ray] [--pin]
                               [--data ~/.cache/shardstream-bench] [--out results.json]

Every contender packs the same synthetic image folder (benchmarks/run.py makes and
caches it) with zstd, as a user would on one machine:

* one part: ``shardstream pack SRC DST --workers 1``, one process;
* 2 parts by hand: ``shardstream pack SRC DST --part I/2 --workers 1`` for I = 0, 1 as
  two concurrent processes (what a SLURM array or a shell loop runs); the last part to
  finish merges, inside the timed region;
* Ray: ``pack_with_ray(SRC, DST, parts=2, cpus_per_part=1)`` on a local Ray instance
  of 2 CPUs, started once before the timed rounds (a user's cluster is already up:
  ``ray.init()`` connecting to it is not the executor's cost);
* webdataset.ShardWriter in one process, for scale.

Each process has fixed costs that do not shrink with the input: starting Python and
importing shardstream (about 0.6 s here), and listing the whole source (every part
lists it, to agree on the order). On a few thousand images these
dominate; `--copies K` packs a folder of K hard links to each image (distinct names,
the same bytes, no extra disk) to show the rate at which they are paid off.

A part is one process, but not one core: it reads and compresses in one thread and
writes and hashes in another, so on this 2-core machine one part already keeps more
than one core busy. `--pin` runs every part under `taskset -c` on a core of its own
(one part on core 0; part I of 2 on core I), as a scheduler that grants one CPU per
task does (SLURM's `--cpus-per-task=1`, a Kubernetes CPU limit of 1): then the ratio
measures how the parts scale, not the baseline's idle core. Ray's tasks are not pinned
(it schedules by CPU counts, not affinities), so with `--pin` the parts by hand run
once more unpinned, as Ray's baseline. Ray's CPU time is not reported: its tasks run in
its own worker processes, which `getrusage` of this one does not see.

Targets (issue #10): 2 parts >= 1.8x the rate of one part; Ray's time at most 1.1x
the parts by hand. Every figure is the median of --repeats rounds, the contenders
taking turns after one untimed warm-up round; outputs are removed before and sync()ed
after each run, outside the timed region.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders as c  # noqa: E402
from run import Contender, dataset_stats, ensure_images, loadavg, machine, measure, write_results  # noqa: E402

CLI = [sys.executable, "-m", "shardstream.cli", "pack"]
PIN = False  # --pin: every part on a core of its own (taskset)
OPTIONS = ["--workers", "1", "--shard-size", c.SHARD_SIZE, "--quiet"]


def _on_core(core: int, pinned: bool) -> list[str]:
    return ["taskset", "-c", str(core % (os.cpu_count() or 1))] if pinned else []


def pack_one_part(src: str, dst: str) -> int:
    subprocess.run([*_on_core(0, PIN), *CLI, src, dst, *OPTIONS], check=True, stdout=subprocess.DEVNULL)
    return _samples(dst)


def pack_parts_by_hand(src: str, dst: str, parts: int, pinned: bool) -> int:
    procs = [subprocess.Popen([*_on_core(i, pinned), *CLI, src, dst, "--part", f"{i}/{parts}", *OPTIONS],
                              stdout=subprocess.DEVNULL)
             for i in range(parts)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"a part failed: exit codes {codes}")
    return _samples(dst)  # the last part merged


def pack_ray(src: str, dst: str, parts: int) -> int:
    from shardstream.executors import pack_with_ray

    manifest, _ = pack_with_ray(src, dst, parts=parts, cpus_per_part=1, progress=False,
                                shard_size=c.SHARD_SIZE)
    return manifest.samples


def _samples(dst: str) -> int:
    import shardstream

    return int(shardstream.open_dataset(dst).counts().sum())


def linked_copies(src: str, copies: int) -> str:
    """A folder holding `copies` hard links to every image of `src`, under distinct names (made once)."""
    if copies == 1:
        return src
    root = f"{src}-x{copies}"
    if os.path.exists(os.path.join(root, ".complete")):
        return root
    c.reset(root)
    for path, key, _ in c.image_files(src):
        folder, name = key.split("/")
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        for k in range(copies):
            os.link(path, os.path.join(root, folder, f"{name}-{k}.jpg"))
    open(os.path.join(root, ".complete"), "w").close()
    return root


def rates_table(title: str, group: list[Contender], baseline: Contender) -> list[dict]:
    print(f"\n{title}")
    print("| contender | median s | img/s | vs one part | runs (s) |")
    print("|---|---:|---:|---:|---|")
    rows = []
    for g in group:
        ratio = g.rate / baseline.rate
        runs = ", ".join(f"{w:.2f}" for w in g.wall)
        print(f"| {g.name} | {g.median:.3f} | {g.rate:,.0f} | {ratio:.2f}x | {runs} |")
        rows.append({"contender": g.name, "runs_s": g.wall, "cpu_s": g.cpu or None, "median_s": g.median,
                     "rate": g.rate, "ratio_vs_one_part": ratio})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4000, help="images in the synthetic folder (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per contender (median reported)")
    p.add_argument("--data", default="~/.cache/shardstream-bench", help="cache folder for images and outputs")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--copies", type=int, default=1, help="hard links per image: a K times larger input")
    p.add_argument("--no-ray", action="store_true", help="leave out the Ray executor")
    p.add_argument("--pin", action="store_true", help="run every part on a core of its own (taskset)")
    args = p.parse_args(argv)
    global PIN
    PIN = args.pin

    data = os.path.expanduser(args.data)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, "
          f"shardstream {info['versions']['shardstream']} ({info['git_commit']})")
    src = linked_copies(ensure_images(data, args.images, 2), args.copies)
    stats = dataset_stats(src)
    n = stats["images"]
    print(f"images: {n} files, {stats['bytes'] / 1e6:,.1f} MB ({src})")
    work = os.path.join(data, f"parts-{n}")
    out_one, out_two, out_ray, out_wds = (os.path.join(work, d) for d in ("one", "two", "ray", "wds"))

    def fresh(path: str):
        return lambda: (c.reset(path), os.sync())

    one = Contender("one part (1 process)", lambda: pack_one_part(src, out_one), prepare=fresh(out_one),
                    after=os.sync)
    two = Contender("2 parts by hand (2 processes, the last merges)",
                    lambda: pack_parts_by_hand(src, out_two, 2, PIN), prepare=fresh(out_two), after=os.sync)
    group = [one, two]
    ray_baseline = two
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray_con = Contender("Ray executor, 2 parts (2 tasks) + merge", lambda: pack_ray(src, out_ray, 2),
                            prepare=fresh(out_ray), after=os.sync)
        if PIN:
            # Ray's tasks are not pinned (`cpus_per_part` is a count it schedules by, not an
            # affinity): their baseline is the parts by hand unpinned too, like with like.
            ray_baseline = Contender("2 parts by hand, unpinned (Ray's baseline)",
                                     lambda: pack_parts_by_hand(src, out_two, 2, False), prepare=fresh(out_two),
                                     after=os.sync)
            group.append(ray_baseline)
        group.append(ray_con)
    group.append(Contender("webdataset.ShardWriter (1 process)", lambda: c.pack_webdataset(src, out_wds),
                           prepare=fresh(out_wds), after=os.sync))

    results: dict = {"date": datetime.date.today().isoformat(),
                     "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                     "machine": info, "dataset": stats, "repeats": args.repeats, "pinned": PIN,
                     "loadavg_before": loadavg()}
    measure("parts", group, args.repeats)
    results["loadavg_after"] = loadavg()
    for g in group:
        assert g.samples == n, f"{g.name} packed {g.samples} samples, expected {n}"
    if not args.no_ray:
        ray_con.cpu = []  # its tasks run in Ray's worker processes, not children this process reaps: not seen
    results["rows"] = rates_table(f"pack zstd in parts, {n} images ({stats['bytes'] / 1e6:,.0f} MB), median of "
                                  f"{args.repeats}", group, one)
    speedup = two.rate / one.rate
    results["targets"] = {"2 parts >= 1.8x one part": {"ratio": speedup, "met": speedup >= 1.8}}
    print(f"\ntarget: 2 parts >= 1.8x one part: {speedup:.2f}x -> {'MET' if speedup >= 1.8 else 'NOT MET'}")
    if not args.no_ray:
        overhead = ray_con.median / ray_baseline.median - 1
        results["targets"]["Ray overhead over parts by hand < 10%"] = {"overhead": overhead, "met": overhead < 0.10,
                                                                       "baseline": ray_baseline.name}
        print(f"target: Ray overhead over parts by hand < 10%: {overhead:+.1%} against {ray_baseline.name} -> "
              f"{'MET' if overhead < 0.10 else 'NOT MET'} (Ray's worker processes are started before the rounds: "
              "they pay no Python start or import, which each part by hand does)")
    print(f"load average before/after: {results['loadavg_before']} / {results['loadavg_after']}")
    print(f"wrote {write_results(args.out or os.path.join(data, f'parts-results-{n}.json'), results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
