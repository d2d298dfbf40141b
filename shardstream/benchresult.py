"""What `shardstream bench` measured: a row per worker count, the knee, and their table, curve and JSON.

`BenchRow` is one worker count's measurement; `BenchResult` holds the run's settings
and its rows, and computes the knee from the rows' rates when asked (`find_knee`: the
smallest worker count within a tolerance of the best rate). `bench` makes a result;
the command prints it (`BenchResult.table`), saves it (`save_json`) and plots it
(`BenchResult.plot`, with matplotlib). Nothing here imports torch or the loader.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BenchResult", "BenchRow", "find_knee", "save_json"]


CPU_BOUND = 0.85  # the share of the CPUs busy from which a rate counts as limited by them


def find_knee(rates: dict[int, float], tolerance: float = 0.05) -> int:
    """The smallest worker count whose rate is within `tolerance` of the best rate.

    ``find_knee({0: 100, 1: 190, 2: 380, 4: 390, 8: 385})`` is 2: 380 is within 5% of
    390, and 2 workers cost less memory than 4 or 8. NaN rates are ignored.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), not {tolerance}")
    valid = {int(n): float(r) for n, r in rates.items() if not math.isnan(float(r))}
    if not valid:
        raise ValueError("find_knee needs at least one rate")
    best = max(valid.values())
    return min(n for n, r in valid.items() if r >= (1.0 - tolerance) * best)


@dataclass
class BenchRow:
    """One worker count's measurement."""

    num_workers: int
    images: int  # images delivered in the measured window
    seconds: float  # length of the measured window
    images_per_s: float
    mb_per_s: float | None  # stored bytes (see `BenchResult.bytes_per_sample`); None if unknown
    first_batch_s: float  # from the first request to the first batch
    peak_rss_mb: float | None  # main process + its workers; None where it cannot be measured
    epochs: int  # epochs started (warm-up included)
    cpus_busy: float | None = None  # CPU seconds of the process tree per second of the window
    # The same of every process on the CPUs this one may use (Linux's /proc/stat): where it is
    # near all of them and `cpus_busy` is not, other work held the CPUs.
    machine_busy: float | None = None
    # Pieces the readers waited for with their read-ahead window at its largest (io_stats):
    # storage latency that only a larger `prefetch` (or a cache) would have hidden.
    readahead_waits: int = 0


