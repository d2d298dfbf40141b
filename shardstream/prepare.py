"""A sample's way from stored bytes to what the training loop receives, in the worker.

`SamplePrep` decodes a sample (decode.py), applies the user's `transform` and picks the
requested fields, and `SamplePrep.batched` collates the results. Every random draw a sample's preparation
makes (a crop, a flip, the user's own augmentations) comes from a generator seeded from
(seed, epoch, sample id), so a sample gets the same draws whichever worker prepares it,
in a resumed run too. The fused crops draw from a torch generator of the iteration's
own, so where nothing else draws, the process's global generators are never touched
(another thread drawing from torch's cannot move a crop, nor be rewound by the loop's
restoring). Where the user's own code runs (a `transform`, a decode callable of theirs,
unpickling), torch's global CPU generator, Python's `random` and numpy's global
generator are seeded, which augmentation code draws from. With `decode_threads`, the
draws stay in the iterating thread and only the pixels go to threads (decode_ahead.py),
so the samples are the same, bit for bit.

The dataset makes a `SamplePrep` per iteration from its settings; nothing here knows
about plans, shards or workers beyond "am I in a DataLoader worker".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .collate import collated, is_own_collate
from .decode import Decoder, image_formats_hint
from .decode_ahead import DecodeAhead
from .device_jpeg import DeferDecode
from .errors import MissingFieldError, ShardstreamError, add_note
from .threads import ordered_map
from .transforms import is_fused, plans_crops

__all__ = ["SamplePrep", "batches", "keeping_callers_generators", "sample_seed"]


@dataclasses.dataclass(frozen=True)
class SamplePrep:
    """How to prepare a sample: its decoding, transform and fields, and the seed of its draws.

    Preparing leaves the generators as the last sample's draws left them; in the training
    loop's own process, `keeping_callers_generators` puts the loop's states back around
    each item.
    """

    decoder: Decoder
    transform: Callable[[dict[str, Any]], Any] | None
    fields: Sequence[str] | None
    seed: int
    epoch: int
    ahead: DecodeAhead | None = None  # with `decode_threads`
    decode_threads: int = 0
    # What the fused crops draw from: this iteration's own (the iterating thread's).
    crops: torch.Generator = dataclasses.field(default_factory=torch.Generator, compare=False, repr=False)

    def __call__(self, sample: dict[str, Any], sample_id: int) -> Any:
        """The sample decoded, transformed and picked, its draws seeded by `sample_id`."""
        if "__error__" in sample:
            raise sample["__error__"]
        sample = self._wanted(sample)
        # Random augmentations draw from generators seeded per sample from (seed, epoch,
        # sample id): the same sample gets the same crop in a resumed run, whichever
        # worker serves it. Where nothing can draw, the seeding is left out.
        crops = self._crops_for(sample_id)
        if not self.draws_globally:
            return self._picked(self.decoder(sample, crops))
        with self._seeded(sample_id):
            sample = self.decoder(sample, crops)
            if self.transform is not None:
                sample = _transformed(self.transform, sample)
        return self._picked(sample)

    @property
    def draws_globally(self) -> bool:
        """Whether preparing a sample may draw from the process's global generators: a
        transform, a decode callable of the user's, or unpickling (which runs any code)
        may; the fused crops draw from `crops`."""
        return self.runs_user_code or self.decoder.allow_pickle

    def _crops_for(self, sample_id: int) -> torch.Generator | None:
        """`crops`, seeded for the sample, where the images are decoded by a fused crop."""
        if not self._crops_draw:
            return None
        return self.crops.manual_seed(sample_seed(self.seed, self.epoch, sample_id))

    @functools.cached_property
    def _crops_draw(self) -> bool:
        """Whether the images are decoded by one of ours that draws from `crops` (asked once a sample)."""
        return _draws_crops(self.decoder.images)

    @functools.cached_property
    def runs_user_code(self) -> bool:
        """Whether the user's own code prepares samples (a transform, a decode callable not
        ours), which may draw from any global generator; ours draw from `crops` only, so
        for them the global ones are left alone (in the main process, saving and restoring
        numpy's state costs about 90 us a sample)."""
        return self.transform is not None or (callable(self.decoder.images) and not self._crops_draw)

    def in_callers_process(self, items: Iterator[Any], collate: Callable[[list[Any]], Any] | None) -> Iterator[Any]:
        """`items` (prepared by this, collated by `collate` if batched) as the training
        loop's own process takes them: where anything draws, with the loop's generator states
        put back around each (`keeping_callers_generators`)."""
        python_too = self.runs_user_code or (collate is not None and not is_own_collate(collate))
        if not (self.draws_globally or python_too):
            return items
        return keeping_callers_generators(items, python_too)

    def _seeded(self, sample_id: int) -> contextlib.AbstractContextManager[None]:
        # The CPU generator only: torch.manual_seed also queues CUDA seeding, which costs
        # ~0.8 ms per call, as much as decoding a small image. Seeded apart from the crops'
        # (`_USER_CODE`): on one seed, a transform's first draw would be the crop's.
        seed = sample_seed(self.seed, self.epoch, sample_id) ^ _USER_CODE
        python_seed = seed if self.runs_user_code else None
        return _generators_as(lambda generator: generator.manual_seed(seed), python_seed)

    def batched(self, items: Iterator[Any], ids: Sequence[int], size: int, drop_last: bool,
                collate: Callable[[list[Any]], Any],
                where: Callable[[int], tuple[str | None, str | None]] = lambda _: (None, None)) -> Iterator[Any]:
        """`items`, prepared from the samples `ids` in order, collated `size` at a time; the
        last, shorter batch too unless `drop_last`. A collate_fn of the user's (MixUp, CutMix)
        draws under a seed from (seed, epoch, the batch's sample ids), as a sample's
        preparation does: a batch gets the same draws in any process, run or resumed run
        (unseeded, it drew from the caller's generator with ``num_workers=0``, and from the
        state the last sample left in a worker). A batch that does not collate is a
        CollateError naming the odd sample: `where` gives a sample id's shard and key."""
        names = [str(spec) for spec in self.fields] if self.fields is not None else None
        for k, batch in enumerate(batches(items, size, drop_last, list)):
            batch_ids = ids[k * size : (k + 1) * size]
            named = lambda position: where(batch_ids[position])  # noqa: E731
            if is_own_collate(collate):  # they draw nothing
                yield collated(collate, batch, named, names)
                continue
            seed = sample_seed(self.seed, self.epoch, hash(tuple(batch_ids)) & _MASK63)
            with _generators_as(lambda generator: generator.manual_seed(seed), seed):
                out = collated(collate, batch, named, names)
            yield out

    @functools.cached_property
    def _names(self) -> frozenset[str] | None:
        """The fields that `fields` may pick, where nothing else sees a sample (no transform)."""
        if self.fields is None or self.transform is not None:
            return None
        return frozenset(name for spec in self.fields for name in spec.split(";"))

    def _wanted(self, sample: dict[str, Any]) -> dict[str, Any]:
        """`sample` without the bytes of the fields nothing will see, before they are decoded:
        a mask PNG beside the JPEG took 100 times the sample's time to decode, a damaged one
        failed the sample, and a pickle field asked for `allow_pickle`, all for fields
        `fields` drops. Their names stay (as None, which nothing decodes), for a missing
        field's error to list what the sample holds."""
        names = self._names
        if names is None:
            return sample
        return {name: value if name in names or name.startswith("__") else None for name, value in sample.items()}

    def as_repeat(self, item: Any) -> Any:
        """A prepared `item` again, its ``__pad__`` set: a stand-in for a skipped sample
        (policy.guarded) repeats the sample after it. Where the item holds no ``__pad__``
        (a transform's own result, or `fields` without it), as it is."""
        if isinstance(item, dict) and "__pad__" in item:
            return {**item, "__pad__": True}
        if self.fields is not None and isinstance(item, tuple) and any(_picks_pad(spec) for spec in self.fields):
            return tuple(True if _picks_pad(spec) else value for spec, value in zip(self.fields, item))
        return item

    def _picked(self, sample: dict[str, Any]) -> Any:
        if self.fields is None:
            return sample
        if not isinstance(sample, Mapping):
            raise TypeError(f"fields picks from the sample dict, and the transform returned a {type(sample).__name__}: "
                            "return the dict from the transform, or leave fields out")
        return tuple(_pick(sample, spec) for spec in self.fields)

    # -- decode_threads: the same samples, their pixels decoded in threads (decode_ahead.py) --

    def ahead_of(self, pairs: Iterator[tuple[dict[str, Any], int]]) -> Iterator[Future[_Staged]]:
        """The samples' draws here, in order; their pixels in `decode_threads` threads.
        Finish each with `complete`."""
        assert self.ahead is not None
        ahead = self.ahead

        def draw(sample: dict[str, Any], sample_id: int) -> _Staged:
            if "__error__" in sample:
                return _Staged(error=sample["__error__"])
            try:
                # decode_threads takes only our decodes, which draw from `crops` alone; the
                # global generators are seeded for the transform, in `complete`.
                decoded, images = ahead.draw(self._wanted(sample), self._crops_for(sample_id))
            except ShardstreamError as error:
                return _Staged(error=error)
            return _Staged(decoded, images, sample_id)

        def pixels(staged: _Staged) -> _Staged:
            if staged.error is not None:
                return staged
            try:
                return _Staged(ahead.pixels(staged.sample, staged.images), {}, staged.sample_id)
            except ShardstreamError as error:
                return _Staged(error=error)

        return ordered_map(pixels, (draw(sample, sample_id) for sample, sample_id in pairs), self.decode_threads,
                           name="shardstream-decode")

    def complete(self, future: Future[_Staged]) -> Any:
        """A sample from `ahead_of`, transformed (under the sample's seed, as `__call__`) and picked."""
        staged = future.result()
        if staged.error is not None:
            raise staged.error
        sample = staged.sample
        if self.draws_globally:
            # Seeded as `__call__` seeds: what a collate_fn that draws finds after the last
            # sample (in a worker; elsewhere the caller's own state comes back) is the same.
            with self._seeded(staged.sample_id):
                if self.transform is not None:
                    sample = _transformed(self.transform, sample)
        return self._picked(sample)


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A sample between its draws and its pixels (`decode_threads`), or its error."""

    sample: dict[str, Any] = dataclasses.field(default_factory=dict)
    images: dict[str, Any] = dataclasses.field(default_factory=dict)  # image fields left to decode
    sample_id: int = 0
    error: ShardstreamError | None = None


def _draws_crops(images: object) -> bool:
    """Whether `images` is ours and draws from the generator passed to it (a fused crop, or
    `DeferDecode` of one, for the device), so that nothing else need be seeded."""
    if type(images).__call__ is DeferDecode.__call__:
        return plans_crops(images.transform)  # type: ignore[attr-defined]
    return is_fused(images)


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """splitmix64 of the triple: cheap, and well spread for consecutive ids."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + sample_id + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


_MASK63 = (1 << 63) - 1
_USER_CODE = 0x2545F4914F6CDD1D  # sets the user code's seed apart from the crops' (within 63 bits)


def keeping_callers_generators(items: Iterator[Any], python_too: bool) -> Iterator[Any]:
    """`items`, with the caller's generators (torch's CPU one; with `python_too`, Python's
    and numpy's global ones too) put back as they were each time one is handed over, so
    that the training loop's own random numbers do not depend on ours: for an iteration
    in the loop's own process. Saved and put back once an item (a whole batch where the
    dataset batches), not once a sample: Python's and numpy's states cost about 130 us
    a sample to save and put back, a few percent of an image's preparation."""
    pending = iter(items)
    try:
        while True:
            saved = _generator_states(python_too)
            try:
                item = next(pending)
            except StopIteration:
                return
            finally:
                _restore_generators(*saved)
            yield item
            item = None  # not held while the next is made (samples of hundreds of MB)
    finally:
        close = getattr(pending, "close", None)
        if close is not None:  # a loop that stops early ends the reading now, not at collection
            close()


@contextlib.contextmanager
def _generators_as(setup: Callable[[torch.Generator], Any], python_seed: int | None) -> Iterator[None]:
    """torch's CPU generator set up for a sample, and with `python_seed` Python's and numpy's
    global generators seeded (`keeping_callers_generators` puts the caller's back)."""
    setup(torch.default_generator)
    if python_seed is not None:
        random.seed(python_seed)
        # numpy's legacy seeding takes 32-bit words: both halves, or 406 of ImageNet's 1.28M
        # samples shared their np.random stream with another's in an epoch.
        np.random.seed([python_seed & 0xFFFFFFFF, (python_seed >> 32) & 0xFFFFFFFF])
    yield


def _generator_states(python_too: bool) -> tuple[torch.Tensor, Any, Any]:
    state = torch.default_generator.get_state()
    return (state, random.getstate(), np.random.get_state(legacy=False)) if python_too else (state, None, None)


def _restore_generators(torch_state: torch.Tensor, python_state: Any, numpy_state: Any) -> None:
    torch.default_generator.set_state(torch_state)
    if python_state is not None:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _transformed(transform: Callable[[Any], Any], sample: dict[str, Any]) -> Any:
    """`transform(sample)`; an error it raises keeps its type (it is the user's code, not bad
    data, so no error policy skips it) and gains a note naming the sample."""
    try:
        return transform(sample)
    except Exception as e:
        add_note(e, f"shardstream: in the transform of sample {sample.get('__key__')!r} of {sample.get('__url__')}")
        raise


def _picks_pad(spec: str) -> bool:
    """Whether a `fields` spec picks ``__pad__``, which every sample holds: as its first name."""
    return spec.split(";")[0] == "__pad__"


def _pick(sample: dict[str, Any], spec: str) -> Any:
    for name in spec.split(";"):
        if name in sample:
            return sample[name]
    has = sorted(k for k in sample if not k.startswith("__"))
    raise MissingFieldError(f"no field {spec!r}; the sample has {has}{image_formats_hint([*spec.split(';'), *has])}",
                            url=sample.get("__url__"), key=sample.get("__key__"))


def batches(items: Iterator[Any], size: int, drop_last: bool, collate: Callable[[list[Any]], Any]) -> Iterator[Any]:
    """`items` collated `size` at a time; the last, shorter batch too unless `drop_last`."""
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield collate(batch)
            batch = []
    if batch and not drop_last:
        yield collate(batch)
