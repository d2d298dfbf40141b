"""Resuming mid-epoch: exact with the same layout, elastic with another world size or worker
count; the state is plain data that survives JSON, msgpack and torch.save in a fresh process.

Interruptions are real: items are consumed from a real iterator (in this process, or
through a DataLoader with real worker processes), the state is taken, and a fresh
dataset (and DataLoader) continues from it.
"""

from __future__ import annotations

import collections
import copy
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import warnings

import msgpack
import numpy as np
import pytest

import shardstream
from shardstream import ShardstreamError
from shardstream.resume import STATE_VERSION

try:  # tests/ may or may not be a package
    from . import _data as D
except ImportError:
    import _data as D

N = D.N
SEED = 7
BATCH = 2
OPTS = dict(shuffle=True, seed=SEED, shuffle_buffer=5, batch_size=BATCH)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return D.make_source(tmp_path_factory.mktemp("rsimages") / "src")


@pytest.fixture(scope="module")
def url(src, tmp_path_factory) -> str:
    return D.pack_to(src, tmp_path_factory.mktemp("rspacked") / "many", D.MANY_SHARDS)


@pytest.fixture(scope="module")
def keys(src) -> set[str]:
    return D.all_keys(src)


def dataset(url, **kwargs):
    return D.key_dataset(url, **{**OPTS, **kwargs})


# -- exact resume, same layout -------------------------------------------------------------------------


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2)])
@pytest.mark.parametrize("stop", ["early", "middle", "late"])
def test_exact_resume_in_process(url, rank, world_size, stop):
    full = [D.freeze(item) for item in dataset(url, rank=rank, world_size=world_size)]
    k = {"early": 1, "middle": len(full) // 2, "late": len(full) - 1}[stop]

    ds = dataset(url, rank=rank, world_size=world_size)
    got = D.take_main(ds, k)
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["current"]["delivered"] == k

    resumed = dataset(url, rank=rank, world_size=world_size)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full) - k
    rest = [D.freeze(item) for item in resumed]
    assert got == full[:k]
    assert rest == full[k:], "the resumed sequence continues the uninterrupted one exactly"
    # the epoch is complete: the next iteration starts it afresh
    assert [D.freeze(item) for item in resumed] == full


@pytest.mark.parametrize(("num_workers", "k", "rank", "world_size"), [
    (2, 1, 0, 1),  # early, odd: the next item comes from worker 1
    (2, 6, 0, 1),  # middle
    (2, 10, 0, 1),  # late: one item left, on worker 0 (worker 1 is exhausted)
    (2, 3, 1, 2),  # rank 1 of 2, padded
    (3, 5, 0, 1),  # 3 workers with 4, 4 and 3 batches
])
def test_exact_resume_through_dataloader_workers(url, num_workers, k, rank, world_size):
    full = D.run(dataset(url, rank=rank, world_size=world_size), num_workers)
    assert 0 < k < len(full)

    ds = dataset(url, rank=rank, world_size=world_size)
    got = D.take(ds, num_workers, k)  # k = the items the training loop received
    state = json.loads(json.dumps(ds.state_dict(delivered=k, num_workers=num_workers)))

    resumed = dataset(url, rank=rank, world_size=world_size)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full) - k
    rest = D.run(resumed, num_workers)
    assert got == full[:k]
    assert rest == full[k:], "the resumed sequence continues the uninterrupted one exactly"


def test_a_count_only_the_loop_knows_must_be_given(url):
    """Regression: with DataLoader workers iterating, `ds.state_dict()` described 0 items delivered (the main
    process counts none of them), so a resume restarted the epoch; a `num_workers` other than the DataLoader's
    resumed another order. Both are refused now, saying what to pass."""
    full = D.run(dataset(url), 2)
    ds = dataset(url)
    got = D.take(ds, 2, 3)
    with pytest.raises(ShardstreamError, match=r"pass state_dict\(delivered=.*num_workers=2\)"):
        ds.state_dict()
    with pytest.raises(ShardstreamError, match="has 2 workers, and num_workers=0 was given"):
        ds.state_dict(delivered=3)
    with pytest.raises(ValueError, match="delivered must be 0 or more, not -1"):
        ds.state_dict(delivered=-1, num_workers=2)
    for bad in (3.0, True):
        with pytest.raises(TypeError, match="delivered must be an integer"):
            ds.state_dict(delivered=bad, num_workers=2)
    assert ds.state_dict(delivered=np.int64(3), num_workers=2) == ds.state_dict(delivered=3, num_workers=2)
    state = ds.state_dict(delivered=3, num_workers=2)
    resumed = dataset(url)
    resumed.load_state_dict(state)
    assert resumed.state_dict(num_workers=2) == state  # loaded, not iterated since: the loaded state stands
    assert got + D.run(resumed, 2) == full
    D.take_main(ds, 4)  # iterated in this process now: it counts, and its own count is the default
    assert ds.state_dict()["current"]["delivered"] == 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_with_shardstream_dataloader(url, num_workers):
    def make():
        return shardstream.DataLoader(dataset(url), num_workers=num_workers, persistent_workers=False)

    full = [D.freeze(b) for b in make()]
    k = 5
    loader = make()
    it = iter(loader)
    got = [D.freeze(next(it)) for _ in range(k)]
    state = loader.state_dict()
    it.close()
    assert state["current"]["delivered"] == k

    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert len(fresh) == len(full) - k
    rest = [D.freeze(b) for b in fresh]
    assert got + rest == full
    assert [D.freeze(b) for b in fresh] == full, "after the resumed epoch, a full epoch"


def test_resume_then_checkpoint_again(url):
    """Resumed, consumed some more, checkpointed again, resumed again: still exact."""
    full = [D.freeze(item) for item in dataset(url)]
    ds = dataset(url)
    first = D.take_main(ds, 3)
    state = ds.state_dict()
    ds2 = dataset(url)
    ds2.load_state_dict(state)
    second = D.take_main(ds2, 4)
    state2 = ds2.state_dict()
    assert state2["current"]["delivered"] == 7
    ds3 = dataset(url)
    ds3.load_state_dict(state2)
    assert first + second + [D.freeze(item) for item in ds3] == full


# -- elastic resume: another world size or worker count -----------------------------------------------


@pytest.fixture(scope="module")
def interrupted(url):
    """A 2-rank x 2-worker run stopped after k items per rank: the items each rank got, and the state."""
    cache = {}

    def get(k):
        if k not in cache:
            got, states = [], []
            for rank in range(2):
                ds = dataset(url, rank=rank, world_size=2)
                got.append(D.take(ds, 2, k))
                states.append(ds.state_dict(delivered=k, num_workers=2))
            assert states[0] == states[1], "ranks in lockstep describe the same state"
            assert states[0]["current"]["layout"]["world_size"] == 2
            assert states[0]["current"]["layout"]["workers"] == 2
            cache[k] = got, json.loads(json.dumps(states[0]))
        return cache[k]

    return get


def check_elastic(keys, consumed_keys, rest_by_rank, lens, world_size, earlier_pads=None):
    """Every sample once over the epoch plus declared padding, equal ranks, len == yield.

    `earlier_pads`: the padding every earlier layout may have repeated (default: the
    first layout's, 21 samples over 2 ranks)."""
    consumed = set(consumed_keys)
    remaining = N - len(consumed)
    per_rank = D.ceil_div(remaining, world_size)
    samples = [D.flat(items) for items in rest_by_rank]
    assert [len(s) for s in samples] == [per_rank] * world_size, "equal ranks after the change"
    assert len({len(items) for items in rest_by_rank}) == 1
    assert lens == [len(items) for items in rest_by_rank], "len(ds) is what the resumed iteration yields"
    rest = [k for s in samples for k in s]
    assert not consumed & set(rest), "nothing consumed before the change is yielded again"
    assert consumed | set(rest) == keys, "nothing is lost"
    pad = per_rank * world_size - remaining
    assert len(rest) - len(set(rest)) == pad, "repeats only as declared padding of the new layout"
    # before the change, repeats only as the padding of the old layouts (1 for 21 over 2 ranks)
    assert len(consumed_keys) - len(consumed) <= (D.pad_count(N, 2) if earlier_pads is None else earlier_pads)


@pytest.mark.parametrize(("new_world", "new_workers"), [(3, 0), (3, 2), (1, 1), (2, 0), (2, 3)])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_elastic_resume(url, keys, interrupted, k, new_world, new_workers):
    got, state = interrupted(k)
    rest, lens = [], []
    for rank in range(new_world):
        ds = dataset(url, rank=rank, world_size=new_world)
        ds.load_state_dict(state)
        lens.append(len(ds))
        rest.append(D.run(ds, new_workers))
    check_elastic(keys, D.flat(got[0] + got[1]), rest, lens, new_world)


@pytest.mark.parametrize("k", [2, 4, 6])
def test_padding_marks_count_each_sample_once_across_an_elastic_resume(url, keys, k):
    """21 samples on 4 ranks x 2 workers (3 repeats), stopped after k samples a rank, resumed on 3
    ranks: the samples delivered without ``__pad__`` are the dataset, each once, whichever of a
    sample's deliveries came before the stop (the validation recipe's count stays exact)."""
    def marked(**kwargs):
        return shardstream.StreamingDataset(url, decode=None, fields=("__key__", "__pad__"), shuffle=True, seed=SEED,
                                            shuffle_buffer=5, **kwargs)

    delivered = []
    for rank in range(4):
        ds = marked(rank=rank, world_size=4)
        it = iter(D.loader(ds, 2))
        try:
            delivered += [(key, bool(pad)) for key, pad in (next(it) for _ in range(k))]
        finally:
            D.shut_down(it)
        state = json.loads(json.dumps(ds.state_dict(delivered=k, num_workers=2)))
    for rank in range(3):
        resumed = marked(rank=rank, world_size=3)
        resumed.load_state_dict(state)
        delivered += list(resumed)
    unmarked = [key for key, pad in delivered if not pad]
    assert sorted(unmarked) == sorted(keys)
    assert len(delivered) > len(keys), "the layouts padded"


