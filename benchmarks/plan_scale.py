"""What planning one rank's share of an epoch costs each DataLoader worker, by kind of epoch.

Every DataLoader worker of every rank plans its rank's block of the epoch before its first
sample (and again each epoch). This script times that block, for one rank in the middle,
through the functions the dataset runs (`EpochSequences.stretch` calls them), with the
data's shape made up (no shard is read):

* plain: every sample once (`plan.epoch_block`);
* sized: `Sampling(samples_per_epoch=N)`, an epoch that is a window of passes (`PassStream`);
* mix: two sources 70/30 (`sampling.mixed_draws`);
* weighted: class-balanced draws over 1,000 classes (`sampling.WeightedDraws`), its draw
  table (the weights' running sum, made once a process) timed apart.

It prints the median of the runs and the peak of numpy's memory (tracemalloc) per block.

    python benchmarks/plan_scale.py [--samples 10000000] [--shards 5000 100000] [--world 1 8 64 512]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from typing import Callable

import numpy as np

from shardstream.plan import epoch_block, epoch_units, rank_stretches
from shardstream.sampling import (PassStream, WeightedDraws, class_sample_weights, draw_table, mixed_draws)


def measured(work: Callable[[], object], runs: int) -> tuple[float, float]:
    """(median seconds, peak MB of the first run) of `work`."""
    times = []
    tracemalloc.start()
    for run in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
        if run == 0:
            peak = tracemalloc.get_traced_memory()[1] / 1e6
            tracemalloc.stop()  # the later runs untraced, timed without its cost
    return statistics.median(times), peak


def blocks(samples: int, shards: int, world: int) -> dict[str, Callable[[], object]]:
    counts = np.full(shards, samples // shards, dtype=np.int64)
    counts[: samples - int(counts.sum())] += 1
    rank, epoch = world // 2, 1
    stretches = rank_stretches(samples, world, rank, "pad")
    sized = PassStream(counts, 0, True)
    half = shards * 7 // 10
    parts = [PassStream(counts[:half], 0, True, salt=0), PassStream(counts[half:], 0, True, salt=1 << 20,
                                                                   offset=int(counts[:half].sum()))]
    labels = np.random.default_rng(0).integers(0, 1000, samples)
    units, order = epoch_units(counts, 0, epoch, True)
    table = draw_table(units, class_sample_weights(labels, "balanced"))

    def joined(piece: Callable[[int, int], np.ndarray]) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype=np.int64)] + [piece(a, b) for a, b in stretches])

    def weighted() -> np.ndarray:
        draws = WeightedDraws(units, order, *table, 0, epoch, samples)
        return joined(lambda a, b: draws.draws(a, b, samples))

    return {
        "plain": lambda: epoch_block(counts, 0, epoch, True, world, rank, "pad"),
        "sized": lambda: joined(lambda a, b: sized.draws(epoch * samples + a, epoch * samples + b, epoch * samples,
                                                         samples)),
        "mix": lambda: joined(lambda a, b: mixed_draws(parts, [0.7, 0.3], epoch * samples, epoch * samples + a,
                                                       epoch * samples + b, samples)),
        "weighted": weighted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--shards", type=int, nargs="+", default=[5000, 100_000])
    parser.add_argument("--world", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for shards in args.shards:
        counts = np.full(shards, args.samples // shards)
        labels = np.random.default_rng(0).integers(0, 1000, args.samples)
        units, _ = epoch_units(counts, 0, 1, True)
        seconds, peak = measured(lambda: draw_table(units, class_sample_weights(labels, "balanced")), args.runs)
        print(f"{args.samples:,} samples, {shards:,} shards: weighted draw table (once a process) "
              f"{seconds:.3f} s, peak {peak:.0f} MB")
        print(f"{'world':>7} {'kind':>9} {'block':>10} {'median s':>9} {'peak MB':>8}")
        for world in args.world:
            for kind, work in blocks(args.samples, shards, world).items():
                seconds, peak = measured(work, args.runs)
                print(f"{world:>7} {kind:>9} {-(-args.samples // world):>10,} {seconds:>9.3f} {peak:>8.0f}")


if __name__ == "__main__":
    main()
