"""shardstream.DataLoader on a machine without CUDA, and JPEG decoding moved to the device side.

Real worker processes throughout. The CUDA branches are exercised by tools/gpu_check.py
on a GPU machine; here the same API must run on the CPU and give the CPU pipeline's
batches exactly.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import torch

import shardstream
from shardstream import DataLoader, DecodeOnDevice, DeferDecode, Normalize, RandomResizedCropJPEG, StreamingDataset
from shardstream.device_jpeg import EncodedBatch, EncodedImage, collate_encoded, decode_then_crop, gpu_decoder_available
from shardstream.batches import to_device
from shardstream.transforms import CenterCropJPEG, CropPlan, crop_resize

ROOT = Path(__file__).resolve().parent.parent
SIZE = 24
BATCH = 4


def images(packed: str, decode, **kwargs) -> StreamingDataset:
    return StreamingDataset(packed, shuffle=True, seed=3, decode=decode, fields=("jpg", "cls", "__key__"),
                            batch_size=BATCH, **kwargs)


def test_cpu_device_gives_the_plain_batches_and_pinning_is_harmless(packed):
    plain = list(torch.utils.data.DataLoader(images(packed, RandomResizedCropJPEG(SIZE)), batch_size=None,
                                             num_workers=2))
    # pin_memory=True on a machine without CUDA must not fail: there is nothing to pin into.
    loader = DataLoader(images(packed, RandomResizedCropJPEG(SIZE)), num_workers=2, device="cpu", pin_memory=True)
    ours = list(loader)
    assert len(ours) == len(plain) == len(loader)
    for (a, la, ka), (b, lb, kb) in zip(ours, plain):
        assert a.device.type == "cpu" and torch.equal(a, b) and torch.equal(la, lb) and ka == kb
    keys = [k for _, _, batch_keys in ours for k in batch_keys]
    assert len(keys) == len(set(keys)) == int(shardstream.open_dataset(packed).counts().sum())


class _CopyProbe(torch.Tensor):
    """A tensor that notes, for every copy of it to a device, whether it was asked to be asynchronous."""

    asked: list[bool] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.asked.append(bool(kwargs.get("non_blocking", False)))
        return super().__torch_function__(func, types, args, kwargs)


def _probed(samples: list) -> tuple:
    return tuple(t.as_subclass(_CopyProbe) for t in torch.utils.data.default_collate(samples))


def test_a_device_other_than_cuda_gets_each_batch_copied_synchronously(packed):
    """Regression: batches went to a device other than CUDA ("mps" on Apple silicon) by asynchronous
    copies that nothing waited for, from host batches let go of at the next batch: on MPS such a copy
    can read the released memory and deliver wrong values, silently (pytorch#189690). The meta device
    stands in for MPS here: any device but the CPU and CUDA takes the same path."""
    _CopyProbe.asked.clear()
    dataset = StreamingDataset(packed, decode=RandomResizedCropJPEG(SIZE), fields=("jpg", "cls"), batch_size=BATCH,
                               collate_fn=_probed)
    batches = list(DataLoader(dataset, num_workers=0, device="meta"))
    assert batches and all(t.device.type == "meta" for batch in batches for t in batch)
    assert len(_CopyProbe.asked) == 2 * len(batches)  # images and labels, batch by batch
    assert not any(_CopyProbe.asked)


def test_decode_on_device_copies_to_a_device_other_than_cuda_synchronously(packed):
    """Regression: `DecodeOnDevice("mps")` decodes on the CPU, then copied each batch to the device with
    ``non_blocking=True`` from a batch let go of at once: the copy the loader itself makes synchronously
    for such devices (pytorch#189690: wrong values, silently). The meta device stands in for MPS."""
    from torch.overrides import TorchFunctionMode

    asked = []

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to:
                asked.append(bool(kwargs.get("non_blocking", False)))
            return func(*args, **kwargs)

    dataset = StreamingDataset(packed, decode=DeferDecode(RandomResizedCropJPEG(SIZE)), fields=("jpg", "cls"),
                               batch_size=BATCH)
    loader = DataLoader(dataset, num_workers=0, device="meta", transform_on_device=DecodeOnDevice("meta"))
    with Probe():
        images, labels = next(iter(loader))
    assert images.device.type == labels.device.type == "meta" and images.shape[0] == BATCH
    assert asked and not any(asked)


def test_stats_count_what_the_loop_received(packed):
    loader = DataLoader(images(packed, RandomResizedCropJPEG(SIZE)), num_workers=2)
    batches = list(loader)
    stats = loader.stats
    assert stats.batches == len(batches)
    assert stats.samples == sum(len(b[1]) for b in batches) == int(shardstream.open_dataset(packed).counts().sum())
    assert 0 < stats.first_batch_s <= stats.elapsed_s
    assert 0 <= stats.wait_s <= stats.elapsed_s and 0 <= stats.wait_fraction <= 1
    assert stats.samples_per_s == pytest.approx(stats.samples / stats.elapsed_s)


@pytest.mark.parametrize("batching", ["samples", "lists"])
def test_stats_count_samples_whatever_an_item_is(packed, batching):
    """Regression: samples were counted by the first tensor's leading dimension, so an unbatched
    image (3, H, W) counted 3 and a collate_fn=list batch of 4 counted 3."""
    dataset = StreamingDataset(packed, decode=RandomResizedCropJPEG(SIZE), fields=("jpg", "cls"),
                               **({"batch_size": BATCH, "collate_fn": list} if batching == "lists" else {}))
    loader = DataLoader(dataset, num_workers=0)
    items = list(loader)
    expected = int(shardstream.open_dataset(packed).counts().sum())
    assert sum(len(b) for b in items) == expected if batching == "lists" else len(items) == expected
    assert loader.stats.samples == expected


def test_stats_wait_counts_the_start_of_the_epoch(packed):
    """The loop waits for its first batch from the moment it asks: through counting the shards and
    starting the workers too, not only inside the first next() after them."""
    loader = DataLoader(images(packed, RandomResizedCropJPEG(SIZE)), num_workers=2, persistent_workers=False)
    for _ in loader:
        time.sleep(0.01)  # the loop's own work: not waiting
    stats = loader.stats
    assert stats.wait_s >= stats.first_batch_s
    assert stats.wait_s + 0.01 * stats.batches <= stats.elapsed_s + 1e-3


def keys_of(packed: str, **kwargs) -> StreamingDataset:
    return StreamingDataset(packed, shuffle=True, seed=3, decode=None, fields=("__key__",), **kwargs)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_pass_leaves_the_loops_own_generators_alone(packed, num_workers):
    """Found by a user's walk: torch's DataLoader draws its workers' base seed at every pass from
    the training loop's global torch generator, so each epoch moved the loop's own numbers (README
    promises they are left as they were). The loader gives torch a generator of its own."""
    loader = DataLoader(keys_of(packed), batch_size=4, num_workers=num_workers)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert len(list(loader)) == len(loader)
        assert torch.equal(torch.get_rng_state(), before), f"epoch {epoch} drew from the loop's generator"


def test_timeout_without_workers_is_ignored(packed):
    """Regression: timeout=1 with num_workers=0 failed at the first iteration on torch's assertion
    "_SingleProcessDataLoaderIter requires timeout == 0". torch documents timeout as the limit for
    collecting a batch from workers: with none there is nothing to time out on. With workers it applies."""
    expected = [tuple(item) for item in DataLoader(keys_of(packed), num_workers=0)]
    assert [tuple(item) for item in DataLoader(keys_of(packed), num_workers=0, timeout=1)] == expected
    with_workers = DataLoader(keys_of(packed), num_workers=2, timeout=60, persistent_workers=False)
    assert with_workers.timeout == 60
    assert sorted(tuple(item) for item in with_workers) == sorted(expected)


def test_a_start_method_without_workers_is_ignored(packed):
    """Regression: multiprocessing_context="spawn" with num_workers=0 failed at the first
    iteration with torch's ValueError, where timeout and prefetch_factor are ignored so that
    turning workers off needs no other change."""
    expected = [tuple(item) for item in DataLoader(keys_of(packed), num_workers=0)]
    assert [tuple(item) for item in DataLoader(keys_of(packed), num_workers=0, multiprocessing_context="spawn")] \
        == expected


def test_a_negative_timeout_is_refused_at_construction(packed):
    with pytest.raises(ValueError, match="timeout must be 0 or more seconds, not -1"):
        DataLoader(keys_of(packed), num_workers=2, timeout=-1)


@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("argument", ["transform", "collate_fn", "decode"])
def test_an_unpicklable_argument_is_named_when_workers_are_not_forked(packed, method, argument):
    """Regression: a lambda under spawn or forkserver gave pickle's own error, which names a lambda but not
    the argument it was passed as, nor why it must pickle. The error keeps its type and gains a note."""
    kwargs = {"transform": dict(transform=lambda sample: sample), "collate_fn": dict(collate_fn=lambda b: b),
              "decode": dict(decode=lambda data: data)}[argument]
    dataset = StreamingDataset(packed, fields=("__key__",), batch_size=2, **{"decode": None, **kwargs})
    loader = DataLoader(dataset, num_workers=1, multiprocessing_context=method)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as raised:
        next(iter(loader))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"the dataset's {argument} argument cannot be pickled" in notes
    assert f"DataLoader workers started by '{method}' receive the dataset pickled" in notes


def test_spawned_workers_decode_under_the_callers_pixel_limit(packed, monkeypatch):
    """Found by the thirty-ninth session's walk: a pixel limit set in the training script (raised
    for trusted photos) held in forked workers, which inherit it, and not in spawned ones, which
    start a fresh interpreter: the dataset carries it to them. Lowered here, so that every image
    is over it: refused in the worker as in this process."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    dataset = StreamingDataset(packed, fields=("jpg",))
    with pytest.raises(shardstream.ShardstreamError, match="exceeds limit of 200 pixels"):
        next(iter(dataset))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    it = iter(loader)
    try:
        with pytest.raises(shardstream.ShardstreamError, match="exceeds limit of 200 pixels"):
            next(it)
    finally:
        it._shutdown_workers()  # now: after an error torch's re-raise keeps the iterator in a reference cycle


def _warns_in_the_worker(sample: dict) -> dict:
    warnings.warn("said in a DataLoader worker", UserWarning)
    return sample


def _first_of_a_spawned_worker(dataset: StreamingDataset) -> object:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    it = iter(loader)
    try:
        return next(it)
    finally:
        it._shutdown_workers()  # now: after an error torch's re-raise keeps the iterator in a reference cycle


def test_spawned_workers_warn_under_the_callers_warning_filters(packed, capfd):
    """Found by the forty-first session's review: forked workers inherit the training script's warning
    filters, spawned ones (macOS's and Windows' default) started with Python's own, so a warning the script
    silenced printed once a worker, and one it made an error printed and the epoch went on."""
    dataset = StreamingDataset(packed, fields=("__key__",), transform=_warns_in_the_worker)
    _first_of_a_spawned_worker(dataset)
    assert "said in a DataLoader worker" in capfd.readouterr().err  # the worker's stderr is this process's
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="said in a DataLoader worker")
        _first_of_a_spawned_worker(dataset)
    assert "said in a DataLoader worker" not in capfd.readouterr().err
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="said in a DataLoader worker")
        with pytest.raises(Exception, match="said in a DataLoader worker"):
            _first_of_a_spawned_worker(dataset)


def test_a_warning_filter_that_does_not_pickle_stays_behind_and_is_named(caplog):
    from shardstream.inherited import callers_settings, take_on

    class Local(UserWarning):  # a class inside a function does not pickle
        pass

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=Local)
        warnings.filterwarnings("error", message="kept")
        settings = callers_settings()
    assert settings["filters_left"] == 1
    assert [pickle.loads(f)[0] for f in settings["warning_filters"][:1]] == ["error"]
    # One that pickles here and does not unpickle there (a class of the caller's `__main__` block, say):
    unknown = pickle.dumps(("ignore", None, UserWarning, None, 0)).replace(b"UserWarning", b"NoSuchClass")
    settings["warning_filters"].insert(0, unknown)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="shardstream"):
        warnings.simplefilter("error")  # a warning of take_on's own would fail the worker's start
        take_on(settings)
        with pytest.raises(UserWarning, match="kept"):
            warnings.warn("kept")
    assert [r.getMessage() for r in caplog.records] == [
        "2 of the training process's warning filters could not be sent to this DataLoader worker (they do not "
        "pickle, or name a class it cannot import); it warns without them"]


def test_normalize_is_the_formula_on_any_field():
    images_u8 = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    expected = (images_u8.double() / 255 - mean.double().view(1, 3, 1, 1)) / std.double().view(1, 3, 1, 1)
    labels = torch.tensor([1, 2])
    out_tuple = Normalize()((images_u8, labels))
    out_dict = Normalize(field="jpg", channels_last=True)({"jpg": images_u8, "cls": labels})
    for out in (out_tuple[0], out_dict["jpg"], Normalize()(images_u8)):
        assert out.dtype == torch.float32 and torch.allclose(out.double(), expected, atol=1e-6)
    assert out_dict["jpg"].is_contiguous(memory_format=torch.channels_last)
    assert out_tuple[1] is labels and out_dict["cls"] is labels
    Batch = collections.namedtuple("Batch", "labels images")
    out_named = Normalize(field=1)(Batch(labels, images_u8))
    assert isinstance(out_named, Batch) and torch.allclose(out_named.images.double(), expected, atol=1e-6)
    # A dict batch and the default field 0 (found by a user's walk: a bare `KeyError: 0`).
    with pytest.raises(ValueError, match=r"the batch has no field 0: it holds \['cls', 'jpg'\]; name the image's "
                                         r"field \(field=\"jpg\"\)"):
        Normalize()({"jpg": images_u8, "cls": labels})


def test_normalize_refuses_what_is_not_images_in_chw():
    """Regression: the constants broadcast over the last three dimensions, so a video batch (N, C, T, H, W)
    of 3 frames was normalised along its frames with the channels' constants, silently."""
    video = torch.zeros(1, 3, 3, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"CHW images or NCHW batches of them, not a tensor of shape \(1, 3, 3, 2, 2\)"):
        Normalize()(video)
    with pytest.raises(ValueError, match=r"not a tensor of shape \(5, 7\)"):
        Normalize()(torch.zeros(5, 7, dtype=torch.uint8))
    assert Normalize()(torch.zeros(3, 5, 7, dtype=torch.uint8)).shape == (3, 5, 7)


def test_normalize_refuses_float_images_and_integer_output():
    """Regression: float images already in [0, 1] (torchvision's ToTensor) were divided by 255
    a second time, silently; Normalize(dtype=torch.int64) gave inf."""
    images = torch.rand(2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"takes uint8 images \(0 to 255\), not torch.float32"):
        Normalize()(images)
    with pytest.raises(ValueError, match="dtype=torch.int64 is not a floating-point dtype"):
        Normalize(dtype=torch.int64)
    assert Normalize(dtype=torch.float16)(torch.zeros(2, 3, 4, 4, dtype=torch.uint8)).dtype == torch.float16


def test_normalize_refuses_0_255_constants_and_encoded_batches():
    """Found by a user's walk: mmcv's and timm's 0-255 constants (mean 123.675, std 58.395) gave
    images near -2, all alike, silently; Normalize before DecodeOnDevice raised a bare
    AttributeError ('EncodedBatch' object has no attribute 'dtype')."""
    with pytest.raises(ValueError, match="constants of images in \\[0, 1\\].*divide 0-255 ones by 255"):
        Normalize(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
    from shardstream.device_jpeg import EncodedBatch

    encoded = EncodedBatch.__new__(EncodedBatch)
    with pytest.raises(TypeError, match="not a EncodedBatch: with DeferDecode, put DecodeOnDevice before it"):
        Normalize(field=0)((encoded, torch.zeros(2)))  # as a batch of (images, labels) comes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalize_to_half_precision_rounds_once(dtype):
    """Regression: Normalize to bfloat16 or float16 computed in that dtype, its constants and
    each step rounded (bfloat16: off by up to 0.022 where a value rounded once is within
    0.008; 478 of the 768 values here not the nearest). Computed in float32 and rounded
    once, every value is the nearest of `dtype` to the exact result."""
    images = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    mean = torch.tensor((0.485, 0.456, 0.406), dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225), dtype=torch.float64).view(1, 3, 1, 1)
    exact = (images.double() / 255 - mean) / std
    out = Normalize(dtype=dtype)(images)
    assert out.dtype == dtype and torch.equal(out, exact.to(dtype))
    # and float64 stays float64 inside (found by review: computed in float32, 2e-7 off)
    assert torch.allclose(Normalize(dtype=torch.float64)(images), exact, rtol=0, atol=1e-12)


def test_normalize_refuses_constants_for_another_number_of_channels():
    """Regression: a grey batch (N, 1, H, W) came out as (N, 3, H, W), each channel normalised with other
    constants, broadcast silently against the three means."""
    grey = torch.full((2, 1, 4, 4), 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"3 means and 3 stds for images of 1 channels \(shape \(2, 1, 4, 4\)\)"):
        Normalize()(grey)
    with pytest.raises(ValueError, match="for images of 1 channels"):
        Normalize()(grey[0])  # CHW
    out = Normalize(mean=(0.5,), std=(0.25,))(grey)
    assert out.shape == (2, 1, 4, 4) and torch.allclose(out, torch.full_like(out, (128 / 255 - 0.5) / 0.25))
    with pytest.raises(ValueError, match="as many means as stds"):  # where it is made now
        Normalize(mean=(0.5, 0.5), std=(0.2, 0.2, 0.2))


def test_to_device_keeps_the_batch_structure():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "text")], "b": Pair(torch.arange(3), 7)}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["a"], list) and isinstance(moved["a"][1], tuple) and moved["a"][1][1] == "text"
    assert isinstance(moved["b"], Pair) and moved["b"].y == 7 and torch.equal(moved["b"].x, torch.arange(3))