def test_elastic_twice(url, keys, interrupted):
    """2x2 -> 3 ranks in process (checkpointed again mid-way) -> 2 ranks x 1 worker."""
    got, state = interrupted(3)
    seg1 = D.flat(got[0] + got[1])
    seg2, states = [], []
    for rank in range(3):
        ds = dataset(url, rank=rank, world_size=3)
        ds.load_state_dict(state)
        seg2 += D.flat(D.take_main(ds, 1))
        states.append(ds.state_dict())
    assert states[0] == states[1] == states[2]
    assert len(states[0]["finished"]) == 1 and states[0]["finished"][0]["layout"]["workers"] == 2
    assert not set(seg1) & set(seg2)
    rest, lens = [], []
    for rank in range(2):
        ds = dataset(url, rank=rank, world_size=2)
        ds.load_state_dict(json.loads(json.dumps(states[0])))
        lens.append(len(ds))
        rest.append(D.run(ds, 1))
    # both earlier layouts may have yielded their declared padding
    check_elastic(keys, seg1 + seg2, rest, lens, 2,
                  earlier_pads=D.pad_count(N, 2) + D.pad_count(N - len(set(seg1)), 3))


def test_what_earlier_layouts_read_is_found_once_per_process(url, interrupted, monkeypatch):
    """Finding what an earlier layout read of the epoch costs about a second per segment on a million
    samples; `load_state_dict`, every `len()` and the iteration each did it again. Now each segment's
    reading is replayed once: two segments precede a 2-rank run in this process here (the 2x2 run,
    then the 3-rank run's), and the answers stay those of a fresh dataset."""
    import shardstream.resume as resume_module

    got, state = interrupted(3)
    ds = dataset(url, rank=0, world_size=3)
    ds.load_state_dict(state)
    D.take_main(ds, 1)
    state = json.loads(json.dumps(ds.state_dict()))
    assert len(state["finished"]) == 1

    replayed = []
    consumed_positions = resume_module.consumed_positions
    monkeypatch.setattr(resume_module, "consumed_positions",
                        lambda *args: replayed.append(args[:2]) or consumed_positions(*args))
    resumed = dataset(url, rank=1, world_size=2)
    resumed.load_state_dict(state)
    lens = [len(resumed), len(resumed)]
    items = D.flat(D.take_main(resumed, lens[0]))
    # A checkpoint's check of its count asked for the epoch's start, which dropped what was kept of the
    # segments after it: every state_dict replayed them (2.4 s at 3M samples, found by a scale walk).
    before = resumed.resumed_items(0)
    states = [resumed.state_dict(delivered=before + k) for k in (1, 2)]
    assert [s["current"]["delivered"] for s in states] == [1, 2]
    assert len(replayed) == 2, replayed  # once per earlier segment, not per call

    # A state of this very layout but its DataLoader workers (2) counted in the loop's process (1 worker)
    # was replayed as a resume onto another layout at every len(); the count is the same.
    replayed.clear()
    _, two_workers = interrupted(3)
    same = dataset(url, rank=0, world_size=2)
    same.load_state_dict(two_workers)
    assert len(same) == len(dataset(url, rank=0, world_size=2)) - 3
    assert not replayed

    monkeypatch.setattr(resume_module, "consumed_positions", consumed_positions)
    fresh = dataset(url, rank=1, world_size=2)
    fresh.load_state_dict(state)
    assert lens == [len(fresh)] * 2 and items == D.flat(D.take_main(fresh, len(fresh)))


def test_elastic_resume_partial_drop(url, keys):
    """With partial="drop" nothing repeats, before or after the change; fewer than
    world_size samples of each layout's split may be left out."""
    got = []
    state = None
    for rank in range(2):
        ds = dataset(url, rank=rank, world_size=2, partial="drop")
        got += D.flat(D.take(ds, 2, 2))
        state = ds.state_dict(delivered=2, num_workers=2)
    rest = []
    for rank in range(3):
        ds = dataset(url, rank=rank, world_size=3, partial="drop")
        ds.load_state_dict(state)
        rest.append(D.flat(D.run(ds, 0)))
    assert len({len(r) for r in rest}) == 1
    everything = got + [k for r in rest for k in r]
    assert len(everything) == len(set(everything)), "drop never repeats"
    assert len(keys - set(everything)) < 3


# Layouts that leave samples out of an epoch: the tail that does not divide over ranks (21
# over 2), the last partial batch of each rank (11 or 10 over batches of 4), or both.
LEAVING_OUT = {"partial-drop": dict(partial="drop"), "drop-last": dict(batch_size=4, drop_last=True),
               "both": dict(partial="drop", batch_size=4, drop_last=True)}


_whole_epochs: dict = {}


def whole_epoch(url, world_size, workers, **opts):
    """Every rank's keys of one uninterrupted epoch, through `workers` real DataLoader workers. Read once a
    layout in this process, a copy handed out: the parametrized tests below ask for the same few layouts again
    and again, and an uninterrupted epoch is fixed by its seed and layout (what every exact resume relies on)."""
    key = (url, world_size, workers, tuple(sorted(opts.items())))
    if key not in _whole_epochs:
        _whole_epochs[key] = [D.flat(D.run(dataset(url, rank=rank, world_size=world_size, **opts), workers))
                              for rank in range(world_size)]
    return [list(keys) for keys in _whole_epochs[key]]


def stopped(url, world_size, workers, k, **opts):
    """Each rank's first `k` items through real DataLoader workers, as keys, and the state there."""
    got, states = [], []
    for rank in range(world_size):
        ds = dataset(url, rank=rank, world_size=world_size, **opts)
        got += D.flat(D.take(ds, workers, k))
        states.append(ds.state_dict(delivered=k, num_workers=workers))
    assert all(s == states[0] for s in states)
    return got, json.loads(json.dumps(states[0]))


def loaded(url, state, **opts):
    """A fresh dataset that loaded `state`."""
    ds = dataset(url, **opts)
    ds.load_state_dict(state)
    return ds


@pytest.mark.parametrize("opts", LEAVING_OUT.values(), ids=LEAVING_OUT.keys())
@pytest.mark.parametrize(("new_world", "new_workers"), [(1, 0), (3, 2)])
def test_an_end_of_epoch_state_leaves_nothing_of_the_epoch_to_another_layout(url, opts, new_world, new_workers):
    """Regression: with partial="drop" or drop_last, a state taken at an epoch's end and resumed
    onto another world size yielded what the old layout had left out, as extra batches of a
    finished epoch (where the new layout did not drop them in turn: one rank)."""
    full = whole_epoch(url, 2, 2, **opts)
    assert N - sum(map(len, full)) > 0, "the layout leaves samples out"
    _, state = stopped(url, 2, 2, len(dataset(url, rank=0, world_size=2, **opts)), **opts)
    next_epoch = whole_epoch(url, new_world, new_workers, **opts)
    for rank in range(new_world):
        ds = loaded(url, state, rank=rank, world_size=new_world, **opts)
        assert len(ds) == 0 and D.run(ds, new_workers) == [], "the epoch was complete"
        assert D.flat(D.run(ds, new_workers)) == next_epoch[rank], "the next pass is whole"


@pytest.mark.parametrize("opts", LEAVING_OUT.values(), ids=LEAVING_OUT.keys())
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("new_world", "new_workers"), [(3, 0), (1, 2)])
def test_a_resumed_epoch_yields_only_what_the_uninterrupted_one_would(url, opts, k, new_world, new_workers):
    """Interrupted mid-epoch and resumed onto another layout, the epoch yields each sample at most
    once, and only samples the uninterrupted run would have yielded; it leaves out no more than
    the new layout's own dropping does."""
    uninterrupted = [key for rank in whole_epoch(url, 2, 2, **opts) for key in rank]
    delivers = set(uninterrupted)
    got, state = stopped(url, 2, 2, k, **opts)
    rest = [D.flat(D.run(loaded(url, state, rank=rank, world_size=new_world, **opts), new_workers))
            for rank in range(new_world)]
    later = [key for r in rest for key in r]
    everything = got + later
    assert len(later) == len(set(later)) and not set(later) & set(got), "nothing twice"
    # Twice only within what the interrupted run took, as often as the uninterrupted one does: the
    # sample the old layout padded its last rank with (21 samples over 2 ranks), where it delivers it.
    assert not collections.Counter(got) - collections.Counter(uninterrupted)
    assert set(everything) <= delivers, "nothing the uninterrupted epoch leaves out"
    assert len({len(r) for r in rest}) == 1, "equal ranks"
    # The new layout leaves out at most its own tail (< new_world) and a partial batch per rank.
    own = (new_world - 1 if opts.get("partial") == "drop" else 0) + new_world * (3 if opts.get("drop_last") else 0)
    assert len(delivers) - len(set(everything)) <= own


