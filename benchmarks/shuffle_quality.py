"""How well does the stream shuffle? Classes per batch, and one epoch's order against the next.

The worst case for a streaming shuffle is data packed in class order (`pack --no-shuffle`
of an ImageFolder): shard order shuffling alone then gives batches from one or two
classes. This script computes, from the plan alone (no data is read: the plan is a pure
function), the mean number of distinct classes in a batch of 64 for several shuffle
buffer sizes, against a uniform random permutation of the same samples.

`--epochs` measures instead how much of an epoch's order the next one repeats, for
datasets of few shards (where each shard is one run of the file order): the Spearman
correlation of a sample's places in consecutive epochs (its size: +0.5 and -0.5 are
alike repeats of a shard order), and how much more often a
sample in the first quarter of its shard comes in an epoch's first tenth than one in
the last quarter, with each shard read whole and cut into blocks (`plan.shuffle_block`).

    python benchmarks/shuffle_quality.py [--classes 100] [--per-class 1000] [--shard 1000] [--workers 4] [--run 1]
    python benchmarks/shuffle_quality.py --epochs [--samples 20000] [--samples-per-frame 9] [--sample-bytes 114000]
"""

from __future__ import annotations

import argparse

import numpy as np

from shardstream.plan import Layout, deal_run, epoch_sequence, shuffle_block, split_ranks, worker_plan


def classes_per_batch(labels: np.ndarray, batch: int) -> float:
    n = len(labels) // batch * batch
    return float(np.mean([len(np.unique(b)) for b in labels[:n].reshape(-1, batch)]))


def layout_of(args: argparse.Namespace, buffer: int) -> Layout:
    """The layout a shuffled StreamingDataset reads with: its workers dealt runs of chunks
    (`plan.deal_run`) from the frames' and samples' sizes, unless `--run` says otherwise."""
    run = args.run or (deal_run(args.batch, args.samples_per_frame, args.sample_bytes) if args.workers > 1 else 1)
    return Layout(world_size=1, workers=args.workers, batch_size=args.batch, shuffle=True, buffer=buffer, run=run)


def delivered(counts: np.ndarray, epoch: int, block: int, layout: Layout) -> np.ndarray:
    """The sample ids a loader hands over in `epoch`: one batch from each worker in turn."""
    workers, batch = layout.workers, layout.chunk
    sequence = epoch_sequence(counts, 0, epoch, True, block=block)
    orders = [mine[perm] for mine, perm in (worker_plan(sequence, layout, 0, epoch, 0, w) for w in range(workers))]
    batches = [o[i : i + batch] for i in range(0, max(map(len, orders)), batch) for o in orders]
    return np.concatenate([b for b in batches if len(b)])


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two permutations' places (places are ranks already)."""
    return float(np.corrcoef(a, b)[0, 1])


def epochs_table(args: argparse.Namespace) -> None:
    n, epochs = args.samples, 17
    layout = layout_of(args, args.buffer)
    print(f"{n} samples, {args.workers} worker(s) dealt runs of {layout.run} chunk(s), batch {args.batch}, buffer {args.buffer}, "
          f"{args.samples_per_frame} samples a frame, {args.sample_bytes} bytes a sample; {epochs} epochs (mean over the {epochs - 1} pairs)")
    print("shards | block | |Spearman| mean (largest), whole shards | cut | first quarter early, whole | cut")
    for shards in (1, 2, 4, 10, 64, 256):
        counts = np.full(shards, n // shards)
        total = int(counts.sum())
        block = shuffle_block(counts, args.samples_per_frame, args.sample_bytes)
        cells = []
        for cut in (0, block):
            places = []
            for epoch in range(epochs):
                place = np.empty(total, dtype=np.int64)
                place[delivered(counts, epoch, cut, layout)] = np.arange(total)
                places.append(place)
            rhos = np.abs([spearman(a, b) for a, b in zip(places, places[1:])])
            rho = (float(np.mean(rhos)), float(np.max(rhos)))
            # Each shard's first and last quarter of its file order.
            where = np.arange(total) % (total // shards)
            first, last = where < total // shards // 4, where >= total // shards * 3 // 4
            early = [np.mean([np.mean(p[part] < total // 10) for p in places]) for part in (first, last)]
            cells.append((rho, early[0] / early[1] if early[1] else float("inf")))
        (whole, whole_max), (cut, cut_max) = cells[0][0], cells[1][0]
        print(f"{shards:>6} | {block:>5} | {whole:.2f} ({whole_max:.2f}) | {cut:.2f} ({cut_max:.2f}) | "
              f"{cells[0][1]:.2f} | {cells[1][1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--per-class", type=int, default=1000)
    parser.add_argument("--shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--epochs", action="store_true", help="one epoch's order against the next, few shards")
    parser.add_argument("--samples", type=int, default=20_000, help="with --epochs: the dataset's samples")
    parser.add_argument("--samples-per-frame", type=int, default=9, help="ImageNet's JPEGs: about 9")
    parser.add_argument("--buffer", type=int, default=2048, help="with --epochs: the shuffle buffer")
    parser.add_argument("--sample-bytes", type=int, default=114_000, help="stored bytes a sample")
    parser.add_argument("--run", type=int, default=0,
                        help="chunks dealt to a worker at a time (default: as the dataset deals them; 1: one at a time)")
    args = parser.parse_args()
    if args.epochs:
        epochs_table(args)
        return

    total = args.classes * args.per_class
    counts = np.full(total // args.shard, args.shard)
    labels = np.arange(total) // args.per_class  # class-sorted, as --no-shuffle packs it
    uniform = classes_per_batch(labels[np.random.default_rng(0).permutation(total)], args.batch)
    print(f"{args.classes} classes x {args.per_class}, class-sorted shards of {args.shard}, batch {args.batch}, "
          f"{args.workers} worker(s) dealt runs of {layout_of(args, 0).run} chunk(s); uniform permutation: {uniform:.1f} classes per batch")
    print("shuffle_buffer | classes per batch | vs uniform")
    for buffer in (0, 1000, 10000, 100000):
        layout = layout_of(args, buffer)
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
