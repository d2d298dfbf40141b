"""`shardstream.DataLoader`: the last hop, host to device, with the training loop's count.

Built on `torch.utils.data.DataLoader` (its worker processes, its pinning thread),
with what a training loop needs on top:

* **Batches on the device.** With a CUDA `device`, each batch is copied on a dedicated
  stream with ``non_blocking=True`` from pinned memory, `prefetch_to_device` batches
  ahead, so the copy of batch n+1 overlaps the compute on batch n; the consumer's
  stream waits on an event before use, and `record_stream` tells the allocator the
  consumer uses the memory. Pinned buffers come from PyTorch's caching host
  allocator, so they are reused, not allocated per batch.
* **uint8 over the bus, arithmetic on the GPU.** `transform_on_device` (for example
  `Normalize`) runs after the copy, on the device.
* **Exact resume.** The loader counts items the training loop has *received* (not
  what workers prefetched) and its `state_dict()` carries that count.
* **Statistics.** `stats` says batches/s, samples/s and how long the loop waited for
  data (the fraction of time the GPU would have idled).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.data

from .arguments import flag, integer
from .batches import count_samples, map_field, tensors, to_device, usable_device
from .collate import is_own_collate
from .dataset import StreamingDataset
from .errors import RaisedInWorker, ShardstreamError, WorkerDiedError
from .parentwatch import end_with_parent
from .rankcounts import WorkerCounts
from .resume import dataset_fingerprint
from .shared import SLOTS
from .workercontext import lock_free_context

__all__ = ["DataLoader", "LoaderStats", "Normalize", "sigterm_held_for_new_workers", "to_device",
           "worker_waits_for_its_parent_on_sigterm"]



@dataclass
class LoaderStats:
    """Throughput of the current (or last) epoch, as the training loop saw it."""

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0  # time spent inside next(): the consumer waiting for data
    elapsed_s: float = 0.0  # from the first request to the last delivery
    first_batch_s: float = 0.0  # time to the first batch

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of the time the consumer spent waiting for data (ideally near 0)."""
        return self.wait_s / self.elapsed_s if self.elapsed_s else 0.0


@dataclass(frozen=True)
class Normalize:
    """uint8 images -> float, ``(x / 255 - mean) / std``, on whatever device the batch is.

    `field` picks the image in a tuple (an index) or dict (a key) batch; a bare tensor
    batch is normalised itself. ``channels_last=True`` returns NHWC memory format,
    which convolutions on tensor cores prefer.
    """

    mean: Sequence[float] = (0.485, 0.456, 0.406)
    std: Sequence[float] = (0.229, 0.224, 0.225)
    field: int | str = 0
    channels_last: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"Normalize makes floating-point images: dtype={self.dtype} is not a floating-point dtype")
        object.__setattr__(self, "channels_last", flag(self.channels_last, "channels_last"))
        # Checked here, not at the first batch on the device: std 0 made a channel inf, silently.
        object.__setattr__(self, "mean", _constants(self.mean, "mean"))
        object.__setattr__(self, "std", _constants(self.std, "std"))
        if len(self.mean) != len(self.std) or not all(self.std):
            raise ValueError(f"Normalize needs as many means as stds, and no std of 0: mean={self.mean}, std={self.std}")
        if max(map(abs, (*self.mean, *self.std))) > 1:
            # mmcv's and timm's 0-255 constants (123.675, 58.395) made images near -2, all alike, silently.
            raise ValueError(f"Normalize takes the constants of images in [0, 1] (it scales uint8 by 255 itself, as "
                             f"torchvision's ToTensor then Normalize): divide 0-255 ones by 255, not mean={self.mean}, "
                             f"std={self.std}")

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        if not isinstance(images, torch.Tensor):  # JPEGs DeferDecode sent: an EncodedBatch, not yet images
            raise TypeError(f"Normalize takes images, not a {type(images).__name__}: with DeferDecode, put "
                            "DecodeOnDevice before it in transform_on_device")
        if images.dtype != torch.uint8:
            # Its constants take 0-255: float images already in [0, 1] (torchvision's ToTensor)
            # were divided by 255 again, silently.
            raise ValueError(f"Normalize takes uint8 images (0 to 255), not {images.dtype}: normalise float "
                             "images with your own transform, or leave them uint8 for this one")
        if images.dim() not in (3, 4):
            # The constants broadcast over the last three dimensions: a video batch (N, C, T, H, W)
            # of 3 frames was normalised along its frames, silently, and others failed on the broadcast.
            raise ValueError(f"Normalize takes CHW images or NCHW batches of them, not a tensor of shape "
                             f"{tuple(images.shape)}")
        channels = images.shape[-3]
        if len(self.mean) != len(self.std) or len(self.mean) not in (1, channels):
            # A grey batch (N, 1, H, W) broadcast against 3 means came out as 3 channels, silently.
            raise ValueError(f"Normalize has {len(self.mean)} means and {len(self.std)} stds for images of {channels} "
                             f"channels (shape {tuple(images.shape)}): give one of each a channel, or one for all")
        # In float32 at least, then rounded once to `dtype`: in bfloat16 itself the constants and
        # each step rounded to 8 bits (up to 3 of its steps off; DALI's normalisation to half is
        # float inside too). float64 is computed in float64.
        compute = torch.promote_types(self.dtype, torch.float32)
        mean, inv_std = _normalize_constants(tuple(self.mean), tuple(self.std), images.device, compute, images.dim())
        out = images.to(compute).sub_(mean).mul_(inv_std).to(self.dtype)
        if self.channels_last and out.dim() == 4:
            out = out.contiguous(memory_format=torch.channels_last)
        return out

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return self.normalize(batch)
        return map_field(batch, self.field, self.normalize)


