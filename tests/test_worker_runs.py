"""A shuffled epoch deals its chunks to DataLoader workers in runs of several (plan.deal_run).

Dealt a batch at a time, chunks of small samples are smaller than a frame, and every worker
read (over remote storage: fetched) about every frame: 2 workers fetched 2.01x a dataset of
6 KB samples an epoch over HTTP, 4 workers 3.64x. The plan's own properties are in
test_plan.py; here the dataset: its layout, the bytes it fetches, and a resume from a
state taken before runs.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardstream
from shardstream import epochs
from shardstream.plan import deal_run

import _data as D
import _remote_helpers as H

SAMPLES = 1200
BATCH = 8


@pytest.fixture(scope="module")
def small_samples(tmp_path_factory) -> str:
    """1,200 samples of 16-24 KB of noise in one shard: a batch of 8 is about 160 KB, a frame
    (1 MB) holds about 48 samples, and a run 8 frames (more than plan.BLOCK_BYTES' 4 MB):
    48 batches, about 7.7 MB."""
    folder = tmp_path_factory.mktemp("runs") / "small"
    rng = np.random.default_rng(0)
    with shardstream.ShardWriter(str(folder)) as writer:
        for i in range(SAMPLES):
            writer.write({"__key__": f"s{i:04d}", "bin": rng.bytes(int(rng.integers(16_000, 24_000))), "cls": i % 3})
    return str(folder)


def run_of(url: str, **kwargs) -> int:
    """The run the layout of a 2-worker DataLoader over `url` holds, from its state."""
    loader = shardstream.DataLoader(D.key_dataset(url, batch_size=BATCH, **kwargs), num_workers=2)
    return loader.state_dict()["current"]["layout"]["run"]


def test_a_shuffled_epoch_deals_runs_of_chunks_and_an_unshuffled_one_a_chunk_at_a_time(small_samples):
    """The layout says the run, from the frames' and the samples' sizes; unshuffled it is one
    chunk (the DataLoader then yields a rank's block in order), and one worker needs none."""
    source = shardstream.open_dataset(small_samples)
    expected = deal_run(BATCH, source.samples_per_frame(), source.least_sample_bytes())
    assert expected > 10  # what the fetch test below relies on: a run far larger than a chunk
    assert run_of(small_samples, shuffle=True) == expected
    assert run_of(small_samples, shuffle=False) == 1
    one = shardstream.DataLoader(D.key_dataset(small_samples, batch_size=BATCH, shuffle=True), num_workers=1)
    assert one.state_dict()["current"]["layout"]["run"] == 1
    ordered = D.flat(D.run(D.key_dataset(small_samples, batch_size=BATCH), 2))
    assert ordered == D.manifest_keys(small_samples)


def test_inspect_says_the_run_a_worker_is_dealt(small_samples):
    """`shardstream inspect` names the fewest samples a worker's run holds: the layout's run is
    that many samples in whole batches."""
    from shardstream.verify import inspect_dataset

    info = inspect_dataset(small_samples)
    assert run_of(small_samples, shuffle=True) == -(-info["worker_run"] // BATCH)
    shown = subprocess.run([sys.executable, "-m", "shardstream.cli", "inspect", small_samples], capture_output=True,
                           text=True, timeout=120, check=True).stdout.splitlines()[-1]
    assert shown.startswith(f"with several DataLoader workers, a shuffled epoch deals each worker runs of at least "
                            f"{info['worker_run']:,} samples, rounded up to whole batches")


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_over_http_fetch_a_shuffled_epoch_about_once(small_samples, workers):
    """Each of the workers reads runs of about 7.7 MB, and a read bridges gaps of 2 MB at most:
    the epoch fetches each frame about once, every sample once (a batch at a time: 2.16x and
    3.2x the bytes). What is over once: the frames at the edges of the shard's 3 blocks, of
    the runs, and of the last round's shares (16 samples each, of 3 workers: 1.235x)."""
    stored = sum(os.path.getsize(os.path.join(small_samples, name)) for name in os.listdir(small_samples)
                 if name.endswith(".tar.zst"))
    with H.CountingHTTPServer(str(Path(small_samples).parent)) as server:
        ds = D.key_dataset(f"{server.url}/{Path(small_samples).name}", shuffle=True, seed=3, batch_size=BATCH)
        got = D.flat(D.run(ds, workers))
        fetched = ds.io_stats()["bytes"]
    assert sorted(got) == D.manifest_keys(small_samples)
    assert stored < fetched < 1.4 * stored, (fetched / stored, workers)


def test_a_state_taken_a_chunk_at_a_time_resumes_exactly_once(small_samples, monkeypatch):
    """A state of version 4 (before runs: its layouts hold none, and dealt a chunk at a time)
    is another layout here: the rest of its epoch comes once, in the runs of this one."""
    def make():
        return shardstream.DataLoader(D.key_dataset(small_samples, shuffle=True, seed=5, batch_size=BATCH),
                                      num_workers=2)

    with monkeypatch.context() as patch:  # the workers fork with it
        patch.setattr(epochs.EpochSequences, "deal_run", lambda self, chunk: 1)
        head, state = D.stop_after(make(), 31)
    assert state["current"]["layout"]["run"] == 1
    del state["current"]["layout"]["run"]
    state["version"] = 4
    resumed = make()
    resumed.load_state_dict(state)
    rest = D.listed(resumed)
    assert resumed.state_dict()["finished"][0]["layout"]["run"] == 1
    seen = D.flat(head) + D.flat(D.freeze(b) for b in rest)
    assert sorted(seen) == D.manifest_keys(small_samples)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_worker_state_taken_a_chunk_at_a_time_is_refused_naming_the_run(small_samples, monkeypatch):
    """torchdata's StatefulDataLoader hands each worker its own place in its layout, which a worker
    dealt runs cannot take up: a version 4 worker state (a chunk at a time) is refused, saying that
    the run differs, not the world size or the worker count (found by a review: the message said
    those must be the same, and they were)."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        return D.key_dataset(small_samples, shuffle=True, seed=5, batch_size=BATCH)

    with monkeypatch.context() as patch:  # the workers fork with it
        patch.setattr(epochs.EpochSequences, "deal_run", lambda self, chunk: 1)
        loader = stateful.StatefulDataLoader(make(), batch_size=None, num_workers=2)
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
        D.shut_down(it)
        del it
    for snapshot in state["_snapshot"]["_worker_snapshots"].values():
        worker_state = snapshot["dataset_state"]
        assert worker_state["current"]["layout"]["run"] == 1
        del worker_state["current"]["layout"]["run"]
        worker_state["version"] = 4
    resumed = stateful.StatefulDataLoader(make(), batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    with pytest.raises(shardstream.ShardstreamError, match=r"another layout \(run 1 there, \d+ here\).*before version 5") as raised:
        iter(resumed)
    # The iterator raised as it was made, so nothing holds it but the error's traceback, in a cycle that the
    # collector would shut down in about 10 s: shut its workers down here.
    tb = raised.tb
    while tb is not None and not hasattr(tb.tb_frame.f_locals.get("self"), "_shutdown_workers"):
        tb = tb.tb_next
    assert tb is not None, "the failed iterator is in the traceback"
    D.shut_down(tb.tb_frame.f_locals["self"])
    del raised, tb
    gc.collect()
