"""How well does the stream shuffle? Classes per batch on a class-sorted dataset.

The worst case for a streaming shuffle is data packed in class order (`pack --no-shuffle`
of an ImageFolder): shard order shuffling alone then gives batches from one or two
classes. This script computes, from the plan alone (no data is read: the plan is a pure
function), the mean number of distinct classes in a batch of 64 for several shuffle
buffer sizes, against a uniform random permutation of the same samples.

    python benchmarks/shuffle_quality.py [--classes 100] [--per-class 1000] [--shard 1000]
"""

from __future__ import annotations

import argparse

import numpy as np

from shardstream.plan import Layout, epoch_sequence, split_ranks, worker_plan


def classes_per_batch(labels: np.ndarray, batch: int) -> float:
    n = len(labels) // batch * batch
    return float(np.mean([len(np.unique(b)) for b in labels[:n].reshape(-1, batch)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--per-class", type=int, default=1000)
    parser.add_argument("--shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    total = args.classes * args.per_class
    counts = np.full(total // args.shard, args.shard)
    labels = np.arange(total) // args.per_class  # class-sorted, as --no-shuffle packs it
    uniform = classes_per_batch(labels[np.random.default_rng(0).permutation(total)], args.batch)
    print(f"{args.classes} classes x {args.per_class}, class-sorted shards of {args.shard}, batch {args.batch}, "
          f"{args.workers} worker(s); uniform permutation: {uniform:.1f} classes per batch")
    print("shuffle_buffer | classes per batch | vs uniform")
    for buffer in (0, 1000, 10000, 100000):
        layout = Layout(world_size=1, workers=args.workers, batch_size=args.batch, shuffle=True, buffer=buffer)
        block = split_ranks(epoch_sequence(counts, 0, 0, True), 1, "pad")[0]
        # The loader takes one batch from each worker in turn.
        batches = []
        plans = [worker_plan(block, layout, 0, 0, 0, w) for w in range(args.workers)]
        orders = [mine[perm] for mine, perm in plans]
        for i in range(max(len(o) for o in orders) // args.batch + 1):
            for order in orders:
                part = order[i * args.batch : (i + 1) * args.batch]
                if len(part) == args.batch:
                    batches.append(part)
        value = classes_per_batch(labels[np.concatenate(batches)], args.batch)
        print(f"{buffer:>14} | {value:>17.1f} | {value / uniform:>9.0%}")


if __name__ == "__main__":
    main()
