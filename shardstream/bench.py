"""`shardstream bench`: measure the loader's throughput per `num_workers`, and find the knee.

How many DataLoader workers a job needs depends on the machine, the storage, the
images and the transform, so it is measured, not guessed. For each worker count,
`bench` runs the real path (`StreamingDataset` -> `shardstream.DataLoader`) with the
transform a training (or validation) job would use, discards a warm-up, then counts
images for a fixed time, looping over epochs (`set_epoch`) if the dataset is small:

* **images/s** delivered to the consumer, and **MB/s** of stored (shard) bytes that
  this means: images times the manifest's mean stored bytes per sample;
* **time to the first batch** (worker start, shard opening, shuffle buffer, decode);
* **peak RSS** of the main process plus the worker processes it started, sampled every
  50 ms in a thread (with psutil if installed, else from ``/proc``), except while the
  workers are being forked (until the first batch). RSS counts pages shared by forked
  workers once per process, so the sum overstates what they use together.

The 0-worker run iterates in this process with ``torch.set_num_threads(1)``, as
DataLoader workers do (and as README advises beside decode threads).

The **knee** is the smallest worker count whose rate is within 5% of the best rate
(`find_knee`): more workers than that buy nothing but memory.

Use ``shardstream bench DATASET --workers 0,1,2,4,8`` or `bench` from Python.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from .errors import ShardstreamError

__all__ = ["BenchResult", "BenchRow", "bench", "find_knee", "peak_memory_method", "TRANSFORMS"]

TRANSFORMS = ("train", "val", "none")
IMAGE_FIELD = "jpg;png;webp"
SAMPLE_INTERVAL_S = 0.05
_MB = 1e6


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
    tolerance: float = 0.05

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
        headers = ("num_workers", "images/sec", "MB/s", "first batch s", "peak RSS MB")
        cells = [
            (str(r.num_workers), f"{r.images_per_s:,.1f}", _fmt(r.mb_per_s, "{:,.1f}"),
             f"{r.first_batch_s:.2f}", _fmt(r.peak_rss_mb, "{:,.0f}"))
            for r in self.rows
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        lines = [" | ".join(h.rjust(w) for h, w in zip(headers, widths)),
                 "-+-".join("-" * w for w in widths)]
        lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def __str__(self) -> str:
        knee = f"\nknee: num_workers={self.knee}" if self.rows else ""
        return self.table() + knee

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
        ax.set_title(f"{os.path.basename(str(self.dataset).rstrip('/')) or self.dataset}: "
                     f"transform={self.transform}, batch {self.batch_size}, {self.device}", fontsize=10)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.fspath(path))


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


# -- memory: RSS of this process and the processes it started ---------------------------------


def peak_memory_method() -> str:
    """How RSS is read here: ``"psutil"``, ``"/proc"``, or ``"unavailable"``."""
    try:
        import psutil  # noqa: F401

        return "psutil"
    except ImportError:
        pass
    return "/proc" if os.path.exists(f"/proc/{os.getpid()}/status") else "unavailable"


def _proc_rss(pid: int) -> int | None:
    """Resident bytes of `pid` from /proc/<pid>/status (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return 0  # a zombie has no VmRSS line


def _listed_children(pid: int) -> list[int] | None:
    """Direct children of `pid` from /proc/<pid>/task/*/children; None where the kernel has no such files."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found  # gone
    listed = False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found += [int(c) for c in f.read().split()]
            listed = True
        except OSError:
            continue
    return found if listed else None


def _parents() -> dict[int, list[int]]:
    """Children by parent pid, from one scan of /proc/*/stat."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
            tree.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return tree


def _proc_descendants(pid: int) -> list[int]:
    """Children, grandchildren... of `pid`, from /proc."""
    out: list[int] = []
    todo = [pid]
    tree: dict[int, list[int]] | None = None
    while todo:
        parent = todo.pop()
        children = _listed_children(parent) if tree is None else None
        if children is None:
            tree = tree if tree is not None else _parents()
            children = tree.get(parent, [])
        out += children
        todo += children
    return out


class _TreeRSS:
    """Reads the RSS of this process and of its descendants (except those in `exclude`)."""

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.method = peak_memory_method()
        self.pid = os.getpid()
        self.exclude = set(exclude)
        if self.method == "psutil":
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process(self.pid)

    def descendants(self) -> list[int]:
        if self.method == "psutil":
            try:
                return [p.pid for p in self._proc.children(recursive=True)]
            except self._psutil.Error:
                return []
        if self.method == "/proc":
            return _proc_descendants(self.pid)
        return []

    def total(self) -> int | None:
        """Bytes resident in this process and its descendants now (None if unavailable)."""
        if self.method == "unavailable":
            return None
        pids = [self.pid] + [p for p in self.descendants() if p not in self.exclude]
        total = 0
        for pid in pids:
            if self.method == "psutil":
                try:
                    total += self._psutil.Process(pid).memory_info().rss
                except self._psutil.Error:
                    continue
            else:
                total += _proc_rss(pid) or 0
        return total


class _PeakSampler:
    """Samples `_TreeRSS.total()` in a thread, keeping the maximum.

    `paused()` holds the sampler off (and waits for a sample in progress to finish)
    while the loader forks its workers, so that no fork happens mid-sample.
    """

    def __init__(self, tree: _TreeRSS, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.tree = tree
        self.interval = interval
        self.peak: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take a sample now (from the measuring thread; not while paused by it)."""
        with self._lock:
            self._sample()

    def _sample(self) -> None:
        value = self.tree.total()
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._stop.is_set():
                    break
                self._sample()

    def __enter__(self) -> "_PeakSampler":
        self.sample()
        if self.tree.method != "unavailable":
            self._thread = threading.Thread(target=self._run, name="shardstream-bench-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def paused(self) -> threading.Lock:
        return self._lock


# -- the measurement ------------------------------------------------------------------------------


def _list_collate(batch: list[Any]) -> list[Any]:
    """Keep a batch of raw-bytes samples as the list it is (top level: it crosses into workers)."""
    return batch


def _batch_images(batch: Any, raw: bool) -> int:
    """Images in a batch: a raw batch is the list of samples; else the leading dimension of the image tensor."""
    if raw:
        return len(batch)
    images = batch[0] if isinstance(batch, (list, tuple)) else batch  # default_collate makes tuples lists
    return int(images.shape[0])


def _batch_bytes(batch: list[Any]) -> int:
    return sum(len(item[0]) for item in batch)


def _decode(transform: str) -> Any:
    if transform == "train":
        from .transforms import RandomResizedCropJPEG

        return RandomResizedCropJPEG(224)
    if transform == "val":
        from .transforms import CenterCropJPEG

        return CenterCropJPEG(224)
    return None


class _Progress:
    """A tqdm bar over the planned seconds of all runs, on stderr."""

    def __init__(self, total_s: float, enabled: bool) -> None:
        from .progress import progress_bar

        self.bar = progress_bar(total=round(total_s, 1), unit="s", desc="bench", disable=not enabled,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}{postfix}]")
        self.done = 0.0  # seconds of finished runs
        self._last = 0.0

    def update(self, run_s: float, postfix: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        self.bar.n = min(self.done + run_s, self.bar.total)
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.refresh()

    def finish_run(self, planned_s: float) -> None:
        self.done += planned_s

    def close(self) -> None:
        self.bar.n = self.bar.total
        self.bar.close()


def _run_one(
    make_loader: Callable[[int], Any],
    num_workers: int,
    *,
    seconds: float,
    warmup: float,
    raw: bool,
    sync: Callable[[], None],
    progress: _Progress,
    exclude: set[int],
) -> tuple[BenchRow, int]:
    """Measure one worker count: (row without MB/s, payload bytes counted)."""
    loader = make_loader(num_workers)
    tree = _TreeRSS(exclude)
    images = payload = 0
    epoch = epochs = 0
    first_batch_s: float | None = None
    window_start: float | None = None
    now = start = time.perf_counter()
    batches: Iterator[Any] | None = None
    with _PeakSampler(tree) as sampler:
        try:
            while True:
                if batches is None:
                    loader.set_epoch(epoch)
                    batches = iter(loader)
                    epochs += 1
                    delivered = 0
                try:
                    if first_batch_s is None and num_workers > 0:
                        with sampler.paused():  # the first next() forks the workers
                            batch = next(batches)
                    else:
                        batch = next(batches)
                except StopIteration:
                    if delivered == 0:
                        raise ShardstreamError("the dataset yields no batches", url=str(loader.dataset.source))
                    batches, epoch = None, epoch + 1
                    continue
                delivered += 1
                now = time.perf_counter()
                if first_batch_s is None:
                    first_batch_s = now - start
                    sampler.sample()
                if window_start is None:
                    if now - start >= warmup:
                        window_start = now  # the warm-up is over; count what arrives from here
                    progress.update(min(now - start, warmup), f"num_workers={num_workers}: warm-up")
                    continue
                images += _batch_images(batch, raw)
                if raw:
                    payload += _batch_bytes(batch)
                elapsed = now - window_start
                if elapsed >= seconds:
                    break
                progress.update(warmup + elapsed, f"num_workers={num_workers}: {images / elapsed:,.0f} img/s")
            sync()  # with CUDA: the copies of the counted batches have landed
            now = time.perf_counter()
            sampler.sample()
        finally:
            if batches is not None:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
            del batches
            loader = None
            gc.collect()  # shuts down the workers before the next worker count starts
    assert window_start is not None and first_batch_s is not None
    window = now - window_start
    progress.update(warmup + seconds, f"num_workers={num_workers}: {images / window:,.0f} img/s", force=True)
    progress.finish_run(warmup + seconds)
    peak = sampler.peak
    row = BenchRow(
        num_workers=num_workers,
        images=images,
        seconds=round(window, 4),
        images_per_s=images / window if window > 0 else 0.0,
        mb_per_s=None,
        first_batch_s=round(first_batch_s, 4),
        peak_rss_mb=round(peak / _MB, 1) if peak is not None else None,
        epochs=epochs,
    )
    return row, payload


def bench(
    dataset: str | Sequence[str],
    workers: Sequence[int] = (0, 1, 2),
    batch_size: int = 64,
    transform: str = "train",
    seconds: float = 5.0,
    warmup: float = 1.0,
    device: str = "cpu",
    *,
    decode_on_device: bool = False,
    decode_threads: int = 0,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    tolerance: float = 0.05,
    on_row: Callable[[BenchRow], None] | None = None,
) -> BenchResult:
    """Measure loader throughput for each worker count in `workers`; see the module doc.

    `dataset` is anything `StreamingDataset` reads. `transform` is ``"train"``
    (`RandomResizedCropJPEG(224)`), ``"val"`` (`CenterCropJPEG(224)`) or ``"none"``
    (raw image bytes, batched as lists: I/O and unpacking only). Each worker count gets
    `warmup` seconds (at least until its first batch) and then `seconds` of counting.
    With `decode_on_device` the workers ship JPEG bytes and the crop they drew, and
    `DecodeOnDevice(device)` decodes the batch (nvJPEG on CUDA; see `device_jpeg`): the
    knee then says how many workers that path needs. With `decode_threads` each process
    that iterates (the main one at 0 workers, else each worker) decodes in that many
    threads (`StreamingDataset(decode_threads=...)`): run it beside a run without, to see
    whether threads or worker processes feed this machine faster. The 0-worker run
    iterates in this process with `torch.set_num_threads(1)`, as DataLoader workers run
    (restored after). `on_row` is called with each row as it is measured.
    """
    from .dataset import StreamingDataset
    from .loader import DataLoader

    workers = [int(n) for n in workers]
    if not workers or any(n < 0 for n in workers):
        raise ShardstreamError(f"workers must be one or more non-negative counts, not {workers}")
    if transform not in TRANSFORMS:
        raise ShardstreamError(f"transform must be one of {TRANSFORMS}, not {transform!r}")
    if batch_size < 1:
        raise ShardstreamError("batch_size must be positive")
    if not seconds > 0 or not warmup >= 0:
        raise ShardstreamError("seconds must be positive and warmup non-negative")
    if decode_on_device and transform == "none":
        raise ShardstreamError("decode_on_device needs a transform to defer (train or val), not 'none'")
    if decode_threads < 0 or (decode_threads and (transform == "none" or decode_on_device)):
        raise ShardstreamError("decode_threads must be 0 or more, and decode images here: transform train or val, "
                               "without decode_on_device")
    sync = _device_sync(device)

    probe = StreamingDataset(dataset, storage_options=storage_options)
    source = probe.resolve()  # reads the manifest: a bad path fails here, before any worker starts
    manifest = source.manifest
    samples = manifest.samples if manifest is not None else None
    bytes_per_sample = (sum(s.bytes for s in manifest.shards) / samples) if manifest is not None and samples else None
    fields = (IMAGE_FIELD, "cls") if manifest is None or manifest.classes else (IMAGE_FIELD,)
    decode = _decode(transform)
    on_device = None
    if decode_on_device:
        from .device_jpeg import DecodeOnDevice, DeferDecode

        decode, on_device = DeferDecode(decode), DecodeOnDevice(device)

    def make_loader(num_workers: int) -> Any:
        ds = StreamingDataset(
            dataset, shuffle=True, decode=decode, fields=fields, storage_options=storage_options,
            collate_fn=_list_collate if transform == "none" else None, decode_threads=decode_threads,
        )
        return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, device=device,
                          transform_on_device=on_device)

    result = BenchResult(
        dataset=str(dataset), batch_size=batch_size, decode_threads=decode_threads,
        transform=transform + (" decoded on the device" if on_device else ""),
        device=str(device), seconds=seconds,
        warmup=warmup, samples=samples, bytes_per_sample=bytes_per_sample, memory=peak_memory_method(),
        tolerance=tolerance,
    )
    _prime(make_loader(0).dataset)
    bar = _Progress(len(workers) * (warmup + seconds), progress)
    before = set(_TreeRSS().descendants())  # processes that are not ours to count
    try:
        for n in workers:
            with _torch_threads(1) if n == 0 else contextlib.nullcontext():
                row, payload = _run_one(make_loader, n, seconds=seconds, warmup=warmup, raw=transform == "none",
                                        sync=sync, progress=bar, exclude=before)
            if bytes_per_sample is not None:
                row.mb_per_s = row.images_per_s * bytes_per_sample / _MB
            elif transform == "none":
                row.mb_per_s = payload / row.seconds / _MB if row.seconds else 0.0  # unpacked bytes: no manifest
            result.rows.append(row)
            if on_row is not None:
                on_row(row)
    finally:
        bar.close()
    return result


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for a while, then back as they were.

    The 0-worker run iterates in this process; DataLoader workers run with one thread
    each, and with torch's default here every resize starts OpenMP threads that spin
    beside it (with 2 decode threads at 0 workers: 77 against 1087 img/s, one
    alternation), so the 0-worker row would measure that, not what the loader can do."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _prime(dataset: Any) -> None:
    """Read, decode and collate one sample in this process, untimed.

    The first use of a decoder, of torch's thread pool and of the modules the loader
    imports lazily costs a second or so once per process; paid here, it does not land
    on whichever worker count is measured first.
    """
    import copy

    ds = copy.copy(dataset)
    ds.shuffle, ds.batch_size = False, None
    for sample in ds:
        ds.collate_fn([sample, sample])
        break


def _device_sync(device: str) -> Callable[[], None]:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ShardstreamError(f"device {device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ShardstreamError(f"device {device!r}: CUDA is not available here")
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def save_json(result: BenchResult, path: str | os.PathLike) -> None:
    """Write `result.to_dict()` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2)
        f.write("\n")