class Encoding(collections.UserDict):
    """A mapping batch with state of its own, as Hugging Face's BatchEncoding."""

    def __init__(self, data, tag="t"):
        super().__init__(data)
        self.tag = tag


class Fields(dict):
    pass


def test_to_device_walks_every_mapping_and_sequence_and_keeps_their_types():
    from types import MappingProxyType

    from shardstream.batches import tensors

    batch = [Encoding({"ids": torch.ones(2)}, tag="kept"), Fields(x=torch.zeros(1)),
             MappingProxyType({"y": torch.arange(2)}), (torch.ones(1), "text", b"bytes")]
    meta = torch.device("meta")  # a device this machine has, unlike CUDA, that every moved tensor shows
    moved = to_device(batch, meta)
    assert isinstance(moved[0], Encoding) and moved[0].tag == "kept" and isinstance(moved[1], Fields)
    assert moved[2]["y"].is_meta and moved[3][1:] == ("text", b"bytes")
    found = list(tensors(moved))
    assert len(found) == 4 and all(t.is_meta for t in found)  # what record_stream is called on, on CUDA
    assert batch[0]["ids"].device.type == "cpu"  # the batch given is left as it was


def test_stats_count_samples_when_the_first_field_is_a_list(packed):
    """Regression: a collated batch whose first field is the keys (a list of strings) counted its fields."""
    dataset = StreamingDataset(packed, decode=RandomResizedCropJPEG(SIZE), fields=("__key__", "jpg", "cls"),
                               batch_size=BATCH)
    loader = DataLoader(dataset, num_workers=0)
    assert sum(len(keys) for keys, _, _ in loader) == loader.stats.samples
    assert loader.stats.samples == int(shardstream.open_dataset(packed).counts().sum())


