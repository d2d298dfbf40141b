"""Sampling in a stream: class weights, epoch size, mixing; each keeping the plan's guarantees."""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from scipy.stats import chisquare

import shardstream as ss
from shardstream.plan import Layout, rng_for, split_ranks, worker_plan
from shardstream.resume import STATE_VERSION
from shardstream.sampling import (MAX_WALKS, Mix, PassStream, Sampling, class_sample_weights, distinct_draws,
                                  drawn_samples, mix_picks, mix_schedule, mixed_draws, sized_sequence, sorted_choice,
                                  weighted_sequence)
from shardstream.synthetic import make_image_folder

TINY = ((8, 8), (12, 12))

# One worker runs this module under `pytest -n 2 --dist loadgroup` (.ci/run): `imbalanced`, 1,110 images
# made and packed (seconds of CPU), is then made once, not once in each worker.
pytestmark = pytest.mark.xdist_group("sampling")


@pytest.fixture(scope="module")
def imbalanced(tmp_path_factory):
    """Classes of 1000, 100 and 10 tiny images, packed into several shards."""
    root = tmp_path_factory.mktemp("imbalanced")
    make_image_folder(root / "src", num_classes=3, images_per_class=[1000, 100, 10], size_range=TINY, workers=2)
    ss.pack(str(root / "src"), str(root / "ds"), shard_size="64KB", progress=False)
    return str(root / "ds")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    make_image_folder(root / "src", num_classes=2, images_per_class=[40, 23], size_range=TINY)
    ss.pack(str(root / "src"), str(root / "ds"), shard_size="8KB", progress=False)
    return str(root / "ds")


def labels_of(ds) -> list[int]:
    return [int(label) for (label,) in ds]


def test_shard_indexes_carry_the_labels(imbalanced):
    source = ss.open_dataset(imbalanced)
    labels = source.labels()
    assert np.bincount(labels).tolist() == [1000, 100, 10]
    # and they agree with the cls field of every sample
    first = source.shards[0].reader()
    assert [int(s["cls"]) for s in first] == source.labels()[: len(first)].tolist()


def test_balanced_classes_are_equally_frequent(imbalanced):
    ds = ss.StreamingDataset(imbalanced, decode=None, fields=("cls",), shuffle=True, seed=3,
                             sampling=Sampling(class_weights="balanced"))
    counts = np.bincount(labels_of(ds), minlength=3)
    assert counts.sum() == 1110  # samples_per_epoch defaults to the dataset size
    # Equal frequencies are not rejected at the 1% level (fixed seed: deterministic).
    assert chisquare(counts).pvalue > 0.01
    # ... whereas the unweighted stream is nowhere near equal.
    plain = np.bincount(labels_of(ss.StreamingDataset(imbalanced, decode=None, fields=("cls",))), minlength=3)
    assert chisquare(plain).pvalue < 1e-6


def test_explicit_class_weights_follow_their_ratio(imbalanced):
    ds = ss.StreamingDataset(imbalanced, decode=None, fields=("cls",), seed=1,
                             sampling=Sampling(class_weights={0: 1.0, 1: 10.0, 2: 0.0}, samples_per_epoch=2000))
    counts = np.bincount(labels_of(ds), minlength=3)
    assert counts[2] == 0
    # class 0 and class 1 have equal total weight (1000 x 1 and 100 x 10)
    assert chisquare(counts[:2]).pvalue > 0.01


def test_class_weights_as_a_list_are_a_weight_per_class_in_order(imbalanced):
    """Regression: a list of class weights failed with a bare "'list' object has no attribute 'items'"."""
    as_list = Sampling(class_weights=[1.0, 10.0, 0.0], samples_per_epoch=500)
    assert as_list == Sampling(class_weights={0: 1.0, 1: 10.0, 2: 0.0}, samples_per_epoch=500)
    drawn = labels_of(ss.StreamingDataset(imbalanced, decode=None, fields=("cls",), seed=1, sampling=as_list))
    assert len(drawn) == 500 and 2 not in drawn
    with pytest.raises(ValueError, match="a weight per class in order, not a int"):
        Sampling(class_weights=3)


@pytest.mark.parametrize(("n", "size", "seed"), [(1, 1, 0), (7, 3, 1), (1000, 37, 2), (200_000, 5_000, 3)])
def test_weighted_draws_are_numpys_choice_sorted(n, size, seed):
    """The weighted draws were `np.sort(rng.choice(..., p=...))`, a cache miss a draw at millions of samples
    (14 s to plan an epoch of 10^7, found by a review of the plan at scale); the same uniforms are sorted first
    now. The draws must be the very same: resume states of weighted epochs name them by position."""
    from shardstream.sampling import sorted_choice

    weights = np.random.default_rng(seed + 100).random(size) ** 3
    p = weights / weights.sum()
    expected = np.sort(np.random.default_rng(seed).choice(size, size=n, p=p))
    assert np.array_equal(sorted_choice(np.random.default_rng(seed), p, n), expected)


def test_a_drawn_epoch_is_drawn_once_for_its_len_and_its_iteration(imbalanced, monkeypatch):
    """A weighted epoch was drawn again at every len(), iter() and head start (seconds each at 10^7 samples)."""
    from shardstream.sampling import WeightedDraws

    drawn, stretches = [], []
    real, real_draws = WeightedDraws.__post_init__, WeightedDraws.draws
    monkeypatch.setattr(WeightedDraws, "__post_init__", lambda self: drawn.append(self.epoch) or real(self))
    monkeypatch.setattr(WeightedDraws, "draws", lambda self, *a: stretches.append(a) or real_draws(self, *a))
    ds = ss.StreamingDataset(imbalanced, decode=None, fields=("__key__",),
                             sampling=Sampling(class_weights="balanced"))
    assert len(ds) == len(ds) == len(list(ds))
    assert drawn == [0] and len(stretches) == 1
    # The rank's block is kept (a head start on the next epoch, then that epoch, ask for it): drawn once.
    assert len(list(ds)) == len(ds) and len(stretches) == 1
    ds.set_epoch(1)
    assert len(ds) == len(list(ds)) and drawn == [0, 1]


def test_weighted_epochs_are_deterministic_and_differ_by_epoch(imbalanced):
    make = lambda: ss.StreamingDataset(imbalanced, decode=None, fields=("__key__",), shuffle=True,
                                       sampling=Sampling(class_weights="balanced", samples_per_epoch=200))
    a, b = make(), make()
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_weighted_ranks_are_equal(imbalanced, world_size):
    per_rank = []
    for rank in range(world_size):
        ds = ss.StreamingDataset(imbalanced, decode=None, fields=("__key__",), batch_size=16, collate_fn=list,
                                 rank=rank, world_size=world_size, sampling=Sampling(class_weights="balanced",
                                                                                     samples_per_epoch=301))
        per_rank.append(list(ds))
        assert len(per_rank[-1]) == len(ds)
    assert len({len(batches) for batches in per_rank}) == 1
    assert sum(len(b) for batches in per_rank for b in batches) == 301 + (-301) % world_size


