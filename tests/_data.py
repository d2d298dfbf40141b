"""Helpers shared by the plan/dataset/resume/distributed tests: small packed datasets and key readers.

The data is real and tiny: `make_image_folder` with 3 classes of 7, 9 and 5 JPEGs
(21 samples, 32x24..48x40 px, ~1.5 KB each), packed by the library. With
``shard_size="11KB"`` that gives 9 shards of uneven, mostly odd sizes
(3, 3, 3, 2, 3, 2, 2, 2, 1); with ``"40KB"`` 2 shards, fewer than ranks x workers.

Samples are read as keys only (``decode=None``, ``fields=("__key__",)``), which costs
no image decoding; batches of keys are lists (see `key_batch`).
"""

from __future__ import annotations

import collections
import io
import json
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from torch.utils.data import DataLoader

import shardstream
from shardstream.synthetic import make_image_folder

IMAGES_PER_CLASS = [7, 9, 5]
N = sum(IMAGES_PER_CLASS)
SIZE_RANGE = ((32, 24), (48, 40))
MANY_SHARDS = "11KB"  # 9 shards: 3, 3, 3, 2, 3, 2, 2, 2, 1 samples
FEW_SHARDS = "40KB"  # 2 shards


def make_source(root: Path) -> Path:
    """The 21-image folder (3 classes: 7, 9, 5 images)."""
    make_image_folder(root, num_classes=3, images_per_class=IMAGES_PER_CLASS, size_range=SIZE_RANGE)
    return root


def pack_to(src: Path, dst: Path, shard_size: str) -> str:
    shardstream.pack(str(src), str(dst), shard_size=shard_size, workers=1, progress=False)
    return str(dst)


def all_keys(src: Path) -> set[str]:
    """Every sample key of an image folder: ``class_xxx/img_xxxxx``."""
    return {p.relative_to(src).with_suffix("").as_posix() for p in Path(src).rglob("*.jpg")}


def manifest_keys(url: str) -> list[str]:
    """Sample keys by global sample id (shard after shard, in manifest order)."""
    source = shardstream.open_dataset(url)
    return [s["__key__"] for ref in source.shards for s in ref.reader()]


def key_batch(batch: list[Any]) -> list[str]:
    """collate_fn for ``fields=("__key__",)``: a batch of 1-tuples -> list of keys."""
    return [item[0] for item in batch]


def key_dataset(url: Any, **kwargs: Any) -> "shardstream.StreamingDataset":
    """A StreamingDataset yielding keys only: 1-tuples, or lists of keys with `batch_size`."""
    kwargs.setdefault("decode", None)
    kwargs.setdefault("fields", ("__key__",))
    if kwargs.get("batch_size") is not None:
        kwargs.setdefault("collate_fn", key_batch)
    return shardstream.StreamingDataset(url, **kwargs)


def as_keys(item: Any) -> list[str]:
    """The keys of one yielded item: a sample (a 1-tuple, or the 1-list DataLoader's
    default_convert makes of it) or a batch (a list of keys, from `key_batch`)."""
    assert isinstance(item, (tuple, list)) and all(isinstance(k, str) for k in item), item
    return list(item)


def freeze(item: Any) -> tuple[str, ...]:
    return tuple(as_keys(item))


def loader(ds: Any, num_workers: int, **kwargs: Any) -> DataLoader:
    return DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs)


def run(ds: Any, num_workers: int, **kwargs: Any) -> list[tuple[str, ...]]:
    """Every item of one pass, each as a tuple of keys, through a real DataLoader."""
    return [freeze(item) for item in loader(ds, num_workers, **kwargs)]