def _two_views(sample: dict) -> dict:
    """Two crops of one image, as contrastive training takes them: ((view1, view2), label) once collated."""
    return {**sample, "views": (sample["jpg"], sample["jpg"].flip(-1))}


def test_stats_count_samples_when_the_first_field_holds_two_views(packed):
    """Regression: a first field of two views collates to a list of two batches, and counted by its length,
    a batch of 8 was 2 samples (stats.samples and samples_per_s a quarter of the truth)."""
    dataset = StreamingDataset(packed, decode=RandomResizedCropJPEG(SIZE), transform=_two_views,
                               fields=("views", "cls"), batch_size=BATCH)
    loader = DataLoader(dataset, num_workers=0)
    assert sum(len(labels) for (_, labels) in loader) == loader.stats.samples
    assert loader.stats.samples == int(shardstream.open_dataset(packed).counts().sum())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_a_cuda_device_without_cuda_runs_the_same_script_on_the_cpu(packed):
    transform = RandomResizedCropJPEG(SIZE)
    reference = list(DataLoader(images(packed, transform), num_workers=2, persistent_workers=False))
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        loader = DataLoader(images(packed, DeferDecode(transform)), num_workers=2, persistent_workers=False,
                            device="cuda", transform_on_device=[DecodeOnDevice("cuda"), Normalize()])
    assert loader.device == torch.device("cpu") and not loader.pin_memory
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        got = list(loader)
    assert len(got) == len(reference) > 1
    for (n, ln, kn), (b, lb, kb) in zip(got, reference):
        assert n.device.type == "cpu" and torch.equal(n, Normalize().normalize(b)) and torch.equal(ln, lb)
        assert kn == kb


class _FakeStream:
    """Stands in for `torch.cuda.Stream` (and `Event`): the copy path's ordering calls, doing nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record(self, stream=None):
        pass


def _fake_cuda(monkeypatch, loader: DataLoader) -> None:
    """Send `loader` down its CUDA copy path (`_on_device`) on a machine without CUDA: the streams and
    events do nothing and the batches stay where they are, so only the path's own logic runs."""
    import contextlib

    import shardstream.loader

    for name in ("Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(shardstream.loader, "to_device", lambda batch, device, non_blocking=True: batch)
    loader.device = torch.device("cuda")


class _FailsAt:
    def __init__(self, key: str):
        self.key = key

    def __call__(self, sample):
        if sample["__key__"] == self.key:
            raise shardstream.DecodeError(f"cannot decode {self.key}")
        return sample


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_on_the_cuda_path_comes_after_the_batches_before_it(packed, monkeypatch, num_workers):
    """Regression: on a CUDA device the loader copies `prefetch_to_device` batches ahead, and an error (a
    worker's, a device transform's) was raised as it arrived: the good batches copied before it, which the
    host path and torch's loader deliver first, were dropped (two here), and the loop never got them."""
    order = [key for batch in DataLoader(keys_of(packed), batch_size=BATCH) for key in batch[0]]
    bad = order[3 * BATCH + 1]  # in the fourth batch

    def received(fake: bool) -> list:
        loader = DataLoader(keys_of(packed, transform=_FailsAt(bad)), batch_size=BATCH, num_workers=num_workers,
                            persistent_workers=False, prefetch_to_device=3)
        if fake:
            _fake_cuda(monkeypatch, loader)
        got = []
        with pytest.raises(shardstream.DecodeError, match="cannot decode"):
            for batch in loader:
                got.append(list(batch[0]))
        assert loader.state_dict()["current"]["delivered"] == len(got)
        return got

    on_host = received(fake=False)
    assert len(on_host) == 3
    assert received(fake=True) == on_host


def test_collate_encoded_keeps_every_images_bytes_and_plan():
    blobs = [b"\xff\xd8first", b"", b"\xff\xd8third one"]
    plans = [CropPlan((10, 8), (0, 0, 8, 10), (4, 4), i == 1) for i in range(3)]
    batch = collate_encoded([EncodedImage(b, p) for b, p in zip(blobs, plans)])
    assert len(batch) == 3 and batch.plans == tuple(plans)
    assert [bytes(t.numpy()) for t in batch.encoded()] == blobs
    # The dataset's default collate packs EncodedImages inside (image, label) tuples too.
    images_, labels = shardstream.default_collate([(EncodedImage(b, p), i) for i, (b, p) in enumerate(zip(blobs, plans))])
    assert isinstance(images_, EncodedBatch) and torch.equal(labels, torch.tensor([0, 1, 2]))
    assert [bytes(t.numpy()) for t in images_.encoded()] == blobs


@pytest.mark.parametrize("transform", [RandomResizedCropJPEG(SIZE), CenterCropJPEG(SIZE, resize=SIZE + 4)],
                         ids=["random-crop", "center-crop"])
def test_decode_on_device_gives_the_cpu_transforms_batches(packed, transform):
    """Workers ship JPEG bytes and the crop they drew; the device side decodes. Without
    CUDA it decodes on the CPU with the fused transform's own code: the same batches,
    bit for bit, as decoding in the workers (same seed, same per-sample randomness)."""
    reference = list(DataLoader(images(packed, transform), num_workers=2, persistent_workers=False))
    decode = DecodeOnDevice(device="cpu")
    assert not decode.on_gpu
    deferred = DataLoader(images(packed, DeferDecode(transform)), num_workers=2, persistent_workers=False,
                          device="cpu", transform_on_device=decode)
    got = list(deferred)
    assert len(got) == len(reference) > 1
    for (a, la, ka), (b, lb, kb) in zip(got, reference):
        assert a.dtype == torch.uint8 and a.shape == (len(ka), 3, SIZE, SIZE)
        assert torch.equal(a, b) and torch.equal(la, lb) and ka == kb
    assert deferred.stats.samples == int(shardstream.open_dataset(packed).counts().sum())
    # A list of device transforms runs in order: decode, then normalise.
    normalized = list(DataLoader(images(packed, DeferDecode(transform)), num_workers=2, device="cpu",
                                 transform_on_device=[decode, Normalize()]))
    for (n, ln, kn), (b, lb, kb) in zip(normalized, reference):
        assert torch.equal(n, Normalize().normalize(b)) and torch.equal(ln, lb) and kn == kb


def test_torch_dataloader_batches_encoded_images_with_our_collate(packed):
    """Where torch's DataLoader makes the batches, shardstream.default_collate packs the
    workers' EncodedImages; the device side then gives the workers' decode exactly."""
    def dataset(decode) -> StreamingDataset:
        return StreamingDataset(packed, shuffle=True, seed=3, decode=decode, fields=("jpg", "cls", "__key__"))

    def loader(decode) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(dataset(decode), batch_size=BATCH, num_workers=2,
                                           collate_fn=shardstream.default_collate)

    reference = list(loader(RandomResizedCropJPEG(SIZE)))
    got = list(loader(DeferDecode(RandomResizedCropJPEG(SIZE))))
    assert len(got) == len(reference) > 1
    for (encoded, la, ka), (b, lb, kb) in zip(got, reference):
        assert isinstance(encoded, EncodedBatch) and ka == kb and torch.equal(la, lb)
        assert torch.equal(DecodeOnDevice("cpu")(encoded), b)


def test_decode_on_device_resumes_exactly(packed):
    """The crop is drawn in the worker from the per-sample seed, so a checkpoint taken
    mid-epoch resumes onto the same device-decoded batches."""
    def make() -> DataLoader:
        return DataLoader(images(packed, DeferDecode(RandomResizedCropJPEG(SIZE))), num_workers=2,
                          persistent_workers=False, device="cpu", transform_on_device=DecodeOnDevice(device="cpu"))

    full = list(make())
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(2)]
    state = first.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(full)
    for (a, la, ka), (b, lb, kb) in zip(head + rest, full):
        assert torch.equal(a, b) and torch.equal(la, lb) and ka == kb