def test_weighted_resume_is_exact_and_elastic(imbalanced):
    def make(**kw):
        return ss.StreamingDataset(imbalanced, decode=None, fields=("__key__",), shuffle=True, batch_size=16,
                                   collate_fn=list, sampling=Sampling(class_weights="balanced", samples_per_epoch=300),
                                   **kw)

    full = list(make())
    it = iter(ds := make())
    head = [next(it) for _ in range(5)]
    state = ds.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    # elastic: two ranks finish the epoch; the multiset of samples is the uninterrupted one
    seen = collections.Counter(k for batch in head for (k,) in batch)
    for rank in range(2):
        other = make(rank=rank, world_size=2)
        other.load_state_dict(state)
        seen.update(k for batch in other for (k,) in batch)
    assert seen == collections.Counter(k for batch in full for (k,) in batch)


def test_distinct_draws_number_each_samples_draws_in_sequence_order():
    sequence = np.array([3, 1, 3, 3, 1, 0])
    assert distinct_draws(sequence, 10).tolist() == [3, 1, 13, 23, 11, 0]
    assert drawn_samples(distinct_draws(sequence, 10), 10).tolist() == sequence.tolist()
    assert distinct_draws(np.arange(5)[::-1], 5).tolist() == [4, 3, 2, 1, 0]  # drawn once: ids kept


def _noise(sample: dict) -> dict:
    """A transform's own random draw, seeded per draw by the dataset (prepare.py)."""
    import torch

    return {**sample, "noise": float(torch.rand(()))}


@pytest.mark.parametrize("sampling", [Sampling(class_weights={0: 1, 1: 20}, samples_per_epoch=200),
                                      Sampling(samples_per_epoch=150)], ids=["weighted", "larger"])
def test_each_draw_of_a_sample_gets_its_own_augmentations_in_any_layout(small, sampling):
    """Regression: a sample's augmentations were seeded by (seed, epoch, sample), so every draw of a sample
    an epoch holds more than once (oversampled by its class weight, or met again on a second pass of an epoch
    larger than the data) got the same crop and flip. Each draw is seeded apart now, and which draw is the
    k-th is fixed by the epoch's sequence, so the draws are the same with any number of ranks, and resumed."""
    def draws(**kw) -> list[tuple[str, float]]:
        return list(ss.StreamingDataset(small, decode=None, fields=("__key__", "noise"), shuffle=True, seed=5,
                                        transform=_noise, sampling=sampling, **kw))

    one = draws()
    by_key = collections.defaultdict(list)
    for key, noise in one:
        by_key[key].append(noise)
    repeated = [noises for noises in by_key.values() if len(noises) > 1]
    assert len(repeated) > 20 and all(len(set(noises)) == len(noises) for noises in repeated)
    two = draws(rank=0, world_size=2) + draws(rank=1, world_size=2)
    assert sorted(two) == sorted(one)
    ds = ss.StreamingDataset(small, decode=None, fields=("__key__", "noise"), shuffle=True, seed=5,
                             transform=_noise, sampling=sampling)
    it = iter(ds)
    head = [next(it) for _ in range(37)]
    resumed = ss.StreamingDataset(small, decode=None, fields=("__key__", "noise"), shuffle=True, seed=5,
                                  transform=_noise, sampling=sampling)
    resumed.load_state_dict(ds.state_dict())
    assert head + list(resumed) == one


def test_samples_per_epoch_smaller_and_larger(small):
    keys = lambda n: [k for (k,) in ss.StreamingDataset(small, decode=None, fields=("__key__",), shuffle=True,
                                                         sampling=Sampling(samples_per_epoch=n))]
    few = keys(20)
    assert len(few) == len(set(few)) == 20
    many = keys(150)
    counts = collections.Counter(many)
    assert len(many) == 150 and len(counts) == 63
    assert max(counts.values()) - min(counts.values()) <= 1  # whole passes first, then part of one more


