"""StreamingDataset: exactly once per epoch over ranks and DataLoader workers, equal ranks,
deterministic order, decoding, field selection, batching, and non-shardstream sources.

Ranks are simulated in one process with explicit ``rank``/``world_size``; DataLoader
workers are real worker processes (test_distributed.py covers real torch.distributed).
The data is 21 synthetic JPEGs packed into 9 shards of uneven size (see _data.py).
"""

from __future__ import annotations

import functools
import gc
import io
import random
import re
import threading
import os
import pickle
import traceback
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import shardstream
from shardstream import DecodeError, MissingFieldError, ShardWriter, StreamingDataset
from shardstream.collate import pad_collate
from shardstream.synthetic import synthetic_jpeg

try:  # tests/ may or may not be a package
    from . import _data as D
except ImportError:
    import _data as D

N = D.N

# More workers than the 2 cores is deliberate here (small data); torch warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return D.make_source(tmp_path_factory.mktemp("dsimages") / "src")


@pytest.fixture(scope="module")
def url(src, tmp_path_factory) -> str:
    """21 samples in 9 shards of 3, 3, 3, 2, 3, 2, 2, 2, 1."""
    url = D.pack_to(src, tmp_path_factory.mktemp("dspacked") / "many", D.MANY_SHARDS)
    assert len(shardstream.open_dataset(url).shards) == 9
    return url


@pytest.fixture(scope="module")
def url_few(src, tmp_path_factory) -> str:
    """The same 21 samples in 2 shards: fewer shards than ranks x workers."""
    url = D.pack_to(src, tmp_path_factory.mktemp("dspacked") / "few", D.FEW_SHARDS)
    assert len(shardstream.open_dataset(url).shards) == 2
    return url


@pytest.fixture(scope="module")
def keys(src) -> set[str]:
    keys = D.all_keys(src)
    assert len(keys) == N
    return keys


def read_ranks(source, world_size: int, num_workers: int, **kwargs) -> tuple[list[list[tuple[str, ...]]], list[int]]:
    """Items per rank (through a real DataLoader) and len(ds) per rank, measured before iterating."""
    items, lens = [], []
    for rank in range(world_size):
        ds = D.key_dataset(source, rank=rank, world_size=world_size, **kwargs)
        lens.append(len(ds))
        items.append(D.run(ds, num_workers))
    return items, lens


def check_exactly_once(items, lens, keys, world_size, *, batch_size=None, pad_keys=None):
    """Every key once across ranks except `pad` declared repeats; equal ranks; len == yield."""
    per_rank = D.ceil_div(N, world_size)
    pad = per_rank * world_size - N
    samples = [D.flat(rank_items) for rank_items in items]
    assert [len(s) for s in samples] == [per_rank] * world_size, "every rank yields the same number of samples"
    assert len({len(rank_items) for rank_items in items}) == 1, "every rank yields the same number of items"
    assert lens == [len(rank_items) for rank_items in items], "len(ds) is what the iteration yields"
    if batch_size is not None:
        assert lens[0] == D.ceil_div(per_rank, batch_size)
        for rank_items in items:
            sizes = [len(b) for b in rank_items]
            assert all(1 <= s <= batch_size for s in sizes)
            assert sum(s < batch_size for s in sizes) <= 1  # only the last chunk of a rank is partial
    counts = D.counts(k for s in samples for k in s)
    assert set(counts) == keys, "the union over ranks is the whole dataset"
    assert sum(c - 1 for c in counts.values()) == pad
    repeated = {k for k, c in counts.items() if c > 1}
    assert all(c <= 2 for c in counts.values())
    if pad_keys is not None:
        assert repeated == set(pad_keys[:pad]), "padding repeats samples from the start of the epoch"


# -- exactly once, equal ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exactly_once_over_ranks_and_workers_batched(url, keys, world_size, num_workers):
    """Batches of 3 made in the workers: chunks of 3 are dealt to the workers round robin."""
    items, lens = read_ranks(url, world_size, num_workers, shuffle=True, seed=11, shuffle_buffer=5, batch_size=3)
    check_exactly_once(items, lens, keys, world_size, batch_size=3, pad_keys=D.epoch_keys(url, 11, 0, True))


# Unbatched samples are dealt in chunks of 64, so with 21 samples one worker serves a rank
# whatever their number: two worker counts cover it.
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exactly_once_over_ranks_and_workers_unbatched(url, keys, world_size, num_workers):
    items, lens = read_ranks(url, world_size, num_workers, shuffle=True, seed=12, shuffle_buffer=5)
    assert all(len(item) == 1 for rank_items in items for item in rank_items)
    check_exactly_once(items, lens, keys, world_size, pad_keys=D.epoch_keys(url, 12, 0, True))


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 0), (2, 2), (3, 1), (4, 3), (4, 0)])
def test_unshuffled_ranks_are_contiguous_blocks_in_order(url, keys, world_size, num_workers):
    """Without shuffling, rank r yields block r of the manifest order (padded from the start),
    in order, whatever the number of workers: chunks are dealt and collected round robin."""
    order = D.manifest_keys(url)
    per_rank = D.ceil_div(N, world_size)
    padded = order + order[: per_rank * world_size - N]
    items, lens = read_ranks(url, world_size, num_workers, batch_size=2)
    for rank in range(world_size):
        assert D.flat(items[rank]) == padded[rank * per_rank : (rank + 1) * per_rank]
    check_exactly_once(items, lens, keys, world_size, batch_size=2, pad_keys=order)


@pytest.mark.parametrize(("world_size", "num_workers", "batch_size"),
                         [(2, 0, None), (3, 2, 3), (4, 1, 2), (4, 0, 3)])