def _constants(values: Any, name: str) -> tuple[float, ...]:
    """Normalize's `mean` or `std`: one finite number a channel (or one for all), as a tuple."""
    try:
        numbers = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise TypeError(f"Normalize's {name} must be a sequence of numbers, one a channel, not {values!r}") from None
    if not numbers or not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"Normalize's {name} must be one finite number a channel (or one for all), not {values!r}")
    return numbers


@functools.lru_cache(maxsize=64)
def _normalize_constants(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device, dtype: torch.dtype,
                         dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """255 * mean and 1 / (255 * std), shaped for `dims`-dimensional images, made once per
    device: ``torch.tensor(..., device="cuda")`` copies synchronously, which would stall
    the host on every batch behind the copy just issued.

    Computed on the host, then copied: arithmetic on the device would be kernels queued
    on whichever stream is current at the first call, and the cached result read later
    from other streams (the loader's copy stream) that do not wait for them."""
    shape = (1, -1, 1, 1) if dims == 4 else (-1, 1, 1)
    mean_t = torch.tensor(mean, dtype=dtype).view(shape) * 255
    inv_std = 1.0 / (torch.tensor(std, dtype=dtype).view(shape) * 255)
    return mean_t.to(device), inv_std.to(device)  # a host-to-device copy from pageable memory: synchronous


def _start_method(context: str | multiprocessing.context.BaseContext | None) -> str:
    """The start method of the workers torch starts with `multiprocessing_context`."""
    if context is None:  # torch uses the default context; its first method is the default
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else context.get_start_method()


def worker_waits_for_its_parent_on_sigterm(worker_id: int) -> None:
    """A DataLoader `worker_init_fn` for jobs that save a checkpoint on SIGTERM:
    `shardstream.DataLoader` gives it to its workers, and `torch.utils.data.DataLoader`
    takes it as it is.

    A scheduler stops a job by signalling every process of it (SLURM, at preemption or
    `scancel`; a container runtime, the process group). Workers that died of that SIGTERM
    failed the training process that had asked, in its own handler, for a checkpoint at
    the end of its step: torch's SIGCHLD handler raised "DataLoader worker is killed by
    signal" wherever it was (in the `torch.save`, four runs in four), and a loop waiting in
    `next()` for a batch never got one (torch's "exited unexpectedly", 5 s later). So a
    SIGTERM from anyone but the worker's parent (the training process) leaves it serving
    until the parent is gone, and then ends it at once (a training process without a
    handler died of the same SIGTERM, and a worker busy in a slow read would not see that
    for minutes); the parent's own SIGTERM (torch ending its workers, multiprocessing's
    at exit) ends it at once. Only `sigwaitinfo` says who sent a signal: SIGTERM is held
    back from every thread of the worker and taken by one of its own
    (`_take_sigterms`). Where there is no `sigwaitinfo` (macOS), a SIGTERM ends the
    worker at once. Nothing of a worker's needs cleaning when it ends so: its cache locks
    end with it, and the cache's next walk removes a download it left."""
    parent = multiprocessing.parent_process()
    # Where SIGTERM reaches a handler (no sigwaitinfo; or a native thread the worker had before
    # this, which does not hold it back), it ends the worker at once: never a worker left that
    # its parent's SIGTERM does not end (multiprocessing waits for it at exit).
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    if hasattr(signal, "sigwaitinfo") and parent is not None:
        # Threads the worker starts from here on inherit the mask: SIGTERM waits for `_take_sigterms`.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_take_sigterms, args=(parent,), name="shardstream-sigterm", daemon=True).start()
    # After the mask, which its thread inherits (one started before took a job's SIGTERM to the
    # handler above): the worker ends with its parent, whoever's signal ended that.
    end_with_parent()


@contextlib.contextmanager
def sigterm_held_for_new_workers(context: str | multiprocessing.context.BaseContext | None) -> Iterator[None]:
    """SIGTERM held back in this thread while DataLoader workers are started by `context`'s
    spawn, for `worker_waits_for_its_parent_on_sigterm` to take in them: a signal mask lasts
    through exec, so every thread of the new interpreter holds it back from its first
    instruction. Without it, the native threads a worker starts as it imports numpy and
    torch (OpenBLAS's, one a core), before that `worker_init_fn` holds SIGTERM back, took a
    job's SIGTERM, and the worker died under a live training process. A SIGTERM to this
    process meanwhile waits, or goes to another thread.

    Forked workers need none of it: their one thread is the one that forked, which holds
    SIGTERM back before it starts another. Workers started by forkserver are forked by the
    fork server, whose mask is its own: where this starts the fork server (the first
    forkserver workers of the process), it starts it with SIGTERM held back, and the server
    lets it through again in each process it forks (`forkserverchild`); a job's SIGTERM
    then leaves the server alone, whose end made every worker it forked look dead. A fork
    server already running (started by other code first) is left as it is.

    `shardstream.DataLoader` starts its workers so. With `torch.utils.data.DataLoader` and
    `worker_init_fn=worker_waits_for_its_parent_on_sigterm`, start them (the first
    ``iter(loader)``; every one without persistent workers) in it::

        with shardstream.sigterm_held_for_new_workers(loader.multiprocessing_context):
            batches = iter(loader)
    """
    method = _start_method(context)
    if method == "forkserver" and hasattr(signal, "sigwaitinfo"):
        _fork_server_holding_sigterm()
    if method != "spawn" or not hasattr(signal, "sigwaitinfo"):
        yield
        return
    # Started first: multiprocessing starts its resource tracker with SIGINT and SIGTERM held
    # back, and then lets them through in this thread, whatever was held back before.
    multiprocessing.resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _fork_server_holding_sigterm() -> None:
    """Start multiprocessing's fork server, unless it runs, with SIGTERM held back in it and
    let through in each process it forks (`forkserverchild`, added to its preload list)."""
    from multiprocessing import forkserver

    preload = list(getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"])
    if "shardstream.forkserverchild" not in preload:
        forkserver.set_forkserver_preload([*preload, "shardstream.forkserverchild"])
    # Started first, as for spawn (below): starting it lets SIGTERM through in this thread.
    multiprocessing.resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        forkserver.ensure_running()  # started now (a mask lasts through exec), or running already
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _take_sigterms(parent: Any) -> None:
    """In a worker's thread of its own: end the worker at its parent's SIGTERM; anyone else's
    is left to `end_with_parent`, which ends the worker once its parent is gone."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent.pid:
            os._exit(0)


def _end_workers_now(iterator: Any) -> None:
    """End the workers of torch's `iterator` at once (SIGKILL: ours outlive a SIGTERM while
    their parent lives). Their pids are first taken out of torch's SIGCHLD watch, which would
    otherwise raise for a worker ended so. What they leave is safe to leave: see
    `worker_waits_for_its_parent_on_sigterm`."""
    if getattr(iterator, "_worker_pids_set", False):
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    for worker in getattr(iterator, "_workers", ()):
        if worker.is_alive():
            worker.kill()


_ROLLED_BACK = "a loaded state"


class _Iteration:
    """One `DataLoader.__iter__`: what ended it while it was open, if anything (`_recount`).
    A roll-back (a state loaded) ends it quietly; anything else with workers is an error,
    since the workers it drew on serve another iteration now."""

    def __init__(self) -> None:
        self.ended_by: str | None = None


def _chain(transforms: Callable[[Any], Any] | Sequence[Callable[[Any], Any]] | None) -> Callable[[Any], Any] | None:
    """One callable for `transform_on_device`: a sequence of transforms runs in order."""
    if transforms is None or callable(transforms):
        return transforms
    steps = tuple(transforms)

    def chained(batch: Any) -> Any:
        for step in steps:
            batch = step(batch)
        return batch

    return chained if steps else None


def _free_frames_holding(error: BaseException) -> None:
    """Clear the frames below this one in `error`'s traceback that hold `error` itself.

    torch re-raises a worker's error from a local variable (`ExceptionWrapper.reraise`), so
    the error, its traceback and every frame in it, this loader's too, form a reference
    cycle: the loader, and the persistent workers of the epochs after, were then freed only
    by the cyclic garbage collector, which finalises torch's queues before its iterator
    and so waited 5 s for each worker. Such a frame has finished: its locals are the
    error and what made it, which the error's message already says."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    while tb is not None:
        frame = tb.tb_frame
        if any(value is error for value in frame.f_locals.values()):
            with contextlib.suppress(RuntimeError):  # a frame still executing keeps its locals
                frame.clear()
                # Before Python 3.13, reading f_locals made a dict on the frame that clear() keeps:
                # reading it again brings it up to date, without the locals clear() dropped.
                frame.f_locals
        tb = tb.tb_next


def _raising_workers_errors(source: Iterator[Any]) -> Iterator[Any]:
    """The batches of `source`; a worker's error sent as an item (`RaisedInWorker`) is raised
    where it comes, as torch would raise it, but with its url, key and offset."""
    for batch in source:
        if type(batch) is RaisedInWorker:
            batch.reraise()
        yield batch


def _worker_died(workers: Sequence[Any], error: BaseException, wait_s: float = 1.0) -> WorkerDiedError | None:
    """The error to raise where `error` came of one of torch's `workers` (processes) ending
    outright (the out-of-memory killer, a crash in a decoder's native code), naming the
    worker, its pid and the signal; None for any other error.

    Such a death came out of the loop as torch's 60-line traceback through its signal
    handler, the signal in the middle of it, or, killed while it handed over a batch, as
    a bare EOFError or "Connection reset by peer" from the socket that batch's memory was
    passed on. Its exit code may be seen a moment after the error, so it is waited for up
    to `wait_s`; where it is not, the worker torch's own message names is."""
    # torch's own words for a worker gone, or the socket a batch came on cut: an error a worker
    # raised (a user's RuntimeError too) is none of these, and is not waited on.
    named = isinstance(error, RuntimeError) and str(error).startswith("DataLoader worker (pid")
    if not (named or isinstance(error, (EOFError, ConnectionError))):
        return None
    deadline = time.monotonic() + wait_s
    while workers:
        # SIGTERM: torch's own. Status 0 is a worker gone too (`os._exit(0)` in code it ran).
        ended = [w for w in workers if w.exitcode is not None and w.exitcode != -signal.SIGTERM]
        if ended:
            how = _DIED_HOW if any(w.exitcode < 0 for w in ended) else _EXITED_HOW
            return WorkerDiedError("; ".join(f"DataLoader worker (pid {w.pid}) {_ending(w.exitcode)}" for w in ended)
                                   + how)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return WorkerDiedError(str(error).strip().rstrip(".") + _DIED_HOW) if named else None


_DIED_HOW = " (killed outright: by the out-of-memory killer, or a crash in native code such as a decoder)"
# A status, not a signal: the worker ended itself, without an error torch could pass on.
_EXITED_HOW = (" (it ended itself, without raising an error: sys.exit or os._exit in code it ran, or a failure "
               "as it started, such as a spawned worker importing the main module; its stderr above says which)")


def _dead_worker(iterator: Any) -> bool:
    """Whether a worker process of torch's `iterator` has ended."""
    return any(w.exitcode is not None for w in getattr(iterator, "_workers", ()))


def _ending(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


# torch's DataLoader options this one leaves to the dataset, or does without: where they go.
_TORCH_OPTIONS = {
    "shuffle": "StreamingDataset(shuffle=True, seed=...) shuffles, and loader.set_epoch(epoch) makes each epoch's "
               "order",
    "drop_last": "StreamingDataset(drop_last=...) drops a rank's short last batch",
    "collate_fn": "StreamingDataset(collate_fn=...) collates in the workers",
    "sampler": "a StreamingDataset splits itself across ranks and workers: no sampler; Sampling(...) weights samples",
    "batch_sampler": "a StreamingDataset batches itself (batch_size here or on it): no batch sampler",
    "generator": "StreamingDataset(seed=...) seeds the shuffle and every sample's augmentation",
    "worker_init_fn": "this loader starts its workers itself: set a worker up in the transform (it runs there), or "
                      "use torch.utils.data.DataLoader with the dataset (README: 'It works with the standard "
                      "DataLoader')",
}


def _where_instead(misplaced: dict[str, Any]) -> str:
    told = [f"{name}: {_TORCH_OPTIONS[name]}" for name in misplaced if name in _TORCH_OPTIONS]
    unknown = [name for name in misplaced if name not in _TORCH_OPTIONS]
    said = f"shardstream.DataLoader takes no {', '.join(misplaced)}"
    if told:
        said += "; " + "; ".join(told)
    if unknown:
        said += f" ({', '.join(unknown)}: no such option)"
    return said


class DataLoader:
    """Batches from a `StreamingDataset`, on `device`, with resumable state and statistics.

    Batching happens in the workers (`batch_size` is set on the dataset), so a batch
    crosses the process boundary as one message. Defaults: persistent workers when
    `num_workers` > 0; pinned memory when `device` is CUDA. `transform_on_device` is a
    callable, or a sequence of them applied in order (``[DecodeOnDevice("cuda"),
    Normalize()]``), run on each batch once it is on `device`. A CUDA `device` on a
    machine without CUDA keeps batches on the CPU, with a warning: the same script runs.
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        *,
        batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        device: str | torch.device | None = None,
        prefetch_to_device: int = 2,
        transform_on_device: Callable[[Any], Any] | Sequence[Callable[[Any], Any]] | None = None,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        timeout: float = 0,
        **misplaced: Any,
    ) -> None:
        if misplaced:
            raise TypeError(_where_instead(misplaced))
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(f"shardstream.DataLoader loads a StreamingDataset, not a {type(dataset).__name__}: "
                            "use torch.utils.data.DataLoader for other datasets")
        # A copy, to batch with `batch_size` without changing the caller's dataset. It shares the
        # epoch with it, and takes a state loaded into it later (_follow_the_callers_dataset).
        self._callers = dataset
        self.dataset = copy.copy(dataset)
        self.dataset.passes_told = True  # its passes' ends are this loader's (`rearm_resume`)
        self.dataset._loader_copy = True
        if batch_size is not None:
            batch_size = integer(batch_size, "batch_size", 1)
            if dataset.batch_size is not None and dataset.batch_size != batch_size:
                raise ValueError(f"the dataset makes batches of {dataset.batch_size} and the loader was asked for "
                                 f"{batch_size}: give batch_size to one of them")
            self.dataset.batch_size = batch_size
        # At most the workers a dataset counts for (shared.SLOTS), refused before any is forked:
        # in the first one's iteration, 100,000 asked for were being forked until memory ran out.
        num_workers = integer(num_workers, "num_workers", 0, SLOTS + 1)
        self.device = usable_device(device) if device is not None else None  # CUDA asked for, none here: the CPU
        cuda = self.device is not None and self.device.type == "cuda"
        self.num_workers = num_workers
        # Flags and counts checked here: torch takes "no" for pin_memory as true, and checks
        # prefetch_factor only when the workers start, by an assertion.
        pin_memory = flag(pin_memory, "pin_memory") if pin_memory is not None else None
        self.pin_memory = cuda if pin_memory is None else pin_memory and torch.cuda.is_available()
        self._copy_stream: torch.cuda.Stream | None = None  # see _on_device
        self.persistent_workers = (num_workers > 0 if persistent_workers is None
                                   else flag(persistent_workers, "persistent_workers"))
        if prefetch_factor is not None:
            prefetch_factor = integer(prefetch_factor, "prefetch_factor", 1)
        self.prefetch_factor = prefetch_factor if num_workers > 0 else None
        self.prefetch_to_device = max(1, integer(prefetch_to_device, "prefetch_to_device", 0))  # 0: none ahead
        self.transform_on_device = _chain(transform_on_device)
        self.multiprocessing_context = multiprocessing_context
        if timeout < 0:
            raise ValueError(f"timeout must be 0 or more seconds, not {timeout}")
        # torch documents `timeout` as the limit for collecting a batch from workers, but its
        # single-process iterator fails on an assertion when one is set. With no workers there
        # is nothing to time out on, so it is ignored here, like prefetch_factor and
        # persistent_workers above: turning workers off (to debug, say) then needs no other change.
        self.timeout = timeout if num_workers > 0 else 0
        self.stats = LoaderStats()
        self._worker_counts = WorkerCounts()  # this rank's num_workers against the other ranks'
        self._loader: torch.utils.data.DataLoader | None = None
        self._iteration: _Iteration | None = None  # the iteration that counts into _delivered (see __iter__)
        self._workers: list[Any] = []  # the worker processes of the latest iteration (see _worker_death)
        self._recount("")  # a state the dataset loaded before still counts

    def _torch_loader(self) -> torch.utils.data.DataLoader:
        if _dead_worker(getattr(self._loader, "_iterator", None)):
            # Persistent workers of which one died while the training loop ran its own code,
            # where torch's SIGCHLD handler raised and no error passed through this loader:
            # torch's iterator would wait for that worker's batches. Fresh ones instead.
            self._drop_workers()
        if self._loader is None:
            if self.num_workers > 0:
                # Count once, here, rather than in every worker: the workers inherit the
                # counts (a manifest read, or a read through every tar without an index,
                # whose indexes they then reuse).
                self.dataset.counts()
            self._loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                persistent_workers=self.persistent_workers and self.num_workers > 0,
                prefetch_factor=self.prefetch_factor,
                # No lock shared with the workers that a killed one could leave held (workercontext.py).
                # Without workers none is used: torch refuses one then, which would make turning
                # workers off take another change (as timeout and prefetch_factor above).
                multiprocessing_context=(lock_free_context(self.multiprocessing_context) if self.num_workers > 0
                                         else None),
                timeout=self.timeout,
                worker_init_fn=worker_waits_for_its_parent_on_sigterm,
                # torch draws its workers' base seed at every pass, from the training loop's global
                # generator by default: a draw a pass moved the loop's own numbers. The samples'
                # draws are seeded per sample (prepare.py) and need no seed from torch.
                generator=torch.Generator(),
            )
        return self._loader

    def __len__(self) -> int:
        self._follow_the_callers_dataset()
        return len(self.dataset)

    def _recount(self, why: str) -> None:
        """Count the epoch's items delivered from what the dataset says came before this pass
        (a loaded state's items, or none). An iteration still open counts no more: it is of
        the place this replaces, and is told `why` (`_Iteration`)."""
        self._delivered = self.dataset.resumed_items(self.num_workers)
        self._counted_epoch = self.dataset.epoch
        self._counted_resume_id = self.dataset._resume_id
        self._end_open_iteration(why)
        self._iteration = None

    def _end_open_iteration(self, why: str) -> None:
        if self._iteration is not None and self._iteration.ended_by is None:
            self._iteration.ended_by = why

    def _follow_the_callers_dataset(self) -> None:
        """Catch up with what the training loop did through its own dataset rather than the
        loader: a state loaded into it (the copy takes it, and persistent workers holding the
        old one are replaced), another epoch set (the count restarts: else a checkpoint before
        the new epoch's first step said the old epoch's items were delivered, and its resume
        skipped the new epoch whole)."""
        if self.dataset.adopt_loaded(self._callers):
            self._recount(_ROLLED_BACK)
            self._drop_workers()
        elif self.dataset._resume_id != self._counted_resume_id and self.dataset._resume is not None:
            # A state loaded straight into the copy (`loader.dataset.load_state_dict`): followed as one
            # loaded through the loader, its count and its workers (else lost at the pass's end, or
            # miscounted by the next state_dict).
            self._recount(_ROLLED_BACK)
            self._drop_workers()
        elif self._counted_epoch != self.dataset.epoch:
            self._recount("the dataset's set_epoch")

    def _worker_death(self, error: BaseException) -> WorkerDiedError | None:
        """`error` as a WorkerDiedError naming the worker and the signal, where it is torch's
        word of a worker of the current iteration ending outright; None for any other error.
        torch's SIGCHLD handler raises wherever the training loop is when it sees a worker
        gone, in the loop's own code too, where no error passes through this loader: a
        caller that wraps its loop (bench.py) asks here."""
        return _worker_died(self._workers, error) if self.num_workers > 0 else None

    def _drop_workers(self, iterator: Any = None, *, at_once: bool = False) -> None:
        """Shut down the torch loader's workers (those of `iterator` too) and forget it: the
        next epoch starts fresh ones. Left to the garbage collector, workers of an iteration
        that raised stayed alive, held by the error's traceback (several a failed epoch).
        `at_once`: end them first (_end_workers_now) rather than wait for them to finish
        what they are reading."""
        persistent = getattr(self._loader, "_iterator", None)
        self._loader = None
        for it in {id(i): i for i in (iterator, persistent) if i is not None}.values():
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                if at_once:
                    _end_workers_now(it)
                shutdown()

    def set_epoch(self, epoch: int) -> None:
        self._follow_the_callers_dataset()
        if self.dataset._resume is not None and epoch != self.dataset.epoch:
            # Persistent workers still hold the resume state of an epoch left unfinished.
            self._drop_workers()
        self.dataset.set_epoch(epoch)
        self._recount("set_epoch")  # a loaded state of this epoch still counts

    def state_dict(self) -> dict[str, Any]:
        """The dataset's state at the items the training loop has received.

        Warns where the ranks of a torch.distributed job iterate with different `num_workers`
        (`rankcounts`): one rank's state would resume the others wrongly."""
        self._follow_the_callers_dataset()
        state = self.dataset.state_dict(delivered=self._delivered, num_workers=self.num_workers)
        self._worker_counts.check(self.num_workers)
        return state

    def _stream(self) -> str:
        """What this loader reads, named alike on every rank: the dataset, and what else its states
        depend on (`rankcounts`)."""
        ds = self.dataset
        what = (dataset_fingerprint(ds), ds.seed, ds.shuffle, ds.batch_size, ds.drop_last, ds.partial, ds.shuffle_buffer)
        return hashlib.sha256(repr(what).encode()).hexdigest()[:16]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._recount(_ROLLED_BACK)  # before the workers go: a loop waiting on them ends quietly
        self._drop_workers()  # persistent workers hold the old state: start fresh ones

    def __iter__(self) -> Iterator[Any]:
        """Start an iteration: its workers (fresh, or persistent ones reset), ending an iteration
        of this loader still open, which then raises at its next batch."""
        self.stats = stats = LoaderStats()
        start = time.perf_counter()
        self._follow_the_callers_dataset()
        if self.dataset.rearm_resume(self.num_workers):
            self._drop_workers()  # they forgot the state, having read it to its end ahead of a pass left early
        self._delivered = self.dataset.start_pass(self.num_workers)
        self._counted_epoch = self.dataset.epoch
        self._counted_resume_id = pass_id = self.dataset._resume_id
        world = self.dataset.world()
        self._worker_counts.tell(self._stream, world.rank, world.size, self.num_workers)
        # This iteration owns the count until a state is loaded or an epoch set (_recount), as
        # the dataset's latest iteration owns its own: a loop that rolled back to a checkpoint
        # (load_state_dict inside it) and ran on counted its old epoch's batches on top of the
        # loaded state, and its end dropped that state, so the next pass replayed the epoch whole.
        self._end_open_iteration("a new iteration of the loader (iter(loader))")
        self._iteration = iteration = _Iteration()
        if self.num_workers > 0:
            self.dataset.weigh_for_workers()
            # Made here, before the fork, workers share this process's temporary folder (torch's
            # fd-passing listener makes one) and it goes at this process's exit; made in each
            # worker, it went with the worker's finalizers, which a worker ended by a signal (the
            # loop's Ctrl-C, a job's SIGTERM) never runs: a /tmp/pymp-* folder left a worker.
            multiprocessing.util.get_temp_dir()
        with torch.cuda.device(self.device) if self._use_cuda() else contextlib.nullcontext():
            try:
                with sigterm_held_for_new_workers(self.multiprocessing_context if self.num_workers else "fork"):
                    source = iter(self._torch_loader())  # torch's pin-memory thread pins on the current device
            except Exception as error:
                if self.num_workers > 0:
                    self.dataset.explain_pickling(error, _start_method(self.multiprocessing_context))
                raise
            except BaseException:
                # A Ctrl-C while torch reset the persistent workers for this epoch (it waits for
                # each to answer) left them alive, and its iterator half reset: ended at once,
                # as in next() below.
                self._drop_workers(at_once=True)
                raise
        # Their handles only, not the iterator, which would keep the workers of an iteration the
        # loop left early alive until the next one.
        self._workers = workers = list(getattr(source, "_workers", ()))
        received = _raising_workers_errors(source)
        batches = self._on_device(received) if self._use_cuda() else self._on_host(received)
        collate_fn = self.dataset.collate_fn
        by_fields = is_own_collate(collate_fn) or collate_fn is torch.utils.data.default_collate
        # Started here, as torch's DataLoader starts its workers at iter(): a generator's body runs
        # from the first next(), and a second iter(loader) ended nothing until its first batch.
        return self._serving(source, workers, batches, iteration, pass_id, stats, start, by_fields)

    def _serving(self, source: Iterator[Any], workers: list[Any], batches: Iterator[Any], iteration: "_Iteration",
                 pass_id: int, stats: LoaderStats, start: float, by_fields: bool) -> Iterator[Any]:
        """The batches of the iteration `__iter__` started, counted (`stats`) as the loop takes them."""
        # The consumer has waited since it asked for the first batch: through resolving the
        # source and starting the workers (`__iter__`), not only inside next().
        t0 = start
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                stats.wait_s += time.perf_counter() - t0
                break
            except BaseException as error:
                if iteration.ended_by == _ROLLED_BACK and isinstance(error, Exception) and self.num_workers > 0:
                    break  # a state loaded from another thread shut the workers down under this wait
                # Before the workers are shut down below, which ends them all alike.
                died = _worker_died(workers, error) if self.num_workers > 0 else None  # this iteration's
                # A worker that died (or raised) leaves torch's persistent workers unusable:
                # the next epoch starts fresh ones instead of raising the same error again.
                # Nor is the loop kept waiting, whatever ended it: torch's graceful shutdown
                # waits up to 5 s a worker for what it is reading, and with storage slow to
                # answer a Ctrl-C took 5.5 to 10.5 s to end the program, and `timeout=3` raised
                # after 13 s with 2 workers stuck in reads, 23 s with 4.
                self._drop_workers(source, at_once=True)
                _free_frames_holding(error)
                if died is not None:
                    raise died from error
                raise
            if iteration.ended_by is not None and self.num_workers > 0:
                if iteration.ended_by == _ROLLED_BACK:
                    # A state was loaded meanwhile, and its workers were dropped: the batches
                    # torch still held (ahead, or out of order) are of the place left.
                    break
                # Its workers now serve the newer one (torch resets persistent workers' iterator):
                # this loop ended after a few batches, without a word.
                raise ShardstreamError(f"this iteration of the DataLoader was ended by {iteration.ended_by} while it "
                                       "was open: with workers, a loader serves one iteration at a time (look at a "
                                       "batch of this loop, and set the next epoch once it ends)")
            now = time.perf_counter()
            stats.wait_s += now - t0
            if stats.batches == 0:
                stats.first_batch_s = now - start
            stats.batches += 1
            stats.samples += count_samples(batch, by_fields) if self.dataset.batch_size is not None else 1
            stats.elapsed_s = now - start
            if self._iteration is iteration:
                self._delivered += 1
            yield batch
            t0 = time.perf_counter()
        stats.elapsed_s = time.perf_counter() - start
        if self._iteration is iteration and self.dataset._resume_id == pass_id:
            self.dataset.finish_pass()  # the epoch is complete; workers forgot it too

    def _use_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _on_host(self, source: Iterator[Any]) -> Iterator[Any]:
        for batch in source:
            if self.device is not None:
                # Synchronously: off CUDA nothing here waits for an asynchronous copy to end, and
                # the host batch is let go of at the next one. On Apple's GPU ("mps") a copy
                # still reading a released batch gave wrong values, silently (pytorch#189690).
                batch = to_device(batch, self.device, non_blocking=False)
            yield self.transform_on_device(batch) if self.transform_on_device else batch

    def _on_device(self, source: Iterator[Any]) -> Iterator[Any]:
        device = self.device
        assert device is not None
        # One stream for the loader's life, not one per epoch: the caching allocator reuses a
        # freed block only on the stream it was allocated on, so each epoch's own stream
        # would leave the last one's cached device batches reserved and of no use.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        copy_stream = self._copy_stream
        pending: deque[tuple[Any, torch.cuda.Event]] = deque()

        def issue(batch: Any) -> None:
            with torch.cuda.stream(copy_stream):
                moved = to_device(batch, device, non_blocking=True)
                if self.transform_on_device is not None:
                    moved = self.transform_on_device(moved)
                event = torch.cuda.Event()
                event.record(copy_stream)
            pending.append((moved, event))

        # An error (a worker's, a device transform's) is raised after the batches copied before it
        # are handed over, as the host path and torch's loader raise it: raised as it came, it
        # dropped the `prefetch_to_device` - 1 good batches before it, which the loop never got.
        failure: Exception | None = None
        try:
            for batch in source:
                issue(batch)
                if len(pending) >= self.prefetch_to_device:
                    yield self._hand_over(*pending.popleft())
        except Exception as error:  # not GeneratorExit: a loop that stops takes nothing more
            failure = error
        while pending:
            yield self._hand_over(*pending.popleft())
        if failure is not None:
            raise failure

    def _hand_over(self, batch: Any, event: torch.cuda.Event) -> Any:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in tensors(batch):
            if t.is_cuda:  # a transform may leave some on the host
                t.record_stream(consumer)  # memory stays allocated until the consumer is done
        return batch

