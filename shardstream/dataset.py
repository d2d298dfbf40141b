"""`StreamingDataset`: a PyTorch IterableDataset over shards, exact per epoch and resumable.

Each epoch every sample is yielded exactly once across all ranks and workers (plus
declared padding), every rank yields the same number of samples and batches, and the
order is a pure function of (seed, epoch, world size, number of workers) and the data
(see plan.py for how). Decoding, transforms and batching (prepare.py) run where the
iterator runs: in the DataLoader's worker processes.

The dataset is a value: constructing it reads nothing. The source is resolved (the
manifest read) on first use, in whichever process gets there first.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import sys
import time
import traceback
import warnings
import weakref
from dataclasses import replace
from multiprocessing.context import get_spawning_popen
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data import default_collate as torch_default_collate

from .arguments import flag, integer
from .cache import ShardCache
from .checkpoint import Checkpointing
from .collate import default_collate
from .decode import Decoder
from .decode_ahead import DecodeAhead
from .epochs import EpochSequences
from .errors import MissingFieldError, RaisedInWorker, ShardstreamError, StorageError, add_note
from .headstart import HeadStart
from .inherited import callers_settings, take_on
from .iostats import IOStats, count_into, counted_in, counting_into
from .parentwatch import end_with_parent
from .policy import ErrorPolicy, guarded
from .plan import MAX_WORLD_SIZE, Layout, items_of
from .prepare import SamplePrep
from .rankplan import RankPlan, WorkerEpoch
from .resume import MAX_EPOCH, Segment, current_place
from .sampling import Mix, Sampling, source_urls
from .shared import SLOTS, SharedState
from .source import Source, resolve_source
from .stream import marked, paired, read_samples, reorder
from .retry import RetryPolicy
from .urls import preload_driver
from .world import World
from .writer import parse_size

__all__ = ["StreamingDataset"]



def _callable(value: Any, name: str) -> Any:
    """`value` where it is callable or None; else an error naming the argument (given 5, it
    failed at the first sample, in a worker)."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable, not {value!r}")
    return value


def _field_names(fields: str | Sequence[str]) -> tuple[str, ...]:
    """The fields asked for, as names: a string is WebDataset's to_tuple spelling ("jpg;png
    cls"); none at all ([] yielded empty tuples) or a name not a string is refused."""
    names = tuple(fields.split()) if isinstance(fields, str) else tuple(fields)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"fields must name one field or more, as strings (\"jpg\", \"cls\"), not {fields!r}")
    return names


# Default read-ahead, in pieces (one storage request each). Local reads need little,
# but a reader thread still pays off: decoding and cropping 4,000 JPEGs of 114 KB from local
# shards (benchmarks/loader.py, BENCHMARKS.md "Twenty-second session"), prefetch 0 ran at
# 0.93x the rate of prefetch 2 in one process, 0.95x in one DataLoader worker, and 1.00x
# in each of two. Over HTTP with 50 ms per request, 6 in flight read fastest (raw
# samples in one process from shardstream.testing.HTTPTestServer, 2,000 JPEGs of
# 110 KB: prefetch 2 gave 1,200 samples/s, 4 gave 2,000, 6 gave 2,750, 8 gave 2,350).
PREFETCH_LOCAL = 2
PREFETCH_REMOTE = 6
IO_COUNT_INTERVAL_S = 0.05  # how often an iteration adds its storage work to `io_stats()`
_END = object()  # what `next` gives at a stream's end (`_yield`)
T = TypeVar("T")