@dataclass
class BenchResult:
    """What `bench` measured: one row per worker count, and the knee."""

    dataset: str
    batch_size: int
    transform: str
    device: str
    seconds: float
    warmup: float
    samples: int | None  # samples in the dataset (None without a manifest)
    bytes_per_sample: float | None  # mean stored bytes per sample (manifest), None if unknown
    memory: str  # how peak RSS was sampled: "psutil", "/proc" or "unavailable"
    rows: list[BenchRow] = field(default_factory=list)
    decode_threads: int = 0  # decode threads in each iterating process
    prefetch: int | None = None  # each reader's read-ahead in pieces (None: StreamingDataset's default)
    tolerance: float = 0.05
    cpus: int | None = None  # CPUs this process may run on
    # CPUs' worth of time its cgroup allows (Docker's --cpus, a Kubernetes limit); None: no quota.
    cpu_quota: float | None = None

    @property
    def rates(self) -> dict[int, float]:
        """images/s by num_workers."""
        return {row.num_workers: row.images_per_s for row in self.rows}

    @property
    def knee(self) -> int:
        """The smallest num_workers within `tolerance` of the best rate."""
        return find_knee(self.rates, self.tolerance)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable), with the knee."""
        out = asdict(self)
        out["knee"] = self.knee if self.rows else None
        out["best_images_per_s"] = max(self.rates.values()) if self.rows else None
        return out

    def table(self) -> str:
        """The rows as an aligned text table."""
        headers = ("num_workers", "images/sec", "MB/s", "CPUs busy", "first batch s", "peak RSS MB")
        cells = [
            (str(r.num_workers), f"{r.images_per_s:,.1f}", _fmt(r.mb_per_s, "{:,.1f}"), _fmt(r.cpus_busy, "{:.2f}"),
             f"{r.first_batch_s:.2f}", _fmt(r.peak_rss_mb, "{:,.0f}"))
            for r in self.rows
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        lines = [" | ".join(h.rjust(w) for h, w in zip(headers, widths)),
                 "-+-".join("-" * w for w in widths)]
        lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def diagnosis(self) -> str | None:
        """What limits the rate at the knee, from the CPUs it kept busy (None if unmeasured).

        If the CPUs were nearly all busy there, the work per image is the limit. If not,
        and the knee is below the most workers measured (more workers stopped paying),
        something that more processes do not speed up is: storage, the consumer, or the
        device. At the most workers measured, with CPUs to spare, more may still pay."""
        row = next((r for r in self.rows if r.num_workers == self.knee), None) if self.rows else None
        if row is None or row.cpus_busy is None or not self.cpus:
            return None
        # Under a quota the CPUs' time, not their number, bounds the rate; the machine's other
        # processes still share the CPUs themselves.
        usable = min(self.cpus, self.cpu_quota) if self.cpu_quota else self.cpus
        busy = (f"num_workers={row.num_workers} kept {row.cpus_busy:.1f} of {round(usable, 2):g} CPUs busy"
                + (" (the CPU quota of its cgroup)" if usable < self.cpus else ""))
        if row.cpus_busy >= CPU_BOUND * usable:
            levers = "a cheaper transform, pack --max-side" + ("" if "on the device" in self.transform
                                                               else ", the decode on the GPU")
            return f"{busy}: CPU-bound. More workers cannot help; less work per image can ({levers}) or more CPUs."
        others = row.machine_busy - row.cpus_busy if row.machine_busy is not None else 0.0
        if row.machine_busy is not None and row.machine_busy >= CPU_BOUND * self.cpus and others >= 0.5:
            return (f"{busy}, and the machine {row.machine_busy:.1f}: other processes held {others:.1f} CPUs. "
                    "The rate is bounded by the CPUs left to it; measure again on an idle machine.")
        if row.readahead_waits:
            return (f"{busy}: not CPU-bound, and its readers waited {row.readahead_waits} times for pieces with "
                    "their read-ahead window at its largest: storage latency limits the rate. Raise prefetch "
                    "(StreamingDataset(prefetch=...)), or use cache_dir.")
        if row.num_workers == max(r.num_workers for r in self.rows):
            return f"{busy}, and it is the most workers measured: measure more workers, they may still pay."
        return (f"{busy}: not CPU-bound. The limit is elsewhere: storage (raise prefetch, use cache_dir), "
                "the consuming loop, or the device.")

    def __str__(self) -> str:
        knee = f"\nknee: num_workers={self.knee}" if self.rows else ""
        diagnosis = self.diagnosis()
        return self.table() + knee + (f"\n{diagnosis}" if diagnosis else "")

    def plot(self, path: str | os.PathLike) -> None:
        """Write the images/s curve (with the knee marked) as an image; needs matplotlib."""
        try:
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("plotting needs matplotlib: pip install 'shardstream[plot]'") from e
        rows = sorted(self.rows, key=lambda r: r.num_workers)
        xs = [r.num_workers for r in rows]
        ys = [r.images_per_s for r in rows]
        fig = Figure(figsize=(6, 4), dpi=100)
        ax = fig.add_subplot()
        ax.plot(xs, ys, marker="o")
        if rows:
            knee = self.knee
            ax.axvline(knee, color="grey", linestyle="--", linewidth=1)
            ax.plot([knee], [self.rates[knee]], marker="o", markersize=11, fillstyle="none", color="red",
                    label=f"knee: num_workers={knee}")
            ax.legend(loc="best")
        ax.set_xticks(xs)
        ax.set_xlabel("num_workers")
        ax.set_ylabel("images / s")
        ax.set_ylim(0, max(ys, default=1.0) * 1.12 or 1.0)
        where = str(self.dataset).removesuffix("?...").rstrip("/")  # a hidden query string names nothing
        ax.set_title(f"{os.path.basename(where) or self.dataset}: "
                     f"transform={self.transform}, batch {self.batch_size}, {self.device}", fontsize=10)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.fspath(path))


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def save_json(result: BenchResult, path: str | os.PathLike) -> None:
    """Write `result.to_dict()` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2)
        f.write("\n")