def shut_down(it: Any) -> None:
    """Shut down the workers of a torch DataLoader iterator now. Left to the garbage collector,
    an iterator whose worker raised waits 5 s for that worker when it is collected in a
    reference cycle (the error's traceback holds it): torch finalises its queues first."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def listed(loader: Any) -> list[Any]:
    """Every item of `loader`, its workers shut down when it ends, or raises."""
    it = iter(loader)
    try:
        return list(it)
    finally:
        shut_down(it)


def take(ds: Any, num_workers: int, k: int) -> list[tuple[str, ...]]:
    """The first `k` items a DataLoader delivers; its workers are shut down before returning."""
    it = iter(loader(ds, num_workers))
    try:
        return [freeze(next(it)) for _ in range(k)]
    finally:
        shut_down(it)
        del it


def stop_after(loader: Any, k: int) -> tuple[list[tuple[str, ...]], dict]:
    """The first `k` items of a `shardstream.DataLoader` and its state there, through JSON as a
    checkpoint keeps it; its workers are shut down before returning."""
    it = iter(loader)
    try:
        head = [freeze(next(it)) for _ in range(k)]
        return head, json.loads(json.dumps(loader.state_dict()))
    finally:
        shut_down(it)
        del it


def take_main(ds: Any, k: int) -> list[tuple[str, ...]]:
    """The first `k` items of ``iter(ds)`` in this process (the generator left suspended, then closed)."""
    it = iter(ds)
    out = [freeze(next(it)) for _ in range(k)]
    return out


def flat(items: Iterable[tuple[str, ...]]) -> list[str]:
    return [k for item in items for k in item]


def counts(keys: Iterable[str]) -> collections.Counter:
    return collections.Counter(keys)


def pad_count(n: int, world_size: int) -> int:
    return -(-n // world_size) * world_size - n


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def epoch_keys(url: str, seed: int, epoch: int, shuffle: bool) -> list[str]:
    """The epoch sequence as keys (plan.epoch_sequence mapped through the manifest, each shard
    cut into the blocks plan.shuffle_block gives for the manifest's frames)."""
    from shardstream.plan import epoch_sequence, shuffle_block

    keys = manifest_keys(url)
    source = shardstream.open_dataset(url)
    counts_ = source.counts()
    block = shuffle_block(counts_, source.samples_per_frame(), source.least_sample_bytes()) if shuffle else 0
    return [keys[i] for i in epoch_sequence(counts_, seed, epoch, shuffle, block=block).tolist()]


def is_permutation(a: np.ndarray, n: int) -> bool:
    return len(a) == n and np.array_equal(np.sort(a), np.arange(n))


def spawned_rank_keys(rank: int, store: str, dataset: Any, out: str) -> None:
    """A training process as `torch.multiprocessing.spawn` starts it: it joins a 2-rank gloo
    group, then writes the keys of its epoch of `dataset` (made in the launcher) to out/RANK.json."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        Path(out, f"{rank}.json").write_text(json.dumps(flat(as_keys(item) for item in dataset)))
    finally:
        dist.destroy_process_group()


def spawned_rank_state(rank: int, store: str, url: str, workers: list[int], preview: bool, out: str) -> None:
    """A training process as `torch.multiprocessing.spawn` starts it: it joins a 2-rank gloo group,
    reads 2 batches of `url` through `shardstream.DataLoader` with `workers[rank]` workers, twice
    (two iterations begun: the second's start compares the counts), and once both ranks have,
    takes a state: out/RANK.json holds [the warnings the iterations' starts gave, those taking
    the state gave]. With `preview`, rank 0 first looks at a batch of the same dataset through a
    loader of its own, with no workers."""
    import json
    import warnings

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        dataset = key_dataset(url, shuffle=True, batch_size=2)
        if preview and rank == 0:
            next(iter(shardstream.DataLoader(dataset)))
        loader = shardstream.DataLoader(dataset, num_workers=workers[rank])
        with warnings.catch_warnings(record=True) as began:
            warnings.simplefilter("always")
            for begun in range(2):
                if begun:
                    it.close()
                it = iter(loader)
                next(it), next(it)
                dist.barrier()
        with warnings.catch_warnings(record=True) as taken:
            warnings.simplefilter("always")
            loader.state_dict()
        it.close()
        ours = [[str(w.message) for w in caught if "numbers of DataLoader workers" in str(w.message)]
                for caught in (began, taken)]
        Path(out, f"{rank}.json").write_text(json.dumps(ours))
        dist.barrier()  # the store (rank 0's) stays until both have asked it
    finally:
        dist.destroy_process_group()


def spawned_rank_other_draws(rank: int, store: str, url: str, out: str) -> None:
    """A training process as `torch.multiprocessing.spawn` starts it: it joins a 2-rank gloo group in which rank 1
    stands for a node whose numpy draws otherwise (its draws' digest another), and begins two iterations of a
    loader of `url`, each after the other rank began its one before: out/RANK.json holds what each start raised."""
    import json

    import torch.distributed as dist

    import shardstream.rankcounts

    if rank == 1:
        shardstream.rankcounts.streams_digest = lambda: "0" * 16
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        loader = shardstream.DataLoader(key_dataset(url, shuffle=True, batch_size=2))
        raised = []
        for _ in range(2):
            try:
                next(iter(loader))
                raised.append(None)
            except shardstream.ShardstreamError as error:
                raised.append(str(error))
            dist.barrier()
        Path(out, f"{rank}.json").write_text(json.dumps(raised))
    finally:
        dist.destroy_process_group()


def spawned_rank_states(rank: int, stores: list[str], url: str, scenarios: list[list[Any]], out: str) -> None:
    """`spawned_rank_state` for each of `scenarios` ([workers, preview] pairs) in turn, each in a 2-rank gloo
    group of its own (on its own store, `stores[i]`), writing to out/i/RANK.json, then `spawned_rank_other_draws`
    on the last store, writing to out/draws/RANK.json: one training process a rank for them all, not one a
    scenario (a process started by spawn imports torch: seconds of CPU)."""
    import gc

    for i, (store, (workers, preview)) in enumerate(zip(stores, scenarios)):
        spawned_rank_state(rank, store, url, workers, preview, str(Path(out, str(i))))
        gc.collect()  # the scenario's loader, and its workers, gone before the next group is made
    spawned_rank_other_draws(rank, stores[-1], url, str(Path(out, "draws")))


def spawned_rank_epoch(rank: int, dataset: Any, out: str) -> None:
    """A training process as `torch.multiprocessing.spawn` starts it: rank 0 sets the epoch of `dataset`
    (made in the launcher) to 5; rank 1, once it has, writes the epoch it sees to out/1.json."""
    import json
    import time

    if rank == 0:
        dataset.set_epoch(5)
        Path(out, "set").write_text("")
        return
    deadline = time.monotonic() + 60
    while not Path(out, "set").exists():
        assert time.monotonic() < deadline, "rank 0 did not set its epoch"
        time.sleep(0.01)
    Path(out, "1.json").write_text(json.dumps(dataset.epoch))


def spawned_rank_orders(rank: int, dataset: Any, out: str) -> None:
    """A training process as `torch.multiprocessing.spawn` starts it: it reads epochs 0 and 1 of `dataset`
    (made in the launcher, its state not used here before) through torch's DataLoader with 2 persistent forked
    workers, setting the epoch between, and writes the two orders to out/RANK.json."""
    import json

    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    orders = []
    for epoch in range(2):
        if epoch:
            dataset.set_epoch(epoch)
        orders.append(flat(as_keys(item) for item in loader))
    Path(out, f"{rank}.json").write_text(json.dumps(orders))


def watch_held_indexes(monkeypatch: Any) -> Callable[[], tuple[int, int]]:
    """Watch the shard indexes that readers load from now on; the function returned gives (indexes
    loaded, the most held at once), an index being held while the reader that loaded it lives (each
    holds every key of its shard: what a count over many shards must not keep)."""
    import weakref

    from shardstream.reader import ShardReader

    loaded: list[weakref.ref] = []
    most_held = 0
    load = ShardReader._load_index

    def watched_load(self: ShardReader) -> Any:
        nonlocal most_held
        loaded.append(weakref.ref(self))
        most_held = max(most_held, sum(ref() is not None for ref in loaded))
        return load(self)

    monkeypatch.setattr(ShardReader, "_load_index", watched_load)
    return lambda: (len(loaded), most_held)


def truncated_shard(tmp_path: Path, compression: str) -> Path:
    """A dataset of one shard of samples s0-s9, cut short after 60% of its bytes: s6-s9 lost, s0-s5 whole."""
    folder = tmp_path / "ds"
    with shardstream.ShardWriter(str(folder), compression=compression, frame_size=512) as writer:  # a frame a sample
        for k in range(10):
            writer.write({"__key__": f"s{k}", "bin": np.random.default_rng(k).bytes(3000)})
    shard = folder / ("shard-000000.tar.zst" if compression == "zstd" else "shard-000000.tar")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) * 6 // 10])
    return folder


def write_unchecked(folder: Path, samples: list[dict[str, Any]]) -> str:
    """A dataset of `samples` (a `__key__` and bytes per field) stored as given, none of the
    bytes checked, as another tool may write them (`ShardWriter` refuses fields that do not
    read back as their extension says): one plain tar, indexed in place by `shardstream index`."""
    from shardstream.adopt import index_tars

    folder.mkdir(parents=True)
    with tarfile.open(folder / "shard-000000.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for sample in samples:
            for name in sorted(name for name in sample if name != "__key__"):
                member = tarfile.TarInfo(f"{sample['__key__']}.{name}")
                member.size = len(sample[name])
                tar.addfile(member, io.BytesIO(sample[name]))
    index_tars(str(folder))
    return str(folder)


def killed_after_first_shard(monkeypatch: Any, run: Callable[[], object]) -> None:
    """`run()` (a pack), killed (a KeyboardInterrupt) right after its journal records the first shard."""
    import pytest

    from shardstream.journal import Journal

    record = Journal.record

    def interrupted(self, shard, info, skipped):  # type: ignore[no-untyped-def]
        record(self, shard, info, skipped)
        raise KeyboardInterrupt

    monkeypatch.setattr(Journal, "record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(Journal, "record", record)
