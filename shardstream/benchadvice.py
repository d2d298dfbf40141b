"""What `shardstream bench`'s numbers mean: the limit at the knee, and what else to know.

`diagnosis` reads the knee's row: the CPUs it kept busy against those it could use (a
cgroup's quota included), other processes' load, storage waits; and names the levers
that can help there (less work per image, more workers, prefetch, a cache for remote
shards). `notes` says what the table alone does not: a run stopped early, a single
count, measurements other processes disturbed, rows that timed epochs restarting more
than streaming, requests the store failed. Text only: the numbers are `BenchResult`'s
(benchresult.py), and nothing here measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .benchresult import CPU_BOUND, CROWDED, SHORT_EPOCHS, listed, plural_s

if TYPE_CHECKING:
    from .benchresult import BenchCount, BenchResult

__all__ = ["diagnosis", "notes"]


def diagnosis(result: BenchResult) -> str | None:
    """What limits the rate at the knee, from the CPUs it kept busy (None if unmeasured).

    If the CPUs were nearly all busy there, the work per image is the limit. If not,
    and the knee is below the most workers measured (more workers stopped paying),
    something that more processes do not speed up is: the consumer or the device, and
    for remote shards storage latency. At the most workers measured, with CPUs to
    spare, more may still pay."""
    count = next((c for c in result.counts if c.num_workers == result.knee), None) if result.rows else None
    if count is None or count.cpus_busy is None or not result.cpus:
        return None
    if result.samples is not None and result.samples < result.batch_size * max(1, count.num_workers):
        # Each row restarted epochs (a note says so): no steady rate to say what limits.
        return (f"num_workers={count.num_workers}: the dataset's {result.samples} samples are fewer than a batch "
                "for each worker, so the rate is of epochs ending and starting: measure a larger dataset to "
                "find what limits a steady one")
    # Under a quota the CPUs' time, not their number, bounds the rate; the machine's other
    # processes still share the CPUs themselves.
    usable = result.usable_cpus
    # Judged on the figure printed: at 1.66 of 2, "1.7 of 2 CPUs busy: not CPU-bound" read as a
    # contradiction of the 85% said.
    kept = round(count.cpus_busy, 2)
    busy = (f"num_workers={count.num_workers} kept {kept:.2f} of {round(usable, 2):g} CPUs busy"
            + (" (the CPU quota of its cgroup)" if usable < result.cpus else ""))
    if kept >= CPU_BOUND * usable - 1e-9:
        levers = "a cheaper transform, pack --max-side" + ("" if "on the device" in result.transform
                                                           else ", the decode on the GPU")
        return f"{busy}: CPU-bound. More workers cannot help; less work per image can ({levers}) or more CPUs."
    others = result.others_busy(count.machine_busy, count.cpus_busy)
    if others is not None:
        return (f"{busy}, and the machine {count.machine_busy:.2f}: other processes held {others:.2f} CPUs. "
                "The rate is bounded by the CPUs left to it; measure again on an idle machine.")
    if count.io.get("readahead_waits"):
        return (f"{busy}: not CPU-bound, and its readers waited {count.io['readahead_waits']:g} times for pieces "
                "with their read-ahead window at its largest: storage latency limits the rate. Raise prefetch "
                "(StreamingDataset(prefetch=...))" + (", or use cache_dir." if _cache_helps(result) else "."))
    most = max(c.num_workers for c in result.counts)
    if count.num_workers == 0 and CPU_BOUND - 1e-9 <= kept < ONE_THREAD_BUSY:
        return _one_process_bound(result, busy, most)
    if count.num_workers == most and most <= usable:
        # One count measured too: one process busy on one CPU of several is limited by being one.
        return f"{busy}, and it is the most workers measured: measure more workers, they may still pay."
    if result.local:  # no requests to wait on: read-ahead and the cache (remote shards only) cannot help
        handover = (", or handing batches over from the workers (raw bytes are pickled through a pipe)"
                    if result.transform == "none" and count.num_workers > 0 else "")
        return (f"{busy}: not CPU-bound, and its shards are local (no request latency for prefetch or a "
                f"cache to hide). The limit is elsewhere: the consuming loop, or the device{handover}.")
    storage = "raise prefetch, use cache_dir" if _cache_helps(result) else "raise prefetch"
    return (f"{busy}: not CPU-bound. The limit is elsewhere: storage ({storage}), the consuming loop, or "
            "the device.")

# num_workers=0 runs the loop, the decode and the collate in one Python thread (torch held to
# one thread): about one CPU busy there is that thread's limit. Past this, the process's
# threads that work without the GIL (reading, decode_threads) did much of it: not one thread's.
ONE_THREAD_BUSY = 1.5


def _one_process_bound(result: BenchResult, busy: str, most: int) -> str:
    """The diagnosis where num_workers=0 (the knee) kept about one CPU busy: what the one
    Python thread that loops, decodes and collates there can use, however many CPUs the
    machine has."""
    said = (f"{busy}: about all that the training process's one thread (the loop's, decoding and collating there "
            "too) can use, so the work per image there is the limit")
    if most == 0:
        return f"{said}. Measure workers (--workers 0,1,2), which take that work off the loop."
    handover = " (raw bytes are pickled through a pipe)" if result.transform == "none" else ""
    alone = result.rates.get(0, 0.0)
    if all(rate < alone for n, rate in result.rates.items() if n > 0):
        return (f"{said}. The workers measured did worse: handing each batch over from a worker{handover} costs "
                "more than the work it takes off the loop.")
    return (f"{said}. The workers measured did no better by more than {result.tolerance:.0%} (the knee's "
            f"tolerance): handing each batch over from a worker{handover} costs about what it takes off the loop.")


def _cache_helps(result: BenchResult) -> bool:
    """Whether cache_dir is advice worth giving: remote shards, read without one."""
    return not result.local and result.cache_dir is None

def notes(result: BenchResult) -> list[str]:
    """What else the reader of the table should know, a line each: a stop before the end, a
    single count, disturbed measurements, rows that measured epoch restarts, requests the
    store failed."""
    counts, notes = result.counts, []
    if result.partial:
        planned = result.workers or [c.num_workers for c in counts]
        missing = [n for n in planned if n not in result.rates]
        notes.append(f"partial: stopped after {len(result.rows)} of the {len(planned) * result.rounds} measurements "
                     f"planned ({result.rounds} round{plural_s(result.rounds)} of {len(planned)} "
                     f"count{plural_s(len(planned))})"
                     + (f"; num_workers={listed(missing)} not measured" if missing else ""))
    if len(counts) == 1 and len(set(result.workers or ())) <= 1:  # a partial run says what it left out
        notes.append("one worker count measured: there is no curve to find a knee on; measure several "
                     "(--workers 0,1,2,4)")
    notes += _disturbed_notes(result)
    notes += _epoch_notes(result, counts)
    retried = [c for c in counts if c.retries]
    if retried:
        notes.append("the store failed requests, and they were retried: "
                     + ", ".join(f"{c.retries} at num_workers={c.num_workers}" for c in retried)
                     + " (over every round); those rates include the waits before each retry")
    waited = [c for c in counts if c.io.get("readahead_waits")]
    if waited and result.io_table() is None:  # else that table shows them
        notes.append("readers waited for pieces with their read-ahead window at its largest (a round's median): "
                     + ", ".join(f"{c.io['readahead_waits']:g} at num_workers={c.num_workers}" for c in waited)
                     + "; --prefetch N measures with more")
    if result.cache_dir is not None and result.local:
        notes.append(f"cache_dir {result.cache_dir} keeps remote shards only: these local ones were read in place")
    return notes


def _disturbed_notes(result: BenchResult) -> list[str]:
    """The counts, and rounds, whose windows other processes disturbed: every row is checked,
    as one disturbed below the knee reads low and moves the knee up."""
    rounds: dict[int, list[int]] = {c.num_workers: [] for c in result.counts}  # in the table's order
    for row in result.rows:
        if result.others_busy(row.machine_busy, row.cpus_busy) is not None:
            rounds.setdefault(row.num_workers, []).append(row.round)
    rounds = {n: sorted(r) for n, r in rounds.items() if r}
    if not rounds:
        return []
    which = ", ".join(f"num_workers={n}" + (f" (round{plural_s(len(r))} {listed(r)})" if result.rounds > 1 else "")
                      for n, r in rounds.items())
    below = [n for n in rounds if n < result.knee]
    return [f"other processes held {CROWDED:g} CPUs or more, on a machine {CPU_BOUND:.0%} busy or more, while "
            f"these were measured: {which}. Their rates may read low"
            + (f"; below the knee (num_workers={listed(below)}) that can move the knee up" if below else "")
            + ": measure again on an idle machine."]

def _epoch_notes(result: BenchResult, counts: list[BenchCount]) -> list[str]:
    """Counts whose rows measured epochs ending and starting as much as steady streaming."""
    small = ([c.num_workers for c in counts if result.samples < result.batch_size * max(1, c.num_workers)]
             if result.samples is not None else [])
    # Counted in epochs a window held, not in time: the gap from an epoch's last batch to the next
    # one's first also holds the batches workers made meanwhile, which then come at once (a review
    # read "62% of the window" at 4 workers, where the rate per busy CPU lost 5-10%).
    short = {c.num_workers: c.epochs for c in counts if c.num_workers not in small and c.epochs >= SHORT_EPOCHS}
    notes = []
    if small:
        notes.append(f"the dataset's {result.samples} samples are fewer than a batch of {result.batch_size} for "
                     f"each worker at num_workers={listed(small)}: those rows measure epochs ending and "
                     "starting, not steady streaming; measure a larger dataset (or a smaller --batch-size)")
    if short:
        which = ", ".join(f"{e} at num_workers={n}" for n, e in short.items())
        notes.append(f"epochs are short: a measurement's window held up to {which} of them, each one's start (its "
                     "plan, its first reads) counted in the rate; measure a larger dataset for the steady rate")
    return notes