def test_the_gpu_branch_crops_like_the_cpu_transform(packed):
    """The nvJPEG branch decodes the batch in one call, then crops, resizes and flips as
    tensors on the device. Run here with a CPU decoder in nvJPEG's place, it must give
    the fused CPU transform's crops: within a level where the CPU path also resizes the
    full-scale image, within resampling differences where the CPU path decodes at a
    DCT-reduced scale, and always far closer than the mirror image (a wrong box, size
    order or flip is tens of levels off)."""
    from shardstream.decode import decode_rgb

    def decode_all(encoded):
        return [torch.from_numpy(decode_rgb(bytes(t.numpy()))).permute(2, 0, 1) for t in encoded]

    blobs = [s["jpg"] for ref in shardstream.open_dataset(packed).shards for s in ref.reader()][:12]
    for transform, shape in ((RandomResizedCropJPEG((SIZE, SIZE + 8)), (SIZE, SIZE + 8)),
                             (CenterCropJPEG(SIZE, resize=SIZE + 4), (SIZE, SIZE))):
        torch.manual_seed(5)
        batch = collate_encoded([DeferDecode(transform)(b) for b in blobs])
        got = decode_then_crop(batch, decode_all)
        assert got.dtype == torch.uint8 and got.shape == (len(blobs), 3, *shape)
        for image, data, plan in zip(got, blobs, batch.plans):
            want = crop_resize(data, plan).float()
            close = float((image.float() - want).abs().mean())
            mirrored = float((image.flip(-1).float() - want).abs().mean())
            # Where crop_resize decodes at full scale (its rule: the crop at least the output size).
            at_least = [min(f, max(1, f * o // c)) for f, o, c in zip(plan.full, plan.size, plan.box[:1:-1])]
            full_scale = decode_rgb(data, tuple(at_least)).shape[:2] == plan.full[::-1]
            assert close < (1.0 if full_scale else 16.0), (plan, close)
            assert close < mirrored / 3, (plan, close, mirrored)
        assert any(p.flip for p in batch.plans) == isinstance(transform, RandomResizedCropJPEG)


def _png(width: int = 40, height: int = 30) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_the_gpu_branch_sends_only_jpegs_to_the_jpeg_decoder(packed):
    from shardstream.decode import decode_rgb

    jpegs = [s["jpg"] for s in shardstream.open_dataset(packed).shards[0].reader()][:2]
    blobs = [jpegs[0], _png(), jpegs[1]]
    torch.manual_seed(1)
    batch = collate_encoded([DeferDecode(RandomResizedCropJPEG(SIZE))(b) for b in blobs])
    seen: list[int] = []

    def decode_all(encoded):
        seen.append(len(encoded))
        assert all(bytes(t[:2].numpy()) == b"\xff\xd8" for t in encoded)
        return [torch.from_numpy(decode_rgb(bytes(t.numpy()))).permute(2, 0, 1) for t in encoded]

    def decode_others(which):
        assert which == [1]
        return torch.stack([crop_resize(blobs[i], batch.plans[i]) for i in which])

    got = decode_then_crop(batch, decode_all, [0, 2], decode_others)
    assert seen == [2] and got.shape == (3, 3, SIZE, SIZE)
    assert torch.equal(got[1], crop_resize(blobs[1], batch.plans[1]))
    with pytest.raises(ValueError, match="not JPEGs"):
        decode_then_crop(batch, decode_all, [0, 2])


def test_a_bad_image_on_the_device_side_is_named(packed):
    good = [s["jpg"] for s in shardstream.open_dataset(packed).shards[0].reader()][:3]
    images_ = [DeferDecode(RandomResizedCropJPEG(SIZE))(b) for b in good]
    # Image 1 keeps its header (the worker's plan was drawn from it) but loses its scan data.
    images_[1] = EncodedImage(good[1][: len(good[1]) // 3], images_[1].plan)
    with pytest.raises(shardstream.DecodeError, match="image 1 of a batch of 3"):
        DecodeOnDevice("cpu")((collate_encoded(images_), torch.tensor([0, 1, 2])))


def test_defer_decode_refuses_a_transform_it_cannot_plan():
    with pytest.raises(TypeError, match="plan"):
        DeferDecode(lambda data: data)


def test_decode_on_device_says_what_it_expected(packed):
    """A batch decoded in the workers already (DeferDecode forgotten) gets a clear error."""
    batch = next(iter(DataLoader(images(packed, RandomResizedCropJPEG(SIZE)))))
    with pytest.raises(TypeError, match="DeferDecode"):
        DecodeOnDevice("cpu")(batch)


def test_gpu_decoder_is_only_claimed_where_it_can_run():
    assert DecodeOnDevice(device="cuda").on_gpu == gpu_decoder_available()
    assert not DecodeOnDevice(device="cpu").on_gpu
    if gpu_decoder_available():
        assert torch.cuda.is_available()


def test_gpu_check_runs_its_cpu_checks_without_cuda(tmp_path):
    """tools/gpu_check.py is what a GPU session runs; without CUDA it must still run its
    CPU-side checks (device="cpu" batches, Normalize, decode on the device side) and pass."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--cpu", "--images", "24",
                           "--workers", "2", "--keep", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness passed" in proc.stdout
    assert "decode on the device side" in proc.stdout


def test_the_loader_checks_its_arguments_where_they_are_given(packed):
    """Regression: batch_size=0 gave ZeroDivisionError and '8' a TypeError from divmod, deep in an iteration; a
    dataset batching by 8 under a loader asked for 4 made batches of 4 without a word; a dataset of another
    kind failed on a missing attribute."""
    batched = StreamingDataset(packed, decode=None, batch_size=8, collate_fn=list)
    with pytest.raises(ValueError, match="batch_size must be 1 or more, not 0"):
        DataLoader(StreamingDataset(packed), batch_size=0)
    with pytest.raises(TypeError, match="batch_size must be an integer, not '8'"):
        DataLoader(StreamingDataset(packed), batch_size="8")
    with pytest.raises(ValueError, match="the dataset makes batches of 8 and the loader was asked for 4"):
        DataLoader(batched, batch_size=4)
    with pytest.raises(ValueError, match="num_workers must be 0 or more"):
        DataLoader(batched, num_workers=-1)
    with pytest.raises(TypeError, match="loads a StreamingDataset, not a TensorDataset"):
        DataLoader(torch.utils.data.TensorDataset(torch.zeros(3)))
    assert [len(b) for b in DataLoader(batched, batch_size=8)] == [len(b) for b in batched]


def test_the_loaders_flags_and_prefetch_counts_are_checked_where_given(packed):
    """Regression: pin_memory="no" (from a config) pinned on a CUDA machine, truthy; prefetch_factor=0 failed
    at the first iteration on torch's assertion (then an AttributeError from its iterator's __del__);
    prefetch_to_device="2" failed on a bare comparison and -3 was taken as 1."""
    ds = StreamingDataset(packed, decode=None, fields=("__key__",))
    with pytest.raises(TypeError, match="pin_memory must be True or False, not 'no'"):
        DataLoader(ds, pin_memory="no")
    with pytest.raises(TypeError, match="persistent_workers must be True or False, not 'yes'"):
        DataLoader(ds, num_workers=2, persistent_workers="yes")
    with pytest.raises(ValueError, match="prefetch_factor must be 1 or more, not 0"):
        DataLoader(ds, num_workers=2, prefetch_factor=0)
    with pytest.raises(TypeError, match="prefetch_to_device must be an integer, not '2'"):
        DataLoader(ds, prefetch_to_device="2")
    with pytest.raises(ValueError, match="prefetch_to_device must be 0 or more, not -3"):
        DataLoader(ds, prefetch_to_device=-3)
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=False, pin_memory=np.bool_(False),
                        prefetch_factor=np.int64(3), prefetch_to_device=0)
    assert (loader.pin_memory, loader.prefetch_factor, loader.prefetch_to_device) == (False, 3, 1)
    assert sum(len(keys) for (keys,) in loader) == int(shardstream.open_dataset(packed).counts().sum())


def test_dataset_flags_and_epochs_are_checked(packed):
    """shuffle="no" shuffled (a truthy string); a negative epoch was taken."""
    for name in ("shuffle", "drop_last"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, not 'no'"):
            StreamingDataset(packed, batch_size=2, **{name: "no"})
    assert StreamingDataset(packed, shuffle=np.bool_(True)).shuffle is True
    with pytest.raises(ValueError, match="epoch must be 0 or more"):
        StreamingDataset(packed).set_epoch(-1)


def test_every_flag_and_argument_of_the_public_api_is_checked_where_given(packed, image_folder, tmp_path):
    """Regression (found by review): flags other than the dataset's took any truthy value, so
    allow_pickle="false" unpickled (ran) every .pyd field; ShardWriter(overwrite="no") and
    pack(overwrite="false") replaced the dataset there; resampled="no" made an endless epoch;
    flip="no" flipped; a numpy seed failed pack in msgpack; std 0 made inf; and fields=[],
    transform=5, sampling="balanced", rank >= world_size, RetryPolicy(attempts=2.5),
    ShardWriter(classes="cat") failed late or not at all. Each is refused where it is given."""
    from shardstream import RandomResizedCropJPEG, RetryPolicy, Sampling, ShardWriter

    existing = tmp_path / "existing"
    shardstream.pack(str(image_folder), str(existing), progress=False)
    before = sorted((path.name, path.read_bytes()) for path in existing.iterdir())
    refused = [
        (TypeError, "allow_pickle must be True or False, not 'false'", lambda: StreamingDataset(packed, allow_pickle="false")),
        (TypeError, "resampled must be True or False", lambda: Sampling(resampled="no")),
        (TypeError, "flip must be True or False", lambda: RandomResizedCropJPEG(32, flip="no")),
        (TypeError, "channels_last must be True or False", lambda: Normalize(channels_last="no")),
        (ValueError, "no std of 0", lambda: Normalize(std=(0.229, 0.0, 0.225))),
        (TypeError, "mean must be a sequence of numbers", lambda: Normalize(mean=0.5)),
        (ValueError, "fields must name one field or more", lambda: StreamingDataset(packed, fields=[])),
        (ValueError, "fields must name one field or more", lambda: StreamingDataset(packed, fields=[1, 2])),
        (TypeError, "transform must be callable, not 5", lambda: StreamingDataset(packed, transform=5)),
        (TypeError, "sampling must be a shardstream.Sampling", lambda: StreamingDataset(packed, sampling="balanced")),
        (ValueError, "rank must be below world_size: rank=3, world_size=2",
         lambda: StreamingDataset(packed, rank=3, world_size=2)),
        (ValueError, "world_size must be below 16777217", lambda: StreamingDataset(packed, world_size=10 ** 9)),
        (TypeError, "RetryPolicy's attempts must be an integer, not 2.5", lambda: RetryPolicy(attempts=2.5)),
        (ValueError, "finite delays", lambda: RetryPolicy(max_delay=float("nan"))),
        (TypeError, "overwrite must be True or False, not 'no'", lambda: ShardWriter(str(tmp_path / "w"), overwrite="no")),
        (TypeError, "classes must be a sequence of class names, not 'cat'",
         lambda: ShardWriter(str(tmp_path / "w"), classes="cat")),
        (TypeError, "level must be an integer, not 3.5", lambda: ShardWriter(str(tmp_path / "w"), level=3.5)),
        (TypeError, "overwrite must be True or False, not 'false'",
         lambda: shardstream.pack(str(image_folder), str(existing), overwrite="false", progress=False)),
        (TypeError, "shuffle must be True or False, not 'no'",
         lambda: shardstream.pack(str(image_folder), str(tmp_path / "p"), shuffle="no", progress=False)),
        (TypeError, "max_samples must be an integer, not 10.5",
         lambda: shardstream.pack(str(image_folder), str(tmp_path / "p"), max_samples=10.5, progress=False)),
    ]
    from shardstream.adopt import index_tars

    refused += [  # found by review of the fix: index's flag, and a generator of class names read twice
        (TypeError, "overwrite must be True or False, not 'false'",
         lambda: index_tars(str(existing), overwrite="false")),
    ]
    for error, message, make in refused:
        with pytest.raises(error, match=re.escape(message)):
            make()
    assert ShardWriter(str(tmp_path / "w"), classes=(name for name in ("cat", "dog"))).classes == ("cat", "dog")
    assert not (tmp_path / "w").exists() and not (tmp_path / "p").exists()
    assert sorted((path.name, path.read_bytes()) for path in existing.iterdir()) == before  # not replaced
    summary = shardstream.pack(str(image_folder), str(tmp_path / "p"), seed=np.int64(5), workers=np.int64(1),
                               progress=False)
    assert summary.samples > 0 and type(shardstream.open_dataset(str(tmp_path / "p")).manifest.options["seed"]) is int


def test_setting_another_epoch_than_a_loaded_states_warns(packed):
    """Regression: README's restart loop started at epoch 0 and set_epoch(0) dropped a state loaded for epoch 1
    in silence: the run repeated epoch 0 and 1 whole. It still drops it (the loop has said where it is), with a
    warning while none of the state was read; the loaded epoch itself, and later epochs once read, do not warn."""
    ds = StreamingDataset(packed, decode=None, fields=("__key__",))
    ds.set_epoch(1)
    it = iter(ds)
    next(it), next(it)
    state = ds.state_dict()
    restarted = StreamingDataset(packed, decode=None, fields=("__key__",))
    restarted.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"set_epoch\(0\) drops the state loaded for epoch 1, of which nothing was"):
        restarted.set_epoch(0)
    assert len(list(restarted)) == len(ds)  # epoch 0, whole
    resumed = StreamingDataset(packed, decode=None, fields=("__key__",))
    resumed.load_state_dict(state)
    loader = DataLoader(resumed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.set_epoch(resumed.epoch)
        assert len(list(loader)) == len(ds) - 2
        loader.set_epoch(2)


def test_two_loaders_of_one_dataset_keep_their_own_counts_and_states(packed):
    """Regression (left since the twenty-ninth session): the loaders of one dataset share its slots.
    A look at a batch through a second loader with workers made the training loader's state_dict
    refuse ("the DataLoader iterating this dataset has 1 workers, and num_workers=2 was given"),
    and the training loader's roll-back (load_state_dict) ended the second loader's persistent
    workers with "load_state_dict was called after this DataLoader's persistent workers started".
    Each keeps its own now: the state resumes the training epoch exactly, the look reads its
    epoch from its start."""
    ds = keys_of(packed)
    train = DataLoader(ds, batch_size=2, num_workers=2)
    look = DataLoader(ds, batch_size=2, num_workers=1)
    full = [tuple(keys) for keys, in DataLoader(keys_of(packed), batch_size=2, num_workers=2,
                                               persistent_workers=False)]
    look_first = tuple(next(iter(DataLoader(keys_of(packed), batch_size=2, num_workers=1,
                                            persistent_workers=False)))[0])
    got = []
    for i, (keys,) in enumerate(train):
        got.append(tuple(keys))
        if i == 1:
            assert tuple(next(iter(look))[0]) == look_first
        if i == 3:
            state = train.state_dict()
            break
    assert got == full[:4]
    train.load_state_dict(state)  # a roll-back, the look's persistent workers alive
    assert tuple(next(iter(look))[0]) == look_first
    assert [tuple(keys) for keys, in train] == full[4:]
    del train, look


def test_a_state_loaded_into_the_loaders_own_dataset_reaches_its_persistent_workers(packed):
    """Regression (found by review of the change above): `loader.dataset.load_state_dict(state)` (README
    names `loader.dataset`) with persistent workers alive was refused by those workers; with the check
    let go for the loader's copy, they read the epoch from its start and repeated the samples before
    the state, silently. Workers started before the copy's state are replaced now."""
    full = [tuple(keys) for keys, in DataLoader(keys_of(packed), batch_size=2, num_workers=2,
                                               persistent_workers=False)]
    loader = DataLoader(keys_of(packed), batch_size=2, num_workers=2)
    it = iter(loader)
    taken = [tuple(next(it)[0]) for _ in range(3)]
    state = loader.state_dict()
    del it
    assert [tuple(keys) for keys, in loader] == full  # a whole pass: the workers live on
    loader.dataset.load_state_dict(state)
    assert len(loader) == len(full) - 3
    assert taken + [tuple(keys) for keys, in loader] == full
    del loader


def test_a_look_through_shardstreams_loader_leaves_a_torch_loops_state_alone(packed):
    """Found by review: training through torch's DataLoader and a look at a batch through
    shardstream.DataLoader over the same dataset: the look's pass made `ds.state_dict(delivered=...,
    num_workers=...)` refuse (it said to take the state from the look's loader, and, with another
    worker count, that the count given was wrong)."""
    def torch_loader(ds: StreamingDataset):  # type: ignore[no-untyped-def]
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=False)

    full = [tuple(item) for item in torch_loader(keys_of(packed))]
    ds = keys_of(packed)
    it = iter(torch_loader(ds))
    taken = [tuple(next(it)) for _ in range(5)]
    next(iter(DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=False)))
    state = ds.state_dict(delivered=5, num_workers=2)
    del it
    resumed = keys_of(packed)
    resumed.load_state_dict(state)
    assert taken + [tuple(item) for item in torch_loader(resumed)] == full


def _stop_after(loader: DataLoader, k: int) -> tuple[list[tuple[str, ...]], dict]:
    """The first `k` batches of keys of `loader` and its state there, through JSON as a checkpoint keeps it."""
    it = iter(loader)
    head = [tuple(next(it)[0]) for _ in range(k)]
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    return head, state


def _reference(packed: str) -> list[tuple[str, ...]]:
    return [tuple(keys) for keys, in DataLoader(keys_of(packed), batch_size=2, num_workers=2, persistent_workers=False)]


def test_a_resumed_pass_left_early_resumes_again_when_one_worker_had_read_to_its_end(packed):
    """Found by review (from before this session): a loaded state's pass left after one batch, one
    persistent worker having read its share of the remainder to its end (and so forgotten the state)
    and the other not: the next pass read the first worker's share of the whole epoch (104 samples
    again in the review's 240). Workers are started afresh where any has read it to its end."""
    full = _reference(packed)
    first = DataLoader(keys_of(packed), batch_size=2, num_workers=2, persistent_workers=False)
    taken, state = _stop_after(first, len(full) - 4)
    loader = DataLoader(keys_of(packed), batch_size=2, num_workers=2)
    loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    time.sleep(0.5)  # the workers read ahead, one to the end of its share
    del it
    assert len(loader) == 4
    assert [tuple(keys) for keys, in loader] == full[-4:]
    del loader


@pytest.mark.parametrize("when", ["inside the loop", "after a pass"])
def test_a_state_loaded_into_the_loaders_own_dataset_is_the_place(packed, when):
    """Found by review: `loader.dataset.load_state_dict(state)` inside the loop (the loop running on) had
    the pass's end drop the state, and the next pass read the whole epoch; loaded after a pass, the
    loader's next state_dict still counted the old pass (a resume from it lost or repeated samples)."""
    full = _reference(packed)
    loader = DataLoader(keys_of(packed), batch_size=2, num_workers=2)
    taken, state = _stop_after(loader, 3)
    if when == "inside the loop":
        for i, _ in enumerate(loader):
            if i == 5:
                loader.dataset.load_state_dict(state)
    else:
        list(loader)
        loader.dataset.load_state_dict(state)
        assert loader.state_dict() == state
    assert [tuple(keys) for keys, in loader] == full[3:]
    del loader


def test_a_datasets_state_is_refused_where_only_shardstreams_loader_iterated_it(packed):
    """Found by review of item 379: `ds.state_dict(delivered=k, num_workers=n)` (torch's recipe) after
    training through shardstream.DataLoader was let through once given a count, and a wrong count lost
    and repeated samples: refused again (take the state from the loader), where no loop of the dataset's
    own has iterated since the last state or epoch."""
    ds = keys_of(packed)
    loader = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=False)
    _stop_after(loader, 3)
    with pytest.raises(shardstream.ShardstreamError, match="take the state from the loader"):
        ds.state_dict(delivered=3, num_workers=3)
    # A look at the dataset itself before the loader's training (found by a fourth review: the look's
    # one item was the state then, silently).
    ds = keys_of(packed)
    next(iter(ds))
    _stop_after(DataLoader(ds, batch_size=2), 3)
    with pytest.raises(shardstream.ShardstreamError, match="take the state from the loader"):
        ds.state_dict()
    # A torch loop's checkpoint before its first batch, a look through shardstream's loader since the epoch
    # began: nothing delivered, the epoch's start, whoever iterates (refused by the first version of this).
    ds = keys_of(packed)
    ds.set_epoch(1)
    _stop_after(DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=False), 1)
    state = ds.state_dict(delivered=0, num_workers=2)
    assert (state["epoch"], state["current"]["delivered"]) == (1, 0)