def _counted_outside(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of a dataset, its reads counted as the dataset's where no iteration counts
    them: the manifest `resolve()` reads, the indexes a `len()` plans from, before the first
    iteration (which then finds them read, and read nothing)."""
    @functools.wraps(method)
    def counted(self: "StreamingDataset", *args: Any, **kwargs: Any) -> Any:
        if counting_into() is not None:  # an iteration's, or the head start's: counted there
            return method(self, *args, **kwargs)
        with counted_in(self._outside_reads()):
            return method(self, *args, **kwargs)
    return counted


def _this_process(table: dict[int, T], make: Callable[[], T]) -> T:
    """This process's entry of `table` (by process id), made if absent: an entry of another
    process (a forked child's copy of its parent's) is that process's, and dropped here."""
    process = os.getpid()
    if process not in table:
        table.clear()
        table[process] = make()
    return table[process]


def carry_errors(items: Iterator[Any], worker: int) -> Iterator[Any]:
    """`items`, then, where they raise a `ShardstreamError`, that error as a `RaisedInWorker`
    item, and no more: how a worker of `shardstream.DataLoader` (number `worker`) sends
    the main process its error whole, url and key with it."""
    try:
        yield from items
    except ShardstreamError as error:
        failure = RaisedInWorker(error, f"in DataLoader worker process {worker}", traceback.format_exc())
        try:
            pickle.dumps(failure)  # torch pickles items in a queue's feeder thread, which would drop it
        except Exception:  # noqa: BLE001 - any failure to pickle: torch's way then, type and text
            failure = None
        if failure is None:
            raise
        yield failure


def _batches_again(caller: Any) -> bool:
    """Whether `caller`, the frame that called iter() on a dataset that batches, is torch's
    DataLoader collating the dataset's items into batches with a default collate: torch's
    default batch_size is 1, so `DataLoader(ds)` stacked every batch into one of one. Known
    by torch's fetcher (torch.utils.data._utils.fetch), looked at by name: a torch without it
    is not checked. A collate_fn of the user's own may mean to group batches: left alone."""
    fetcher = caller.f_locals.get("self")
    if type(fetcher).__name__ != "_IterableDatasetFetcher" or not getattr(fetcher, "auto_collation", False):
        return False
    return getattr(fetcher, "collate_fn", None) in (torch_default_collate, default_collate)


class StreamingDataset(Checkpointing, IterableDataset):
    """Stream samples from shards into PyTorch.

    Args:
        source: a packed dataset (path or fsspec URL of the folder with
            ``manifest.msgpack``), a brace pattern (``data/shard-{000000..000009}.tar``)
            or a list of shard URLs (plain WebDataset tars are read too), or a `Mix`.
        shuffle: shuffle the shard order per epoch, then samples in a buffer per worker.
        seed: the seed of every random choice; with `set_epoch` it fixes the order.
        shuffle_buffer: samples held per worker for shuffling; memory is about this
            many times the mean sample size as written (JPEG bytes, not decoded pixels;
            a field zstd compresses well counts at its size before compression).
        decode: image decoding: ``"rgb8"`` (uint8 CHW tensors), ``"pil"``, ``None``
            (bytes), or a callable from image bytes to anything (for example
            `RandomResizedCropJPEG`). Other fields decode by extension.
        transform: a callable applied to each decoded sample dict, in the worker.
        fields: yield tuples of these fields instead of dicts; ``"jpg;png"`` takes the
            first present of several. Without a `transform` (which sees the whole
            sample), the fields left out are not decoded. Besides the stored fields, a
            sample holds ``__key__``, ``__url__`` (its shard) and ``__pad__``: True on a
            repeat that pads uneven ranks, or a stand-in for a skipped sample, which a
            validation loop leaves out to score each sample once (README).
        batch_size: batch in the worker with `collate_fn` (default: `default_collate`,
            which stacks tensors, in DataLoader workers into shared memory they reuse:
            batchmemory.py); use with ``DataLoader(batch_size=None)``. Iterating with a
            `collate_fn` and no `batch_size` (the dataset's, or `shardstream.DataLoader`'s)
            is an error.
        drop_last: drop the last partial batch (of `batch_size`; without one, iterating is an
            error).
        partial: when samples do not divide evenly over ranks: ``"pad"`` repeats
            samples from the start of the epoch (the DistributedSampler convention),
            ``"drop"`` leaves the remainder out of this epoch.
        rank, world_size: override what torch.distributed or RANK/WORLD_SIZE say.
        storage_options: fsspec options for remote sources.
        prefetch: pieces read ahead by background threads in each worker, so storage
            latency overlaps decoding (0: read in the iterating thread). A piece is one
            storage request of up to 8 MB, cut between frames, and holds up to 8 MB of
            samples once decompressed (a sample larger than that is a piece of its
            own); each is held whole until its samples are yielded. Default: 2 for local
            shards, 6 for remote ones, where each request waits tens of milliseconds
            and several must be in flight (6 measured best at 50 ms of latency). Beyond
            `prefetch` pieces, up to `prefetch` x 4 MB are in flight; for remote shards
            that budget doubles each time the iteration has to wait for a piece, up to
            four times (readahead.py), so a fast reader of slow storage keeps more in flight.
            Remote shards also get a head start: a process on its second iteration
            or later reads the first pieces of the next epoch (``set_epoch(epoch + 1)``)
            while the current one ends, or with `cache_dir` downloads its first shard
            (headstart.py).
        retry: how transient storage errors (5xx, throttling, resets, timeouts) are
            retried: `RetryPolicy(attempts, base_delay, max_delay)`, exponential
            backoff with jitter; default `RetryPolicy()` (10 attempts, about 33 s at most).
        cache_dir, cache_limit: keep whole remote shards in this local folder, at most
            `cache_limit` bytes (default "50GB") beyond the shards in use, shared safely by
            all workers and ranks of a machine. In use are the shard each reader (a
            DataLoader worker, or the main process) reads and the `prefetch` shards it
            downloads ahead: on a small disk, allow readers x (prefetch + 1) shards, or
            lower prefetch. Without `cache_dir`, shards stream from storage into memory
            by ranged reads of just the samples planned.
        on_error: ``"raise"`` stops at a bad sample (corrupt frame, undecodable image,
            missing field) naming shard and key; ``"skip"`` logs and counts it and
            yields the next good sample of its worker in its place (counts stay equal
            per rank, and a resumed run yields the same stand-ins), raising past a cap;
            an `ErrorPolicy` sets the cap.
        sampling: class-weighted draws and the epoch size (`Sampling`); a `Mix` as the
            source mixes datasets by weight (with a `Mix`, only the epoch size and
            `resampled` apply, not class or sample weights). Both keep every guarantee
            but exactly-once, which weighted draws replace by design.
        allow_pickle: decode ``.pyd``/``.pth`` fields with pickle (trusted data only).
        decode_threads: decode images in this many threads of the iterating process
            (the main process with ``num_workers=0``, or each DataLoader worker), ahead
            of the consumer and in its order. The random draws (crops, `transform`)
            stay in the iterating thread, so the samples are those of 0 (the default),
            bit for bit. For ``decode="rgb8"``/``"pil"`` and the fused transforms;
            decode_ahead.py says why and how fast. Up to 4 samples per thread are
            decoded ahead, so 4 x `decode_threads` decoded samples are held beside the
            consumer's (with ``"rgb8"``, a 3000x2400 photo is 21.6 MB). In the main
            process, torch's own intra-op threads compete with these:
            ``torch.set_num_threads(1)``.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Mix,
        *,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 2048,
        decode: str | Callable[[bytes], Any] | None = "rgb8",
        transform: Callable[[dict[str, Any]], Any] | None = None,
        fields: Sequence[str] | None = None,
        batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        partial: str = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        on_error: str | ErrorPolicy = "raise",
        sampling: Sampling | None = None,
        allow_pickle: bool = False,
        decode_threads: int = 0,
    ) -> None:
        super().__init__()
        if partial not in ("pad", "drop"):
            raise ValueError(f"partial must be 'pad' or 'drop', not {partial!r}")
        self.source = source if isinstance(source, Mix) else source_urls(source)
        for url in _urls(self.source):
            preload_driver(url)
        self.shuffle = flag(shuffle, "shuffle")
        # Plain ints (a numpy seed from a sweep overflowed the plan's masking, and numpy ints in
        # the layout made state_dict() neither JSON nor loadable by torch.load's weights_only).
        # numpy's generators take the seed modulo 2**64: -1 and 2**64 - 1 would shuffle alike, 2**64 as 0.
        self.seed = integer(seed, "seed", minimum=0, below=1 << 64)
        self.shuffle_buffer = integer(shuffle_buffer, "shuffle_buffer", 0)
        self.transform = _callable(transform, "transform")
        # A string is WebDataset's to_tuple spelling ("jpg;png cls"), not a sequence of letters.
        self.fields = _field_names(fields) if fields is not None else None
        self.batch_size = integer(batch_size, "batch_size", 1) if batch_size is not None else None
        self._collate_given = collate_fn is not None  # see _check_batching
        self.collate_fn = _callable(collate_fn, "collate_fn") or default_collate
        self.drop_last = flag(drop_last, "drop_last")
        self.partial = partial
        self.rank = integer(rank, "rank", 0) if rank is not None else None
        self.world_size = integer(world_size, "world_size", 1, below=MAX_WORLD_SIZE + 1) if world_size is not None \
            else None
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank must be below world_size: rank={self.rank}, world_size={self.world_size}")
        self.storage_options = dict(storage_options or {})
        self._prefetch = integer(prefetch, "prefetch", 0) if prefetch is not None else None
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a shardstream.RetryPolicy, not {retry!r}")
        self.retry = retry
        if cache_limit is not None and not cache_dir:
            # A limit alone read every epoch from storage, without a word (MosaicML's `cache_limit`
            # goes with its `local`): the cache is a folder, cache_dir.
            raise ValueError(f"cache_limit={cache_limit!r} without cache_dir: the cache is the local folder "
                             "cache_dir names (StreamingDataset(..., cache_dir=..., cache_limit=...))")
        limit = parse_size("50GB" if cache_limit is None else cache_limit)
        self._cache = ShardCache(os.path.abspath(os.path.expanduser(cache_dir)), limit) if cache_dir else None
        # A flag: "false" (from a config) unpickled every .pyd field, running whatever it held.
        allow_pickle = flag(allow_pickle, "allow_pickle")
        self._decoder = Decoder(images=decode, allow_pickle=allow_pickle)
        self.decode_threads = integer(decode_threads, "decode_threads", 0)
        self._ahead = DecodeAhead(decode, allow_pickle) if decode_threads else None
        self._resolved: Source | None = None
        self._fields_checked = False
        self._counts: np.ndarray | None = None
        self.on_error = ErrorPolicy.of(on_error)
        if isinstance(source, Mix) and sampling is not None and sampling.weighted:
            # A mix draws each source's own epoch sequence by the mix's weights; weights per
            # class or sample of the mixed whole have no sequence to act on (and were ignored).
            raise ValueError("class_weights and sample_weights do not apply to a Mix: weight the sources "
                             "(Mix(weights=...)), or sample each dataset by weight on its own; "
                             "Sampling(samples_per_epoch=..., resampled=...) does apply")
        if sampling is not None and not isinstance(sampling, Sampling):  # "balanced" failed at iteration
            raise TypeError(f"sampling must be a shardstream.Sampling (such as Sampling(class_weights=\"balanced\")), "
                            f"not {sampling!r}")
        self.sampling = sampling
        self._epochs: EpochSequences | None = None  # see _sequences
        self._shared = SharedState()  # epoch and counters, seen by the workers too
        # This process's head start, by process id (see _head_start): a dict, so that the copies of
        # this dataset (`shardstream.DataLoader`'s) share it, and a copy's read-ahead is counted
        # by the caller's `io_stats` too.
        self._heads: dict[int, HeadStart] = {}
        self._outside: dict[int, IOStats] = {}  # this process's reads outside iterations (_counted_outside)
        self._init_checkpointing()

    # -- epochs, world and layout --------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._shared.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields.

        Another epoch than a loaded state's drops that state (the loop has moved on); if
        none of it was read yet, with a warning: a restarted loop usually means to start
        at the loaded epoch (`dataset.epoch`)."""
        epoch = integer(epoch, "epoch", 0, MAX_EPOCH + 1)  # 2**64 was read back as epoch 0, silently
        if epoch != self.epoch:
            if self._shared.loaded_unread:
                warnings.warn(f"set_epoch({epoch}) drops the state loaded for epoch {self.epoch}, of which nothing "
                              f"was read: to resume, start the loop at the loaded epoch (dataset.epoch, "
                              f"{self.epoch})", stacklevel=2)
            self.forget_resume()
        self._shared.epoch = epoch
        self._shared.epoch_chosen = True
        self._shared.plain_iterated = False

    def world(self) -> World:
        """This process's place: rank and size (explicit, or detected), DataLoader worker."""
        return World.detect(self.rank, self.world_size)

    def __copy__(self) -> "StreamingDataset":
        """A shallow copy sharing this one's attributes (`shardstream.DataLoader` holds one),
        its head start among them: `copy.copy` would otherwise go through `__getstate__`,
        which drops it (for pickling), and the copy's read-ahead went uncounted here."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker started by spawn or forkserver cannot see the parent's process
        # group: pin the rank and world size of that group. Only of a process group: a
        # launcher's own spawn (mp.spawn of the training processes, which then join a group)
        # must leave each child to find its rank, and children inherit torchrun's variables.
        spawning = get_worker_info() is None and get_spawning_popen() is not None
        if spawning:
            self.weigh_for_workers()  # before the copy, which then carries them
        state = self.__dict__.copy()
        state["_heads"] = {}  # threads and their reads stay in their process
        state["_outside"] = {}
        if spawning:
            if _in_process_group():
                world = World.detect(self.rank, self.world_size)
                state["rank"], state["world_size"] = world.rank, world.size
            state["_callers_settings"] = callers_settings()  # what a forked worker inherits (inherited.py)
        return state

    def weigh_for_workers(self) -> None:
        """Read the draw weights of a weighted `sampling` here, once, for DataLoader workers
        about to start: they inherit them (forked) or receive them (spawned), where each would
        read every shard's index for them (a remote store: every worker of every rank a
        request a shard). `shardstream.DataLoader` calls it, and pickling for a worker being
        spawned; with torch's DataLoader and forked workers, call it before `iter(loader)`."""
        if self.sampling is not None and self.sampling.weighted and not isinstance(self.source, Mix):
            self._sequences().draw_weights()

    def __setstate__(self, state: dict[str, Any]) -> None:
        settings = state.pop("_callers_settings", None)
        if settings is not None:  # a worker process being started
            take_on(settings)
        self.__dict__.update(state)

    def explain_pickling(self, error: Exception, start_method: str) -> None:
        """Add a note to `error`, raised while DataLoader workers started by `start_method`,
        naming what of this dataset cannot be pickled (`transform`, `collate_fn`, `decode`), if any.

        spawn and forkserver start a fresh interpreter and send it the dataset pickled (a
        forked worker inherits it), so each callable must pickle: not a lambda or a local
        function. Checked once starting failed, so that a start that works costs nothing."""
        if start_method == "fork":
            return
        why = (f"DataLoader workers started by {start_method!r} receive the dataset pickled (forked ones inherit it): "
               "pass a function defined at module level or a picklable object, not a lambda or a local function, "
               "or multiprocessing_context='fork' where fork is safe")
        arguments = (("transform", self.transform), ("collate_fn", self.collate_fn), ("decode", self._decoder.images))
        for name, value in (*arguments, ("dataset", self)):
            try:
                pickle.dumps(value)
            except Exception as reason:  # PicklingError, TypeError or AttributeError, by the object
                what = "the dataset" if name == "dataset" else f"the dataset's {name} argument"
                add_note(error, f"shardstream: {what} cannot be pickled ({reason}); {why}")
                return

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("a StreamingDataset streams its samples and cannot be indexed (torch's Subset, random_split): "
                        "for part of it, pass fewer shards or Sampling(samples_per_epoch=...)")

    def layout(self, world: World) -> Layout:
        layout = Layout(world.size, world.workers, self.batch_size, self.drop_last, self.partial,
                        self.shuffle, self.shuffle_buffer)
        # A run is how many chunks a worker is dealt at a time, which one worker reading them all does
        # not need: so one worker's layout stays what states from before runs hold.
        return replace(layout, run=self._sequences().deal_run(layout.chunk)) if world.workers > 1 else layout

    @_counted_outside
    def resolve(self) -> Source:
        """Read the manifest (or list the shards) once per process."""
        if self._resolved is None:
            source = resolve_source(self.source, storage_options=self.storage_options, retry=self.retry)
            if self._cache is not None and not source.cacheable:
                # Here, not at the first sample: counting tars without an index read them all first.
                raise StorageError("cache_dir keeps the shards of datasets with a manifest (its checksums verify "
                                   "each copy), and these remote shards have none: `shardstream index` writes one, "
                                   "or leave out cache_dir", url=source.url)
            apart = source.classes_apart()
            if apart is not None and not self._shared.mix_said:
                self._shared.mix_said = True  # once a dataset: every worker of every epoch resolves it
                warnings.warn(f"the mixed sources name their classes differently ({apart}): label k is another "
                              "class in each, and the mix yields the labels as they are; map them to one table in "
                              "a transform", stacklevel=3)
            self._resolved = source
        return self._resolved

    @property
    def classes(self) -> tuple[str, ...]:
        """The class names of the labels (`cls`): ``classes[label]``, as torchvision's `ImageFolder`
        names them (sorted folder names, or a file list's names). From the manifest; () where
        there is none (shards named without one), or a mix's datasets name their labels apart."""
        return self.resolve().classes()

    @property
    def prefetch(self) -> int:
        """Pieces read ahead per worker (see the constructor)."""
        if self._prefetch is not None:
            return self._prefetch
        return PREFETCH_LOCAL if self.resolve().local else PREFETCH_REMOTE

    @_counted_outside
    def counts(self) -> np.ndarray:
        """Samples per shard."""
        if self._counts is None:
            self._counts = self.resolve().counts()
        return self._counts

    @_counted_outside
    def _sequences(self) -> EpochSequences:
        """The epoch sequences (epochs.py), made once per process, and again if `seed` or
        `shuffle` have changed since."""
        made = self._epochs
        if made is None or (made.seed, made.shuffle) != (self.seed, self.shuffle):
            mix = self.source.weights if isinstance(self.source, Mix) else None
            made = self._epochs = EpochSequences(self.resolve(), self.counts(), self.seed, self.shuffle,
                                                 self.sampling, mix)
        return made

    def _plan(self, world: World) -> RankPlan:
        """This rank's reads with `world`'s layout (rankplan.py)."""
        return RankPlan(self._sequences(), self.layout(world), world.rank, self.resampled)

    def _rank_block(self, world: World) -> tuple[np.ndarray, RankPlan, tuple[Segment, ...], int, int]:
        """This rank's samples of the current segment, its plan, the segments finished before
        it (earlier layouts'), items already delivered, and the epoch (that of a loaded resume
        state, else the dataset's)."""
        plan = self._plan(world)
        resume = self._resume_for(world)
        epoch = resume.epoch if resume is not None else self.epoch
        finished, delivered = current_place(resume, plan.layout)
        return plan.block(epoch, finished), plan, finished, delivered, epoch

    def __len__(self) -> int:
        """Items (batches with `batch_size`, else samples) the next iteration yields on this rank."""
        if self.resampled:
            raise TypeError("an endless (resampled) stream has no length; count steps instead")
        block, plan, _, delivered, _ = self._rank_block(self._counting_world())
        return items_of(len(block), plan.layout) - delivered

    def _counting_world(self) -> World:
        """The world `len()` counts with: this process's, but with a loaded state's number of
        DataLoader workers where the training loop's process counts for them. A rank's items do
        not depend on the number of workers (batches are dealt whole), and counted with the
        loop's own one, a state taken with 8 workers was replayed as a resume onto another
        layout: seconds at 10^6 samples, at every `len()` of the resumed epoch."""
        world = self.world()
        resume = self._resume
        if resume is None or self._worker_resume or get_worker_info() is not None:
            return world
        return replace(world, workers=resume.current.layout.workers)

    @property
    def resampled(self) -> bool:
        return self.sampling is not None and self.sampling.resampled

    # -- iteration -------------------------------------------------------------------

    def _check_batching(self) -> None:
        """`collate_fn` and `drop_last` act on the dataset's own batches only; without a
        `batch_size` (the dataset's, or the one `shardstream.DataLoader` sets on its copy)
        they were ignored, and a user who meant the DataLoader's batches got none of it."""
        if self.batch_size is None and (self._collate_given or self.drop_last):
            given = "collate_fn" if self._collate_given else "drop_last"
            raise ValueError(f"{given} applies to the dataset's own batches: give batch_size too (to the dataset, "
                             f"or to shardstream.DataLoader), or pass {given} to the DataLoader that batches "
                             "(partial='drop' leaves out the samples that do not divide evenly over ranks)")

    def _check_fields(self) -> None:
        """A `fields` name that no shard holds, by the manifest, is a typo: said before the
        first sample (under ``on_error="skip"`` every sample was skipped for lacking it, until
        the cap of skips). Not with a `transform`, which may add the field, nor where a shard
        has no manifest entry to list its fields."""
        if self.fields is None or self.transform is not None or self._fields_checked:
            return
        source = self.resolve()
        present = source.fields()
        if not source.shards or present is None:
            return
        for spec in self.fields:
            if not any(name.startswith("__") or name in present for name in spec.split(";")):
                raise MissingFieldError(f"no shard has the field {spec!r} that fields= names; the dataset's fields "
                                        f"are {sorted(present)}", url=source.url)
        self._fields_checked = True  # once: a manifest's fields do not change

    def __iter__(self) -> Iterator[Any]:
        if self.batch_size is not None and _batches_again(sys._getframe(1)):
            raise ValueError(f"this dataset makes batches of {self.batch_size}, and torch's DataLoader batches them "
                             "again (a batch of batches, stacked: (n, batch, ...), and an error at a short last "
                             "batch): pass DataLoader(batch_size=None), or leave batch_size off the dataset")
        # This iteration's storage work counts in its own counters (io_stats(); iostats.py): the
        # manifest `_check_fields` reads and the planning's reads too.
        reads = IOStats()
        with counted_in(reads):
            return self._iterate(reads)

    def _iterate(self, reads: IOStats) -> Iterator[Any]:
        # Planned here, eagerly, not in the generator: a DataLoader worker calls iter()
        # when it starts, and torchdata's StatefulDataLoader asks for the worker's state
        # right after, before the first item.
        self._check_batching()
        self._check_fields()
        world = self.world()
        missed = self._state_not_reached()
        if missed is None and world.workers > SLOTS:
            missed = ShardstreamError(f"{world.workers} DataLoader workers: a StreamingDataset keeps the counts of at "
                                      f"most {SLOTS} (skips, storage, resume), and more would go uncounted")
        if missed is not None:  # at the first item: torch's worker dies of an error from iter() without a word
            return _raising(missed)
        self._forget_stale()  # a worker's own loaded place too, if the epoch has moved on
        loaded, self._loaded_position = self._loaded_position, None
        if loaded is None and self._worker_resume:  # a worker's own state applies to one iteration
            self._resume, self._worker_resume = None, False
        block, plan, finished, delivered, epoch = self._rank_block(world)
        if not self._loader_copy:  # shardstream.DataLoader gives its counts itself: the slots are torch's loops'
            self._shared.iterating_workers = world.workers if get_worker_info() is not None else 0
            self._shared.plain_iterated = True
        if get_worker_info() is not None:
            end_with_parent()  # torch's own DataLoader too, whose workers look for their parent only between items
        self._shared.loader_copy_iterates = self._loader_copy
        self._shared.loaded_unread = False
        self._pass_resume = self._active_resume(world)
        if self._pass_resume is None:
            self._shared.begin_pass(world.worker)
            if loaded is None:  # not the rest of an epoch from a state: its order again
                self._warn_of_a_repeated_order(epoch, world)
        resume_id = self._resume_id if self._resume is not None and not self._worker_resume else None
        worker, done = loaded or plan.start(len(block), delivered, world.worker)
        first = WorkerEpoch(epoch, block, plan.sequence_length(epoch, finished), len(finished), worker, done)
        stream = self._endless(world, plan, first) if plan.endless else self._epoch_items(world, plan, first)
        self._delivered = delivered
        self._position = (epoch, worker, done)
        # The latest iteration begun owns the count and the place `state_dict` reads: an
        # earlier one still open (a loop left with `break`, or `zip(ds, ds)`) that goes on
        # would count its items into another iteration's place.
        self._iteration = iteration = object()
        self._count_io(world.worker, reads)  # the planning's reads: an iterator made and never iterated has read
        items = self._yield(world, stream, resume_id, iteration, reads)
        info = get_worker_info()
        return carry_errors(items, info.id) if self._loader_copy and info is not None else items

    def _yield(self, world: World, stream: Iterator[Any], resume_id: int | None,
               iteration: object, reads: IOStats) -> Iterator[Any]:
        last_count = time.monotonic()
        try:
            while True:
                # The stream reads in this thread as it makes an item: counted as this iteration's
                # (by hand, not `counted_in`: a context manager's 2 us an item is 2% of a raw read's).
                before = counting_into()
                count_into(reads)
                try:
                    item = next(stream, _END)
                finally:
                    count_into(before)
                if item is _END:
                    break
                if self._iteration is iteration:  # counts what the consumer received (main-process iteration)
                    self._delivered += 1
                    epoch, worker, done = self._position
                    self._position = (epoch, worker, done + 1)
                if (now := time.monotonic()) - last_count >= IO_COUNT_INTERVAL_S:  # not per item: 5 us each
                    self._count_io(world.worker, reads)
                    last_count = now
                yield item
                item = None  # not held while the next is made (samples of hundreds of MB)
        finally:
            # A loop that leaves the epoch early (a `break`; torch resetting a persistent worker's
            # iterator) closes this at its `yield`: the reads since the last count, the read-ahead
            # window's in flight among them, are counted once the stream is closed (its reads
            # done). They went uncounted: 83% of the bytes of epochs left after a few steps.
            close = getattr(stream, "close", None)
            if close is not None:
                with counted_in(reads):
                    close()
            self._count_io(world.worker, reads)
        if resume_id is not None:  # the resumed epoch is complete: later passes start afresh
            self._shared.finish_resume(resume_id, world.worker, world.workers)
        if get_worker_info() is None and not self._loader_copy:
            # A loop in this process received the epoch whole (shardstream.DataLoader says so of its
            # own, `finish_pass`). A worker's share read to its end says nothing of the loop's: a look
            # at one batch through workers read ahead to their ends, and the epoch after was warned of.
            self._shared.finished_epoch = self._position[0] + 1
        # A worker's own state stays until its next iteration (see _worker_state); a state loaded
        # while this iteration ran (it no longer owns the place) is the next iteration's.
        if not self._worker_resume and self._iteration is iteration:
            self._resume = None

    def _warn_of_a_repeated_order(self, epoch: int, world: World) -> None:
        """Say so where a shuffled (or sampled) epoch begins again in the order of one a loop just
        received whole (`finished_epoch`), the loop never having called `set_epoch`: every epoch of
        such a loop is the same, as with torch's DistributedSampler, and nothing else shows it.
        Once a dataset, by its first worker alone (a DataLoader worker's warning reaches the
        console from its process; torch's workers, not persistent, are new processes each epoch:
        the slot is shared). torch's own DataLoader with workers tells no process that its loop
        received an epoch whole: not warned there."""
        if not (self.shuffle or self.sampling is not None) or self.resampled or self._shared.epoch_chosen \
                or self._shared.finished_epoch != epoch + 1:
            return  # (Sampling draws an epoch's samples by the epoch: the same few again otherwise)
        if world.worker == 0 and not self._shared.repeat_said:
            self._shared.repeat_said = True
            warnings.warn(f"epoch {epoch} begins again in the order of the pass just read (a shuffle's order, "
                          "and a Sampling's draw, are the epoch's): call set_epoch(epoch) (on the dataset or "
                          "shardstream.DataLoader) before each epoch, or every epoch is this one", stacklevel=4)

    def _epoch_items(self, world: World, plan: RankPlan, part: WorkerEpoch) -> Iterator[Any]:
        """The items of `part` (one plan worker's share of an epoch, after its first items):
        read, decode, batch."""
        draws, remaining, needed = plan.reads(part)
        mine = plan.sequences.samples_of(draws)  # a sample drawn twice is read twice; its draws seed apart
        source = self.resolve()
        head_start = self._head_start(source)
        next_ids = None  # a process on its second iteration or later will likely see another
        if head_start is not None and head_start.iterations > 0:
            next_ids = lambda: plan.next_epoch_reads(part.epoch, part.next_worker, world.worker)  # noqa: E731
            head_start.count_at_stop = functools.partial(_count_read_ahead_of, weakref.ref(self), world.worker)
        samples = read_samples(source, mine[needed], self.counts(), self.prefetch, self._cache,
                               tolerant=self.on_error.mode == "skip", head_start=head_start, next_ids=next_ids)
        ordered = marked(reorder(paired(needed.tolist(), samples), remaining), plan.repeats(part)[remaining].tolist())
        prep = SamplePrep(self._decoder, self.transform, self.fields, self.seed, part.epoch, self._ahead,
                          self.decode_threads)
        ids = draws[remaining].tolist()
        planned = plan.epoch_share(part, len(mine))  # what the fraction cap counts from
        on_skip = lambda: self._shared.add_skip(world.worker)  # noqa: E731

        def earlier() -> Iterator[tuple[dict[str, Any], int]]:
            """The samples the run before yielded, latest first: a resumed pass left with bad samples
            only pads with the last good one, as the uninterrupted pass did. Read only then."""
            back = draws[plan.yielded(part)[::-1]]
            stand_ins = marked(read_samples(source, plan.sequences.samples_of(back), self.counts(), 0, self._cache,
                                            tolerant=True), itertools.repeat(True))
            return zip(stand_ins, back.tolist())

        stages = [samples]  # closed when the items end, however (see _closing)
        if self.decode_threads:
            ahead = prep.ahead_of(paired(ordered, ids))
            stages.insert(0, ahead)
            items = guarded(ahead, prep.complete, self.on_error, planned, on_skip,
                            lambda: prep.ahead_of(earlier()), prep.as_repeat)
        else:
            items = guarded(paired(ordered, ids), lambda pair: prep(*pair), self.on_error, planned, on_skip, earlier,
                            prep.as_repeat)
        if self.batch_size is not None:
            items = prep.batched(items, ids, self.batch_size, self.drop_last, self.collate_fn,
                                 lambda draw: source.where(int(plan.sequences.samples_of(np.array([draw]))[0])))
        if get_worker_info() is None:  # the training loop's process: its own random numbers stay its own
            items = prep.in_callers_process(items, self.collate_fn if self.batch_size is not None else None)
        return _closing(items, stages)

    def _endless(self, world: World, plan: RankPlan, first: WorkerEpoch) -> Iterator[Any]:
        """The items of an endless stream from `first` on, epoch after epoch (`RankPlan.endless_epochs`)."""
        for part in plan.endless_epochs(first):
            yield from self._epoch_items(world, plan, part)

    def _head_start(self, source: Source) -> HeadStart | None:
        """This process's head start on its next iteration (headstart.py), where one pays:
        remote shards, with prefetch on."""
        if self.prefetch <= 0 or not source.indexed or source.local:
            return None
        return _this_process(self._heads, HeadStart)  # a forked child's copy is its parent's, threads and all

    def io_stats(self) -> dict[str, float]:
        """Storage counters (requests, bytes, remote_bytes (those of `bytes` remote storage
        sent: not a cached copy's), retries, wait_s, cache hits and misses, and
        `readahead_waits`: pieces a reader waited for with its read-ahead window at its
        largest, a sign to raise `prefetch`) of this dataset, summed over the processes that
        read for it (the workers, or this process) and over epochs. An iteration counts its
        own reads, its reading threads' too, so that two datasets (or two iterations of one)
        read at the same time in one process count each their own; it adds them as it
        begins, every 50 ms while it yields, and at its end (an iterator suspended and kept:
        when it resumes or is closed). What a process reads for the dataset outside its
        iterations (the manifest `resolve()` or `len()` reads before the first; the head
        start on its next iteration, remote shards) is counted by the next count: in this
        process by this call, in a DataLoader worker by its next iteration's (a persistent
        worker's head start on an epoch that never comes: as the worker exits, so once the
        loader is gone)."""
        self._count_read_ahead(0)
        return self._shared.io()

    def _count_io(self, worker: int, reads: IOStats) -> None:
        """Add an iteration's storage work since its last count (`reads`) to this dataset's counts."""
        done = reads.drain()
        self._shared.add_io(worker, dict.fromkeys(done, 0), done)
        self._count_read_ahead(worker)

    def _count_read_ahead(self, worker: int) -> None:
        """Add what this process read for the dataset outside its iterations since the last
        count: its head start (between iterations), and planning before the first."""
        head_start = self._heads.get(os.getpid())
        for read in (head_start.io if head_start is not None else None, self._outside_reads()):
            done = read.drain() if read is not None else {}
            if any(done.values()):  # a slot is another process's too (worker 0's): touched only to add
                self._shared.add_io(worker, dict.fromkeys(done, 0), done)

    def _outside_reads(self) -> IOStats:
        """This process's counters of the dataset's reads outside its iterations (a forked
        child's copy of its parent's holds the parent's to count, not its own)."""
        return _this_process(self._outside, IOStats)

    @property
    def skipped(self) -> int:
        """Bad samples skipped so far under ``on_error="skip"``, summed over this rank's workers."""
        return self._shared.skips


def _raising(error: Exception) -> Iterator[Any]:
    raise error
    yield


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _urls(source: Any) -> list[str]:
    """The locations a source names (a Mix: those of its parts)."""
    if isinstance(source, Mix):
        return [url for part in source.sources for url in _urls(part)]
    return [source] if isinstance(source, str) else [str(url) for url in source]


def _count_read_ahead_of(dataset: "weakref.ref[StreamingDataset]", worker: int) -> None:
    """`StreamingDataset._count_read_ahead` of the dataset, if it is still there (by a weak
    reference: its head start, which calls this at exit, must not keep it)."""
    alive = dataset()
    if alive is not None:
        alive._count_read_ahead(worker)


def _closing(items: Iterator[Any], stages: list[Any]) -> Iterator[Any]:
    """`items`, then, however the iteration ends, each stage (generator) closed: its thread
    pools shut down now. A bad sample's error, raised again in `guarded`, holds in its
    traceback the frames that hold the stages: caught by the loop (or a `break` after it),
    they lived, threads, read-ahead and all, until the garbage collector found the cycle:
    126 threads and 170 MB more after 60 such epochs (RELIABILITY 256)."""
    try:
        yield from items
    finally:
        for stage in stages:
            stage.close()
