"""What `shardstream bench` measured: a row per worker count and round, the knee, and their table, curve and JSON.

`BenchRow` is one measurement: one worker count in one round. `BenchResult` holds the
run's settings and every row; it sums each count's rounds up (`BenchCount`: the median
of each figure, and the least and most rate of a round) and computes the knee from the
medians when asked (`find_knee`: the smallest worker count within a tolerance of the
best rate). One sample a count was not enough: five identical runs on a shared 2-core
machine gave knees of 1, 2, 2, 4 and 4. `bench` makes a result; the command prints it
(`str`: its tables, and what they mean, from benchadvice.py), saves it (`save_json`)
and plots it (`plot`, with matplotlib). Nothing here imports torch or the loader.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

__all__ = ["BenchCount", "BenchResult", "BenchRow", "find_knee", "save_json"]


CPU_BOUND = 0.85  # the share of the CPUs busy from which a rate counts as limited by them
CROWDED = 0.5  # CPUs' worth of other processes' work in a window, on a machine CPU_BOUND busy, that disturbed it
# The epochs a measurement's window held from which its rate counts their starts (a plan, the first
# reads, workers refilled) as much as steady streaming: 400 small images made 5 a 2 s window, and
# 1,600 of the same 1 or 2. In epochs, not seconds: the time from an epoch's last batch to the next
# one's first (`BenchRow.restart_s`) holds the batches workers made meanwhile, which then come at
# once, and read as up to 62% of a window at 4 workers where the rate per busy CPU lost 5-10%.
SHORT_EPOCHS = 4


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
    """One measurement: one worker count, in one round."""

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
    # Seconds of the window from an epoch's last batch to the next one's first, beyond a batch's
    # usual interval: the pipeline drained and filled again, shards opened, the shuffle buffer refilled.
    # With workers it also holds the batches they made meanwhile, so it reads high (SHORT_EPOCHS):
    # kept in the JSON, not judged by.
    restart_s: float = 0.0
    # The dataset's storage counters over the window (`StreamingDataset.io_stats`): requests,
    # bytes, retries, `wait_s` (summed over the reading threads: it can exceed the window),
    # `readahead_waits` (pieces waited for with the read-ahead window at its largest: storage
    # latency that only a larger `prefetch`, or a cache, would have hidden), cache hits, ...
    io: dict[str, float] = field(default_factory=dict)
    round: int = 1  # the round that measured it, from 1


@dataclass
class BenchCount:
    """One worker count over the rounds that measured it: each figure the median of theirs."""

    num_workers: int
    rounds: int
    images_per_s: float
    low: float  # the least rate of a round
    high: float  # the most
    mb_per_s: float | None
    first_batch_s: float
    peak_rss_mb: float | None  # the most of any round: memory is a limit to stay under, not a rate
    epochs: int  # the most a round started
    cpus_busy: float | None
    machine_busy: float | None
    io: dict[str, float]  # each counter the median of the rounds'
    retries: int  # over every round: a median would hide the one round whose requests failed

    @classmethod
    def of(cls, rows: Sequence[BenchRow]) -> "BenchCount":
        rates = [r.images_per_s for r in rows]
        return cls(
            num_workers=rows[0].num_workers, rounds=len(rows), images_per_s=statistics.median(rates),
            low=min(rates), high=max(rates), mb_per_s=_median([r.mb_per_s for r in rows]),
            first_batch_s=statistics.median(r.first_batch_s for r in rows),
            peak_rss_mb=None if any(r.peak_rss_mb is None for r in rows) else max(r.peak_rss_mb for r in rows),
            epochs=max(r.epochs for r in rows), cpus_busy=_median([r.cpus_busy for r in rows]),
            machine_busy=_median([r.machine_busy for r in rows]),
            io={name: statistics.median(r.io.get(name, 0) for r in rows) for name in _keys(r.io for r in rows)},
            retries=int(sum(r.io.get("retries", 0) for r in rows)),
        )


@dataclass
class BenchResult:
    """What `bench` measured: every round's row for each worker count, and the knee of their medians."""

    dataset: str
    batch_size: int
    transform: str
    device: str
    seconds: float  # a round's measured window for each count
    warmup: float
    samples: int | None  # samples in the dataset (None without a manifest)
    bytes_per_sample: float | None  # mean stored bytes per sample (manifest), None if unknown
    memory: str  # how peak RSS was sampled: "psutil", "/proc" or "unavailable"
    rows: list[BenchRow] = field(default_factory=list)  # in the order measured
    decode_threads: int = 0  # decode threads in each iterating process
    prefetch: int | None = None  # each reader's read-ahead in pieces (None: StreamingDataset's default)
    tolerance: float = 0.05
    cpus: int | None = None  # CPUs this process may run on
    # CPUs' worth of time its cgroup allows (Docker's --cpus, a Kubernetes limit); None: no quota.
    cpu_quota: float | None = None
    rounds: int = 1  # rounds planned: each measures every count once
    workers: list[int] = field(default_factory=list)  # the counts planned (empty: those of the rows)
    # Whether every shard is on a local file system (`Source.local`): no request latency, so no
    # read-ahead or cache to advise. None: not known.
    local: bool | None = None
    cache_dir: str | None = None  # StreamingDataset's cache_dir (remote shards only)
    partial: bool = False  # stopped (Ctrl-C, SIGTERM) before every round had measured every count

    @property
    def counts(self) -> list[BenchCount]:
        """Each worker count's rounds summed up, in the order first measured."""
        by_count: dict[int, list[BenchRow]] = {}
        for row in self.rows:
            by_count.setdefault(row.num_workers, []).append(row)
        return [BenchCount.of(rows) for rows in by_count.values()]

    @property
    def rates(self) -> dict[int, float]:
        """images/s by num_workers: the median of its rounds."""
        return {count.num_workers: count.images_per_s for count in self.counts}

    @property
    def knee(self) -> int:
        """The smallest num_workers whose median is within `tolerance` of the best median."""
        return find_knee(self.rates, self.tolerance)

    def others_busy(self, machine_busy: float | None, cpus_busy: float | None) -> float | None:
        """CPUs other processes kept busy in a window, where they disturbed it (the machine's
        CPUs CPU_BOUND busy, CROWDED of it theirs); None where they did not, or unmeasured."""
        if machine_busy is None or cpus_busy is None or not self.cpus:
            return None
        others = round(round(machine_busy, 2) - round(cpus_busy, 2), 2)  # as the two figures are printed
        return others if round(machine_busy, 2) >= CPU_BOUND * self.cpus - 1e-9 and others >= CROWDED else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable): every row, each count's medians, and the knee."""
        out = asdict(self)
        for row, data in zip(self.rows, out["rows"]):
            data["disturbed_by"] = self.others_busy(row.machine_busy, row.cpus_busy)
        out["counts"] = [asdict(count) for count in self.counts]
        out["knee"] = self.knee if self.rows else None
        out["best_images_per_s"] = max(self.rates.values()) if self.rows else None
        return out

    def table(self) -> str:
        """A row a worker count, as an aligned text table (with rounds: medians, and the rates' range)."""
        spread = self.rounds > 1
        headers = ("num_workers", "images/sec", *(("min-max",) if spread else ()), "MB/s", "CPUs busy",
                   "first batch s", "peak RSS MB")
        cells = [
            (str(c.num_workers), f"{c.images_per_s:,.1f}", *((f"{c.low:,.0f}-{c.high:,.0f}",) if spread else ()),
             _fmt(c.mb_per_s, "{:,.1f}"), _fmt(c.cpus_busy, "{:.2f}"), f"{c.first_batch_s:.2f}",
             _fmt(c.peak_rss_mb, "{:,.0f}"))
            for c in self.counts
        ]
        return _aligned(headers, cells)

    def legend(self) -> str | None:
        """What the table's figures are, where they sum rounds up."""
        if self.rounds == 1:
            return None
        rounds = f"the rounds measured ({self.rounds} planned)" if self.partial else f"{self.rounds} rounds"
        return (f"each figure the median of {rounds} (the counts' order reversed every other round), "
                "min-max the range of the rates; peak RSS the most of any round")

    def io_table(self) -> str | None:
        """Each count's storage counters (a round's median), for a dataset not on a local file system."""
        if self.local is not False or not self.rows:
            return None
        cached = self.cache_dir is not None
        headers = ("num_workers", "requests", "MB read", "MB from store", "retries", "read-ahead waits",
                   "wait s (all threads)", *(("cache hits", "cache misses") if cached else ()))
        cells = [
            (str(c.num_workers), f"{c.io.get('requests', 0):,.0f}", f"{c.io.get('bytes', 0) / 1e6:,.1f}",
             f"{c.io.get('remote_bytes', 0) / 1e6:,.1f}",
             f"{c.retries:,}", f"{c.io.get('readahead_waits', 0):,.0f}", f"{c.io.get('wait_s', 0):,.2f}",
             *((f"{c.io.get('cache_hits', 0):,.0f}", f"{c.io.get('cache_misses', 0):,.0f}") if cached else ()))
            for c in self.counts
        ]
        return _aligned(headers, cells) + (
            "\nstorage: a round's median (retries: every round's); MB read counts cached copies' reads too, MB "
            "from store the remote store's alone; wait s sums the time each reading thread spent in storage "
            "calls, so it exceeds the window where several read at once")

    def diagnosis(self) -> str | None:
        """What limits the rate at the knee (benchadvice.py), or None where unmeasured."""
        from .benchadvice import diagnosis

        return diagnosis(self)

    @property
    def usable_cpus(self) -> float:
        """The CPUs whose time the bench could use: the affinity's, or the cgroup's quota where less."""
        cpus = float(self.cpus or 0)
        return min(cpus, self.cpu_quota) if self.cpu_quota else cpus

    def notes(self) -> list[str]:
        """What else the reader of the table should know, a line each (benchadvice.py)."""
        from .benchadvice import notes

        return notes(self)

    def __str__(self) -> str:
        """The report `shardstream bench` prints: tables, legend, knee, diagnosis and notes."""
        in_process = ("num_workers=0 ran in this process with torch.set_num_threads(1), as DataLoader workers run"
                      if 0 in self.rates else None)
        knee = None
        if self.rows:
            knee = (f"knee: num_workers={self.knee}"
                    + (f" (with {self.decode_threads} decode threads per process)" if self.decode_threads else "")
                    + (" (of what was measured)" if self.partial else ""))
        lines = [self.table(), self.io_table(), self.legend(), in_process, knee, self.diagnosis(), *self.notes()]
        return "\n".join(line for line in lines if line)

    def plot(self, path: str | os.PathLike) -> None:
        """Write the images/s curve (medians, each round's range as a bar; the knee marked) as an
        image; needs matplotlib."""
        try:
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("plotting needs matplotlib: pip install 'shardstream[plot]'") from e
        counts = sorted(self.counts, key=lambda c: c.num_workers)
        xs = [c.num_workers for c in counts]
        ys = [c.images_per_s for c in counts]
        fig = Figure(figsize=(6, 4), dpi=100)
        ax = fig.add_subplot()
        ax.errorbar(xs, ys, yerr=[[c.images_per_s - c.low for c in counts], [c.high - c.images_per_s for c in counts]],
                    marker="o", capsize=3)
        if counts:
            knee = self.knee
            ax.axvline(knee, color="grey", linestyle="--", linewidth=1)
            ax.plot([knee], [self.rates[knee]], marker="o", markersize=11, fillstyle="none", color="red",
                    label=f"knee: num_workers={knee}")
            ax.legend(loc="best")
        ax.set_xticks(xs)
        ax.set_xlabel("num_workers")
        ax.set_ylabel("images / s" + (f" (median of {self.rounds} rounds)" if self.rounds > 1 else ""))
        ax.set_ylim(0, max((c.high for c in counts), default=1.0) * 1.12 or 1.0)
        ax.set_title(self.title(), fontsize=10)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.fspath(path))

    def title(self) -> str:
        """The plot's title: the dataset and what was measured with it."""
        where = str(self.dataset).removesuffix("?...").rstrip("/")  # a hidden query string names nothing
        settings = [f"transform={self.transform}", f"batch {self.batch_size}", self.device]
        if self.decode_threads:
            settings.append(f"{self.decode_threads} decode threads")
        if self.prefetch is not None:
            settings.append(f"prefetch {self.prefetch}")
        return f"{os.path.basename(where) or self.dataset}: {', '.join(settings)}"


def _keys(dicts: Any) -> list[str]:
    """The keys of `dicts`, each once, in the order first seen."""
    return list(dict.fromkeys(key for d in dicts for key in d))


def _median(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]


def plural_s(n: int) -> str:
    return "" if n == 1 else "s"


def listed(values: Sequence[int]) -> str:
    return ", ".join(map(str, values))


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def _aligned(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = [" | ".join(h.rjust(w) for h, w in zip(headers, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def save_json(result: BenchResult, path: str | os.PathLike) -> None:
    """Write `result.to_dict()` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2)
        f.write("\n")