class _FailsEveryOtherEpoch:
    """A user transform with a bug that shows in epochs 0, 2, 4, ..."""

    def __init__(self, dataset_epoch, error=ValueError):
        self.epoch = dataset_epoch
        self.error = error

    def __call__(self, sample):
        if self.epoch() % 2 == 0:
            raise self.error("a bug in the user's transform")
        return sample


@pytest.mark.parametrize("error", [ValueError, shardstream.DecodeError])  # torch's re-raise; shardstream's own
def test_a_loader_whose_epoch_failed_is_freed_when_the_loop_lets_go_of_it(packed, error):
    """Regression: torch re-raises a worker's error from a local variable, so the error, its traceback and the
    loader in its frames made a reference cycle: the loader, and the persistent workers of the epochs after,
    were freed only by the cyclic garbage collector, which waited 5 s for each worker (10 s here). A
    ShardstreamError comes as an item (`RaisedInWorker`), which must let go of it as it raises it."""
    import weakref

    ds = StreamingDataset(packed, decode=None, fields=("__key__",), batch_size=4, collate_fn=list)
    ds.transform = _FailsEveryOtherEpoch(lambda: ds._shared.epoch, error)
    loader = DataLoader(ds, num_workers=2)
    failed = 0
    for epoch in range(2):  # fails, then runs on fresh persistent workers
        loader.set_epoch(epoch)
        try:
            for _ in loader:
                pass
        except error:
            failed += 1
    assert failed == 1
    gone = weakref.ref(loader)
    gc.disable()  # freed by reference counting, or not at all
    try:
        del loader
        assert gone() is None, "the loader is held by a reference cycle"
    finally:
        gc.enable()


