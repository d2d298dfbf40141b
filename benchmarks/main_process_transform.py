"""What a transform of the user's costs beyond itself when the loop iterates in its own process.

Where the user's code prepares samples (a `transform`), Python's and numpy's global
generators are seeded per sample, and in the training loop's own process
(`num_workers=0`) the loop's states are saved and put back around every item the
dataset hands over (prepare.py `keeping_callers_generators`): once a sample unbatched,
once a batch where the dataset batches. This times one epoch of small samples (no
images: the cost measured is the seeding and the state juggling, not a decode) in four
ways, taking turns round by round, and prints the medians and the ratios:

* `none`: no transform (nothing seeded), batched in the dataset: the floor;
* `transform, batched`: a no-op transform, batches of `--batch` made in the dataset;
* `transform, unbatched`: the same transform, one sample an item;
* `transform, torch batches`: unbatched, batched by torch's DataLoader(num_workers=0).

    python benchmarks/main_process_transform.py [--samples 4000] [--batch 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any, Callable

import torch.utils.data

import shardstream


def no_op(sample: dict[str, Any]) -> dict[str, Any]:
    return sample


def contenders(folder: str, batch: int) -> dict[str, Callable[[], int]]:
    def dataset(**options: Any) -> shardstream.StreamingDataset:
        return shardstream.StreamingDataset(folder, decode=None, shuffle=True, seed=0, **options)

    def count(items: Any) -> int:
        return sum(1 for _ in items)

    return {
        "none": lambda: count(dataset(batch_size=batch, collate_fn=list)),
        "transform, batched": lambda: count(dataset(transform=no_op, batch_size=batch, collate_fn=list)),
        "transform, unbatched": lambda: count(dataset(transform=no_op)),
        "transform, torch batches": lambda: count(torch.utils.data.DataLoader(
            dataset(transform=no_op), batch_size=batch, num_workers=0, collate_fn=list)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        with shardstream.ShardWriter(folder, max_samples=500) as writer:
            for i in range(args.samples):
                writer.write({"__key__": f"{i:07d}", "txt": "x" * 100, "cls": i % 10})
        runs = contenders(folder, args.batch)
        for run in runs.values():  # warm-up: imports, page cache
            run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    floor = medians["none"]
    print(f"{args.samples} samples, {args.repeats} rounds, medians (us a sample; beyond 'none')")
    results = {}
    for name, median in medians.items():
        per_sample = median / args.samples * 1e6
        beyond = (median - floor) / args.samples * 1e6
        results[name] = {"median_s": median, "us_per_sample": per_sample, "us_beyond_none": beyond,
                         "rounds_s": times[name]}
        print(f"  {name:26s} {per_sample:7.1f} us   +{beyond:6.1f} us   {median / floor:5.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"samples": args.samples, "batch": args.batch, "repeats": args.repeats, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
