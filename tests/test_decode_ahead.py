"""`StreamingDataset(decode_threads=N)`: images decoded in threads give the samples of one thread, bit for bit."""

from __future__ import annotations

import gc
import random
import threading

import numpy as np
import pytest
import torch

from shardstream import CenterCropJPEG, DecodeError, RandomResizedCropJPEG, ShardWriter, StreamingDataset
from shardstream.policy import ErrorPolicy
from shardstream.synthetic import synthetic_jpeg

try:
    from . import _data as D
except ImportError:
    import _data as D

SAMPLES = 40
BAD = {"s011", "s027"}  # truncated JPEGs in the `damaged` dataset


def _write(dst, bad: set[str] = frozenset()) -> str:
    with ShardWriter(str(dst), max_samples=7) as writer:
        for i in range(SAMPLES):
            key = f"s{i:03d}"
            jpg = synthetic_jpeg(i, 72 + 8 * (i % 5), 56 + 4 * (i % 3))
            writer.write({"__key__": key, "jpg": jpg[: len(jpg) // 3] if key in bad else jpg, "cls": i % 4})
    return str(dst)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("ahead") / "ds")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("ahead") / "bad", BAD)


def noisy(sample: dict) -> dict:
    """A transform that draws from torch's generator after the crop did, and from Python's and numpy's."""
    sample["noise"] = int(torch.randint(0, 1 << 30, (1,))) ^ random.getrandbits(30) ^ int(np.random.randint(1 << 30))
    return sample


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("decode", [RandomResizedCropJPEG(24), CenterCropJPEG(24, 28), "rgb8"], ids=str)
def test_threads_give_the_samples_of_one_thread(data, decode):
    def run(threads: int) -> list:
        ds = StreamingDataset(data, shuffle=True, seed=3, decode=decode, transform=noisy,
                              fields=("jpg", "cls", "noise", "__key__"), decode_threads=threads)
        ds.set_epoch(1)
        return list(ds)

    one, three = run(0), run(3)
    assert len(one) == SAMPLES and len({s[3] for s in one}) == SAMPLES
    assert same(one, three)
    assert len({s[2] for s in one}) == SAMPLES  # the transform's draws differ per sample, yet agree between runs


def test_threads_in_dataloader_workers_batched(data):
    """Two worker processes, each decoding in two threads, batching in the worker: the batches of no threads."""
    def run(threads: int) -> list:
        ds = StreamingDataset(data, shuffle=True, decode=RandomResizedCropJPEG(16), transform=noisy,
                              fields=("jpg", "cls", "noise"), batch_size=6, decode_threads=threads)
        return list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))

    plain, threaded = run(0), run(2)
    assert sum(len(batch[1]) for batch in plain) == SAMPLES
    assert same(plain, threaded)


def test_the_callers_generator_is_left_alone(data):
    """In the main process the draws run under each sample's seed, and the caller's generator carries on as if
    nothing had been drawn."""
    def draws() -> tuple:
        return torch.rand(4), random.random(), np.random.rand()

    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    list(StreamingDataset(data, shuffle=True, decode=RandomResizedCropJPEG(16), transform=noisy, decode_threads=2))
    after = draws()
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    again = draws()
    assert torch.equal(after[0], again[0]) and after[1:] == again[1:]


def test_a_bad_image_raises_at_its_place_naming_it(damaged):
    def first_error(threads: int) -> tuple[int, str | None, str | None, str]:
        got = 0
        with pytest.raises(DecodeError) as info:
            for _ in StreamingDataset(damaged, decode=RandomResizedCropJPEG(16), decode_threads=threads):
                got += 1
        error = info.value
        found = got, error.key, error.url, str(error)
        del info, error
        gc.collect()  # the traceback held the stream's generators, and with them its threads
        return found

    (n0, key0, url0, text0), (n2, key2, url2, text2) = first_error(0), first_error(2)
    assert n0 == n2 == 11 and key0 == key2 == "s011" and url0 == url2
    assert text0 == text2


def test_skip_policy_skips_the_same_samples(damaged):
    def run(threads: int) -> tuple[list, int]:
        ds = StreamingDataset(damaged, shuffle=True, decode=RandomResizedCropJPEG(16), fields=("jpg", "__key__"),
                              on_error=ErrorPolicy("skip", max_skips=5), decode_threads=threads)
        return list(ds), ds.skipped

    (one, skipped_one), (two, skipped_two) = run(0), run(2)
    assert skipped_one == skipped_two == len(BAD)
    assert len(one) == SAMPLES and not BAD & {key for _, key in one}
    assert same(one, two)


def test_a_custom_decode_callable_is_refused():
    with pytest.raises(ValueError, match="decode_threads"):
        StreamingDataset("unused", decode=lambda data: data, decode_threads=2)
    with pytest.raises(ValueError, match="decode_threads"):
        StreamingDataset("unused", decode=None, decode_threads=2)
    with pytest.raises(ValueError, match="0 or more"):
        StreamingDataset("unused", decode_threads=-1)


class _CropAsFloat(RandomResizedCropJPEG):
    def __call__(self, data: bytes) -> torch.Tensor:
        return super().__call__(data).float() / 255


class _KeepsTheCall(CenterCropJPEG):
    pass