def test_a_mix_of_sources_whose_labels_name_other_classes_is_warned_of(imbalanced, small, tmp_path):
    """Found by a user's walk: a Mix of datasets whose class tables differ yielded each one's labels as they are,
    label 0 a cat in one and a truck in the other, and said so only by `classes` being ()."""
    import warnings

    make_image_folder(tmp_path / "src", num_classes=2, images_per_class=3, size_range=TINY)
    for old, new in (("class_000", "cat"), ("class_001", "dog")):
        (tmp_path / "src" / old).rename(tmp_path / "src" / new)
    ss.pack(str(tmp_path / "src"), str(tmp_path / "pets"), progress=False)
    with pytest.warns(UserWarning, match=r"the mixed sources name their classes differently \(.*pets: 2 \(cat, dog\); "
                                         r".*: 2 \(class_000, class_001\)\)"):
        ss.StreamingDataset(Mix([str(tmp_path / "pets"), small], weights=[1, 1]), decode=None).resolve()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one table begins the other: label k is one class in both
        ds = ss.StreamingDataset(Mix([imbalanced, small], weights=[1, 1]), decode=None)
        ds.resolve()
    assert ds.classes == ()
    # Once a dataset, not once each worker and epoch (found by review: 4 times in 2 epochs of 2 workers). In a
    # process of its own: pytest records the warnings of the workers this process forks, and they print none.
    script = textwrap.dedent(f"""
        import warnings
        from torch.utils.data import DataLoader
        import shardstream as ss
        warnings.simplefilter("always")  # the workers' own once-a-place would not show a second
        pets = ss.StreamingDataset(ss.Mix([{str(tmp_path / "pets")!r}, {small!r}], weights=[1, 1]), decode=None,
                                   fields=("cls",))
        loader = DataLoader(pets, batch_size=None, num_workers=2)
        for epoch in range(2):
            pets.set_epoch(epoch)
            assert len(list(loader)) == 6 + 63
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.count("name their classes differently") == 1, done.stderr


def test_mix_proportions_hold_per_window(imbalanced, small):
    mix = Mix([imbalanced, small], weights=[0.7, 0.3])
    ds = ss.StreamingDataset(mix, decode=None, fields=("__url__",), sampling=Sampling(samples_per_epoch=1000),
                             batch_size=50, collate_fn=list)
    fractions = [sum("/" + "small" in u for (u,) in batch) / len(batch) for batch in ds]
    assert len(fractions) == 20
    # no shuffle buffer: the interleaving itself keeps every batch within a sample of 30%
    assert all(abs(f - 0.3) <= 1 / 50 + 1e-9 for f in fractions)


@pytest.mark.parametrize("sampling", [Sampling(class_weights="balanced"), Sampling(sample_weights=np.ones(3))])
def test_weights_on_a_mix_are_refused_not_ignored(imbalanced, small, sampling):
    """Regression: class and sample weights given with a Mix were silently ignored (class 0, weighted 0,
    still made most draws)."""
    with pytest.raises(ValueError, match="do not apply to a Mix"):
        ss.StreamingDataset(Mix([imbalanced, small], weights=[0.5, 0.5]), sampling=sampling)


@pytest.mark.parametrize("sampling", [Sampling(class_weights="balanced"), Sampling(sample_weights="weight")])
def test_compressed_tars_without_an_index_are_sampled_by_weight_as_plain_ones(tmp_path, sampling):
    """Regression: the same samples as a `.tar` and as a `.tar.gz`: weighted sampling of the
    `.tar.gz` failed, saying its index had no labels (it has no index) and advising a repack
    with a cls field, which every sample had. Their labels and weights are read as they are counted."""
    import gzip
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tf:
        for i in range(12):
            for field, value in (("bin", b"x"), ("cls", str(i % 3 if i < 9 else 0).encode()),
                                 ("weight", str(1 + i % 4).encode())):
                info = tarfile.TarInfo(f"s{i:02d}.{field}")
                info.size = len(value)
                tf.addfile(info, io.BytesIO(value))
    (tmp_path / "a.tar").write_bytes(data.getvalue())
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress(data.getvalue()))
    plain, compressed = ([key for (key,) in ss.StreamingDataset([str(tmp_path / name)], decode=None, seed=3,
                                                                fields=("__key__",), sampling=sampling)]
                         for name in ("a.tar", "a.tar.gz"))
    assert compressed == plain and len(plain) == 12 and len(set(plain)) < 12  # drawn by weight, with repeats


@pytest.mark.parametrize("sampling", [Sampling(samples_per_epoch=100), Sampling(class_weights="balanced"),
                                      Sampling(class_weights="balanced", samples_per_epoch=100)])
def test_sampling_from_an_empty_dataset_is_an_error(tmp_path, sampling):
    """Regression: samples_per_epoch on a dataset without samples gave epochs of none, len 0,
    silently; weighted, it said the weights were all 0."""
    with ss.ShardWriter(str(tmp_path / "empty")):
        pass
    ds = ss.StreamingDataset(str(tmp_path / "empty"), decode=None, sampling=sampling)
    with pytest.raises(ValueError, match=r"(samples_per_epoch=100|sampling by weight), but the dataset .*empty has no"):
        len(ds)
    with pytest.raises(ValueError, match="has no samples"):
        list(ds)


@pytest.mark.parametrize("sampling", [None, Sampling(samples_per_epoch=100)])
def test_a_mix_with_an_empty_source_names_it(tmp_path, small, sampling):
    """Regression: a mix of empty sources gave epochs of none, silently; one empty source
    among others failed as "mixed source 1 has no samples", by number, once first drawn."""
    with ss.ShardWriter(str(tmp_path / "empty")):
        pass
    for sources in ([small, str(tmp_path / "empty")], [str(tmp_path / "empty")] * 2):
        ds = ss.StreamingDataset(Mix(sources, weights=[0.5, 0.5]), decode=None, sampling=sampling)
        with pytest.raises(ValueError, match=f"mixed source {tmp_path / 'empty'} has no samples"):
            list(ds)


def test_mix_proportions_across_ranks_and_workers(imbalanced, small):
    import torch

    mix = Mix([imbalanced, small], weights=[3, 1])
    total, from_small = 0, 0
    for rank in range(2):
        ds = ss.StreamingDataset(mix, decode=None, fields=("__url__",), shuffle=True, rank=rank, world_size=2,
                                 sampling=Sampling(samples_per_epoch=800), batch_size=40, collate_fn=list)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        for batch in loader:
            total += len(batch)
            from_small += sum("small" in u for (u,) in batch)
    assert total == 800
    assert from_small == 200  # exact over the epoch: the interleaving is deterministic


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mix_resume_is_exact_and_elastic(imbalanced, small, num_workers):
    """A mixed stream checkpointed mid-epoch through shardstream.DataLoader resumes onto the same batches; resumed
    onto 2 ranks, the rest of the epoch holds exactly the samples (with their repeats) not yet consumed."""
    def make(**kw):
        ds = ss.StreamingDataset(Mix([imbalanced, small], weights=[0.7, 0.3]), decode=None, fields=("__key__",),
                                 shuffle=True, seed=9, batch_size=10, collate_fn=list,
                                 sampling=Sampling(samples_per_epoch=300), **kw)
        return ss.DataLoader(ds, num_workers=num_workers, persistent_workers=False)

    full = [tuple(k for (k,) in batch) for batch in make()]
    loader = make()
    it = iter(loader)
    head = [tuple(k for (k,) in next(it)) for _ in range(13)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [tuple(k for (k,) in batch) for batch in resumed] == full
    seen = collections.Counter(k for batch in head for k in batch)
    for rank in range(2):
        other = make(rank=rank, world_size=2)
        other.load_state_dict(state)
        seen.update(k for batch in other for (k,) in batch)
    assert seen == collections.Counter(k for batch in full for k in batch)


def test_mixed_draws_reuse_a_short_source():
    streams = [PassStream(np.array([10]), 0, False), PassStream(np.array([3]), 0, False, offset=10)]
    out = mixed_draws(streams, [0.5, 0.5], 0, 0, 20, 13)
    samples = drawn_samples(out, 13)
    assert sorted(samples[samples >= 10].tolist()) == sorted([10, 11, 12] * 3 + [10])
    assert len(set(out.tolist())) == 20  # each draw of a sample told apart


def test_pure_functions_validate():
    with pytest.raises(ValueError):
        Sampling(class_weights="uniform")
    with pytest.raises(ValueError):
        Mix(["a"], weights=[0.0])
    with pytest.raises(ValueError):
        class_sample_weights(np.array([0, -1]), "balanced")
    assert np.allclose(class_sample_weights(np.array([0, 0, 1]), "balanced"), [0.5, 0.5, 1.0])
    counts = np.array([3, 4])
    assert len(sized_sequence(counts, 0, 0, True, 5)) == 5
    drawn = weighted_sequence(counts, np.ones(7), 0, 0, False, 50)
    assert len(drawn) == 50 and set(drawn.tolist()) <= set(range(7))


def test_resampled_runs_epoch_after_epoch_split_across_ranks(small):
    import itertools

    make = lambda rank: ss.StreamingDataset(small, decode=None, fields=("__key__",), shuffle=True, batch_size=8,
                                            collate_fn=list, rank=rank, world_size=2,
                                            sampling=Sampling(resampled=True))
    with pytest.raises(TypeError):
        len(make(0))
    # 63 samples: 32 per rank (one padded), 4 batches of 8 per rank and epoch
    per_rank = [list(itertools.islice(iter(make(r)), 12)) for r in range(2)]
    for epoch in range(3):
        keys = [k for r in range(2) for batch in per_rank[r][4 * epoch : 4 * epoch + 4] for (k,) in batch]
        assert len(keys) == 64 and len(set(keys)) == 63
    first, second = (per_rank[0][4 * e : 4 * e + 4] for e in (0, 1))
    assert first != second  # each epoch its own order


@pytest.mark.parametrize("num_workers", [2, 3])
def test_resampled_workers_cross_epochs_together(small, num_workers):
    """63 samples in batches of 4 are 16 batches an epoch, which 3 workers share 6, 5, 5 (2 share them evenly).
    Dealt per epoch, the first worker fell a round behind every epoch and the others ran ahead, epochs apart
    after a while, so the first 16 * E batches held some samples far more often than others. Dealt across
    epoch boundaries, they hold every sample of epochs 0..E-1 exactly E times."""
    import collections
    import itertools

    epochs = 6
    loader = ss.DataLoader(ss.StreamingDataset(small, decode=None, fields=("__key__",), shuffle=True, batch_size=4,
                                               collate_fn=list, sampling=Sampling(resampled=True)),
                           num_workers=num_workers, persistent_workers=False)
    batches = list(itertools.islice(iter(loader), 16 * epochs))
    seen = collections.Counter(key for batch in batches for (key,) in batch)
    assert len(seen) == 63 and set(seen.values()) == {epochs}
    for e in range(epochs):  # and epoch by epoch: batches 16e..16e+15 are epoch e, whole
        keys = [key for batch in batches[16 * e : 16 * e + 16] for (key,) in batch]
        assert len(keys) == len(set(keys)) == 63


def test_resampled_resume_is_exact_through_workers(small):
    import itertools

    make = lambda: ss.DataLoader(ss.StreamingDataset(small, decode=None, fields=("__key__",), shuffle=True,
                                                     batch_size=4, collate_fn=list,
                                                     sampling=Sampling(resampled=True)), num_workers=2)
    full = list(itertools.islice(iter(make()), 40))
    loader = make()
    head = list(itertools.islice(iter(loader), 21))  # past the first epoch (16 batches)
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + list(itertools.islice(iter(resumed), 19)) == full


@pytest.mark.parametrize(("k", "new_world", "new_workers"), [(7, 2, 0), (15, 2, 0), (17, 3, 0), (20, 1, 3),
                                                           (25, 2, 2), (33, 1, 1)])
def test_resampled_elastic_resume_sees_every_sample_of_each_epoch(small, k, new_world, new_workers):
    """An endless stream checkpointed after `k` batches of 4 from 2 DataLoader workers (which cross each epoch
    boundary at slightly different times), resumed onto another layout, continues in the earliest epoch an old
    worker had not finished, with exactly the samples of it not yet seen: the old head plus the new ranks' rest of
    that epoch hold every sample once per epoch, plus padding and what old workers had taken of the next epoch."""
    import itertools

    from torch.utils.data import DataLoader

    from shardstream.plan import worker_items

    def make(**kw):
        return ss.StreamingDataset(small, decode=None, fields=("__key__",), shuffle=True, seed=5, batch_size=4,
                                   collate_fn=list, sampling=Sampling(resampled=True), **kw)

    def keys(batches):
        return [key for batch in batches for (key,) in batch]

    old = make()
    head = keys(itertools.islice(DataLoader(old, batch_size=None, num_workers=2), k))
    state = old.state_dict(delivered=k, num_workers=2)
    rest, epoch = [], None
    for rank in range(new_world):
        resumed = make(rank=rank, world_size=new_world)
        resumed.load_state_dict(state)
        # the batches left of the epoch resumed in, on this rank (what its workers' plans hold)
        block, plan, _, _, epoch = resumed._rank_block(resumed._world_with(new_workers))
        items = sum(worker_items(len(block), plan.layout))
        rest += keys(itertools.islice(DataLoader(resumed, batch_size=None, num_workers=new_workers), items))
    assert epoch == (len(head) - 8) // 63 or epoch == len(head) // 63  # the epoch some old worker had not finished
    counts = collections.Counter(head + rest)
    assert len(counts) == 63 and min(counts.values()) == epoch + 1, "a sample of a finished epoch was lost"
    # beyond whole epochs: padding of the remainder (< 1 per rank) and what old workers had already taken of the
    # next epoch (at most one batch each), which the next epoch yields again
    assert sum(counts.values()) - (epoch + 1) * 63 <= (new_world - 1) + 2 * 4
    assert max(counts.values()) <= epoch + 2


# -- per-sample weights ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """600 samples over several shards, each with a `weight` field: 1.0 for even ids, 3.0 for odd ones, 0.0 for
    every tenth (never drawn)."""
    root = tmp_path_factory.mktemp("weighted") / "ds"
    rng = np.random.default_rng(0)
    with ss.ShardWriter(str(root), shard_size="20KB", frame_size=4000) as writer:
        for i in range(600):
            weight = 0.0 if i % 10 == 0 else (3.0 if i % 2 else 1.0)
            writer.write({"__key__": f"s{i:04d}", "bin": rng.bytes(100), "cls": i % 2, "weight": weight})
    return str(root)


def weight_of(key: str) -> float:
    i = int(key[1:])
    return 0.0 if i % 10 == 0 else (3.0 if i % 2 else 1.0)


def keys_of(ds) -> list[str]:
    return [k for (k,) in ds]


def test_weight_field_is_kept_in_the_index_and_decodes_as_float(weighted):
    source = ss.open_dataset(weighted)
    assert len(source.shards) > 2
    assert source.weights().tolist() == [weight_of(f"s{i:04d}") for i in range(600)]
    for key, weight in ss.StreamingDataset(weighted, decode=None, fields=("__key__", "weight")):
        assert isinstance(weight, float) and weight == weight_of(key)
    raw = next(iter(ss.open_dataset(weighted).shards[0].reader()))
    assert raw["weight"] == repr(weight_of(raw["__key__"])).encode()  # stored as ASCII, like cls


@pytest.mark.parametrize("how", ["field", "array"])
def test_sample_weights_set_the_draw_frequencies(weighted, how):
    weights = "weight" if how == "field" else [weight_of(f"s{i:04d}") for i in range(600)]
    ds = ss.StreamingDataset(weighted, decode=None, fields=("__key__",), shuffle=True, seed=4,
                             sampling=Sampling(sample_weights=weights, samples_per_epoch=6000))
    keys = keys_of(ds)
    assert len(keys) == 6000
    assert not [k for k in keys if weight_of(k) == 0.0], "a sample of weight 0 was drawn"
    # odd ids (300 of weight 3) against even ones (240 of weight 1, 60 of weight 0): 900 : 240
    odd = sum(int(k[1:]) % 2 for k in keys)
    assert chisquare([odd, 6000 - odd], [6000 * 900 / 1140, 6000 * 240 / 1140]).pvalue > 0.01
    # and within the odd ones, every sample about as often as another
    per_key = collections.Counter(k for k in keys if int(k[1:]) % 2)
    assert chisquare(list(per_key.values())).pvalue > 0.001


def test_sample_weights_multiply_class_weights(weighted):
    """class 1 (odd ids) weight 0: only even ids, weighted 1 each (every tenth excluded by its own weight 0)."""
    ds = ss.StreamingDataset(weighted, decode=None, fields=("__key__",), seed=2,
                             sampling=Sampling(class_weights={0: 1.0, 1: 0.0}, sample_weights="weight",
                                               samples_per_epoch=1000))
    keys = keys_of(ds)
    assert all(int(k[1:]) % 2 == 0 and int(k[1:]) % 10 for k in keys)


def test_sample_weights_resume_exactly_and_the_state_knows_them(weighted):
    def make(weights):
        return ss.StreamingDataset(weighted, decode=None, fields=("__key__",), shuffle=True, batch_size=8,
                                   collate_fn=list, sampling=Sampling(sample_weights=weights, samples_per_epoch=200))

    weights = np.array([weight_of(f"s{i:04d}") for i in range(600)])
    full = list(make(weights))
    it = iter(ds := make(weights))
    head = [next(it) for _ in range(7)]
    state = ds.state_dict()
    resumed = make(weights.copy())
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    other = weights.copy()
    other[1] = 5.0
    with pytest.raises(ss.ShardstreamError, match="another dataset .*: its shards, their contents, or its "
                                                  "Sampling or Mix weights differ"):
        make(other).load_state_dict(state)


def test_bad_sample_weights_are_refused(weighted, small, tmp_path):
    with pytest.raises(ValueError, match="one finite, non-negative"):
        Sampling(sample_weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="'weight'"):
        Sampling(sample_weights="score")
    with pytest.raises(ValueError, match="600 samples"):
        list(ss.StreamingDataset(weighted, decode=None, sampling=Sampling(sample_weights=[1.0] * 599)))
    with pytest.raises(ss.ShardstreamError, match="weight field") as info:
        list(ss.StreamingDataset(small, decode=None, sampling=Sampling(sample_weights="weight")))
    assert info.value.url is not None and "shard-" in info.value.url
    for bad in (-1.0, b"heavy", float("inf")):  # bytes are stored as given, so the writer checks them
        with pytest.raises(ss.ShardstreamError, match="weight must be") as info:
            with ss.ShardWriter(str(tmp_path / "bad")) as writer:
                writer.write({"__key__": "a", "bin": b"x", "weight": bad})
        assert info.value.key == "a"


@pytest.mark.parametrize(("field", "value", "sampling", "message"), [
    ("cls", b"cat", Sampling(class_weights="balanced"), "no class"),
    ("cls", b"-1", Sampling(class_weights="balanced"), "no class"),
    ("cls", None, Sampling(class_weights="balanced"), "no class"),
    ("weight", None, Sampling(sample_weights="weight"), "no weight \\(a weight field"),
])
def test_sampling_names_the_sample_without_its_field(tmp_path, field, value, sampling, message):
    """A tar whose sample has no usable cls (a name, a negative number, none at all) was a bare ValueError
    naming neither shard nor sample, and one without a weight named only the shard: which of a million
    samples lacked it was anyone's guess."""
    import io
    import tarfile

    path = tmp_path / "other.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key in "abc":
            fields = {"cls": b"1", "weight": b"1.0"}
            if key == "b":
                fields[field] = value
            for name, data in fields.items():
                if data is not None:
                    info = tarfile.TarInfo(f"{key}.{name}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ss.ShardstreamError, match=message) as info:
        list(ss.StreamingDataset([str(path)], decode=None, sampling=sampling))
    assert (info.value.url, info.value.key) == (str(path), "b")


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Sampling(class_weights={-1: 5.0, 0: 1.0}), "class indices"),  # -1 weighted the last class
    (lambda: Sampling(class_weights={10**9: 1.0}), "class indices"),  # an 8 GB table
    (lambda: Sampling(class_weights={0: float("nan")}), "finite and non-negative"),
    (lambda: Sampling(class_weights={0: -1.0}), "finite and non-negative"),
    (lambda: Sampling(class_weights={0.5: 1.0}), "class indices"),
    (lambda: ss.Mix(["a", "b"], [float("nan"), 1.0]), "finite and positive"),
])
def test_weights_are_checked_where_they_are_given(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_unshuffled_epochs_cut_short_walk_the_data_in_order(small):
    """Cut short (samples_per_epoch, or a Mix reading less of a source than it holds) and unshuffled, every epoch
    took the same prefix: the tail was never read. Each epoch goes on from where the last stopped now."""
    import collections

    every = [k for (k,) in ss.StreamingDataset(small, decode=None, fields=("__key__",))]
    seen = []
    ds = ss.StreamingDataset(small, decode=None, fields=("__key__",), sampling=Sampling(samples_per_epoch=20))
    for epoch in range(7):  # 140 samples of 63: every sample twice, some thrice
        ds.set_epoch(epoch)
        got = [k for (k,) in ds]
        assert got == [every[(epoch * 20 + i) % 63] for i in range(20)]
        seen += got
    assert set(collections.Counter(seen).values()) == {2, 3}

    mixed = ss.StreamingDataset(ss.Mix([small, small], [0.75, 0.25]), decode=None, fields=("__key__",),
                                sampling=Sampling(samples_per_epoch=40))
    counts = collections.Counter()
    for epoch in range(8):
        mixed.set_epoch(epoch)
        counts.update(k for (k,) in mixed)
    assert set(counts) == set(every)  # the first source's 30 picks an epoch reach its tail in 3 epochs


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    """Two datasets of shards of 100 samples: `a` of 4 shards, `b` of 3."""
    root = tmp_path_factory.mktemp("bigshards")
    for name, shards in (("a", 4), ("b", 3)):
        with ss.ShardWriter(str(root / name), max_samples=100) as writer:
            for i in range(100 * shards):
                writer.write({"__key__": f"{name}{i:04d}", "cls": i % 2})
    return str(root / "a"), str(root / "b")


def keys_over_epochs(ds, epochs) -> list[str]:
    out = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        out += [k for (k,) in ds]
    return out


def test_shuffled_epochs_cut_short_walk_on_through_every_sample(big_shards):
    """Regression: shuffled, an epoch cut short (samples_per_epoch) took the first samples of a freshly
    shuffled pass, each shard's in file order: with epochs smaller than a shard, the samples beyond the
    cut in every shard were never read (200 of 400 over 40 epochs of 50). Epochs are windows of one
    stream of passes now: every 8 epochs of 50 read the 400 samples once each."""
    a, _ = big_shards
    ds = ss.StreamingDataset(a, decode=None, fields=("__key__",), shuffle=True, seed=1,
                             sampling=Sampling(samples_per_epoch=50))
    first, second = keys_over_epochs(ds, range(8)), keys_over_epochs(ds, range(8, 16))
    assert sorted(first) == sorted(second) == sorted(f"a{i:04d}" for i in range(400))
    assert first != second  # another pass, in another order
    whole = ss.StreamingDataset(a, decode=None, fields=("__key__",), shuffle=True, seed=1,
                                sampling=Sampling(samples_per_epoch=400))
    plain = ss.StreamingDataset(a, decode=None, fields=("__key__",), shuffle=True, seed=1)
    assert keys_over_epochs(whole, [3]) == keys_over_epochs(plain, [3])  # an epoch the data's size is the plain one


def test_a_mix_keeps_its_shares_across_epochs_and_reads_every_samples(big_shards):
    """Regression: each epoch of a Mix drew its picks afresh from the start, so every epoch had the same
    per-source counts, rounding errors added up epoch after epoch, and a source with less than half a pick
    an epoch was never read (0.98/0.02 over 100 epochs of 20: none of b); a source's share was the first
    samples of a freshly shuffled pass, so the tails of its shards were never read either. Epochs are
    windows of one mixed stream now, and each source's picks walk on through its own passes."""
    a, b = big_shards
    ds = ss.StreamingDataset(Mix([a, b], [0.98, 0.02]), decode=None, fields=("__key__",), shuffle=True, seed=2,
                             sampling=Sampling(samples_per_epoch=20))
    keys = keys_over_epochs(ds, range(100))
    assert abs(sum(k.startswith("b") for k in keys) - 40) <= 1
    wide = ss.StreamingDataset(Mix([a, b], [0.95, 0.05]), decode=None, fields=("__key__",), shuffle=True, seed=2,
                               sampling=Sampling(samples_per_epoch=600))
    from_b = [k for k in keys_over_epochs(wide, range(10)) if k.startswith("b")]  # 30 an epoch, 300 in all
    assert sorted(from_b) == sorted(f"b{i:04d}" for i in range(300))


def test_the_mixed_stream_is_the_same_whatever_the_epoch_size():
    """An epoch's picks are a window of one schedule: epochs of n picks laid end to end are the schedule's
    first picks, and the counts before a window are those picks' counts, for many weights."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = rng.random(int(rng.integers(1, 7))) + 0.001
        n, epochs = int(rng.integers(1, 200)), int(rng.integers(1, 6))
        whole = mix_picks(weights, n * epochs)
        for e in range(epochs):
            picks, before = mix_schedule(weights, e * n, n)
            assert (picks == whole[e * n : (e + 1) * n]).all()
            assert (before == np.bincount(whole[: e * n], minlength=len(weights))).all()


def test_a_version_1_state_of_a_mix_or_a_sized_epoch_is_refused(big_shards):
    """Version 1 states were taken when a Mix and samples_per_epoch drew each epoch afresh: resumed here they
    would describe other samples, so they are refused, saying why; plain datasets' still load."""
    a, b = big_shards
    for source, sampling in ((Mix([a, b], [0.5, 0.5]), None), (a, Sampling(samples_per_epoch=50))):
        ds = ss.StreamingDataset(source, decode=None, fields=("__key__",), sampling=sampling)
        it = iter(ds)
        next(it)
        state = {**ds.state_dict(), "version": 1}
        with pytest.raises(ss.ShardstreamError, match="walk on across epochs"):
            ss.StreamingDataset(source, decode=None, fields=("__key__",), sampling=sampling).load_state_dict(state)
    plain = ss.StreamingDataset(a, decode=None, fields=("__key__",))
    it = iter(plain)
    next(it)
    ss.StreamingDataset(a, decode=None, fields=("__key__",)).load_state_dict({**plain.state_dict(), "version": 1})


def test_a_class_left_out_of_class_weights_is_an_error_naming_it(imbalanced):
    """Regression: a class missing from a class_weights mapping had weight 0, so it left every epoch without
    a word; and weights that were all 0 were reported as "sample weights sum to zero" when none were given."""
    with pytest.raises(ValueError, match="no weight for class 0, which samples have \\(nor for 1 more\\)"):
        len(ss.StreamingDataset(imbalanced, sampling=Sampling(class_weights={1: 5.0})))
    ds = ss.StreamingDataset(imbalanced, decode=None, fields=("cls",),
                             sampling=Sampling(class_weights={0: 0.0, 1: 1.0, 2: 0.0}, samples_per_epoch=50))
    assert {int(c) for (c,) in ds} == {1}  # 0 says "leave it out"
    with pytest.raises(ValueError, match="are 0 for every sample"):
        list(ss.StreamingDataset(imbalanced, sampling=Sampling(class_weights={0: 0.0, 1: 0.0, 2: 0.0})))


def test_weights_whose_sum_overflows_still_weigh():
    """Each finite, two weights of 1e308 summed past float's range: a Mix normalised them to 0 and failed
    later with "negative dimensions", class weights with numpy's "probabilities do not sum to 1"."""
    assert Mix(["a", "b"], [1e308, 1e308]).weights == (0.5, 0.5)
    drawn = weighted_sequence(np.array([2, 2]), np.array([1e308, 1e308, 0.0, 0.0]), 0, 0, False, 20)
    assert set(drawn.tolist()) == {0, 1}
    # numpy's pairwise sum finite, the running sum not (found by review: every weighted epoch failed).
    weights = np.zeros(16)
    weights[0] = weights[2] = 2.0 ** 969
    weights[3] = np.finfo(float).max
    assert np.isfinite(weights.sum()) and not np.isfinite(np.cumsum(weights)[-1])
    assert set(weighted_sequence(np.array([8, 8]), weights, 0, 0, True, 5).tolist()) <= {0, 2, 3}


def test_samples_per_epoch_must_be_a_whole_count():
    """Regression: 1e6 from a config file was taken, then failed with numpy's slicing error when the epoch was
    first planned (in a DataLoader worker); True was taken as 1."""
    with pytest.raises(TypeError, match="samples_per_epoch must be an integer, not 1000000.0"):
        Sampling(samples_per_epoch=1e6)
    with pytest.raises(TypeError, match="samples_per_epoch must be an integer, not True"):
        Sampling(samples_per_epoch=True)
    with pytest.raises(ValueError, match="samples_per_epoch must be 1 or more, not 0"):
        Sampling(samples_per_epoch=0)
    assert Sampling(samples_per_epoch=np.int64(5)).samples_per_epoch == 5


def test_a_sample_drawn_again_is_read_once(tmp_path):
    """Regression (found by review): weighted sampling draws a sample again beside itself, and each draw was
    read as a run of its own, its frame read and decompressed again: a class-balanced epoch of 20,000 tiny
    samples made 10,498 requests against 43 for a uniform one (100k samples: 36,934 against 28). The samples,
    and their order, are as before: a repeat is a copy. (Copies are spread over up to `MAX_WALKS` walks over
    the shards since, each walk reading the shards its draws are in: a repeat within a walk is a copy.)"""
    with ss.ShardWriter(str(tmp_path / "ds"), shard_size="2MB") as writer:
        for i in range(20_000):
            writer.write({"__key__": f"k{i:06d}", "cls": 0 if i % 10 else 1, "txt": "x" * 20})

    def epoch(sampling):
        ds = ss.StreamingDataset(str(tmp_path / "ds"), decode=None, fields=("__key__",), shuffle=True,
                                 seed=3, sampling=sampling)
        return [key for (key,) in ds], ds.io_stats()["requests"]

    uniform_keys, uniform_requests = epoch(None)
    keys, requests = epoch(Sampling(class_weights="balanced"))
    assert len(keys) == len(uniform_keys) and len(set(keys)) < len(keys)  # samples drawn again
    assert requests <= 2 * MAX_WALKS * uniform_requests


def test_a_shard_read_again_walks_later_is_let_go_in_between(tmp_path, monkeypatch):
    """Regression (found by the first review of the walks): a worker kept every shard it read open (its
    index in memory; with a cache, its copy locked past `cache_limit`) until its last run, which the walks
    put in the epoch's last walk: 1,658 shard readers open at once over 2,858 shards. A shard is let go
    after a stretch that its next one follows by more than `REVISIT_HOLD` stretches, and opened again."""
    import shardstream.stream as stream
    from shardstream.pieces import REVISIT_HOLD, Stretch, stretches

    runs = [(0, 0, 5), (0, 7, 9), (1, 0, 3), (0, 9, 10)] + [(k, 0, 1) for k in range(2, 3 + REVISIT_HOLD)] + [(0, 10, 12)]
    planned = stretches(runs)
    assert planned[:3] == [Stretch(0, [(0, 5), (7, 9)], False, 0), Stretch(1, [(0, 3)], True, 0),
                           Stretch(0, [(9, 10)], True, 0)]  # back within REVISIT_HOLD: held; then far: let go
    assert planned[-1] == Stretch(0, [(10, 12)], True, 1)  # opened again
    with ss.ShardWriter(str(tmp_path / "ds"), max_samples=5) as writer:
        for i in range(1500):
            writer.write({"__key__": f"k{i:05d}", "cls": i % 50 if i % 3 else 0, "txt": "x"})
    most = 0
    get = stream.Readers.get

    def counted(self, shard):
        nonlocal most
        reader = get(self, shard)
        most = max(most, len(self._entries))
        return reader

    monkeypatch.setattr(stream.Readers, "get", counted)
    for prefetch in (0, 4):  # 300 shards, each met in several walks
        most = 0
        ds = ss.StreamingDataset(str(tmp_path / "ds"), decode=None, fields=("__key__",), shuffle=True,
                                 prefetch=prefetch, sampling=Sampling(class_weights="balanced"))
        assert len(list(ds)) == 1500
        # Held: a shard's stretches within REVISIT_HOLD, those opened ahead, those of pieces in flight.
        assert 0 < most <= (1 if prefetch == 0 else prefetch + 1 + stream.MAX_AHEAD + REVISIT_HOLD), (prefetch, most)


def test_a_weighted_state_of_an_earlier_plan_is_refused(small):
    """A state of version 2, taken when a weighted epoch read its draws in one walk over the shards, and one of
    versions 3-5, taken when it was drawn whole (not shard by shard), describe other draws than the plan makes
    now: refused, saying why, where an unweighted one still loads."""
    def make(sampling):
        return ss.StreamingDataset(small, decode=None, fields=("__key__",), shuffle=True, sampling=sampling)

    for sampling, refused in ((Sampling(class_weights="balanced"), True), (None, False)):
        ds = make(sampling)
        it = iter(ds)
        head = [next(it) for _ in range(3)]
        state = ds.state_dict()
        it.close()
        assert state["version"] == STATE_VERSION
        if refused:
            with pytest.raises(ss.ShardstreamError, match=r"version 2 was taken when a weighted epoch .* afresh"):
                make(sampling).load_state_dict({**state, "version": 2})
            # Versions 3-5 drew the whole epoch at once, not shard by shard: other samples.
            with pytest.raises(ss.ShardstreamError, match=r"version 5 was taken when a weighted epoch was drawn for "
                                                          r"the whole epoch at once.* afresh"):
                make(sampling).load_state_dict({**state, "version": 5})
        else:
            for version in (2, 5):
                resumed = make(sampling)
                resumed.load_state_dict({**state, "version": version})
                assert head + list(resumed) == list(make(sampling))
        resumed = make(sampling)
        resumed.load_state_dict(state)
        assert head + list(resumed) == list(make(sampling))


def test_the_copies_of_a_sample_drawn_often_are_spread_over_the_epoch():
    """Regression (found by a review of the shuffle's statistics): class-balanced sampling of a long-tailed
    dataset put a rare sample's copies side by side in the epoch sequence, and the shuffle buffer spread them
    over a few batches only: 7.7 pairs of copies in a batch of 64 where independent draws (torch's
    WeightedRandomSampler) give 0.77, and up to 18 copies of one image in one batch. Spread over 8 walks over
    the shards: 0.9-1.2 pairs (four seeds) and at most 4 copies."""
    rng = np.random.default_rng(1)
    sizes = np.round(1000 * (5 / 1000) ** (np.arange(100) / 99)).astype(int)  # 100 classes, 1000 down to 5
    labels = rng.permutation(np.repeat(np.arange(100), sizes))
    n = len(labels)
    counts = np.full(n // 1000, 1000)
    counts[-1] += n - counts.sum()
    weights = class_sample_weights(labels, "balanced")
    batch, layout = 64, Layout(workers=4, batch_size=64, shuffle=True, buffer=2048)
    pairs, most = [], 0
    for epoch in range(2):
        sequence = weighted_sequence(counts, weights, 0, epoch, True, n)
        per_class = np.bincount(labels[sequence], minlength=100)  # balanced: n / 100 each, binomially
        assert len(sequence) == n and np.abs(per_class - n / 100).max() < 6 * np.sqrt(n / 100), per_class
        for worker in range(layout.workers):
            mine, order = worker_plan(sequence, layout, 0, epoch, 0, worker)
            out = mine[order]
            for i in range(0, len(out) - batch + 1, batch):
                copies = np.unique(out[i : i + batch], return_counts=True)[1]
                pairs.append(int((copies * (copies - 1) // 2).sum()))
                most = max(most, int(copies.max()))
    p = weights / weights.sum()
    independent = batch * (batch - 1) / 2 * float((p ** 2).sum())  # 0.77 pairs a batch
    assert np.mean(pairs) < 2 * independent and most <= 4, (np.mean(pairs), independent, most)  # 1.0 and 4 here


def test_weights_given_as_numpy_numbers_describe_the_same_sampling(small):
    """Regression (found by review): `Mix` weights and class weights given as numpy numbers
    (np.bincount's, a weights array's) drew the same samples as the same weights given as
    floats, and their resume state was refused by the other ("from another dataset"): the
    state's fingerprint held their repr, "np.float64(0.7)". Weights are kept as plain floats."""
    def mixed(weights) -> ss.StreamingDataset:
        return ss.StreamingDataset(ss.Mix([small, small], weights), decode=None, fields=("__key__",), shuffle=True,
                                   sampling=Sampling(samples_per_epoch=20))

    def class_weighted(weights) -> ss.StreamingDataset:
        return ss.StreamingDataset(small, decode=None, fields=("__key__",),
                                   sampling=Sampling(class_weights=weights, samples_per_epoch=20))

    for plain, numpy in ((mixed([0.7, 0.3]), mixed(np.array([0.7, 0.3]))),
                         (class_weighted({0: 1.0, 1: 5.0}), class_weighted({0: np.float64(1.0), np.int64(1): 5}))):
        it = iter(numpy)
        first = [next(it) for _ in range(5)]
        state = numpy.state_dict()
        it.close()
        plain.load_state_dict(state)
        assert first + list(plain) == list(numpy)


def _random_shape(rng: np.random.Generator) -> tuple[np.ndarray, int, int, bool, int]:
    """Shard counts (some empty), a seed, an epoch, shuffle, and a block to cut shards into."""
    counts = rng.integers(0, 40, int(rng.integers(1, 12)))
    counts[0] += 1
    return counts, int(rng.integers(0, 100)), int(rng.integers(0, 7)), bool(rng.integers(0, 2)), \
        int(rng.integers(0, 3)) * int(rng.integers(2, 9))


def test_a_stretch_of_an_epoch_larger_or_smaller_than_the_data_is_made_without_the_rest():
    """An epoch of `samples_per_epoch` and a mix's epoch are made a stretch at a time (each DataLoader worker
    of a rank made the whole epoch and told every draw apart: 0.6-1.4 s and 560 MB at 10^7 samples, for one
    rank's 1/64). A stretch is that stretch of the whole, each draw told apart as in the whole window."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        counts, seed, epoch, shuffle, block = _random_shape(rng)
        total = int(counts.sum())
        n = int(rng.integers(1, 3 * total + 2))
        a, b = sorted(int(x) for x in rng.integers(0, n + 1, 2))
        whole = distinct_draws(sized_sequence(counts, seed, epoch, shuffle, n, block), total)
        stream = PassStream(counts, seed, shuffle, block=block)
        assert np.array_equal(stream.draws(epoch * n + a, epoch * n + b, epoch * n, total), whole[a:b])
        cut = int(rng.integers(1, len(counts))) if len(counts) > 1 else 0
        if not cut or not counts[:cut].sum() or not counts[cut:].sum():
            continue
        weights = [float(rng.random() + 0.05), float(rng.random() + 0.05)]
        sources = [PassStream(counts[:cut], seed, shuffle, block=block),
                   PassStream(counts[cut:], seed, shuffle, salt=1 << 20, block=block, offset=int(counts[:cut].sum()))]
        mixed = mixed_draws(sources, weights, epoch * n, epoch * n, (epoch + 1) * n, total)
        assert np.array_equal(mixed, distinct_draws(drawn_samples(mixed, total), total))
        assert np.array_equal(mixed_draws(sources, weights, epoch * n, epoch * n + a, epoch * n + b, total),
                              mixed[a:b])


def test_a_stretch_of_a_weighted_epoch_is_made_from_the_shards_it_meets(monkeypatch):
    """A weighted epoch is drawn shard by shard, so a stretch (a rank's share) is made from the shards it meets:
    that stretch of the whole, draws told apart as in the whole, none of a sample weighing 0, with the same
    draws whatever group of units is drawn at once."""
    import shardstream.sampling as sampling
    from shardstream.plan import rank_stretches, split_ranks
    from shardstream.sampling import weighted_draws

    rng = np.random.default_rng(11)
    for trial in range(200):
        counts, seed, epoch, shuffle, block = _random_shape(rng)
        total = int(counts.sum())
        weights = rng.random(total) * (rng.random(total) < 0.8)
        weights[rng.integers(0, total)] += 0.1
        n = int(rng.integers(1, 3 * total + 2))
        monkeypatch.setattr(sampling, "DRAW_GROUP", 1 << 20 if trial % 2 else 5)
        draws = weighted_draws(counts, weights, seed, epoch, shuffle, n, block)
        whole = draws.draws(0, n, total)
        assert len(whole) == n and (weights[drawn_samples(whole, total)] > 0).all()
        assert np.array_equal(whole, distinct_draws(drawn_samples(whole, total), total))
        world, partial = int(rng.integers(1, 6)), ("pad", "drop")[trial % 2]
        for rank, block_of_rank in enumerate(split_ranks(whole, world, partial)):
            stretches = rank_stretches(n, world, rank, partial)
            made = [draws.draws(a, b, total) for a, b in stretches]
            assert np.array_equal(np.concatenate(made) if made else np.zeros(0, dtype=np.int64), block_of_rank)


def test_weighted_draws_follow_the_weights():
    """Drawn shard by shard (a multinomial over the shards, then within each), each sample is drawn in
    proportion to its weight, as by independent draws: a chi-square test over 300 epochs (the statistic of
    199 degrees of freedom within 4 standard deviations, sqrt(2 x 199), of its mean)."""
    rng = np.random.default_rng(3)
    counts, n = np.array([50, 70, 0, 80]), 400
    weights = (rng.random(200) + 0.1) * np.repeat([3.0, 1.0, 0.5], [50, 70, 80])  # shards of unequal weight
    hits = sum(np.bincount(weighted_sequence(counts, weights, 0, epoch, True, n), minlength=200)
               for epoch in range(300))
    expected = weights / weights.sum() * n * 300
    statistic = float(((hits - expected) ** 2 / expected).sum())
    assert abs(statistic - 199) < 4 * np.sqrt(2 * 199), statistic


@pytest.mark.parametrize("kind", ["weighted", "sized", "mix"])
def test_a_ranks_block_of_a_drawn_epoch_costs_its_share(kind):
    """Regression (found by a walk at scale): every DataLoader worker of every rank drew the whole epoch of a
    weighted, sized or mixed epoch to keep its rank's block (3.5 s and 560 MB a worker at 10^7 draws). A
    rank of 64 now draws the shards its block meets: a fraction of the memory of the whole."""
    import tracemalloc
    from types import SimpleNamespace

    from shardstream.epochs import EpochSequences

    n, shards = 400_000, 200
    counts = np.full(shards, n // shards, dtype=np.int64)
    parts = (SimpleNamespace(shards=[None] * 140, url="a", indexed=False),
             SimpleNamespace(shards=[None] * 60, url="b", indexed=False))
    source = SimpleNamespace(indexed=False, url="x", parts=parts, labels=lambda: np.arange(n) % 10)
    sampling = {"weighted": Sampling(class_weights="balanced"), "sized": Sampling(samples_per_epoch=n),
                "mix": None}[kind]
    sequences = EpochSequences(source, counts, 0, True, sampling, (0.7, 0.3) if kind == "mix" else None)
    sequences.rank_block(0, (), 64, 1, "pad")  # the draw table, made once a process

    def peak(work) -> int:
        tracemalloc.start()
        try:
            work()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    whole = peak(lambda: sequences.draws(1))
    share = peak(lambda: sequences.rank_block(1, (), 64, 5, "pad"))
    assert share < whole / 4, (share, whole)
    assert np.array_equal(sequences.rank_block(1, (), 64, 5, "pad"), split_ranks(sequences.draws(1), 64, "pad")[5])


def test_sample_weights_are_kept_apart_from_the_callers_array():
    """Regression: `Sampling(sample_weights=array)` made the caller's own array read-only, so
    weights updated between epochs (hard example mining) failed at the assignment; and it drew from that
    array, so a change made through a view would have drawn otherwise than the state's fingerprint says."""
    weights = np.ones(6)
    sampling = Sampling(sample_weights=weights)
    described = sampling.describe()
    weights[0] = 5.0  # the caller's array stays theirs
    assert sampling.sample_weights.tolist() == [1.0] * 6 and sampling.describe() == described
    assert Sampling(sample_weights=weights).describe() != described  # other weights, another fingerprint


def test_a_mixed_epoch_past_the_streams_float_times_is_refused(small):
    """Found by review: a Mix's epoch is a window of one stream of picks placed by float times; at
    `set_epoch(2**62)` (accepted: epochs go to 2^63 - 1) the window's place overflowed and the schedule spun
    for good. Past 2^53 picks the times cannot tell picks apart: refused, saying why; below, drawn."""
    ds = ss.StreamingDataset(Mix([small, small], weights=[0.3, 0.7]), decode=None, fields=("__key__",))
    ds.set_epoch(2**62)
    with pytest.raises(ValueError, match=r"a mix's epochs are windows of one stream of picks.*set a smaller epoch"):
        list(ds)
    ds.set_epoch(2**53 // (2 * 63) - 1)  # its window ends below 2^53 (two sources of 63 samples)
    assert len(list(ds)) == len(ds) == 126