def test_partial_drop(url, keys, world_size, num_workers, batch_size):
    items, lens = read_ranks(url, world_size, num_workers, shuffle=True, seed=4, shuffle_buffer=3,
                             batch_size=batch_size, partial="drop")
    per_rank = N // world_size
    samples = [D.flat(rank_items) for rank_items in items]
    assert [len(s) for s in samples] == [per_rank] * world_size
    assert len({len(i) for i in items}) == 1
    assert lens == [len(i) for i in items]
    seen = [k for s in samples for k in s]
    assert len(seen) == len(set(seen)), "drop never repeats a sample"
    left_out = keys - set(seen)
    assert len(left_out) == N - per_rank * world_size < world_size
    assert left_out == set(D.epoch_keys(url, 4, 0, True)[per_rank * world_size :]), "the tail is left out"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last_yields_only_full_batches(url, keys, num_workers):
    world_size, batch_size = 2, 4
    items, lens = read_ranks(url, world_size, num_workers, shuffle=True, seed=2, shuffle_buffer=4,
                             batch_size=batch_size, drop_last=True)
    per_rank = D.ceil_div(N, world_size)  # 11: two full batches of 4 and a dropped 3
    for rank_items in items:
        assert [len(b) for b in rank_items] == [batch_size] * (per_rank // batch_size)
    assert lens == [per_rank // batch_size] * world_size
    seen = D.flat(i for rank_items in items for i in rank_items)
    assert set(seen) <= keys and len(seen) == world_size * (per_rank // batch_size) * batch_size


@pytest.mark.parametrize(("world_size", "num_workers", "batch_size"),
                         [(2, 3, None), (3, 2, 3)])
def test_fewer_shards_than_ranks_times_workers(url_few, keys, world_size, num_workers, batch_size):
    assert len(shardstream.open_dataset(url_few).shards) < world_size * num_workers
    items, lens = read_ranks(url_few, world_size, num_workers, shuffle=True, seed=8, shuffle_buffer=4,
                             batch_size=batch_size)
    check_exactly_once(items, lens, keys, world_size, batch_size=batch_size,
                       pad_keys=D.epoch_keys(url_few, 8, 0, True))


def test_a_single_shard_dataset(src, keys, tmp_path):
    url_one = D.pack_to(src, tmp_path / "one", "1MB")
    assert len(shardstream.open_dataset(url_one).shards) == 1
    items, lens = read_ranks(url_one, 4, 1, shuffle=True, seed=3, batch_size=2)
    check_exactly_once(items, lens, keys, 4, batch_size=2, pad_keys=D.epoch_keys(url_one, 3, 0, True))


# -- order -------------------------------------------------------------------------------------------


def ordered(url, num_workers, *, epoch=0, seed=5, rank=0, world_size=2):
    ds = D.key_dataset(url, shuffle=True, seed=seed, shuffle_buffer=6, batch_size=2, rank=rank,
                       world_size=world_size)
    ds.set_epoch(epoch)
    return D.run(ds, num_workers)


def test_same_seed_and_epoch_same_order(url):
    assert ordered(url, 2) == ordered(url, 2)
    assert ordered(url, 0, epoch=3) == ordered(url, 0, epoch=3)


def test_other_epoch_or_seed_other_order(url):
    base = ordered(url, 0)
    for other in (ordered(url, 0, epoch=1), ordered(url, 0, seed=6)):
        assert D.flat(other) != D.flat(base)
    # the union over ranks is still the whole epoch in epoch 1
    both = D.flat(ordered(url, 2, epoch=1, rank=0)) + D.flat(ordered(url, 0, epoch=1, rank=1))
    assert len(set(both)) == N


def test_shuffle_buffer_shuffles_within_a_rank(url):
    """With a one-sample buffer only shards move; with a larger buffer samples move within a shard run."""
    def seq(buffer):
        ds = D.key_dataset(url, shuffle=True, seed=5, shuffle_buffer=buffer)
        return D.flat(D.run(ds, 0))

    no_buffer, buffered = seq(1), seq(21)
    assert no_buffer == D.epoch_keys(url, 5, 0, True)  # shard order only, samples in file order
    assert buffered != no_buffer and sorted(buffered) == sorted(no_buffer)


def test_set_epoch_reaches_persistent_workers(url):
    ds = D.key_dataset(url, shuffle=True, seed=9, shuffle_buffer=6, batch_size=2, rank=1, world_size=2)
    dl = D.loader(ds, 2, persistent_workers=True)
    try:
        epochs = []
        for epoch in (0, 1, 2):
            ds.set_epoch(epoch)
            epochs.append([D.freeze(b) for b in dl])
    finally:
        it = dl._iterator
        if it is not None:
            it._shutdown_workers()
        del dl
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    for epoch in (0, 1, 2):
        assert epochs[epoch] == ordered(url, 2, epoch=epoch, seed=9, rank=1), f"epoch {epoch}"
        assert len(D.flat(epochs[epoch])) == D.ceil_div(N, 2)


def test_len_follows_set_epoch_and_layout(url):
    for world_size in (1, 2, 3, 4):
        for batch_size in (None, 2, 5):
            ds = D.key_dataset(url, rank=world_size - 1, world_size=world_size, batch_size=batch_size)
            per_rank = D.ceil_div(N, world_size)
            assert len(ds) == (per_rank if batch_size is None else D.ceil_div(per_rank, batch_size))


# -- decoding ---------------------------------------------------------------------------------------


def shut_down(it) -> None:
    """Stop a DataLoader iterator's workers now (`D.shut_down`), and collect the cycle that
    torch's re-raise of an error leaves holding it."""
    D.shut_down(it)
    gc.collect()


def png_bytes(w, h, seed):
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


RICH = 5  # samples in the "rich" dataset


def rich_sample(i: int) -> dict:
    sample = {
        "__key__": f"s{i:03d}",
        "cls": i % 3,
        "txt": f"caption {i} \u00fc\u00df\u2713",
        "json": {"id": i, "tags": ["a", "b"][: i % 3], "nested": {"x": i / 2}},
        "msgpack": {"id": i, "blob": bytes([i]) * 3, "list": [1, 2, i]},
        "npy": (np.arange(6, dtype=np.float32).reshape(2, 3) * i),
        "seq.npy": np.arange(2 * (i % 4 + 1), dtype=np.int64).reshape(-1, 2) + 100 * i,
    }
    if i == 1:
        sample["png"] = png_bytes(16, 12, i)
    else:
        sample["jpg"] = synthetic_jpeg(i, 16, 12)
    return sample


@pytest.fixture(scope="module")
def rich(tmp_path_factory) -> str:
    """Five samples with one field of every decoded type, written with ShardWriter (two shards)."""
    dst = tmp_path_factory.mktemp("rich") / "ds"
    with ShardWriter(str(dst), max_samples=3) as writer:
        for i in range(RICH):
            writer.write(rich_sample(i))
    assert shardstream.open_dataset(str(dst)).counts().tolist() == [3, 2]
    return str(dst)


def expected_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_decode_every_field_type_rgb8(rich):
    got = list(StreamingDataset(rich, decode="rgb8"))
    assert [s["__key__"] for s in got] == [f"s{i:03d}" for i in range(RICH)]
    for i, s in enumerate(got):
        want = rich_sample(i)
        image = s["png"] if i == 1 else s["jpg"]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.shape == (3, 12, 16)
        assert image.is_contiguous()
        raw = want["png"] if i == 1 else want["jpg"]
        np.testing.assert_array_equal(image.numpy().transpose(1, 2, 0), expected_rgb(raw))
        assert s["cls"] == i % 3 and type(s["cls"]) is int
        assert s["txt"] == want["txt"] and isinstance(s["txt"], str)
        assert s["json"] == want["json"] and isinstance(s["json"], dict)
        assert s["msgpack"] == want["msgpack"]
        assert isinstance(s["npy"], np.ndarray) and s["npy"].dtype == np.float32
        np.testing.assert_array_equal(s["npy"], want["npy"])
        np.testing.assert_array_equal(s["seq.npy"], want["seq.npy"])
        assert s["__url__"].endswith((".tar.zst", ".tar"))


def test_decode_pil_and_none(rich):
    for i, s in enumerate(StreamingDataset(rich, decode="pil")):
        image = s["png"] if i == 1 else s["jpg"]
        assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (16, 12)
        raw = rich_sample(i)["png" if i == 1 else "jpg"]
        np.testing.assert_array_equal(np.asarray(image), expected_rgb(raw))
        assert s["cls"] == i % 3  # other fields decode whatever the image mode
    for i, s in enumerate(StreamingDataset(rich, decode=None)):
        raw = rich_sample(i)["png" if i == 1 else "jpg"]
        assert s["png" if i == 1 else "jpg"] == raw
        assert s["json"] == rich_sample(i)["json"]


def test_decode_callable_and_transform_run_in_workers(rich):
    ds = StreamingDataset(rich, decode=len, transform=lambda s: (s["__key__"], s.get("jpg", s.get("png")), os.getpid()))
    got = D.loader(ds, 1)
    got = list(got)
    assert [g[0] for g in got] == [f"s{i:03d}" for i in range(RICH)]
    assert [g[1] for g in got] == [len(rich_sample(i)["png" if i == 1 else "jpg"]) for i in range(RICH)]
    assert {g[2] for g in got} != {os.getpid()}  # ran in the worker process


@pytest.fixture(scope="module")
def pickled(tmp_path_factory):
    """A dataset whose `.pyd` field, if unpickled, creates a marker folder."""
    root = tmp_path_factory.mktemp("pickled")
    marker = root / "unpickled-marker"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    dst = root / "ds"
    with ShardWriter(str(dst)) as writer:
        writer.write({"__key__": "p000", "cls": 1, "pyd": pickle.dumps(Payload())})
    return str(dst), marker


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pickle_refused_without_allow_pickle(pickled, num_workers):
    url, marker = pickled
    ds = StreamingDataset(url)
    # try/except rather than pytest.raises: a held traceback would keep the iteration
    # (and its prefetch threads) alive past the test
    it = iter(D.loader(ds, num_workers))
    try:
        list(it)
    except DecodeError as e:
        message, key = str(e), e.key
    else:
        pytest.fail("a pickle field was decoded without allow_pickle")
    finally:
        shut_down(it)
    assert "p000" in message and "pickle" in message
    if num_workers == 0:
        assert key == "p000"
    assert not marker.exists(), "refusing must not unpickle"


@pytest.mark.parametrize("npy", ["npz archive", "damaged zip"])
def test_an_npy_field_that_is_a_zip_is_bad_data_naming_the_sample(tmp_path, npy):
    """Regression: numpy's loader opens bytes that begin as a zip does as an npz archive: a real one decoded
    to a lazy NpzFile, not an array, and a damaged one raised zipfile's BadZipFile, which named no shard or
    sample and which on_error="skip" did not skip. An npy field is the .npy format only."""
    archive = io.BytesIO()
    np.savez(archive, a=np.arange(3))
    bad = archive.getvalue() if npy == "npz archive" else b"PK\x03\x04" + b"\0" * 40
    good = io.BytesIO()
    np.save(good, np.arange(4))
    folder = D.write_unchecked(tmp_path / "ds", [{"__key__": f"n{i}", "npy": bad if i == 2 else good.getvalue()}
                                                 for i in range(4)])
    with pytest.raises(DecodeError, match="n2") as info:
        list(StreamingDataset(folder))
    assert info.value.key == "n2"
    del info
    ds = StreamingDataset(folder, on_error=shardstream.ErrorPolicy(mode="skip", max_skips=1))
    got = list(ds)
    assert ds.skipped == 1 and len(got) == 4 and all(isinstance(s["npy"], np.ndarray) for s in got)


def test_pickle_decoded_with_allow_pickle(pickled):
    url, marker = pickled
    [sample] = list(StreamingDataset(url, allow_pickle=True))
    assert marker.is_dir(), "allow_pickle=True unpickles the field"
    assert sample["cls"] == 1
    os.rmdir(marker)


# -- fields, batching, collation -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gappy(tmp_path_factory) -> str:
    """s000 has a jpg, s001 a png, s002 neither."""
    dst = tmp_path_factory.mktemp("gappy") / "ds"
    with ShardWriter(str(dst)) as writer:
        writer.write({"__key__": "s000", "jpg": synthetic_jpeg(0, 16, 12), "cls": 0})
        writer.write({"__key__": "s001", "png": png_bytes(8, 8, 1), "cls": 1})
        writer.write({"__key__": "s002", "txt": "no image here", "cls": 2})
    return str(dst)


def test_a_field_no_shard_holds_is_refused_before_the_first_sample(gappy):
    """Regression: a typo in `fields` (`"clss"`) was met sample by sample: under
    ``on_error="skip"`` every sample was skipped for lacking it until the cap. The manifest
    lists each shard's fields, so it is said at the start; a transform may add the field."""
    from shardstream.policy import ErrorPolicy

    ds = StreamingDataset(gappy, fields=("jpg;png", "clss"), on_error=ErrorPolicy("skip", max_skips=100))
    with pytest.raises(MissingFieldError, match="'clss'") as info:
        next(iter(ds))
    assert "['cls', 'jpg', 'png', 'txt']" in str(info.value) and ds.skipped == 0
    added = StreamingDataset(gappy, fields=("__key__", "clss"), decode=None,
                             transform=lambda sample: {**sample, "clss": sample["cls"]})
    assert [key for key, _ in added] == ["s000", "s001", "s002"]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_fields_take_first_present_and_name_the_missing_key(gappy, num_workers):
    ds = StreamingDataset(gappy, fields=("jpg;png", "cls"))
    it = iter(D.loader(ds, num_workers))
    first, second = next(it), next(it)
    # the dataset yields tuples; DataLoader(batch_size=None)'s default_convert makes them lists
    assert isinstance(first, (tuple, list)) and len(first) == 2
    assert first[0].shape == (3, 12, 16) and first[1] == 0
    assert second[0].shape == (3, 8, 8) and second[1] == 1
    try:
        next(it)
    except MissingFieldError as e:
        message, key = str(e), e.key
    else:
        pytest.fail("no MissingFieldError")
    finally:
        shut_down(it)
    assert "s002" in message and "jpg;png" in message
    if num_workers == 0:
        assert key == "s002"


def test_batch_size_with_default_collate_stacks(rich):
    ds = StreamingDataset(rich, fields=("jpg;png", "cls", "npy", "__key__"), batch_size=2)
    assert len(ds) == 3
    batches = list(D.loader(ds, 2))
    assert len(batches) == 3
    images, labels, arrays, keys = zip(*batches)
    assert [tuple(b.shape) for b in images] == [(2, 3, 12, 16), (2, 3, 12, 16), (1, 3, 12, 16)]
    assert all(b.dtype == torch.uint8 for b in images)
    assert torch.cat(labels).tolist() == [i % 3 for i in range(RICH)]
    assert all(lab.dtype == torch.int64 for lab in labels)
    np.testing.assert_array_equal(torch.cat(arrays).numpy(), np.stack([rich_sample(i)["npy"] for i in range(RICH)]))
    assert [k for batch in keys for k in batch] == [f"s{i:03d}" for i in range(RICH)]
    expected0 = np.stack([expected_rgb(rich_sample(0)["jpg"]), expected_rgb(rich_sample(1)["png"])])
    np.testing.assert_array_equal(images[0].numpy().transpose(0, 2, 3, 1), expected0)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pad_collate_variable_length_sequences(rich, num_workers):
    ds = StreamingDataset(rich, fields=("seq.npy", "cls"), batch_size=3, collate_fn=pad_collate)
    batches = list(D.loader(ds, num_workers))
    assert len(batches) == 2
    i = 0
    for padded, lengths, labels in batches:
        assert padded.dim() == 3 and padded.shape[2] == 2 and padded.dtype == torch.int64
        assert lengths.dtype == torch.int64
        assert padded.shape[1] == int(lengths.max())
        for row in range(len(lengths)):
            want = rich_sample(i)["seq.npy"]
            assert int(lengths[row]) == len(want)
            np.testing.assert_array_equal(padded[row, : len(want)].numpy(), want)
            assert (padded[row, len(want) :] == 0).all()
            assert int(labels[row]) == i % 3
            i += 1
    assert i == RICH


def test_pad_collate_direct():
    seqs = [torch.arange(3.0), torch.arange(1.0), np.arange(4, dtype=np.float32)]
    padded, lengths, labels = pad_collate([(s, lab) for s, lab in zip(seqs, [2, 0, 1])], padding_value=-1)
    assert padded.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1], [0, 1, 2, 3]]
    assert lengths.tolist() == [3, 1, 4] and labels.tolist() == [2, 0, 1]
    with pytest.raises(ValueError):
        pad_collate([])


def test_pad_collate_keeps_every_part_and_takes_sequences_alone():
    """Regression (found by a user's walk): parts after the label were dropped without a
    word (`fields=("tok.npy", "cls", "__key__")` lost the keys), and a sequence alone
    (`fields=("tok.npy",)`) failed, its error blaming the lengths it exists to pad."""
    seqs = [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)]
    padded, lengths, labels, keys = pad_collate([(s, i, f"k{i}") for i, s in enumerate(seqs)])
    assert padded.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]] and lengths.tolist() == [3, 5]
    assert labels.tolist() == [0, 1] and list(keys) == ["k0", "k1"]
    for batch in ([(s,) for s in seqs], seqs):
        padded, lengths = pad_collate(batch)
        assert padded.shape == (2, 5) and lengths.tolist() == [3, 5]
    with pytest.raises(shardstream.CollateError, match="pad_collate pads a sequence .* not a dict"):
        pad_collate([{"tok.npy": s} for s in seqs])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pad_collate_errors_name_the_part_that_failed(tmp_path, num_workers):
    """Regression (found by a user's walk): any failure under pad_collate was blamed on the
    sequences' lengths ("has field tok.npy of shape (247,), the batch's first (426,)"), the
    difference it exists to pad; the part that failed is named now."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        for i, n in enumerate((3, 5)):
            writer.write({"__key__": f"s{i}", "tok.npy": np.arange(n), "mel.npy": np.zeros((n, 80 if i == 0 else 40)),
                          "meta.json": {"spans": list(range(i + 1))}})
    failing = {("tok.npy", "meta.json"): "sample 's1'.* has field meta.json.spans of 2 items, the batch's first 1",
               ("mel.npy", "meta.json"): r"has field mel.npy of shape \(5, 40\), the batch's first \(3, 80\): "
                                         r"sequences may differ in their length \(the first dimension\) only"}
    for fields, message in failing.items():
        ds = StreamingDataset(str(tmp_path / "ds"), fields=fields, batch_size=2, collate_fn=pad_collate)
        assert re.search(message, _collate_error_of(ds, num_workers)), (fields, _collate_error_of(ds, num_workers))
    ds = StreamingDataset(str(tmp_path / "ds"), fields=("tok.npy",), batch_size=2, collate_fn=pad_collate)
    [(padded, lengths)] = list(D.loader(ds, num_workers))
    assert padded.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]] and lengths.tolist() == [3, 5]


def test_default_collate_of_ints_then_floats_keeps_float64():
    """Regression (found by a user's walk): torch's collate of numbers whose first is an int
    makes `torch.tensor(batch)`, float32 where floats follow: JSON timestamps 1700000000 then
    1700000000.123 came back all 1700000000.0, where a float first gave float64."""
    collated = shardstream.default_collate([{"t": 1700000000}, {"t": 1700000000.123}, {"t": 1700000001.75}])["t"]
    assert collated.dtype == torch.float64 and collated.tolist() == [1700000000, 1700000000.123, 1700000001.75]
    assert shardstream.default_collate([1, 2]).dtype == torch.int64
    assert shardstream.default_collate([True, False]).dtype == torch.bool


@pytest.mark.parametrize("decode_threads", [0, 2])
def test_fields_left_out_are_not_decoded(tmp_path, decode_threads):
    """Regression: with `fields`, every field was decoded, then the asked-for ones picked: a
    damaged mask PNG beside each JPEG failed every sample, and a pickle field nothing asked
    for wanted allow_pickle=True."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        for i in range(6):
            writer.write({"__key__": f"s{i:03d}", "jpg": synthetic_jpeg(i, 16, 12), "cls": i,
                          "seg.png": b"not a png", "pth": b"\x80\x04K\x01."})
    ds = StreamingDataset(str(tmp_path / "ds"), fields=("jpg;png", "cls", "__key__"), decode_threads=decode_threads)
    got = list(ds)
    assert [key for _, _, key in got] == [f"s{i:03d}" for i in range(6)] and [int(c) for _, c, _ in got] == list(range(6))
    assert all(tuple(image.shape) == (3, 12, 16) for image, _, _ in got)
    with pytest.raises(shardstream.DecodeError, match="seg.png"):  # asked for, as with no `fields`, it is decoded
        list(StreamingDataset(str(tmp_path / "ds"), fields=("seg.png",), decode_threads=decode_threads))


def test_pad_collate_promotes_to_one_dtype_as_default_collate_does():
    """Regression: every sequence was cast to the first's dtype: int64 then [1.5, 2.5] gave
    [1, 2], uint8 then int64 [300, -1] gave [44, 255], silently."""
    padded, _, _ = pad_collate([(torch.tensor([1, 2]), 0), (torch.tensor([1.5, 2.5, 3.75]), 1)])
    assert padded.dtype == torch.float32 and padded.tolist() == [[1, 2, 0], [1.5, 2.5, 3.75]]
    padded, _, _ = pad_collate([(np.array([7], dtype=np.uint8), 0), (np.array([300, -1]), 1)])
    assert padded.dtype == torch.int64 and padded.tolist() == [[7, 0], [300, -1]]


def _collate_error_of(ds: StreamingDataset, num_workers: int) -> str:
    """The message of the CollateError an epoch of `ds` raises, through a loader of `num_workers`."""
    it = iter(D.loader(ds, num_workers))
    try:
        with pytest.raises(shardstream.CollateError) as raised:
            list(it)
    finally:
        shut_down(it)
    return str(raised.value)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_batch_that_does_not_collate_names_the_odd_sample(tmp_path, num_workers):
    """Regression: one image of another size in a batch was torch's bare RuntimeError ("stack
    expects each tensor to be equal size ... at entry 1"), naming no shard, sample or field."""
    with ShardWriter(str(tmp_path / "ds"), max_samples=4) as writer:
        for i in range(12):
            writer.write({"__key__": f"s{i:03d}", "jpg": synthetic_jpeg(i, 40 if i == 6 else 32, 32), "cls": i})
    ds = StreamingDataset(str(tmp_path / "ds"), fields=("jpg", "cls"), batch_size=4)
    message = _collate_error_of(ds, num_workers)
    assert "shard-000001.tar.zst, sample 's006'" in message, message
    assert "sample 2 of the batch has field jpg of shape (3, 32, 40), the batch's first (3, 32, 32)" in message
    # A collate_fn of the user's own that fails for its own reason is not blamed on the shapes
    # (found by review), which a padding collate handles: the difference is told as a maybe.
    ds = StreamingDataset(str(tmp_path / "ds"), fields=("jpg", "cls"), batch_size=4, collate_fn=_fails_on_labels)
    message = _collate_error_of(ds, num_workers)
    assert ("sample 2 of the batch differs from the first, which may be why _fails_on_labels failed: it has field "
            "jpg of shape (3, 32, 40)") in message and "KeyError" in message, message


def _fails_on_labels(batch: list) -> tuple:
    """A user's collate failing for a reason of its own: label 6, which it has no name for."""
    names = {i: f"class {i}" for i in range(12) if i != 6}
    labels = [names[int(label)] for _, label in batch]  # KeyError at 6
    return torch.stack([image for image, _ in batch]), labels


def test_sample_dicts_with_other_fields_do_not_collate_into_a_batch_without_them(rich):
    """Regression: batching sample dicts (no `fields`), torch's collate took the first
    sample's fields: a field the first lacked vanished from the whole batch, silently (here
    sample 1 holds a png where the others hold a jpg)."""
    ds = StreamingDataset(rich, decode=None, batch_size=2)
    with pytest.raises(shardstream.CollateError) as raised:
        list(ds)
    assert raised.value.key == "s001" and "has no jpg and png among its fields" in str(raised.value), str(raised.value)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_arrays_of_other_dtypes_collate_to_one_promoted_dtype_with_workers_too(tmp_path, num_workers):
    """Regression (found by review): in a DataLoader worker, a batch was stacked into the
    first sample's dtype: int32 then int64 turned 2**40 into 0, float16 then float32 turned
    70000.25 into inf, and bool then int64 failed; the main process promoted. Every process
    promotes now, as torch.stack does."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        for key, array in (("a", np.array([1, 2], np.int32)), ("b", np.array([2**40, 300], np.int64)),
                           ("c", np.array([0.5, 1.0], np.float16)), ("d", np.array([1.5, 70000.25], np.float32)),
                           ("e", np.array([True, False])), ("f", np.array([7, 8], np.int64))):
            writer.write({"__key__": key, "npy": array})
    ds = StreamingDataset(str(tmp_path / "ds"), decode=None, fields=("npy",), batch_size=2)
    it = iter(D.loader(ds, num_workers))
    try:
        got = [(x.dtype, x.tolist()) for (x,) in it]
    finally:
        shut_down(it)
    assert got == [(torch.int64, [[1, 2], [2**40, 300]]), (torch.float32, [[0.5, 1.0], [1.5, 70000.25]]),
                   (torch.int64, [[1, 0], [7, 8]])]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dicts_within_samples_with_other_keys_do_not_collate(tmp_path, num_workers):
    """Regression (found by review): only the samples' own dicts were compared; a JSON
    field's dicts, in tuple samples (`fields`) or within a list, took the first's keys,
    and a key the first lacked (a bbox) vanished from the batch, silently."""
    with ShardWriter(str(tmp_path / "flat")) as writer:
        writer.write({"__key__": "a", "json": {"x": 1}, "cls": 0})
        writer.write({"__key__": "b", "json": {"x": 2, "bbox": [5, 6, 7, 8]}, "cls": 1})
    with ShardWriter(str(tmp_path / "listed")) as writer:
        writer.write({"__key__": "a", "json": [{"x": 1}], "cls": 0})
        writer.write({"__key__": "b", "json": [{"x": 2, "bbox": 9}], "cls": 1})
    for folder, fields, field in (("flat", ("json", "cls"), "field json"), ("listed", None, "field json[0]")):
        ds = StreamingDataset(str(tmp_path / folder), decode=None, fields=fields, batch_size=2)
        message = _collate_error_of(ds, num_workers)
        assert "sample 'b'" in message and f"has bbox among the keys of {field}" in message, message
    alike = [({"x": 1, "y": [2]}, 0), ({"x": 3, "y": [4]}, 1)]
    assert shardstream.default_collate(alike)[0]["x"].tolist() == [1, 3]  # alike dicts still collate


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_padding_value_the_dtype_cannot_hold_is_refused_in_every_process(tmp_path, num_workers):
    """Regression (found by review): uint8 sequences padded with -1 were refused in the main
    process and padded with 255 in a worker (filled into shared memory)."""
    with ShardWriter(str(tmp_path / "ds")) as writer:
        for i, length in enumerate((3, 1)):
            writer.write({"__key__": f"s{i}", "npy": np.arange(length, dtype=np.uint8), "cls": i})
    collate = functools.partial(pad_collate, padding_value=-1)
    ds = StreamingDataset(str(tmp_path / "ds"), decode=None, fields=("npy", "cls"), batch_size=2, collate_fn=collate)
    assert re.search("padding_value -1 is no value of .* torch.uint8", _collate_error_of(ds, num_workers))
    padded, lengths, _ = pad_collate([(np.arange(3, dtype=np.uint8), 0), (np.arange(1, dtype=np.uint8), 1)], 255)
    assert padded.tolist() == [[0, 1, 2], [0, 255, 255]] and lengths.tolist() == [3, 1]


def test_a_partial_of_our_collates_is_ours():
    """Regression (found by review): a `functools.partial` of `pad_collate` was taken for a
    user's collate: batches then drew under a seed of their own, and samples were counted
    as another collate's."""
    from shardstream.collate import is_own_collate

    assert is_own_collate(pad_collate) and is_own_collate(shardstream.default_collate)
    assert is_own_collate(functools.partial(pad_collate, padding_value=-1))
    assert is_own_collate(functools.partial(functools.partial(pad_collate), padding_value=2))
    assert not is_own_collate(list) and not is_own_collate(functools.partial(sorted, key=len))


# -- sources other than a packed dataset -------------------------------------------------------------------


def write_wds(src: Path, dst: Path, splits, compress=False) -> list[str]:
    """Plain WebDataset tars (no index, no manifest) of the image folder, `splits` samples each."""
    import webdataset as wds

    files = sorted(src.rglob("*.jpg"))
    assert sum(splits) == len(files)
    dst.mkdir(parents=True)
    urls, start = [], 0
    for n, count in enumerate(splits):
        url = str(dst / f"shard-{n:06d}.tar{'.gz' if compress else ''}")
        with wds.TarWriter(url, compress=compress, encoder=False, mtime=0) as sink:
            for path in files[start : start + count]:
                key = path.relative_to(src).with_suffix("").as_posix()
                sink.write({"__key__": key, "jpg": path.read_bytes(), "cls": path.parent.name[-1:].encode()})
        urls.append(url)
        start += count
    return urls


@pytest.fixture(scope="module")
def wds_tars(src, tmp_path_factory) -> list[str]:
    return write_wds(src, tmp_path_factory.mktemp("wds") / "plain", [5, 9, 7])


@pytest.mark.parametrize(("world_size", "num_workers", "batch_size"),
                         [(1, 0, None), (2, 2, 2), (3, 1, 3)])
def test_brace_pattern_of_plain_webdataset_tars(wds_tars, keys, world_size, num_workers, batch_size):
    folder = os.path.dirname(wds_tars[0])
    assert not os.path.exists(os.path.join(folder, "manifest.msgpack"))
    pattern = f"{folder}/shard-{{000000..000002}}.tar"
    items, lens = read_ranks(pattern, world_size, num_workers, shuffle=True, seed=1, shuffle_buffer=4,
                             batch_size=batch_size)
    check_exactly_once(items, lens, keys, world_size, batch_size=batch_size)


def test_list_of_shard_urls(wds_tars, keys):
    items, lens = read_ranks(list(wds_tars), 2, 1, shuffle=True, seed=2, batch_size=2)
    check_exactly_once(items, lens, keys, 2, batch_size=2)
    # unshuffled: the list order, shard after shard
    [only], _ = read_ranks(list(wds_tars), 1, 0)
    files = sorted(Path(os.path.dirname(wds_tars[0])).glob("*.tar"))
    assert len(files) == 3
    assert D.flat(only) == sorted(keys)


def test_webdataset_tars_decode(wds_tars):
    sample = next(iter(StreamingDataset(wds_tars[0])))
    assert sample["__key__"] == "class_000/img_00000"
    assert sample["jpg"].dtype == torch.uint8 and sample["jpg"].shape[0] == 3
    assert sample["cls"] == 0


def test_gzipped_webdataset_tars(src, keys, tmp_path):
    urls = write_wds(src, tmp_path / "gz", [8, 13], compress=True)
    assert all(u.endswith(".tar.gz") for u in urls)
    items, lens = read_ranks(urls, 3, 1, shuffle=True, seed=6, shuffle_buffer=3, batch_size=2)
    check_exactly_once(items, lens, keys, 3, batch_size=2)


def test_manifest_and_plain_sources_agree_on_the_unshuffled_stream(url, src, wds_tars):
    """The same samples through different sources: every sample's bytes arrive intact."""
    by_key = {p.relative_to(src).with_suffix("").as_posix(): p.read_bytes() for p in src.rglob("*.jpg")}
    for source in (url, list(wds_tars)):
        got = {s["__key__"]: s["jpg"] for s in StreamingDataset(source, decode=None)}
        assert got == by_key


# -- the dataset is a value ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("shuffle", "world_size"), [(False, 1), (True, 1), (False, 4)])
def test_a_sample_the_loop_let_go_of_is_not_held_while_the_next_is_made(tmp_path, shuffle, world_size, monkeypatch):
    """Regression (found by a walk with 256 MB volumes): the generators between the reader and the loop each kept the
    sample they had yielded (a local, or zip's tuple) while the next one was made, so a sample of 256 MB was held
    twice over (1.3 GB of peak for 256 MB samples). With `world_size=4`, 5 samples are padded to 8: the marks too.
    The read sample (its bytes) as well: a review found zip's reused tuples holding it."""
    with ShardWriter(str(tmp_path / "ds"), max_samples=2) as writer:
        for i in range(5):
            writer.write({"__key__": f"vol{i}", "npy": np.full((64, 64), i, np.uint8)})
    alive, last = [], [None]

    def check(sample):
        if last[0] is not None:
            alive.append(last[0]() is not None)
        return sample

    class Raw(dict):  # a read sample, as the reader makes it, that a weak reference can follow
        pass

    raw_alive, last_raw = [], [None]
    read_samples = shardstream.dataset.read_samples

    def reading(*args, **kwargs):  # the raw samples, each looked at as the next is asked for
        for sample in read_samples(*args, **kwargs):
            if last_raw[0] is not None:
                raw_alive.append(last_raw[0]() is not None)
            sample = Raw(sample)
            last_raw[0] = weakref.ref(sample)
            yield sample
            sample = None

    monkeypatch.setattr(shardstream.dataset, "read_samples", reading)
    order = {"shuffle": True, "seed": 3, "shuffle_buffer": 0} if shuffle else {}
    dataset = StreamingDataset(str(tmp_path / "ds"), fields=("npy",), transform=check, rank=world_size - 1,
                               world_size=world_size, **order)
    for (volume,) in dataset:
        last[0] = weakref.ref(volume)
        del volume
    assert alive and not any(alive), alive
    assert raw_alive and not any(raw_alive), raw_alive  # the read sample (its bytes) too


def test_a_shuffle_buffer_of_large_samples_is_warned_of_once(tmp_path, monkeypatch):
    """Found by a walk with volumes: the default shuffle_buffer (2,048) held a worker's whole share of 2 GB of them
    (2.25 GB of peak), where README's formula (buffer x sample size) says so but nothing told the user. Past
    BUFFER_WARN_BYTES (2 GiB; lowered here) the buffer is warned of, once a process; an unshuffled read holds
    none, and ImageNet's 220 MB is far below."""
    import shardstream.stream

    with ShardWriter(str(tmp_path / "ds")) as writer:
        for i in range(600):
            writer.write({"__key__": f"s{i:03d}", "bin": bytes([i % 256]) * 100})
    monkeypatch.setattr(shardstream.stream, "BUFFER_WARN_BYTES", 10_000)
    monkeypatch.setattr(shardstream.stream, "_buffer_warned", False)

    def warned(**order) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len(list(StreamingDataset(str(tmp_path / "ds"), decode=None, **order))) == 600
        return [str(w.message) for w in caught if "shuffle buffer" in str(w.message)]

    assert warned() == []  # unshuffled: nothing is held
    said = warned(shuffle=True, shuffle_buffer=512)
    assert len(said) == 1 and re.search(r"holds \d{3} samples, 0\.0 GiB, in this process .*lower shuffle_buffer",
                                        said[0]), said
    assert warned(shuffle=True, shuffle_buffer=512) == []  # once a process


def test_constructing_reads_nothing(tmp_path):
    ds = StreamingDataset(str(tmp_path / "does-not-exist-yet"), shuffle=True)
    assert ds.epoch == 0
    with pytest.raises(shardstream.ShardstreamError):
        len(ds)


def test_dataset_pickles_and_deep_copies(url):
    import copy

    ds = D.key_dataset(url, shuffle=True, seed=3, batch_size=2)
    ds.set_epoch(4)
    for clone in (pickle.loads(pickle.dumps(ds)), copy.deepcopy(ds)):
        assert clone.epoch == 4
        assert D.run(clone, 0) == D.run(ds, 0)


class _FailsOn:
    """A user transform with a bug that shows on one sample."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, sample: dict) -> str:
        if sample["__key__"] == self.key:
            raise ValueError("a bug in the user's transform")
        return sample["__key__"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_in_the_users_transform_names_the_sample(packed, num_workers):
    """It keeps its type (the user's code, which no error policy skips) and says which sample it met."""
    key = sorted(s["__key__"] for ref in shardstream.open_dataset(packed).shards for s in ref.reader())[3]
    ds = shardstream.StreamingDataset(packed, decode=None, transform=_FailsOn(key))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    with pytest.raises(ValueError) as info:
        D.listed(loader)
    text = "".join(traceback.format_exception(info.value))
    del info, loader  # the traceback holds the failed epoch's generator, its threads and queues
    gc.collect()
    assert "a bug in the user's transform" in text and f"in the transform of sample {key!r}" in text


class _ErrorOfPython310(ValueError):
    """An exception as Python 3.10 (which shardstream supports) makes them: no `add_note`."""

    def __getattribute__(self, name: str):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_notes_reach_errors_of_python_3_10_too(packed):
    """Regression: the note naming the sample was added with `add_note`, new in Python 3.11:
    on 3.10 the user's own error became an AttributeError about `add_note`. Now the error is
    raised as it was, its note kept in `__notes__` as 3.11 keeps it; every note goes through
    `errors.add_note`."""
    import ast

    from shardstream.errors import add_note

    error = _ErrorOfPython310("the user's")
    add_note(error, "first")
    add_note(error, "second")
    assert error.__notes__ == ["first", "second"] and str(error) == "the user's"

    def raises(sample: dict) -> dict:
        raise _ErrorOfPython310("a bug in the user's transform")

    with pytest.raises(_ErrorOfPython310) as info:
        list(shardstream.StreamingDataset(packed, decode=None, transform=raises))
    assert any("in the transform of sample" in note for note in info.value.__notes__)
    del info
    gc.collect()
    package = Path(shardstream.__file__).parent
    direct = [f"{path.name}:{node.lineno}" for path in package.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Attribute) and node.attr == "add_note" and path.name != "errors.py"]
    assert not direct, f"call errors.add_note(error, note), which Python 3.10 has, not error.add_note: {direct}"


def test_samples_are_seeded_only_where_something_can_draw(packed):
    from shardstream.decode import Decoder
    from shardstream.prepare import SamplePrep

    def prep(decode, transform=None, allow_pickle=False):
        return SamplePrep(Decoder(decode, allow_pickle), transform, None, 0, 0)

    assert not prep(None).draws_globally and not prep("rgb8").draws_globally and not prep("pil").draws_globally
    assert not prep(shardstream.RandomResizedCropJPEG(8)).draws_globally  # from its own generator
    assert prep("rgb8", transform=lambda s: s).draws_globally and prep(lambda data: data).draws_globally
    assert prep(None, allow_pickle=True).draws_globally
    # Either way the caller's generator is left as it was, and a transform's draws are per sample.
    torch.manual_seed(123)
    before = torch.default_generator.get_state()
    plain = [s["__key__"] for s in StreamingDataset(packed, decode="rgb8")]
    assert torch.equal(torch.default_generator.get_state(), before) and len(plain) > 0

    def noisy(sample):
        sample["noise"] = torch.rand(1).item()
        return sample

    first = {s["__key__"]: s["noise"] for s in StreamingDataset(packed, decode=None, transform=noisy)}
    again = {s["__key__"]: s["noise"] for s in StreamingDataset(packed, decode=None, transform=noisy, shuffle=True)}
    assert first == again and torch.equal(torch.default_generator.get_state(), before)


def test_fused_crops_draw_from_a_generator_of_their_own(packed):
    """Regression: the fused crops drew from torch's global generator, seeded per sample and
    put back around every item: another thread of the training process drawing from it at
    the same time moved the crops, and had its own draws rewound and repeated. The crops
    draw from the iteration's own generator now, and the global one is left alone."""
    crop = shardstream.RandomResizedCropJPEG(16)

    def crops() -> dict[str, torch.Tensor]:
        return {s["__key__"]: s["jpg"] for s in StreamingDataset(packed, decode=crop, shuffle=True, seed=2)}

    alone = crops()
    stop, drawn = threading.Event(), []

    def draw() -> None:
        torch.manual_seed(0)
        while not stop.is_set():
            drawn.append(torch.rand(1).item())

    thread = threading.Thread(target=draw)
    thread.start()
    try:
        busy = crops()
    finally:
        stop.set()
        thread.join()
    assert busy.keys() == alone.keys() and all(torch.equal(busy[k], alone[k]) for k in alone) and len(alone) > 10
    torch.manual_seed(0)
    assert drawn == [torch.rand(1).item() for _ in drawn] and len(drawn) > 100  # each number once, in order


class _JitteredPlan(shardstream.RandomResizedCropJPEG):
    """A user's own `plan(data)`, written before plans took a generator: it draws from torch's global one."""

    def plan(self, data: bytes):
        plan = super().plan(data)
        return plan._replace(flip=bool(torch.rand(1).item() < 0.5))


def test_a_crop_planner_of_the_users_own_is_called_as_written_and_seeded(packed):
    """Regression (found by review of the change above): a subclass's own `plan(data)`, and a
    planner of the user's inside `DeferDecode`, were called with the crops' generator (a
    TypeError on every sample), and one taking it but drawing from torch's global generator
    was no longer seeded (two runs, two epochs). They are the user's code: called as
    `plan(data)`, under the seeded global generators."""
    from shardstream import DeferDecode
    from shardstream.decode_ahead import DecodeAhead

    def epoch(decode) -> list:
        return [(s["__key__"], s["jpg"]) for s in StreamingDataset(packed, decode=decode, shuffle=True, seed=1)]

    for decode in (_JitteredPlan(16), DeferDecode(_JitteredPlan(16))):
        first, again = epoch(decode), epoch(decode)
        assert len(first) > 10 and [k for k, _ in first] == [k for k, _ in again]
        for (_, a), (_, b) in zip(first, again):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a.plan == b.plan
    with pytest.raises(ValueError, match="or plan of its own"):
        DecodeAhead(_JitteredPlan(16))


def _draws_everywhere(sample: dict) -> tuple[str, int, int, int]:
    """A transform as augmentation code is written: it draws from torch's, Python's and numpy's generators."""
    return sample["__key__"], int(torch.randint(0, 1 << 30, (1,))), random.getrandbits(30), int(np.random.randint(1 << 30))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_python_and_numpy_draws_are_seeded_per_sample_too(packed, num_workers):
    """A transform drawing from Python's random or numpy's global generator gets the same numbers for a sample
    whichever worker prepares it and however the epoch is ordered (so a resumed run repeats them), different
    numbers per sample and per epoch; in the main process the caller's generators carry on untouched."""
    def draws(**options) -> dict[str, tuple[int, int, int]]:
        ds = StreamingDataset(packed, decode=None, transform=_draws_everywhere, **options)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
        return {key: rest for key, *rest in loader}

    random.seed(3), np.random.seed(3)
    plain = draws()
    caller = random.random(), np.random.rand()
    random.seed(3), np.random.seed(3)
    assert (random.random(), np.random.rand()) == caller  # the dataset's seeding left the caller's generators be
    assert draws(shuffle=True, seed=0) == plain
    python, numpy = {d[1] for d in plain.values()}, {d[2] for d in plain.values()}
    assert len(python) == len(numpy) == len(plain) > 10
    later = draws(seed=1)
    assert later.keys() == plain.keys() and all(later[k][1:] != plain[k][1:] for k in plain)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_the_loops_own_draws_between_items_are_its_own(packed, batch_size):
    """In the main process, a loop that draws from torch's, Python's and numpy's generators
    between the items it takes (and stops early) draws what it would with no dataset at all:
    the dataset's per-sample seeding is put back around every item, a whole batch or a sample,
    and a transform's draws stay per sample whatever the batching."""
    def loop(take: int | None) -> tuple[list, list]:
        torch.manual_seed(5), random.seed(5), np.random.seed(5)
        ds = StreamingDataset(packed, decode=None, transform=_draws_everywhere, batch_size=batch_size,
                              collate_fn=list if batch_size else None)
        items, own = [], []
        for item in ds:
            items.extend(item if batch_size else [item])
            own.append((torch.rand(1).item(), random.random(), float(np.random.rand())))
            if len(own) == take:
                break
        own.append((torch.rand(1).item(), random.random(), float(np.random.rand())))  # after the loop
        return items, own

    def alone(n: int) -> list:
        torch.manual_seed(5), random.seed(5), np.random.seed(5)
        return [(torch.rand(1).item(), random.random(), float(np.random.rand())) for _ in range(n)]

    items, own = loop(None)
    assert own == alone(len(own)) and len(own) > 3
    early, own = loop(2)
    assert own == alone(3) and early == items[:len(early)]
    per_sample = {key: rest for key, *rest in loop(None)[0]}
    assert per_sample == {key: rest for key, *rest in StreamingDataset(packed, decode=None, transform=_draws_everywhere)}


def _mixup_keys(items: list) -> tuple:
    """A MixUp-style collate_fn: the batch's keys and draws from torch's, Python's and numpy's generators."""
    return tuple(k for (k,) in items), torch.rand(1).item(), random.random(), float(np.random.rand())


def test_a_collate_fn_that_draws_is_seeded_per_batch(packed):
    """Regression: a collate_fn drawing random numbers (MixUp, CutMix) drew from the training loop's own
    generator with num_workers=0 and from the last sample's state in a worker: other numbers for another
    num_workers, and a resumed run drew others than the uninterrupted one. Each batch now draws from a seed of
    its samples, and the caller's generators are left alone."""
    def run(num_workers: int, state: dict | None = None, take: int | None = None) -> tuple[list, StreamingDataset]:
        ds = StreamingDataset(packed, decode=None, fields=("__key__",), shuffle=True, seed=4, batch_size=3,
                              collate_fn=_mixup_keys)
        if state is not None:
            ds.load_state_dict(state)
        # In this process, the dataset itself (a DataLoader draws its own base seed from torch's generator).
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers) if num_workers else ds
        out = []
        for batch in loader:
            out.append((tuple(batch[0]), *batch[1:]))  # a DataLoader's default_convert makes lists of tuples
            if take is not None and len(out) == take:
                break
        return out, ds

    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    plain, _ = run(0)
    caller = torch.rand(1).item(), random.random(), np.random.rand()
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == caller  # the loop's draws are its own
    assert len({b[1:] for b in plain}) == len(plain) > 3  # every batch draws its own numbers
    assert run(0)[0] == plain
    first, ds = run(0, take=2)
    rest, _ = run(0, state=ds.state_dict())
    assert first + rest == plain  # a resumed run draws what the uninterrupted one drew
    workers, _ = run(2)  # other batches (the workers' shares are shuffled apart), drawn alike every run
    assert workers == run(2)[0]
    first, ds = run(2, take=3)
    rest, _ = run(2, state=ds.state_dict(delivered=3, num_workers=2))
    assert first + rest == workers