def test_workers_of_a_failed_epoch_are_shut_down(packed):
    """Regression: an error in a worker dropped the torch loader but left its workers to the garbage collector,
    and the error's traceback held them: a script that caught the error and went on gained worker processes
    (and their file descriptors) with every failed epoch."""
    psutil = pytest.importorskip("psutil")
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # other tests' servers
    ds = StreamingDataset(packed, decode=None, fields=("__key__",), batch_size=4, collate_fn=list)
    ds.transform = _FailsEveryOtherEpoch(lambda: ds._shared.epoch)
    loader = DataLoader(ds, num_workers=2)
    errors = []
    for epoch in range(6):
        loader.set_epoch(epoch)
        try:
            for _ in loader:
                pass
        except ValueError as error:
            errors.append(error)  # kept, as a script logging them would: their tracebacks too
    children = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before]
    failed = len(errors)
    del errors, loader  # the last epoch's persistent workers, and their queues' threads, go with the loader
    gc.collect()
    assert failed == 3 and len(children) <= 2, children  # the last epoch's two workers at most


class _Slow:
    """A transform that takes `seconds` a sample: workers still mid-epoch when the loop leaves."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, sample: dict) -> dict:
        time.sleep(self.seconds)
        return sample


class _DiesOnItsThirdSample:
    """A transform that SIGKILLs the DataLoader worker it runs in, on that worker's third sample. From
    inside, where the worker runs this code: a kill from another thread of the test landed once while the
    worker held the lock of an event torch shares with the training process, which then waited on it
    forever (torch's hazard with any kill, rare; not this test's question)."""

    def __init__(self, exit_status: int | None = None) -> None:
        self.seen = 0
        self.exit_status = exit_status  # end with this status (os._exit) instead

    def __call__(self, sample: dict) -> dict:
        self.seen += 1
        if self.seen == 3 and torch.utils.data.get_worker_info() is not None:
            time.sleep(0.1)  # the loop waits in next() when the worker dies, where the loader sees it
            if self.exit_status is not None:
                os._exit(self.exit_status)
            os.kill(os.getpid(), signal.SIGKILL)
        return sample


def test_a_worker_killed_outright_is_one_error_naming_it_and_the_signal(packed):
    """Regression: a worker killed outright (the out-of-memory killer, a crash in a decoder's native code)
    came out of the training loop as torch's traceback through its signal handler, or a bare EOFError or
    "Connection reset by peer" from the socket a batch came on. It is a WorkerDiedError naming the pid and
    the signal now, and no worker is left."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    loader = DataLoader(StreamingDataset(packed, decode=None, transform=_DiesOnItsThirdSample(), batch_size=1),
                        num_workers=1, prefetch_factor=1)
    batches = iter(loader)
    next(batches)
    [worker] = [p for p in multiprocessing.active_children() if p not in before]
    with pytest.raises(shardstream.WorkerDiedError) as error:
        for _ in batches:
            pass
    assert str(error.value) == (f"DataLoader worker (pid {worker.pid}) killed by SIGKILL (killed outright: by the "
                                "out-of-memory killer, or a crash in native code such as a decoder)")
    assert not [p for p in multiprocessing.active_children() if p not in before]