def test_a_version_1_state_reads_as_it_was_written(url):
    """A state of version 1 (before left-out samples counted as consumed) leaves its layout's
    left-out samples to the layouts after it, as the shardstream that wrote it did, and keeps
    doing so through a further checkpoint, so that the later layout continues exactly."""
    opts = LEAVING_OUT["drop-last"]
    _, state = stopped(url, 2, 2, 1, **opts)
    old = {**state, "version": 1}  # what an earlier shardstream wrote for the same run
    assert len(loaded(url, old, **opts)) > len(loaded(url, state, **opts)), "the versions read differently"
    rest = [D.freeze(item) for item in loaded(url, old, **opts)]
    ds = loaded(url, old, **opts)
    head = D.take_main(ds, 1)
    again = json.loads(json.dumps(ds.state_dict()))
    assert again["version"] == STATE_VERSION and again["finished"][0]["spends_left_out"] is False
    assert head + [D.freeze(item) for item in loaded(url, again, **opts)] == rest, "continues exactly"


@pytest.mark.parametrize("endless", [False, True])
def test_a_state_taken_right_after_loading_onto_another_layout_is_the_loaded_one(url, endless):
    """Regression: a checkpoint right after a restart onto another layout (no step taken)
    described an empty segment of the new layout after the loaded one. Resumed onto the loaded
    layout, that state no longer continued it exactly; and since left-out samples count as
    consumed, the empty segment's left-out was lost as well. An endless stream's state came back
    re-expressed for the new layout, with the same result."""
    opts = dict(LEAVING_OUT["drop-last"], **({"sampling": shardstream.Sampling(resampled=True)} if endless else {}))

    def loader(workers, state=None):
        made = shardstream.DataLoader(dataset(url, **opts), num_workers=workers, persistent_workers=False)
        if state is not None:
            made.load_state_dict(state)
        return made

    def first(made, k):
        it = iter(made)
        try:
            return [D.freeze(next(it)) for _ in range(k)]
        finally:
            it.close()

    full = first(loader(2), 4)
    made = loader(2)
    head = first(made, 1)
    state = json.loads(json.dumps(made.state_dict()))
    again = json.loads(json.dumps(loader(0, state).state_dict()))  # restarted in one process, checkpointed at once
    assert again == state
    assert head + first(loader(2, again), 3) == full, "the loaded layout continues exactly"


def test_an_earlier_layout_that_delivered_nothing_leaves_nothing_out(url):
    """A state whose earlier layout delivered nothing (as shardstream wrote right after a restart
    before the fix above) resumes onto the same samples as the state before it: that layout
    consumed nothing, and what it would have left out is not spent."""
    opts = LEAVING_OUT["both"]
    _, state = stopped(url, 2, 2, 1, **opts)
    empty = {**state["current"], "layout": {**state["current"]["layout"], "world_size": 3, "workers": 1},
             "delivered": 0}
    with_empty = {**state, "finished": [state["current"]], "current": empty}
    rest = D.flat(loaded(url, state, **opts))
    assert rest and sorted(D.flat(loaded(url, with_empty, **opts))) == sorted(rest)  # a later segment: its own order


# -- the state itself ----------------------------------------------------------------------------------------


def test_state_is_plain_data(url):
    ds = dataset(url, rank=1, world_size=2)
    D.take_main(ds, 2)
    state = ds.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert msgpack.unpackb(msgpack.packb(state), raw=False) == state
    assert state["seed"] == SEED and state["shuffle"] is True and state["epoch"] == 0

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or type(x) in (int, str, bool, float)

    assert plain(state)