@pytest.mark.parametrize("given", [dict(collate_fn=list), dict(drop_last=True)])
def test_batch_options_without_batch_size_are_refused(url, given):
    """Regression: collate_fn or drop_last without batch_size were ignored silently (the user meant the
    DataLoader's batches, and got none of what they asked for)."""
    (name,) = given
    with pytest.raises(ValueError, match=f"{name} applies to the dataset's own batches"):
        list(StreamingDataset(url, **given))
    with pytest.raises(ValueError, match=f"{name} applies to the dataset's own batches") as info:
        D.listed(torch.utils.data.DataLoader(StreamingDataset(url, **given), batch_size=4, num_workers=1))
    del info  # its traceback holds the DataLoader's iterator, and with it a queue's thread
    gc.collect()
    assert len(list(StreamingDataset(url, decode=None, batch_size=4, **given))) > 0
    # shardstream.DataLoader gives its copy of the dataset the batch size
    assert len(list(shardstream.DataLoader(StreamingDataset(url, decode=None, **given), batch_size=4))) > 0


def test_arguments_as_training_scripts_pass_them(url):
    """numpy ints (a seed from a sweep overflowed; in the layout, state_dict() was not JSON), a pathlib.Path
    source, fields as WebDataset's to_tuple string: each as the plain value it stands for."""
    import json

    plain = StreamingDataset(url, decode=None, fields=("__key__", "cls"), shuffle=True, seed=7, batch_size=3,
                             collate_fn=list)
    numpy = StreamingDataset(Path(url), decode=None, fields="__key__ cls", shuffle=True, seed=np.int64(7),
                             batch_size=np.int64(3), shuffle_buffer=np.int32(2048), collate_fn=list)
    assert list(numpy) == list(plain)
    json.dumps(numpy.state_dict())
    assert shardstream.open_dataset(Path(url)).manifest == shardstream.open_dataset(url).manifest
    assert shardstream.open_dataset(Path(url)).url == url  # was the Path itself, where Source.url says str
    with pytest.raises(TypeError, match="seed must be an integer"):
        StreamingDataset(url, seed=1.5)
    # Regression: numpy takes seeds modulo 2**64, so -1 shuffled as 2**64 - 1, and 2**64 as 0.
    with pytest.raises(ValueError, match="seed must be 0 or more, not -1"):
        StreamingDataset(url, seed=-1)
    with pytest.raises(ValueError, match=f"seed must be below {2**64}"):
        StreamingDataset(url, seed=2**64)
    StreamingDataset(url, seed=2**64 - 1)
    with pytest.raises(ValueError, match="shuffle_buffer must be 0 or more"):
        StreamingDataset(url, shuffle_buffer=-5)