_DIES_HOLDING_THE_DONE_EVENT = r"""
import os, signal, sys, time
import torch.utils.data
import shardstream

class DiesHoldingTheDoneEvent:
    # SIGKILLs its worker on the third sample, holding the lock of the "done" event the worker
    # shares with the training process if the event has one: where a kill from outside (the
    # out-of-memory killer) lands when the worker is inside the event's is_set().
    seen = 0
    def __call__(self, sample):
        self.seen += 1
        if self.seen == 3 and torch.utils.data.get_worker_info() is not None:
            frame = sys._getframe()
            while frame.f_code.co_name != "_worker_loop":
                frame = frame.f_back
            done = frame.f_locals["done_event"]
            if hasattr(done, "_cond"):  # multiprocessing.Event: a Condition over a shared lock
                done._cond.acquire()
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
        return sample

ds = shardstream.StreamingDataset(sys.argv[1], decode=None, transform=DiesHoldingTheDoneEvent(), batch_size=1)
try:
    for _ in shardstream.DataLoader(ds, num_workers=2, prefetch_factor=1):
        pass
except RuntimeError as error:
    print("raised", type(error).__name__, flush=True)
"""


def test_a_worker_killed_holding_a_lock_it_shares_does_not_hang_the_training_process(packed, tmp_path):
    """Regression (RELIABILITY 211): a worker SIGKILLed while it held the lock of torch's
    `multiprocessing.Event` that tells workers the epoch is done left the training process
    waiting on that lock forever, in torch's shutdown of the workers. The loader's workers
    share a lock-free flag instead (workercontext.py), so the death is an error and the
    process ends."""
    script = tmp_path / "dies.py"
    script.write_text(_DIES_HOLDING_THE_DONE_EVENT)
    proc = subprocess.run([sys.executable, str(script), packed], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "raised WorkerDiedError" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


_INTERRUPTED_WHILE_WORKERS_WAIT = r"""
import os, signal, sys, threading, time
import torch.utils.data
import shardstream

# torch's graceful shutdown waits this long for each worker before it terminates it: here
# longer than the test waits, so that a loader that waited for its workers hangs the test.
torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL = 600.0

class StuckAfterTheFirstSamples:  # a worker waiting on storage that does not answer
    seen = 0
    def __call__(self, sample):
        self.seen += 1
        if self.seen > 2:
            time.sleep(3600)
        return sample

ds = shardstream.StreamingDataset(sys.argv[1], decode=None, transform=StuckAfterTheFirstSamples(), batch_size=1)
loader = shardstream.DataLoader(ds, num_workers=2, prefetch_factor=1)
try:
    for n, _ in enumerate(loader):
        if n == 0:  # Ctrl-C while the loop waits for the next batch
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
except KeyboardInterrupt:
    print("interrupted", [worker.is_alive() for worker in loader._workers], flush=True)
"""


def _record_temp_dir(sample: dict) -> dict:
    """A transform: the multiprocessing temporary folder of the worker it runs in, written
    where the test reads it (a file a process)."""
    import multiprocessing.util

    Path(os.environ["SHARDSTREAM_TEST_TEMP_RECORD"], str(os.getpid())).write_text(multiprocessing.util.get_temp_dir())
    return sample


def test_workers_share_the_main_processs_temporary_folder(packed, tmp_path, monkeypatch):
    """Regression (found by review): each worker made its own multiprocessing temporary
    folder (/tmp/pymp-*, for torch's fd-passing listener), removed by the worker's
    finalizers, which a worker ended by a signal (a Ctrl-C's SIGKILL, a job's SIGTERM) never
    runs: one folder left per worker at every interrupted run (1,149 on the review's VM).
    The main process makes its own before the fork; the workers share it, and it goes at
    the main process's exit."""
    import multiprocessing.util

    monkeypatch.setenv("SHARDSTREAM_TEST_TEMP_RECORD", str(tmp_path))
    loader = DataLoader(StreamingDataset(packed, decode=None, transform=_record_temp_dir), batch_size=4,
                        num_workers=2, persistent_workers=False)
    assert sum(len(batch["__key__"]) for batch in loader) > 0
    recorded = [path.read_text() for path in tmp_path.iterdir()]
    assert len(recorded) == 2 and set(recorded) == {multiprocessing.util.get_temp_dir()}


def test_ctrl_c_ends_the_workers_without_waiting_for_what_they_read(packed, tmp_path):
    """Regression: a KeyboardInterrupt while the loop waited for a batch shut the persistent
    workers down gracefully, waiting up to 5 s for each to finish what it was reading: with
    slow storage a Ctrl-C took 5.5 to 10.5 s to end the program. The workers are ended at
    once instead (`_end_workers_now`); here torch's wait is made longer than the test's."""
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED_WHILE_WORKERS_WAIT)
    proc = subprocess.run([sys.executable, str(script), packed], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "interrupted [False, False]" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


_KILLED_WHILE_WORKERS_ARE_BUSY = r"""
import os, signal, sys, time
import torch.utils.data
import shardstream

class StuckAfterTheFirst:  # a worker busy in a slow read, or a transform that never returns
    seen = 0
    def __call__(self, sample):
        self.seen += 1
        if self.seen > 1:
            time.sleep(3600)
        return sample

ds = shardstream.StreamingDataset(sys.argv[1], decode=None, transform=StuckAfterTheFirst(), batch_size=1)
if sys.argv[2] == "shardstream":
    loader = shardstream.DataLoader(ds, num_workers=2, prefetch_factor=1)
else:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=1)
batches = iter(loader)
next(batches)
workers = loader._workers if sys.argv[2] == "shardstream" else batches._workers
print(" ".join(str(w.pid) for w in workers), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the out-of-memory killer, or a scheduler's SIGKILL
"""


@pytest.mark.parametrize("loader", ["shardstream", "torch"])
def test_workers_end_with_a_training_process_killed_while_they_are_busy(packed, tmp_path, loader):
    """Regression (found by review): torch's workers look for their parent only between items,
    so a worker busy when the training process was killed (here a transform that sleeps for an
    hour) lived on for as long, its parent gone. A thread of each worker's own ends it when the
    parent ends (`parentwatch.end_with_parent`), under torch's DataLoader too."""
    script, out, err = tmp_path / "killed.py", tmp_path / "out", tmp_path / "err"
    script.write_text(_KILLED_WHILE_WORKERS_ARE_BUSY)
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: a live worker holds those open
        returncode = subprocess.run([sys.executable, str(script), packed, loader], stdout=stdout, stderr=stderr,
                                    timeout=120).returncode
    pids = [int(pid) for pid in out.read_text().split()]
    assert returncode == -signal.SIGKILL and len(pids) == 2, (out.read_text(), err.read_text()[-2000:])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended and waiting to be reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_while_the_persistent_workers_are_reset_ends_them(packed, monkeypatch):
    """Regression (found by review): a Ctrl-C landing while torch reset the persistent workers
    for the next epoch (`iter()` waits for each to answer) passed by the loader's handling,
    which covered `next()` only: the workers stayed alive, torch's iterator half reset. Here
    the KeyboardInterrupt is raised in that wait, as a Ctrl-C there would."""
    import torch.utils.data.dataloader as torch_dataloader

    cls = torch_dataloader._MultiProcessingDataLoaderIter
    reset, get_data = cls._reset, cls._get_data
    state = {"resetting": False, "armed": False}

    def resetting(self, loader, first_iter=False):
        state["resetting"] = not first_iter
        try:
            return reset(self, loader, first_iter)
        finally:
            state["resetting"] = False

    def interrupted(self):
        if state["resetting"] and state["armed"]:
            state["armed"] = False
            raise KeyboardInterrupt("in the persistent workers' reset")
        return get_data(self)

    monkeypatch.setattr(cls, "_reset", resetting)
    monkeypatch.setattr(cls, "_get_data", interrupted)
    loader = DataLoader(keys_of(packed), batch_size=4, num_workers=2)
    assert len(list(loader)) > 0  # epoch 0 starts the persistent workers
    workers = list(loader._workers)
    loader.set_epoch(1)
    state["armed"] = True
    with pytest.raises(KeyboardInterrupt, match="reset"):
        next(iter(loader))
    for worker in workers:
        worker.join(5)
    assert [worker.is_alive() for worker in workers] == [False, False]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # torch's checks in its shutdown
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_of_every_start_method_share_the_done_flag_and_end_cleanly(packed, method):
    """The lock-free flag in place of torch's shared Event reaches workers however they start
    (inherited, or pickled to a spawned process): an epoch left after one batch ends its workers
    cleanly (a worker told to stop mid-epoch that did not see the flag set fails torch's
    assertion and exits with 1), and whole epochs yield every sample once."""
    expected = sorted(key for (key,) in keys_of(packed))
    slow = StreamingDataset(packed, decode=None, fields=("__key__",), transform=_Slow(0.05))
    loader = DataLoader(slow, num_workers=2, multiprocessing_context=method, persistent_workers=False)
    batches = iter(loader)
    next(batches)
    workers = list(loader._workers)
    batches.close()  # left mid-epoch: the workers are told to stop
    gc.collect()
    for worker in workers:
        worker.join(10)
    assert [worker.exitcode for worker in workers] == [0, 0]
    loader = DataLoader(keys_of(packed), num_workers=2, multiprocessing_context=method, persistent_workers=False)
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sorted(key for (key,) in loader) == expected


def test_more_workers_than_the_dataset_counts_for_are_refused(packed, monkeypatch):
    """Regression: workers past the 64th had no slot in the dataset's shared counts: their skips, storage
    counts and resume bookkeeping were dropped without a word (100 workers: 24 of 42 skips counted). There are
    1024 slots now, and more workers are refused, saying why (here the limit is made 1 to see it)."""
    import shardstream.dataset as dataset_module

    monkeypatch.setattr(dataset_module, "SLOTS", 1)  # forked workers see it too
    loader = torch.utils.data.DataLoader(StreamingDataset(packed, decode=None, fields=("__key__",)),
                                         batch_size=None, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    try:
        with pytest.raises(shardstream.ShardstreamError, match="2 DataLoader workers: a StreamingDataset keeps the "
                                                               "counts of at most 1"):
            next(it)
    finally:
        it._shutdown_workers()  # now: left to the collector, its queues' threads outlived the test under load
    monkeypatch.setattr(dataset_module, "SLOTS", 2)
    assert len(list(loader)) == len(list(StreamingDataset(packed, decode=None, fields=("__key__",))))


@pytest.mark.parametrize("status", [3, 0])
def test_a_worker_that_ends_itself_is_named_with_its_status_not_as_killed(packed, status):
    """Regression: a worker that ended with a status (os._exit in a dataset's code, a spawned worker that
    failed to import the main module) was reported as "killed outright: by the out-of-memory killer"; status 0
    was, still, until the twenty-ninth session."""
    loader = DataLoader(StreamingDataset(packed, decode=None, transform=_DiesOnItsThirdSample(exit_status=status),
                                         batch_size=1), num_workers=1, prefetch_factor=1)
    with pytest.raises(shardstream.WorkerDiedError) as error:
        for _ in loader:
            pass
    assert re.fullmatch(rf"DataLoader worker \(pid \d+\) exited with status {status} \(it ended itself, without "
                        r"raising an error: .*its stderr above says which\)", str(error.value)), str(error.value)


def test_a_worker_that_dies_while_the_loop_runs_its_own_code_is_named_and_replaced(packed):
    """torch's SIGCHLD handler raises its RuntimeError wherever the training loop is when it sees a worker
    gone: in the loop's own code too, where no error passes through the loader. The loader names the worker
    and the signal when asked (`_worker_death`, which bench uses), and its next epoch starts fresh workers:
    the persistent ones, one of them dead, would have waited for that worker's batches."""
    import multiprocessing

    dataset = StreamingDataset(packed, decode=None, transform=_DiesOnItsThirdSample(), batch_size=1)
    loader = DataLoader(dataset, num_workers=1, prefetch_factor=1)
    before = set(multiprocessing.active_children())
    received = 0
    with pytest.raises(RuntimeError) as error:
        for _ in loader:
            received += 1
            time.sleep(1.0)  # the loop's own work: the worker dies meanwhile, and torch raises here
    assert not isinstance(error.value, shardstream.WorkerDiedError) and received < 3  # raised in the loop body
    died = loader._worker_death(error.value)
    assert isinstance(died, shardstream.WorkerDiedError) and re.match(
        r"DataLoader worker \(pid \d+\) killed by SIGKILL \(killed outright", str(died)), (str(error.value), died)
    assert loader._worker_death(RuntimeError("the model's own error")) is None
    dataset.transform.seen = -(10**9)  # the fresh workers' copy never reaches its third sample
    loader.set_epoch(1)
    assert sum(1 for _ in loader) == len(dataset)
    loader._drop_workers()
    assert not [p for p in multiprocessing.active_children() if p not in before]