def test_state_survives_torch_save_in_a_fresh_process(url, tmp_path):
    ds = dataset(url)
    full = [D.freeze(item) for item in dataset(url)]
    ds.set_epoch(0)
    got = D.take_main(ds, 4)
    path = tmp_path / "ckpt.pt"
    import torch

    torch.save({"data": ds.state_dict(), "step": 4}, path)
    script = textwrap.dedent(f"""
        import json, sys, torch
        import shardstream
        ckpt = torch.load({str(path)!r})  # weights_only: plain data loads without pickle
        ds = shardstream.StreamingDataset({url!r}, decode=None, fields=("__key__",), shuffle=True, seed={SEED},
                                          shuffle_buffer=5, batch_size={BATCH},
                                          collate_fn=lambda b: [x[0] for x in b])
        ds.load_state_dict(ckpt["data"])
        print(json.dumps({{"step": ckpt["step"], "rest": [list(b) for b in ds]}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 4
    assert got + [tuple(b) for b in result["rest"]] == full


def test_state_of_another_epoch(url):
    """A state records its epoch; loading it selects that epoch."""
    ds = dataset(url)
    ds.set_epoch(3)
    full3 = [D.freeze(item) for item in ds]
    ds = dataset(url)
    ds.set_epoch(3)
    got = D.take_main(ds, 2)
    state = ds.state_dict()
    assert state["epoch"] == 3
    fresh = dataset(url)
    fresh.load_state_dict(state)
    assert fresh.epoch == 3
    assert got + [D.freeze(item) for item in fresh] == full3
    # moving on to the next epoch forgets the resume point
    fresh2 = dataset(url)
    fresh2.load_state_dict(state)
    with pytest.warns(UserWarning, match="drops the state loaded for epoch 3"):
        fresh2.set_epoch(4)
    ds4 = dataset(url)
    ds4.set_epoch(4)
    assert [D.freeze(item) for item in fresh2] == [D.freeze(item) for item in ds4]
    # Regression: a state taken at the epoch's end (a checkpoint after each epoch) leaves nothing to drop,
    # and the next epoch set after loading it warned that its unread rest was dropped.
    ds.set_epoch(3)
    assert [D.freeze(item) for item in ds] == full3
    ended = ds.state_dict()
    for loaded, warned in ((ended, False), (state, True)):
        fresh4 = dataset(url)
        fresh4.load_state_dict(loaded)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh4.set_epoch(4)
        assert any("drops the state loaded" in str(w.message) for w in caught) is warned
        assert [D.freeze(item) for item in fresh4] == [D.freeze(item) for item in ds4]
    ended_there = dataset(url)
    ended_there.load_state_dict(ended)
    assert list(ended_there) == []  # its epoch is over: nothing of epoch 3 is read again


def test_state_from_another_dataset_or_seed_is_refused(url, src, tmp_path):
    ds = dataset(url)
    D.take_main(ds, 2)
    state = ds.state_dict()
    other_url = D.pack_to(src, tmp_path / "few", D.FEW_SHARDS)  # same samples, other shards
    with pytest.raises(ShardstreamError, match="another dataset"):
        dataset(other_url).load_state_dict(state)
    with pytest.raises(ShardstreamError, match="seed"):
        dataset(url, seed=SEED + 1).load_state_dict(state)
    with pytest.raises(ShardstreamError):
        dataset(url, shuffle=False).load_state_dict(state)
    for broken in ({}, {**state, "version": 99}, {k: v for k, v in state.items() if k != "current"},
                   {**state, "current": {"layout": {"nonsense": 1}, "delivered": 0}}):
        with pytest.raises(ShardstreamError):
            dataset(url).load_state_dict(broken)
    # a refused state leaves the dataset as it was
    ds2 = dataset(url)
    with pytest.raises(ShardstreamError):
        ds2.load_state_dict({**state, "seed": 123})
    assert [D.freeze(i) for i in ds2] == [D.freeze(i) for i in dataset(url)]


def test_a_state_of_the_same_folder_packed_in_another_order_is_refused(src, tmp_path):
    """Regression: the fingerprint held shard names and counts only, which the same folder packed again
    with another seed shares, with other samples in each place: a state of one loaded into the other, and
    the resumed epoch read other samples than those left. The shards' checksums count now."""
    from shardstream.resume import _fingerprint_of

    a, b = (str(tmp_path / f"seed{seed}") for seed in (1, 2))
    for seed, dst in ((1, a), (2, b)):
        shardstream.pack(str(src), dst, max_samples=7, seed=seed, workers=1, progress=False)
    shards = [shardstream.open_dataset(u).shards for u in (a, b)]
    assert [(r.name, r.info.samples) for r in shards[0]] == [(r.name, r.info.samples) for r in shards[1]]
    assert D.manifest_keys(a) != D.manifest_keys(b)
    ds = dataset(a)
    D.take_main(ds, 2)
    state = ds.state_dict()
    with pytest.raises(ShardstreamError, match="another dataset"):
        dataset(b).load_state_dict(state)
    # A state taken before the checksums counted (shard names and counts only) is still its dataset's.
    legacy = {**state, "dataset": _fingerprint_of(dataset(a), contents=False)}
    assert legacy["dataset"] != state["dataset"]
    resumed = dataset(a)
    resumed.load_state_dict(legacy)
    assert [D.freeze(i) for i in resumed] == [D.freeze(i) for i in dataset(a)][2:]


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_state_of_webdataset_tars_written_again_in_another_order_is_refused(tmp_path, url, suffix):
    """Regression (found by a review of resume states): tars without a manifest were told apart by shard names and
    counts only, which a WebDataset writer run again with another seed shares (every shard holds `maxcount`): a
    state of one loaded into the other, and the resumed epoch repeated 5 samples of 20 and never read 5 others.
    The keys of the tars read through to count them count now."""
    import gzip
    import random

    keys = [f"img{i:03d}" for i in range(20)]

    def write(seed: int) -> str:
        order = keys[:]
        random.Random(seed).shuffle(order)
        for s in range(4):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tf:
                for key in order[5 * s : 5 * s + 5]:
                    info = tarfile.TarInfo(f"{key}.txt")
                    info.size = len(key)
                    tf.addfile(info, io.BytesIO(key.encode()))
            data = gzip.compress(buf.getvalue()) if suffix == ".tar.gz" else buf.getvalue()
            (tmp_path / f"shard-{s:06d}{suffix}").write_bytes(data)
        return str(tmp_path / f"shard-{{000000..000003}}{suffix}")

    def make(url: str):
        return shardstream.StreamingDataset(url, decode=None, fields=("__key__",), shuffle=True, seed=SEED,
                                           shuffle_buffer=4)

    packed = url
    url = write(0)
    ds = make(url)
    before = D.flat(D.take_main(ds, 4))
    state = json.loads(json.dumps(ds.state_dict()))
    again = make(url)
    again.load_state_dict(state)  # the same tars: resumed
    assert sorted(before + D.flat(D.freeze(item) for item in again)) == keys
    # Through torch's DataLoader only its workers count the tars; the state, made in the main process, named
    # no keys (found by the third review of this session's changes), and a Mix with a packed dataset too.
    through = make(url)
    assert len(D.run(through, 2)[:3]) == 3
    states = [state, json.loads(json.dumps(through.state_dict(delivered=3, num_workers=2)))]
    mixed = shardstream.StreamingDataset(shardstream.Mix([url, packed], [1, 1]), decode=None, fields=("__key__",),
                                         shuffle=True, seed=SEED)
    D.take_main(mixed, 3)
    mix_state = mixed.state_dict()
    assert all(s["dataset"].startswith("keys-") for s in states + [mix_state])
    if suffix == ".tar":  # the same tars indexed since (as the library's warnings advise): still theirs
        from shardstream.adopt import index_tars

        index_tars(str(tmp_path), progress=False)
        for indexed in (url, str(tmp_path)):
            again = make(indexed)
            again.load_state_dict(state)
            assert sorted(before + D.flat(D.freeze(item) for item in again)) == keys
            shardstream.StreamingDataset(shardstream.Mix([indexed, packed], [1, 1]), decode=None, fields=("__key__",),
                                         shuffle=True, seed=SEED).load_state_dict(mix_state)
        for path in tmp_path.glob("*.idx"):
            path.unlink()
        (tmp_path / "manifest.msgpack").unlink()
    write(1)
    for taken in states:
        with pytest.raises(ShardstreamError, match="another dataset"):
            make(url).load_state_dict(taken)


# -- a state is checked where it is loaded ------------------------------------------------------------------


def _broken(state, path, value):
    """A deep copy of `state` with the entry at `path` (keys and list indexes) set to `value`."""
    state = copy.deepcopy(state)
    place = state
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    return state


MALFORMED = [
    (("current", "delivered"), -1, r"current\.delivered must be an int >= 0, not -1"),
    (("current", "delivered"), 2.0, r"current\.delivered must be an int >= 0, not 2\.0"),
    (("current", "delivered"), "2", r"current\.delivered must be an int >= 0, not '2'"),
    (("current", "delivered"), True, r"current\.delivered must be an int >= 0, not True"),
    (("current", "delivered"), None, r"current\.delivered must be an int >= 0, not None"),
    (("current", "per_worker"), [1, 1], r"current\.per_worker must be one count per worker of its layout \(1\)"),
    (("current", "per_worker"), [3], r"current\.delivered must be the sum of current\.per_worker \(3\), not 2"),
    (("current", "layout", "world_size"), 0, r"current\.layout\.world_size must be an int >= 1 and < 16777217, not 0"),
    (("current", "layout", "workers"), -1, r"current\.layout\.workers must be an int >= 1 and < 1025, not -1"),
    # No run writes these: planned, they failed as a bare MemoryError, or took minutes (found by review)
    (("current", "layout", "workers"), 10 ** 6, r"current\.layout\.workers must be an int >= 1 and < 1025, not 1000000"),
    (("current", "layout", "world_size"), 10 ** 9, r"current\.layout\.world_size must be an int >= 1 and < 16777217"),
    (("current", "layout", "batch_size"), 0, r"current\.layout\.batch_size must be an int >= 1, not 0"),
    (("current", "layout", "partial"), "repeat", r"current\.layout\.partial must be one of \('pad', 'drop'\)"),
    (("current", "layout", "drop_last"), "no", r"current\.layout\.drop_last must be true or false, not 'no'"),
    (("current", "layout", "nonsense"), 1, r"current\.layout has unknown keys \['nonsense'\]"),
    (("current", "layout", "run"), 0, r"current\.layout\.run must be an int >= 1 and < 1048577, not 0"),
    (("current", "layout", "run"), 10 ** 30, r"current\.layout\.run must be an int >= 1 and < 1048577"),
    (("epoch",), "0", r"epoch must be an int >= 0 and < 9223372036854775808, not '0'"),
    (("epoch",), -1, r"epoch must be an int >= 0 and < 9223372036854775808, not -1"),
    (("finished",), {}, r"finished must be a list, not \{\}"),
    (("position",), [1, 0], r"position\[0\] \(the plan worker\) must be an int >= 0 and < 1, not 1"),
    (("position",), [0, -1], r"position\[1\] \(items yielded\) must be an int >= 0, not -1"),
]


@pytest.mark.parametrize(("path", "value", "message"), MALFORMED,
                         ids=[f"{'.'.join(map(str, path))}={value!r}" for path, value, _ in MALFORMED])
def test_a_malformed_state_is_refused_naming_the_field(url, path, value, message):
    """Regression: a negative, fractional or non-int count loaded silently (and resumed at the wrong place),
    and a zero worker count or batch size failed later, deep inside the plan, with ZeroDivisionError."""
    ds = dataset(url)
    D.take_main(ds, 2)
    resumed = dataset(url)
    with pytest.raises(ShardstreamError, match=message):
        resumed.load_state_dict(_broken(ds.state_dict(), path, value))
    assert len(resumed) == len(dataset(url)), "a refused state leaves the dataset as it was"


@pytest.mark.parametrize("key", ["world_size", "workers", "batch_size", "shuffle", "buffer", "drop_last", "partial"])
def test_a_layout_with_a_key_left_out_is_refused(url, key):
    """Found by an elastic-resume walk: a layout key left out (a state cut short or edited) took
    Layout's default: without world_size (1), a 2-rank resume lost 20 samples and repeated 53,
    each rank yielding another count. Every layout key has been written since the first state;
    only `run` is new (version 5), and defaults in older states."""
    ds = dataset(url, rank=0, world_size=2)
    D.take_main(ds, 2)
    state = ds.state_dict()
    cut = copy.deepcopy(state)
    del cut["current"]["layout"][key]
    with pytest.raises(ShardstreamError, match=rf"current\.layout lacks {key} \(a state cut short or edited\?\)"):
        dataset(url, rank=0, world_size=2).load_state_dict(cut)
    older = copy.deepcopy(state)
    older["version"] = 4
    del older["current"]["layout"]["run"]  # a version 4 state: no run, dealt a chunk at a time
    from shardstream.resume import ResumeState

    assert ResumeState.from_dict(older, dataset(url, rank=0, world_size=2)).current.layout.run == 1


def test_a_count_the_epoch_cannot_hold_is_refused_when_the_state_is_taken(url):
    """Found by an elastic-resume walk: `state_dict(delivered=...)` given the global step instead of
    the epoch's count wrote a state every load then refused, found only after the restart it was for."""
    ds = dataset(url)
    ds.set_epoch(1)
    total = len(ds)
    assert ds.state_dict(delivered=total, num_workers=2)["current"]["delivered"] == total
    with pytest.raises(ValueError, match=rf"delivered={total + 3} is more items than this rank's epoch 1 holds .*"
                                         rf"at most {total} .*a step count since the run began is not one"):
        ds.state_dict(delivered=total + 3, num_workers=2)


def test_a_state_planned_under_other_random_draws_is_refused(url, monkeypatch):
    """Regression: a resume replays the epoch's plan from numpy's draws, which numpy promises only within one
    build: a state taken under a numpy that permutes otherwise (or whose `default_rng` is another generator)
    resumed onto another order, samples repeated and lost, silently. The plan's generator is PCG64 by name,
    and a state names the draws it was planned with; one of other draws is refused, naming numpy."""
    ds = dataset(url)
    D.take_main(ds, 2)
    state = ds.state_dict()
    assert state["streams"] == shardstream.plan.streams_digest() and state["numpy"] == np.__version__
    with pytest.raises(ShardstreamError, match=r"other random draws \(numpy 1\.0\.0; this is numpy .*Resume with the numpy"):
        dataset(url).load_state_dict({**state, "streams": "0" * 16, "numpy": "1.0.0"})
    with pytest.raises(ShardstreamError, match=rf"numpy {np.__version__} as here, but its draws' digest is not "
                                               r"this numpy's: another build of it, or a state damaged or edited"):
        dataset(url).load_state_dict({**state, "streams": "0" * 16})  # found by a walk: "2.4.6; this is 2.4.6"
    with pytest.raises(ShardstreamError, match=r"streams must be a string, not 7"):
        dataset(url).load_state_dict({**state, "streams": 7})
    older = {k: v for k, v in state.items() if k not in ("streams", "numpy")}  # states taken before: as they were
    resumed = dataset(url)
    resumed.load_state_dict(older)
    rest = [D.freeze(item) for item in resumed]
    # numpy's default generator changing (as it may, to PCG64DXSM) changes no plan.
    monkeypatch.setattr(np.random, "default_rng", lambda seed=None: np.random.Generator(np.random.PCG64DXSM(seed)))
    again = dataset(url)
    again.load_state_dict(state)
    assert [D.freeze(item) for item in again] == rest and len(rest) == len(ds) - 2


def test_the_draws_digest_covers_weighted_epochs_and_reads_the_earlier_one(url, monkeypatch):
    """Regression: the digest drew permutations and uniforms only, and weighted epochs are drawn by a multinomial
    over the shards and bounded integers too (`sampling.WeightedDraws`): a numpy drawing those otherwise passed the
    check and replayed a weighted epoch onto other draws. States of version 6, which carry the earlier digest
    (permutations and uniforms), are still read, checked as far as it goes; a version 7 state with it is refused
    (found by a review: without a new version, an earlier shardstream blamed another numpy build)."""
    earlier = shardstream.plan._draws_digest(weighted=False)
    assert shardstream.plan.streams_digests_read() == {shardstream.plan.streams_digest(), earlier}
    ds = dataset(url)
    D.take_main(ds, 2)
    state = ds.state_dict()
    assert state["version"] == 7
    resumed = dataset(url)
    resumed.load_state_dict({**state, "version": 6, "streams": earlier})
    assert len([D.freeze(item) for item in resumed]) == len(ds) - 2
    with pytest.raises(ShardstreamError, match="other random draws"):
        dataset(url).load_state_dict({**state, "streams": earlier})
    for draw in ("multinomial", "integers"):
        original = getattr(np.random.Generator, draw)
        otherwise = type("Other", (np.random.Generator,),  # a numpy whose `draw` alone draws otherwise
                         {draw: lambda self, *args, **kwargs: original(self, *args, **kwargs) + 1})
        monkeypatch.setattr(np.random, "Generator", otherwise)
        assert shardstream.plan._draws_digest(weighted=True) != state["streams"]
        assert shardstream.plan._draws_digest(weighted=False) == earlier
        monkeypatch.undo()


def test_counts_beyond_the_epoch_are_refused_at_load(url):
    """Regression: a count past the end of the epoch loaded, then len() raised "__len__() should return >= 0"
    and iterating raised ValueError from the plan's round robin. The bound is what the state's own layout (2 real
    DataLoader workers here) holds of the epoch; exactly the end of the epoch is a state like any other."""
    def make():
        return shardstream.DataLoader(dataset(url), num_workers=2, persistent_workers=False)

    total = len(make())
    loader = make()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    it.close()
    assert state["current"]["layout"]["workers"] == 2

    fresh = make()
    with pytest.raises(ShardstreamError, match=rf"current\.delivered must be at most {total} .*, not {total + 1}"):
        fresh.load_state_dict(_broken(state, ("current", "delivered"), total + 1))
    fresh.load_state_dict(_broken(state, ("current", "delivered"), total))
    assert len(fresh) == 0 and list(fresh) == [], "the epoch is complete"


def test_counts_of_earlier_layouts_are_checked_against_what_they_had_left(url, interrupted):
    """An elastic state's finished segments are bounded by their own layout, the current one by what the
    finished ones left of the epoch."""
    _, state = interrupted(3)  # 2 ranks x 2 workers, 3 items each
    ds = dataset(url, rank=0, world_size=3)
    ds.load_state_dict(state)
    D.take_main(ds, 1)
    elastic = ds.state_dict()
    assert len(elastic["finished"]) == 1
    per_rank = len(dataset(url, rank=0, world_size=2))
    with pytest.raises(ShardstreamError, match=rf"finished\[0\]\.delivered must be at most {per_rank} "):
        dataset(url, rank=0, world_size=3).load_state_dict(_broken(elastic, ("finished", 0, "delivered"), per_rank + 1))
    resumed = dataset(url, rank=0, world_size=3)
    resumed.load_state_dict(elastic)
    bound = elastic["current"]["delivered"] + len(resumed)  # what 3 ranks have of what 2x2 left of the epoch
    with pytest.raises(ShardstreamError, match=rf"current\.delivered must be at most {bound} \(.* left to it\)"):
        dataset(url, rank=0, world_size=3).load_state_dict(_broken(elastic, ("current", "delivered"), bound + 1))
    resumed.load_state_dict(_broken(elastic, ("current", "delivered"), bound))
    assert len(resumed) == 0


def test_an_endless_streams_count_may_span_epochs(url):
    """The bound is one epoch's items except in an endless stream, whose count runs on into later epochs."""
    full = D.take_main(endless(url), 20)
    ds = endless(url)
    D.take_main(ds, 15)  # 6 batches an epoch: this is in epoch 2
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["current"]["delivered"] == 15
    resumed = endless(url)
    resumed.load_state_dict(state)
    assert D.take_main(resumed, 5) == full[15:]


# -- known bugs ------------------------------------------------------------------------------------------------


def test_state_dict_right_after_load_keeps_the_progress(url):
    full = [D.freeze(item) for item in dataset(url)]
    ds = dataset(url)
    got = D.take_main(ds, 4)
    state = ds.state_dict()
    resumed = dataset(url)
    resumed.load_state_dict(state)
    again = resumed.state_dict()  # e.g. a checkpoint written right after restart, before step 1
    fresh = dataset(url)
    fresh.load_state_dict(again)
    assert got + [D.freeze(item) for item in fresh] == full


def test_the_latest_iteration_owns_the_place_state_dict_reads(url):
    """Regression: two iterations of one dataset open at once (a loop left with `break`
    and a new one, or `zip(ds, ds)`) both counted into its place: the first's items,
    taken after the second began, moved the state past what the second had yielded."""
    ds = dataset(url)
    first = iter(ds)
    [next(first) for _ in range(3)]
    second = iter(ds)  # begun after three items of `first`
    taken = [D.freeze(next(second)) for _ in range(2)]
    [next(first) for _ in range(4)]  # the older iteration goes on
    state = ds.state_dict()
    rest = [D.freeze(item) for item in second]
    resumed = dataset(url)
    resumed.load_state_dict(state)
    assert [D.freeze(item) for item in resumed] == rest and taken + rest == [D.freeze(i) for i in dataset(url)]


def test_a_state_loaded_during_an_iteration_applies_to_the_next(url):
    """Regression: `load_state_dict` while an iteration was open (rolling back to a checkpoint
    inside the loop) made that iteration's next item raise a bare TypeError (None + 1); run
    to its end, it would have dropped the state just loaded. It runs on now, counting
    nowhere, and the next iteration continues from the state (found by mypy, `None + int`)."""
    full = [D.freeze(item) for item in dataset(url)]
    checkpointed = dataset(url)
    D.take_main(checkpointed, 3)
    state = checkpointed.state_dict()
    ds = dataset(url)
    it = iter(ds)
    first = D.freeze(next(it))
    ds.load_state_dict(state)
    assert [first] + [D.freeze(item) for item in it] == full
    assert ds.state_dict() == state
    assert [D.freeze(item) for item in ds] == full[3:]


def test_loader_state_dict_right_after_load_keeps_the_progress(url):
    loader = shardstream.DataLoader(dataset(url))
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    it.close()
    fresh = shardstream.DataLoader(dataset(url))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_a_resumed_pass_left_early_is_resumed_again_however_far_the_workers_read(url):
    """Regression: a loop that resumed an epoch, left it early and iterated it again (no
    set_epoch) got the resumed remainder again, or the whole epoch where its workers had read
    the remainder to its end before the loop left (prefetch_factor 4: every time), and `len()`
    could say the one while the pass gave the other. As with no workers, the state holds until
    a pass over it is complete."""
    def loader():
        return shardstream.DataLoader(dataset(url), num_workers=3, prefetch_factor=4)

    full = loader_keys(loader())
    checkpointed = loader()
    it = iter(checkpointed)
    for _ in range(2):
        next(it)
    state = checkpointed.state_dict()
    it.close()
    resumed = loader()
    resumed.load_state_dict(state)
    it = iter(resumed)
    next(it)
    copy_ = resumed.dataset
    deadline = time.monotonic() + 60
    while not copy_._shared.resume_used_up(copy_._resume_id, 3):  # the workers read it to its end, ahead
        assert time.monotonic() < deadline, "the workers did not read the resumed epoch to its end"
        time.sleep(0.05)
    it.close()  # the loop leaves the pass
    assert len(resumed) == len(full) - 2
    assert loader_keys(resumed) == full[2:]  # the state holds: its pass was left early
    assert loader_keys(resumed) == full  # that pass was complete: the epoch from its start


def test_an_epoch_past_what_the_processes_share_is_refused(url):
    """Regression: set_epoch(2**64) read back as epoch 0 (the processes share the epoch as a
    signed 64-bit int), 2**63 as a negative one; states with such epochs, or -1, were loaded."""
    ds = dataset(url)
    for epoch in (2**63, 2**64, -1):
        with pytest.raises(ValueError, match="epoch must be"):
            ds.set_epoch(epoch)
    ds.set_epoch(2**63 - 1)
    assert ds.epoch == 2**63 - 1
    state = dataset(url).state_dict()
    for epoch in (2**63, -1):
        with pytest.raises(shardstream.ShardstreamError, match="epoch"):
            dataset(url).load_state_dict({**state, "epoch": epoch})


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_a_state_loaded_into_the_loader_during_an_iteration_applies_to_the_next(url, num_workers):
    """Regression: `loader.load_state_dict` inside the loop (a rollback to a checkpoint) left the open
    iteration counting: without workers it ran on and its batches were added to the loaded state's
    (the state said more batches delivered than the epoch has), and either way its end dropped the
    state, so the next iteration replayed the epoch whole instead of continuing from the checkpoint."""
    full = loader_keys(shardstream.DataLoader(dataset(url), num_workers=num_workers))
    checkpointed = shardstream.DataLoader(dataset(url), num_workers=num_workers)
    it = iter(checkpointed)
    for _ in range(3):
        next(it)
    state = checkpointed.state_dict()
    it.close()
    # Workers far ahead (prefetch_factor 4): torch holds more of the old place's batches.
    loader = shardstream.DataLoader(dataset(url), num_workers=num_workers,
                                    prefetch_factor=4 if num_workers else None)
    it = iter(loader)
    taken = [next(it) for _ in range(5)]  # batches of the place left come in ahead meanwhile, some out of order
    loader.load_state_dict(state)
    after = 0
    for _ in it:  # runs on without workers; with them it ends (its workers held the old state)
        assert loader.state_dict() == state
        after += 1
    # With workers, not one more batch of the place left (torch held some, ahead or out of order).
    assert after == (len(full) - len(taken) if num_workers == 0 else 0)
    assert loader.state_dict() == state
    assert loader_keys(loader) == full[3:]


@pytest.mark.parametrize("persistent", [True, False])
def test_a_newer_iteration_or_epoch_inside_the_loop_is_an_error_not_a_short_epoch(url, persistent):
    """Regression (found by review): with workers, a loop that looked at one batch mid-epoch with
    `next(iter(loader))`, or set the next epoch inside the loop, ended after a few batches without a word
    (4 of 20): its workers served the newer iteration. It is an error now, saying why; without workers the
    loop runs on, as before."""
    loader = shardstream.DataLoader(dataset(url), num_workers=2, persistent_workers=persistent)
    full = len(loader)
    with pytest.raises(ShardstreamError, match=r"ended by a new iteration of the loader \(iter\(loader\)\)"):
        for step, _ in enumerate(loader):
            if step == 1:
                next(iter(loader))
    # iter() alone starts the iteration, as torch's DataLoader's does (found by a README walk: the open loop
    # ran on until the new iterator's first batch, `__iter__` being a generator that ran nothing before it).
    with pytest.raises(ShardstreamError, match=r"ended by a new iteration of the loader \(iter\(loader\)\)"):
        for step, _ in enumerate(loader):
            if step == 1:
                newer = iter(loader)
    del newer
    with pytest.raises(ShardstreamError, match="ended by set_epoch while it was open"):
        for step, _ in enumerate(loader):
            if step == 1:
                loader.set_epoch(1)
    loader = shardstream.DataLoader(dataset(url), num_workers=0)
    seen = 0
    for step, _ in enumerate(loader):
        if step == 1:
            next(iter(loader))
        seen += 1
    assert seen == full


def test_loader_set_epoch_of_the_loaded_epoch_keeps_the_progress(url):
    """The usual restart loop, ``for epoch in range(state["epoch"], E): loader.set_epoch(epoch)``,
    with a checkpoint before the first step: it still counts what was delivered before."""
    full = loader_keys(shardstream.DataLoader(dataset(url)))
    loader = shardstream.DataLoader(dataset(url))
    it = iter(loader)
    head = [D.freeze(next(it)) for _ in range(4)]
    state = loader.state_dict()
    it.close()
    restarted = shardstream.DataLoader(dataset(url))
    restarted.load_state_dict(state)
    restarted.set_epoch(state["epoch"])
    again = restarted.state_dict()
    assert again == state
    fresh = shardstream.DataLoader(dataset(url))
    fresh.load_state_dict(again)
    assert head + loader_keys(fresh) == full


@pytest.mark.parametrize("driver", ["torch-persistent", "shardstream-loader"])
def test_a_resumed_epoch_left_early_is_not_replayed_as_the_next(url, driver):
    """A loaded state, its epoch left after one batch (eval, a step limit), then set_epoch(1) on the
    caller's dataset: the copies the loader holds (persistent workers', shardstream.DataLoader's) must
    yield epoch 1, not the rest of epoch 0."""
    import torch.utils.data

    def make_loader(ds):
        if driver == "torch-persistent":
            return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        return shardstream.DataLoader(ds, num_workers=0)

    workers = 2 if driver == "torch-persistent" else 0
    expected = dataset(url)
    expected.set_epoch(1)
    epoch_1 = D.run(expected, workers)  # the order depends on the number of workers
    interrupted = dataset(url)
    D.take_main(interrupted, 3)
    state = interrupted.state_dict(num_workers=workers)
    ds = dataset(url)
    loader = make_loader(ds)
    if driver == "torch-persistent":
        ds.load_state_dict(state)
    else:
        loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    del it
    ds.set_epoch(1)
    assert loader_keys(loader) == epoch_1


@pytest.mark.parametrize("num_workers", [
    0,
    1,
])
def test_after_a_resumed_epoch_the_next_pass_is_full(url, num_workers):
    full = D.run(dataset(url), num_workers)
    ds = dataset(url)
    D.take_main(ds, 3)
    state = ds.state_dict(num_workers=num_workers)
    resumed = dataset(url)
    resumed.load_state_dict(state)
    dl = D.loader(resumed, num_workers)
    assert [D.freeze(b) for b in dl] == full[3:]
    assert [D.freeze(b) for b in dl] == full
    assert len(resumed) == len(full)


def test_after_a_resumed_epoch_the_next_pass_is_full_with_more_workers(url, keys):
    """Regression: the resumed remainder counted as used up once the workers of the pass asking had all
    finished it: a pass with 3 workers after the 2 that read it to its end found its third never
    finished, and replayed the remainder instead of the whole epoch."""
    ds = dataset(url)
    D.take_main(ds, 3)
    state = ds.state_dict(num_workers=2)
    resumed = dataset(url)
    resumed.load_state_dict(state)
    rest = D.run(resumed, 2)
    assert len(rest) == len(D.run(dataset(url), 2)) - 3
    again = D.run(resumed, 3)
    assert sorted(D.flat(again)) == sorted(keys), "the next pass is the whole epoch"


def loader_keys(loader) -> list[tuple[str, ...]]:
    return [D.freeze(b) for b in loader]


def resumed_to_the_end(url, state, num_workers):
    """A shardstream.DataLoader restored from `state` and run to the end of the epoch: its
    batches, and the state it gives there (the usual end-of-epoch checkpoint)."""
    loader = shardstream.DataLoader(dataset(url), num_workers=num_workers, persistent_workers=False)
    loader.load_state_dict(json.loads(json.dumps(state)))
    loader.set_epoch(0)
    rest = loader_keys(loader)
    return rest, json.loads(json.dumps(loader.state_dict()))


def assert_epoch_complete(url, state, num_workers, full):
    """Restored from `state`, epoch 0 has nothing left, and the next pass is whole again."""
    loader = shardstream.DataLoader(dataset(url), num_workers=num_workers, persistent_workers=False)
    loader.load_state_dict(state)
    loader.set_epoch(0)
    assert len(loader) == 0
    assert loader_keys(loader) == [], "a complete epoch yields nothing more"
    assert loader_keys(loader) == full, "the next pass is the whole epoch"


@pytest.mark.parametrize(("first", "second"), [(2, 0), (0, 2)])
def test_end_of_epoch_state_after_an_elastic_resume(url, keys, first, second):
    """An epoch interrupted, resumed onto another num_workers and run to its end: the state
    then says the epoch is complete, in either layout (it counted only the items since the
    change, and forgot the earlier layout's: restored, it yielded samples again)."""
    loader = shardstream.DataLoader(dataset(url), num_workers=first, persistent_workers=False)
    loader.set_epoch(0)
    it = iter(loader)
    head = [D.freeze(next(it)) for _ in range(4)]
    state = loader.state_dict()
    it.close()

    rest, end = resumed_to_the_end(url, state, second)
    assert sorted(D.flat(head + rest)) == sorted(keys), "every sample of the epoch once"
    assert end["epoch"] == 0 and len(end["finished"]) == 1
    for num_workers in (first, second):
        full = loader_keys(shardstream.DataLoader(dataset(url), num_workers=num_workers))
        assert_epoch_complete(url, end, num_workers, full)


def test_a_count_since_the_restart_is_refused_on_the_same_layout_too(url, keys):
    """Regression (found by a user's walk resuming DDP from S3): through torch's DataLoader, a count of the items
    since the restart (resumed_items() forgotten) was refused after a resume onto another layout, and taken on the
    same one: the state then said 3 where 8 had been trained on, and a resume from it repeated 5."""
    first = dataset(url)
    head = D.take(first, 2, 5)
    state = json.loads(json.dumps(first.state_dict(delivered=5, num_workers=2)))
    resumed = dataset(url)
    resumed.load_state_dict(state)
    middle = D.take(resumed, 2, 3)
    with pytest.raises(ValueError, match=r"5 were delivered before this pass \(the state it resumed from\), and 3 "
                                         r"is fewer"):
        resumed.state_dict(delivered=3, num_workers=2)
    later = json.loads(json.dumps(resumed.state_dict(delivered=resumed.resumed_items(2) + 3, num_workers=2)))
    restored = dataset(url)
    restored.load_state_dict(later)
    rest = D.run(restored, 2)
    assert sorted(D.flat(head + middle + rest)) == sorted(keys), "every sample of the epoch once"
    # The same once the workers have read the resumed pass to its end (found by review: the floor was
    # then 0, and resumed_items() too, so a count read from it at the checkpoint was taken).
    ended = dataset(url)
    ended.load_state_dict(state)
    assert len(D.run(ended, 2)) == len(middle) + len(rest) and ended.resumed_items(2) == 0
    with pytest.raises(ValueError, match=r"5 were delivered before this pass .*read resumed_items\(\) as the pass "
                                         r"begins"):
        ended.state_dict(delivered=len(head) - 1, num_workers=2)


def test_shardstream_dataloaders_copy_refuses_a_state_without_the_loaders_count(url, keys):
    """Regression (found by a user's walk resuming DDP from S3): `loader.dataset.state_dict()` described the
    epoch's start (another layout, nothing delivered), and a resume from it repeated every batch trained on."""
    ds = dataset(url)
    loader = shardstream.DataLoader(ds, num_workers=2)
    head, state = D.stop_after(loader, 4)
    with pytest.raises(ShardstreamError, match=r"shardstream.DataLoader's copy of the dataset \(loader.dataset\).*"
                                               r"loader.state_dict\(\)"):
        loader.dataset.state_dict()
    assert loader.dataset.state_dict(delivered=4, num_workers=2) == loader.state_dict() == state
    restored = dataset(url)
    restored.load_state_dict(loader.state_dict())
    assert sorted(D.flat(head + D.run(restored, 1))) == sorted(keys)


@pytest.mark.parametrize("persistent", [False, True])
def test_end_of_epoch_state_through_a_torch_dataloader_after_an_elastic_resume(url, keys, persistent):
    """Through a plain torch DataLoader the training loop counts its items and passes them to
    `ds.state_dict(delivered=k, num_workers=n)`; the main process never sees a pass begin or end.
    Resumed onto 2 workers from a 1-worker state and run to the end of the epoch, the state said
    "k items into a fresh epoch", which restored yielded samples again (RELIABILITY.md item 23).
    A later pass of the same epoch (no set_epoch) starts afresh, and so does its state."""
    first = dataset(url)
    head = D.take(first, 1, 3)
    state = json.loads(json.dumps(first.state_dict(delivered=3, num_workers=1)))

    resumed = dataset(url)
    resumed.load_state_dict(state)
    assert resumed.resumed_items(2) == 3  # where the loop's count of the epoch stands, the other layout's items
    dl = D.loader(resumed, 2, persistent_workers=persistent)
    rest = [D.freeze(item) for item in dl]
    assert sorted(D.flat(head + rest)) == sorted(keys), "every sample of the epoch once"
    with pytest.raises(ValueError, match=r"3 were delivered before this pass \(the state it resumed from\)"):
        resumed.state_dict(delivered=2, num_workers=2)
    end = json.loads(json.dumps(resumed.state_dict(delivered=3 + len(rest), num_workers=2)))
    restored = dataset(url)
    restored.load_state_dict(end)
    assert len(restored) == 0 and list(restored) == [], "the epoch is complete"

    again = iter(dl)  # the same epoch again: a whole, fresh pass
    middle = [D.freeze(next(again)) for _ in range(2)]
    mid_state = json.loads(json.dumps(resumed.state_dict(delivered=2, num_workers=2)))
    if persistent:
        again._shutdown_workers()
    del again
    assert mid_state == dataset(url).state_dict(delivered=2, num_workers=2)
    assert middle == D.take(dataset(url), 2, 2)


def test_end_of_epoch_state_after_two_resumes(url, keys):
    """2 workers -> 0 workers, checkpointed mid-way -> 0 workers again, to the end of the epoch."""
    full = loader_keys(shardstream.DataLoader(dataset(url), num_workers=0))
    head = D.take(dataset(url), 2, 3)
    state = dataset(url).state_dict(delivered=3, num_workers=2)
    loader = shardstream.DataLoader(dataset(url))
    loader.load_state_dict(state)
    it = iter(loader)
    middle = [D.freeze(next(it)) for _ in range(2)]
    state = loader.state_dict()
    it.close()

    rest, end = resumed_to_the_end(url, state, 0)
    assert sorted(D.flat(head + middle + rest)) == sorted(keys)
    assert end["current"]["delivered"] == len(middle + rest)
    assert_epoch_complete(url, end, 0, full)


def test_end_of_epoch_state_after_a_world_size_change(url, interrupted):
    """2 ranks x 2 workers -> 3 ranks in process, each to the end of the epoch: restored,
    every rank has nothing left of the epoch."""
    _, state = interrupted(3)
    ends = []
    for rank in range(3):
        ds = dataset(url, rank=rank, world_size=3)
        ds.load_state_dict(state)
        list(ds)
        ends.append(ds.state_dict())
    assert ends[0] == ends[1] == ends[2]
    for rank in range(3):
        ds = dataset(url, rank=rank, world_size=3)
        ds.load_state_dict(json.loads(json.dumps(ends[0])))
        assert len(ds) == 0 and list(ds) == []


def test_end_of_epoch_state_of_a_later_pass_is_fresh(url):
    """After a resumed epoch is complete, another pass of the same epoch starts afresh, and so does
    its state: the earlier layouts' segments no longer apply."""
    state = dataset(url).state_dict(delivered=3, num_workers=2)  # 3 items of 2 workers
    loader = shardstream.DataLoader(dataset(url))
    loader.load_state_dict(state)
    loader_keys(loader)
    full = loader_keys(loader)
    again = loader.state_dict()
    assert again["finished"] == [] and again["current"]["delivered"] == len(full)
    loader.set_epoch(1)
    assert loader.state_dict()["finished"] == [] and loader.state_dict()["epoch"] == 1


def endless(url, **kwargs):
    return dataset(url, batch_size=4, seed=5, sampling=shardstream.Sampling(resampled=True), **kwargs)


def per_worker(url, state, epoch, rank, world_size, num_workers, rounds):
    """`rounds` items of each loader worker of an endless DataLoader (its round robin is
    regular: the streams never end), started from `state`, else at `epoch`."""
    import itertools

    ds = endless(url, rank=rank, world_size=world_size)
    if state is not None:
        ds.load_state_dict(state)
    else:
        ds.set_epoch(epoch)
    it = iter(D.loader(ds, num_workers))
    try:
        items = [D.freeze(b) for b in itertools.islice(it, rounds * num_workers)]
    finally:
        it._shutdown_workers()
    return [items[w::num_workers] for w in range(num_workers)]


@pytest.mark.parametrize(("world_size", "num_workers", "k"), [(1, 2, 5), (1, 3, 4), (2, 2, 5)])
def test_endless_resume_onto_more_workers_near_the_end_of_an_epoch(url, keys, world_size, num_workers, k):
    """An endless stream checkpointed after 5 of the 6 batches of epoch 0 in one process, resumed onto more
    workers: the samples left of epoch 0 go to some workers only, the others have none left of it (it raised
    "needs at least one item per worker and epoch"). Each worker yields its share of what is left of epoch 0,
    each unconsumed sample once, then exactly what some worker yields of epoch 1 and on in a run started at epoch 1
    (chunks are dealt across epoch boundaries, so which worker reads which share of epoch 1 follows from where the
    deal of what was left of epoch 0 ended: the workers' streams are those of the run from epoch 1, rotated)."""
    old = endless(url)
    head = D.flat(D.take_main(old, k))
    state = json.loads(json.dumps(old.state_dict()))
    missing = keys - set(head)
    assert len(head) == 4 * k and 0 < len(missing) < num_workers * world_size * 4
    rest_of_epoch = []
    for rank in range(world_size):
        resumed = per_worker(url, state, None, rank, world_size, num_workers, rounds=8)
        later = per_worker(url, None, 1, rank, world_size, num_workers, rounds=8)
        matched = []
        for got in resumed:
            lead, worker = next((j, v) for j in range(len(got)) for v, expected in enumerate(later)
                                if got[j:] == expected[: len(got) - j])
            assert lead <= 1, "at most one batch of epoch 0 is left per worker"
            rest_of_epoch += D.flat(got[:lead])
            matched.append(worker)
        assert sorted(matched) == list(range(num_workers)), "each worker goes on as one worker of the later run"
    assert set(rest_of_epoch) == missing, "every sample of epoch 0 not yet consumed comes, nothing else"
    assert len(rest_of_epoch) == D.ceil_div(len(missing), world_size) * world_size, "once each, plus padding"


# -- torchdata's StatefulDataLoader --------------------------------------------------------------------


pytestmark_stateful = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def stateful_loader(ds, num_workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)


@pytestmark_stateful
@pytest.mark.parametrize(("num_workers", "k"), [(0, 4), (2, 1), (2, 4), (2, 7), (3, 5)])
def test_exact_resume_under_torchdata_stateful_dataloader(url, num_workers, k, tmp_path):
    """StatefulDataLoader asks each worker's dataset for its state and gives it back to that worker: the batches
    after its load_state_dict are exactly those of the uninterrupted run, also after a torch.save round trip."""
    import torch

    full = [D.freeze(b) for b in stateful_loader(dataset(url), num_workers)]
    assert 0 < k < len(full)
    loader = stateful_loader(dataset(url), num_workers)
    it = iter(loader)
    got = [D.freeze(next(it)) for _ in range(k)]
    state = loader.state_dict()
    del it
    torch.save(state, tmp_path / "ckpt.pt")

    fresh = stateful_loader(dataset(url), num_workers)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    rest = [D.freeze(b) for b in fresh]
    assert got == full[:k]
    assert rest == full[k:], "the resumed batches continue the uninterrupted run exactly"
    assert [D.freeze(b) for b in fresh] == full, "the next epoch is whole again"


@pytestmark_stateful
@pytest.mark.parametrize("mid_epoch", [False, True])
def test_torchdata_worker_state_gives_way_to_the_epoch_the_loop_chose(url, mid_epoch):
    """Regression: StatefulDataLoader loads each worker's state as the iteration begins, after the loop's
    set_epoch, and the state wrote its epoch over the loop's in every process: restarted at the next epoch
    after an end-of-epoch checkpoint, the run replayed the finished epoch under the next one's number; after
    a mid-epoch one, set_epoch(another) yielded the old epoch's rest. The epoch the loop chose wins now: the
    state is dropped, with a warning, and the iteration is the chosen epoch's, every batch once (in the turns
    over the workers that torchdata resumes)."""
    def epoch_batches(epoch: int) -> list:
        ds = dataset(url)
        ds.set_epoch(epoch)
        return [D.freeze(b) for b in stateful_loader(ds, 2)]

    ds = dataset(url)
    ds.set_epoch(1)
    loader = stateful_loader(ds, 2)
    it = iter(loader)
    taken = [next(it) for _ in range(3)] if mid_epoch else list(it)
    assert taken
    state = loader.state_dict()
    del it

    ds = dataset(url)
    restarted = stateful_loader(ds, 2)
    restarted.load_state_dict(state)
    ds.set_epoch(2)
    got = [D.freeze(b) for b in restarted]  # the workers warn, each on its stderr
    assert sorted(got) == sorted(epoch_batches(2)) and ds.epoch == 2


@pytestmark_stateful
def test_torchdata_worker_state_with_another_layout_is_refused(url):
    """A StatefulDataLoader worker state resumes the same world size and worker count only; another layout is
    refused with a clear error (shardstream.DataLoader's own state is the one that resumes elastically)."""
    loader = stateful_loader(dataset(url, rank=0, world_size=2), 2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    worker_state = state["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"]
    assert worker_state["position"] == [1, 1]  # plan worker 1 has handed over one item
    with pytest.raises(ShardstreamError, match=r"another layout \(world_size 2 there, 3 here, .*its world size, "
                                                 "num_workers"):
        dataset(url, rank=0, world_size=3).load_state_dict(worker_state)


@pytestmark_stateful
@pytest.mark.parametrize(("num_workers", "k"), [(0, 3), (2, 3), (2, 6), (3, 4)])
def test_exact_resume_with_batches_made_by_the_dataloader(url, num_workers, k):
    """Batching outside the dataset (DataLoader(batch_size=4) over single samples): a DataLoader takes a whole
    batch from one worker, then the next, which a per-rank item count cannot describe; torchdata's
    StatefulDataLoader keeps each worker's own place, so the resume is exact there too."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        ds = dataset(url, batch_size=None, collate_fn=None)
        return stateful.StatefulDataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=D.key_batch)

    full = [D.freeze(b) for b in make()]
    loader = make()
    it = iter(loader)
    got = [D.freeze(next(it)) for _ in range(k)]
    state = loader.state_dict()
    del it
    fresh = make()
    fresh.load_state_dict(state)
    assert got + [D.freeze(b) for b in fresh] == full


@pytest.mark.parametrize("second_workers", [2, 3])
def test_the_loops_epoch_count_resumes_after_an_elastic_resume_too(url, keys, second_workers):
    """Regression: the count `state_dict(delivered=...)` takes meant the epoch's items after a resume onto the
    same layout, and only this layout's after one onto another: a loop counting the epoch's items (k1 + k2) lost
    6 of 17 samples after an elastic resume, one counting since the restart (k2) replayed them after a same-layout
    one. It is the epoch's count now, whatever the layouts, and `resumed_items` says where it stands."""
    first = dataset(url)
    head = D.take(first, 2, 3)
    state = first.state_dict(delivered=3, num_workers=2)
    second = dataset(url)
    second.load_state_dict(state)
    count = second.resumed_items(second_workers)
    assert count == 3
    middle = D.take(second, second_workers, 2)
    state = second.state_dict(delivered=count + 2, num_workers=second_workers)
    third = dataset(url)
    third.load_state_dict(state)
    rest = D.run(third, second_workers)
    seen = D.flat(head + middle + rest)
    assert sorted(set(seen)) == sorted(keys)
    assert len(seen) - len(keys) == sum(1 for k in keys if seen.count(k) > 1)  # repeats are declared padding only
    assert all(seen.count(k) <= 2 for k in keys)
    if second_workers == 2:  # the same layout throughout: exactly the uninterrupted epoch
        assert head + middle + rest == D.run(dataset(url), 2)


# -- shardstream.DataLoader and the caller's dataset: one progress ----------------------------------


def loader_over(ds: shardstream.StreamingDataset, where: str) -> shardstream.DataLoader:
    """A shardstream.DataLoader over `ds`, the batches made by the dataset's batch_size or by the
    loader's (the loader then batches a copy of the dataset)."""
    return shardstream.DataLoader(ds, batch_size=BATCH if where == "loader" else None)


def batched_by(where: str, url: str) -> tuple[shardstream.StreamingDataset, shardstream.DataLoader]:
    """A dataset, and a loader over it as `loader_over` makes."""
    ds = dataset(url) if where == "dataset" else dataset(url, batch_size=None, collate_fn=D.key_batch)
    return ds, loader_over(ds, where)


BATCHED_BY = pytest.mark.parametrize("where", ["dataset", "loader"])


@BATCHED_BY
def test_an_epoch_set_on_the_callers_dataset_restarts_the_loaders_count(url, where):
    """Regression: after a whole epoch, ``dataset.set_epoch(1)`` (the loop's own dataset, not the loader)
    and a checkpoint before the first step of epoch 1 gave a state of epoch 1 with epoch 0's batches
    counted as delivered: resumed from it, epoch 1 yielded nothing."""
    ds, loader = batched_by(where, url)
    loader_keys(loader)
    ds.set_epoch(1)
    state = loader.state_dict()
    assert state["epoch"] == 1
    epoch_1 = loader_keys(loader)
    _, restarted = batched_by(where, url)
    restarted.load_state_dict(state)
    assert len(restarted) == len(epoch_1) and loader_keys(restarted) == epoch_1


def interrupted_state(url: str, where: str, k: int = 3) -> tuple[list, list, dict]:
    """The first `k` batches of epoch 0, the rest of it, and the state after the first `k`."""
    _, loader = batched_by(where, url)
    full = loader_keys(loader)
    _, loader = batched_by(where, url)
    it = iter(loader)
    head = [D.freeze(next(it)) for _ in range(k)]
    state = loader.state_dict()
    it.close()
    assert head == full[:k]
    return head, full[k:], state


@BATCHED_BY
def test_a_loader_made_after_its_dataset_loaded_a_state_resumes_from_it(url, where):
    """Regression: the loader's count started at 0 whatever its dataset had loaded, so a checkpoint
    taken before the first step said nothing was delivered (a second restart replayed the batches)."""
    _, rest, state = interrupted_state(url, where)
    ds, _ = batched_by(where, url)
    ds.load_state_dict(state)
    loader = loader_over(ds, where)
    assert loader.state_dict() == state
    assert len(loader) == len(rest) and loader_keys(loader) == rest


@BATCHED_BY
def test_a_state_loaded_into_the_callers_dataset_reaches_its_loader(url, where):
    """Regression: ``loader = DataLoader(ds); ds.load_state_dict(state)`` (the order torch's DataLoader
    allows) was ignored where the loader batches a copy of the dataset: the epoch was replayed whole."""
    _, rest, state = interrupted_state(url, where)
    ds, loader = batched_by(where, url)
    ds.load_state_dict(state)
    assert loader.state_dict() == state
    assert len(loader) == len(rest) and loader_keys(loader) == rest


def test_the_callers_dataset_refuses_to_describe_what_the_loaders_copy_read(url):
    """Where the loader batches a copy of the dataset, the dataset saw none of what the loader read:
    a state from it would say the epoch had not begun. It says where the state is instead."""
    ds, loader = batched_by("loader", url)
    it = iter(loader)
    next(it)
    with pytest.raises(shardstream.ShardstreamError, match=r"loader\.state_dict\(\)"):
        ds.state_dict()
    it.close()


def test_a_state_loaded_after_persistent_torch_workers_started_is_refused_not_ignored(url):
    """Regression: the state stays in the main process (only the epoch is shared), so torch's persistent
    workers, started before `load_state_dict`, read the loaded epoch from its start: 8 batches where
    `len()` said 5 were left, silently. They refuse now, saying what to do; a state dropped for
    another epoch before they iterate misses nothing, and a new DataLoader resumes exactly."""
    import torch.utils.data

    expected = dataset(url)
    expected.set_epoch(1)
    epoch_1 = D.run(expected, 2)
    interrupted = dataset(url)
    interrupted.set_epoch(1)
    D.take(interrupted, 2, 3)
    state = interrupted.state_dict(delivered=3, num_workers=2)

    ds = dataset(url)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    try:
        assert len(loader_keys(loader)) == len(D.run(dataset(url), 2))  # epoch 0: the workers have started
        ds.load_state_dict(state)
        assert len(ds) == len(epoch_1) - 3
        with pytest.raises(ShardstreamError, match="after this DataLoader's persistent workers started"):
            loader_keys(loader)
        assert D.run(ds, 2) == epoch_1[3:]  # a new DataLoader's workers have the state

        ds.load_state_dict(state)
        with pytest.warns(UserWarning, match="drops the state"):
            ds.set_epoch(2)  # the state is dropped: the persistent workers miss nothing
        expected.set_epoch(2)
        assert loader_keys(loader) == D.run(expected, 2)
    finally:
        D.shut_down(loader._iterator)