def test_a_fused_transform_with_a_call_of_its_own_is_refused(data):
    """Regression: a subclass of a fused transform whose own `__call__` changed the crop (to
    float, here) was taken for the fused one, its `__call__` skipped: uint8 with decode_threads,
    float without, where the samples are promised the same."""
    with pytest.raises(ValueError, match="without a __call__ or plan of its own"):
        StreamingDataset(data, decode=_CropAsFloat(16), decode_threads=2)
    inline, threaded = (list(StreamingDataset(data, decode=_KeepsTheCall(16, 20), fields=("jpg",), decode_threads=n))
                        for n in (0, 2))
    assert len(inline) == SAMPLES and all(torch.equal(a, b) for (a,), (b,) in zip(inline, threaded))


def test_resume_mid_epoch_with_threads(data):
    def dataset() -> StreamingDataset:
        return StreamingDataset(data, shuffle=True, decode=RandomResizedCropJPEG(16), transform=noisy,
                                fields=("jpg", "noise", "__key__"), decode_threads=2)

    whole = list(dataset())
    ds = dataset()
    it = iter(ds)
    head = [next(it) for _ in range(13)]
    state = ds.state_dict()
    it.close()
    resumed = dataset()
    resumed.load_state_dict(state)
    assert same(head + list(resumed), whole)


def test_stopping_early_stops_the_threads(data):
    ds = StreamingDataset(data, decode=RandomResizedCropJPEG(16), decode_threads=3)
    it = iter(ds)
    next(it)
    assert any(t.name.startswith("shardstream-decode") for t in threading.enumerate())
    it.close()
    del it
    gc.collect()
    assert not any(t.name.startswith("shardstream-decode") for t in threading.enumerate())


def test_persistent_workers_follow_set_epoch_with_threads(data):
    """Workers that live across epochs start a pool of decode threads per epoch: two epochs, each the
    samples of no threads for that epoch."""
    def epochs(threads: int) -> list:
        ds = StreamingDataset(data, shuffle=True, decode=RandomResizedCropJPEG(16), fields=("jpg", "__key__"),
                              batch_size=8, decode_threads=threads)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        out = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            out.append(list(loader))
        del loader
        gc.collect()
        return out

    plain, threaded = epochs(0), epochs(2)
    assert same(plain, threaded)
    assert not same(plain[0], plain[1])  # the epochs differ


def _mixing_collate(items):
    """A MixUp-style collate: it draws from torch's generator in the worker, after the samples."""
    return [image for image, _ in items], torch.tensor([label for _, label in items]), torch.rand(len(items))


@pytest.mark.parametrize("decode", ["rgb8", RandomResizedCropJPEG(16)], ids=["rgb8", "crop"])
def test_a_collate_that_draws_draws_the_same_with_threads(data, decode):
    """The threads seeded samples with nothing to draw (rgb8), and left the generator at a sample 4 x threads
    ahead: a collate_fn drawing in the worker drew other numbers than without threads."""
    def run(threads):
        torch.manual_seed(0)
        ds = StreamingDataset(data, shuffle=True, seed=1, decode=decode, fields=("jpg", "cls"), batch_size=4,
                              collate_fn=_mixing_collate, decode_threads=threads)
        return list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1))

    plain, threaded = run(0), run(2)
    assert len(plain) == len(threaded) > 1
    for (a, la, ra), (b, lb, rb) in zip(plain, threaded):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(la, lb) and torch.equal(ra, rb)


def test_an_error_drawing_items_is_raised_at_its_own_place():
    """The items are drawn ahead (4 per thread): a read error there (a damaged shard) was raised before the
    samples ahead of it were handed over, so threads changed where a run stopped."""
    from shardstream.threads import ordered_map

    def items():
        yield from range(5)
        raise OSError("the sixth cannot be read")

    got = []
    with pytest.raises(OSError, match="sixth"):
        for future in ordered_map(lambda x: x * 10, items(), threads=3):
            got.append(future.result())
    assert got == [0, 10, 20, 30, 40]


@pytest.mark.parametrize("decode", ["rgb8", RandomResizedCropJPEG(16)], ids=["rgb8", "crop"])
@pytest.mark.parametrize("json_field", ["json", "a.json"], ids=["image-first", "json-first"])
def test_a_sample_with_two_bad_fields_names_the_field_inline_decoding_names(tmp_path, decode, json_field):
    """Regression: the threads decoded every other field before any image, so where a JPEG's
    body and a later JSON field were both bad, the error named the JSON field; decoding
    inline names the first bad field in the sample's order (sorted by name, as stored)."""
    jpg = synthetic_jpeg(1, 64, 48)
    folder = D.write_unchecked(tmp_path / "ds", [{"__key__": "good", "jpg": jpg, json_field: b"{}"},
                                                 {"__key__": "bad", "jpg": jpg[: len(jpg) // 3],
                                                  json_field: b"{not json"}])

    def error(threads: int) -> str:
        with pytest.raises(DecodeError) as info:
            list(StreamingDataset(folder, decode=decode, decode_threads=threads))
        text = str(info.value)
        del info
        gc.collect()  # the traceback held the stream's threads
        return text

    inline, threaded = error(0), error(2)
    assert "'bad'" in inline and f"field {min('jpg', json_field)!r}" in inline
    assert threaded == inline