def test_misuse_is_named(url):
    with pytest.raises(TypeError, match="cannot be indexed"):
        torch.utils.data.Subset(StreamingDataset(url), [0, 1])[0]
    tupled = StreamingDataset(url, decode=None, fields=("cls",), transform=lambda s: (s["cls"],))
    with pytest.raises(TypeError, match="the transform returned a tuple"):
        next(iter(tupled))


def test_only_the_parts_of_a_sample_that_hold_dicts_are_compared_across_a_batch():
    """Comparing every list at any depth (item 305's first form) made the collate of samples
    holding a JSON list of 2,048 numbers 33 times slower; the first sample's parts holding
    no dict are not looked into, and dicts deep in lists are still compared."""
    from shardstream.collate import _dicts_in, dicts_unlike_the_first

    assert _dicts_in((torch.zeros(3), list(range(2048)), "text")) is None
    assert _dicts_in({"a": list(range(5)), "b": [{"x": 1}], "c": 3}) == ("map", {"b": ("seq", {0: ("map", {})})})
    batch = [({"boxes": [{"x": 1}, {"x": 2}]}, 0), ({"boxes": [{"x": 1}, {"x": 2, "y": 3}]}, 1)]
    assert dicts_unlike_the_first(batch, ["json", "cls"]) == (1, "has y among the keys of field json.boxes[1], "
                                                                 "unlike the batch's first")
