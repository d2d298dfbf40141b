"""`shardstream bench`: measure the loader's throughput per `num_workers`, and find the knee.

How many DataLoader workers a job needs depends on the machine, the storage, the
images and the transform, so it is measured, not guessed. For each worker count,
`bench` runs the real path (`StreamingDataset` -> `shardstream.DataLoader`) with the
transform a training (or validation) job would use, discards a warm-up, then counts
images for a fixed time, looping over epochs (`set_epoch`) if the dataset is small:

* **images/s** delivered to the consumer, and **MB/s** of stored (shard) bytes that
  this means: images times the manifest's mean stored bytes per sample;
* **time to the first batch** (worker start, shard opening, shuffle buffer, decode);
* **CPUs busy**: CPU seconds of the main process and its workers (every thread) per
  second of the window. At the knee it says what limits the rate (`BenchResult.diagnosis`):
  CPUs nearly all busy (85% or more; of the CPU quota, where a cgroup sets one: Docker's
  ``--cpus``, a Kubernetes limit) mean the work per image does, and more workers
  cannot help; CPUs idle at a knee below the most workers measured mean the consuming
  loop or the device does, or for remote shards storage latency; at the most workers
  measured, where there are CPUs for more, more may still pay;
* **storage counters** of the window (`StreamingDataset.io_stats`: requests, bytes,
  retries, read-ahead waits, time in storage calls summed over the reading threads), and
  the time the window lost to **epoch restarts** (a small dataset measures those more
  than streaming);
* **peak RSS** of the main process plus the worker processes it started, sampled every
  50 ms in a thread (`peakmem`: with psutil if installed, else from ``/proc``), except
  while the workers are being forked (until the first batch). RSS counts pages shared
  by forked workers once per process, so the sum overstates what they use together.

The 0-worker run iterates in this process with ``torch.set_num_threads(1)``, as
DataLoader workers do (and as README advises beside decode threads).

The **knee** is the smallest worker count whose rate is within 5% of the best rate
(`find_knee`): more workers than that buy nothing but memory. One measurement a count
is not enough to find it: five identical runs over 0, 1, 2 and 4 workers on a shared
2-core machine gave knees of 1, 2, 2, 4 and 4. So `bench` measures in **rounds**, each
measuring every count once, in the order given in odd rounds and reversed in even ones
(`round_order`), so that a drift over the run (another job starting, a disk cache
filling, the machine warming) does not favour the counts measured first; the knee is
found from each count's median, and the table shows the range of the rates beside it.
Every measurement's window is checked for other processes holding the CPUs.

Use ``shardstream bench DATASET --workers 0,1,2,4,8`` or `bench` from Python.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from typing import Any, Callable, Iterator, Sequence

from .benchresult import BenchCount, BenchResult, BenchRow, find_knee
from .errors import MissingFieldError, ShardstreamError, WorkerDiedError, scrubbed
from .cpus import cpu_quota, cpus_here
from .fields import IMAGE_EXTENSIONS, field_extension
from .peakmem import PeakSampler, TreeRSS, peak_memory_method
from .shared import SLOTS

__all__ = ["BenchCount", "BenchResult", "BenchRow", "bench", "find_knee", "peak_memory_method", "round_order",
           "TRANSFORMS"]

TRANSFORMS = ("train", "val", "none")
MIN_BATCHES_PER_WORKER = 4  # a row's window holds at least this many batches a worker, whatever `seconds`
ROUNDS = 3  # each count measured three times: a median, and a range to judge it by
# The window of each count a round: 5 s in one round; 2 s in each of several, so that the default
# (5 counts, 3 rounds, 1 s of warm-up each: 45 s planned) measures 6 s a count, and took 59 s on
# this project's shared 2-core machine, against 101 s with 5 s a round (34 s for one round of 5 s).
SECONDS, ROUND_SECONDS = 5.0, 2.0
IMAGE_FIELD = "jpg;jpeg;png;webp"  # what pack stores, and `jpeg` of other tools' tars
_MB = 1e6


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
    """A tqdm bar over the planned seconds of all runs, on stderr; `prefix` names the round."""

    def __init__(self, total_s: float, enabled: bool) -> None:
        from .progress import progress_bar

        self.bar = progress_bar(total=round(total_s, 1), unit="s", desc="bench", disable=not enabled,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}{postfix}]")
        self.done = 0.0  # seconds of finished runs
        self._last = 0.0
        self.prefix = ""

    def update(self, run_s: float, postfix: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        self.bar.n = min(self.done + run_s, self.bar.total)
        self.bar.set_postfix_str(self.prefix + postfix, refresh=False)
        self.bar.refresh()

    def finish_run(self, planned_s: float) -> None:
        self.done += planned_s

    def close(self, complete: bool = True) -> None:
        """End the bar: full where every run ended, else where it stopped (Ctrl-C, an error)."""
        if complete:
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
    tree = TreeRSS(exclude)
    images = payload = 0
    epoch = epochs = 0
    cpu_start = cpu_end = machine_start = machine_end = None
    io_start: dict[str, float] = {}
    io_end: dict[str, float] = {}  # the dataset's storage counters (io_stats) at the window's ends
    first_batch_s: float | None = None
    window_start: float | None = None
    counted = 0  # batches in the window
    # The window's epoch restarts, and the time from each epoch's last batch to the next one's first.
    restarts, restart_gaps, restarting = 0, 0.0, False
    now = start = last = time.perf_counter()
    batches: Iterator[Any] | None = None
    interrupted = False
    with PeakSampler(tree) as sampler:
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
                    batches, epoch, restarting = None, epoch + 1, True
                    continue
                delivered += 1
                now = time.perf_counter()
                (gap, last), (restarted, restarting) = (now - last, now), (restarting, False)
                if first_batch_s is None:
                    first_batch_s = now - start
                    sampler.sample()
                if window_start is None:
                    if now - start >= warmup:
                        window_start = now  # the warm-up is over; count what arrives from here
                        cpu_start, machine_start = tree.cpu_seconds(), _machine_busy_seconds()
                        io_start = loader.dataset.io_stats()
                    progress.update(min(now - start, warmup), f"num_workers={num_workers}: warm-up")
                    continue
                images += _batch_images(batch, raw)
                counted += 1
                if restarted:
                    restarts, restart_gaps = restarts + 1, restart_gaps + gap
                if raw:
                    payload += _batch_bytes(batch)
                elapsed = now - window_start
                # And a few batches a worker: a window of one batch (--seconds 0.000001) timed
                # only the taking of one already queued, and its CPU figures one 10 ms tick.
                if elapsed >= seconds and counted >= MIN_BATCHES_PER_WORKER * max(1, num_workers):
                    break
                progress.update(warmup + elapsed, f"num_workers={num_workers}: {images / elapsed:,.0f} img/s")
            sync()  # with CUDA: the copies of the counted batches have landed
            now = time.perf_counter()
            cpu_end, machine_end = tree.cpu_seconds(), _machine_busy_seconds()
            io_end = loader.dataset.io_stats()
            sampler.sample()
        except RuntimeError as error:
            # A worker that ended outright: the loader's WorkerDiedError where next() saw it,
            # else torch's own error, which its SIGCHLD handler raises wherever this loop is.
            died = error if isinstance(error, WorkerDiedError) else loader._worker_death(error)
            if died is None:
                raise
            cause = died.__cause__ if died is error else error
            raise WorkerDiedError(f"num_workers={num_workers}: {died}") from cause
        except BaseException as error:
            # Ctrl-C (not an `Exception`): the shutdown below does not wait for the workers' reads.
            interrupted = not isinstance(error, Exception)
            raise
        finally:
            if batches is not None:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
            del batches
            # The workers are shut down here, before the next worker count starts, not by the
            # garbage collector: a Ctrl-C while torch's `__del__` waited for them was printed
            # as "Exception ignored" and lost, and the bench went on to the next count.
            loader._drop_workers(at_once=interrupted)
            loader = None
            gc.collect()
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
        cpus_busy=round((cpu_end - cpu_start) / window, 3) if cpu_start is not None and cpu_end is not None else None,
        machine_busy=(round((machine_end - machine_start) / window, 3)
                      if machine_start is not None and machine_end is not None else None),
        # Beyond a batch's usual interval: what the restarts cost the window.
        restart_s=round(max(0.0, restart_gaps - restarts * window / counted), 4) if counted else 0.0,
        io={name: round(io_end[name] - io_start.get(name, 0), 4) for name in io_end},
    )
    return row, payload


def bench(
    dataset: str | Sequence[str],
    workers: Sequence[int] = (0, 1, 2, 4, 8),  # as the command's --workers
    batch_size: int = 64,
    transform: str = "train",
    seconds: float | None = None,  # SECONDS with one round, ROUND_SECONDS a round with more
    warmup: float = 1.0,
    device: str = "cpu",
    *,
    rounds: int = ROUNDS,
    decode_on_device: bool = False,
    decode_threads: int = 0,
    prefetch: int | None = None,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_limit: int | str | None = None,
    tolerance: float = 0.05,
    on_row: Callable[[BenchRow], None] | None = None,
    image_field: str = IMAGE_FIELD,
) -> BenchResult:
    """Measure loader throughput for each worker count in `workers`; see the module doc.

    `dataset` is anything `StreamingDataset` reads. `transform` is ``"train"``
    (`RandomResizedCropJPEG(224)`), ``"val"`` (`CenterCropJPEG(224)`) or ``"none"``
    (raw image bytes, batched as lists: I/O and unpacking only). Each of `rounds` rounds
    measures every worker count once (`round_order`): `warmup` seconds (at least until
    its first batch), then `seconds` of counting (default: 5 with one round, 2 a round
    with more). `cache_dir` and `cache_limit` are StreamingDataset's, for remote shards:
    the first measurement fills the cache, the rounds after read it.
    With `decode_on_device` the workers ship JPEG bytes and the crop they drew, and
    `DecodeOnDevice(device)` decodes the batch (nvJPEG on CUDA; see `device_jpeg`): the
    knee then says how many workers that path needs. With `decode_threads` each process
    that iterates (the main one at 0 workers, else each worker) decodes in that many
    threads (`StreamingDataset(decode_threads=...)`): run it beside a run without, to see
    whether threads or worker processes feed this machine faster. The 0-worker run
    iterates in this process with `torch.set_num_threads(1)`, as DataLoader workers run
    (restored after). `prefetch` is the dataset's (None: its default): where the
    diagnosis says the readers waited with their read-ahead at its largest, measure again
    with more. `on_row` is called with each row as it is measured. `image_field` names the
    image's field, alternatives joined by ";" as `fields=` takes them.

    A KeyboardInterrupt (Ctrl-C; the command's SIGTERM) is raised on, after the workers
    are shut down, with the rows measured so far as its `result` (`partial` set), for
    the command to print and save: rounds make a run long enough to be stopped.
    """
    from .dataset import StreamingDataset
    from .loader import DataLoader

    workers = [int(n) for n in workers]
    if not workers or any(not 0 <= n <= SLOTS for n in workers):  # checked before any row forks its workers
        raise ShardstreamError(f"workers must be one or more counts from 0 to {SLOTS}, not {workers}")
    if len(set(workers)) < len(workers):
        # The knee, the best rate and the plot take one rate for each count: a count measured twice
        # was judged by its last row, the diagnosis read its first, and the JSON's best rate was not the table's.
        raise ShardstreamError(f"workers must name each count once, not {workers}")
    if transform not in TRANSFORMS:
        raise ShardstreamError(f"transform must be one of {TRANSFORMS}, not {transform!r}")
    if batch_size < 1:
        raise ShardstreamError("batch_size must be positive")
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ShardstreamError(f"rounds must be 1 or more, not {rounds!r}")
    if seconds is None:
        seconds = SECONDS if rounds == 1 else ROUND_SECONDS
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(warmup) and warmup >= 0):
        raise ShardstreamError("seconds must be positive and warmup non-negative, both finite")
    if not 0 <= tolerance < 1:  # checked by the knee, but only once every worker count has run
        raise ShardstreamError(f"tolerance must be in [0, 1) (0.05: within 5% of the best rate), not {tolerance}")
    if decode_on_device and transform == "none":
        raise ShardstreamError("decode_on_device needs a transform to defer (train or val), not 'none'")
    if transform != "none" and not all(field_extension(f) in IMAGE_EXTENSIONS for f in image_field.split(";")):
        # Decoded by its name's extension, as every field is: another name would reach the crop as bytes.
        raise ShardstreamError(f"image_field {image_field!r}: an image field is named by its format "
                               f"({', '.join(sorted(IMAGE_EXTENSIONS))}), alternatives joined by ';'")
    if decode_threads < 0 or (decode_threads and (transform == "none" or decode_on_device)):
        raise ShardstreamError("decode_threads must be 0 or more, and decode images here: transform train or val, "
                               "without decode_on_device")
    if prefetch is not None and not (isinstance(prefetch, int) and prefetch >= 0):
        raise ShardstreamError(f"prefetch must be 0 or more pieces (None: the dataset's default), not {prefetch!r}")
    sync = _device_sync(device)

    probe = StreamingDataset(dataset, storage_options=storage_options)
    source = probe.resolve()  # reads the manifest: a bad path fails here, before any worker starts
    present = source.fields()
    if source.shards and present is not None and not any(name in present for name in image_field.split(";")):
        # Else the dataset's own check said "that fields= names": bench has no such option.
        raise MissingFieldError(f"image_field {image_field!r} (--image-field): no shard has it; the dataset's "
                                f"fields are {sorted(present)}", url=source.url)
    manifest = source.manifest
    samples = manifest.samples if manifest is not None else None
    bytes_per_sample = (int(manifest.shards.bytes.sum()) / samples) if manifest is not None and samples else None
    fields = (image_field, "cls") if _labelled(source) else (image_field,)
    decode = _decode(transform)
    on_device = None
    if decode_on_device:
        from .device_jpeg import DecodeOnDevice, DeferDecode

        decode, on_device = DeferDecode(decode), DecodeOnDevice(device)

    def make_loader(num_workers: int) -> Any:
        ds = StreamingDataset(
            dataset, shuffle=True, decode=decode, fields=fields, storage_options=storage_options,
            collate_fn=_list_collate if transform == "none" else None, decode_threads=decode_threads,
            prefetch=prefetch, cache_dir=cache_dir, cache_limit=cache_limit,
        )
        return DataLoader(ds, batch_size=batch_size, num_workers=num_workers, device=device,
                          transform_on_device=on_device)

    result = BenchResult(
        # As messages show it: the result is printed, saved as JSON and drawn, and ends up shared,
        # so an HTTP(S) URL's token or password stays out of it.
        dataset=scrubbed(str(dataset)), batch_size=batch_size, decode_threads=decode_threads, prefetch=prefetch,
        transform=transform + (" decoded on the device" if on_device else ""),
        device=str(device), seconds=seconds,
        warmup=warmup, samples=samples, bytes_per_sample=bytes_per_sample, memory=peak_memory_method(),
        tolerance=tolerance, cpus=cpus_here(), cpu_quota=cpu_quota(), rounds=rounds, workers=workers,
        local=source.local, cache_dir=cache_dir,
    )
    _prime(make_loader(0).dataset)
    bar = _Progress(rounds * len(workers) * (warmup + seconds), progress)
    before = set(TreeRSS().descendants())  # processes that are not ours to count
    try:
        with _more_workers_than_cpus(workers, result.cpus):
            for r in range(1, rounds + 1):
                bar.prefix = f"round {r}/{rounds}, " if rounds > 1 else ""
                for n in round_order(workers, r):
                    # This process decodes on the CPU at every worker count where the device side
                    # decodes there: one thread for each row, as for the 0-worker row (_torch_threads).
                    one_thread = n == 0 or (on_device is not None and not on_device.on_gpu)
                    with _torch_threads(1) if one_thread else contextlib.nullcontext():
                        row, payload = _run_one(make_loader, n, seconds=seconds, warmup=warmup,
                                                raw=transform == "none", sync=sync, progress=bar, exclude=before)
                    row.round = r
                    if bytes_per_sample is not None:
                        row.mb_per_s = row.images_per_s * bytes_per_sample / _MB
                    elif transform == "none":
                        row.mb_per_s = payload / row.seconds / _MB if row.seconds else 0.0  # unpacked: no manifest
                    result.rows.append(row)
                    if on_row is not None:
                        on_row(row)
    except KeyboardInterrupt as stop:
        # The rows measured go with it, for the caller to show: with rounds a run lasts a minute or
        # more, and a Ctrl-C near its end threw every row away.
        result.partial = True
        stop.result = result  # type: ignore[attr-defined]
        raise
    finally:
        bar.close(complete=len(result.rows) == rounds * len(workers))
    return result


def round_order(workers: Sequence[int], round_: int) -> list[int]:
    """The order round `round_` (from 1) measures the counts in: as given in odd rounds, reversed in
    even ones, so that each count is measured early as often as late and a drift over the run
    (a job starting beside, caches filling) weighs on every count alike, not on the last ones."""
    return list(workers) if round_ % 2 else list(reversed(workers))


@contextlib.contextmanager
def _more_workers_than_cpus(workers: Sequence[int], cpus: int | None) -> Iterator[None]:
    """torch's warning against more workers than CPUs, said once for the run rather than twice for
    each such count and round (torch warns as the loader is made and again as each iteration
    starts): bench runs such counts on purpose, to find where the curve flattens."""
    import warnings

    over = [n for n in workers if cpus and n > cpus]
    if over:
        warnings.warn(f"num_workers={', '.join(map(str, over))} more than the {cpus} CPU{'s' if cpus > 1 else ''} "
                      f"here (torch suggests at most {cpus}): measured as asked, to see whether more workers still "
                      "pay", stacklevel=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        yield


def _labelled(source: Any) -> bool:
    """Whether every sample has a `cls` field: the manifest's class counts cover every
    sample (a dataset where only some have one is read, and measured, without labels), else
    (other tools' tars) the first sample has one."""
    manifest = source.manifest
    if manifest is not None:
        return bool(manifest.classes) and sum(manifest.class_counts) == manifest.samples
    first = next(iter(source.reader(0)), None) if source.shards else None
    return first is not None and "cls" in first


def _machine_busy_seconds() -> float | None:
    """CPU seconds every process has used on the CPUs this one may run on, since boot (not idle,
    not waiting on I/O), from Linux's /proc/stat; None where there is none."""
    try:
        allowed = os.sched_getaffinity(0)
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except (AttributeError, OSError):
        return None
    ticks = 0
    for fields in lines:
        if int(fields[0][3:]) in allowed:
            values = [int(v) for v in fields[1:]]
            ticks += sum(values[:8]) - values[3] - values[4]  # user .. steal, less idle and iowait
    return ticks / os.sysconf("SC_CLK_TCK")


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
    """Read, decode and collate two samples in this process, untimed.

    The first use of a decoder, of torch's thread pool and of the modules the loader
    imports lazily costs a second or so once per process; paid here, it does not land
    on whichever worker count is measured first.
    """
    import copy

    ds = copy.copy(dataset)
    ds.shuffle, ds.batch_size = False, 2  # a batch of two: the decoder and the collate, once each
    for _ in ds:
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
    try:  # a type this build of torch has no backend for (mps, xpu): torch's traceback, else
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        said = str(e).split(". ", 1)[0].splitlines()[0] if str(e) else type(e).__name__  # torch's runs on for a page
        raise ShardstreamError(f"device {device!r}: this build of torch has no backend for it ({said})") from None
    return lambda: None
