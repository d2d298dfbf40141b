"""tools/train_ddp.py under torchrun: 2 CPU ranks (gloo), real DDP steps, exact data split and resume.

Each run is a real `python -m torch.distributed.run --nproc_per_node=2` job (a few seconds
of torch import and DDP set-up per process), so the file runs three jobs in all: one
uninterrupted epoch, and one epoch preempted after 2 steps then resumed from its checkpoint.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardstream
from shardstream.synthetic import make_image_folder

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "train_ddp.py"
WORLD = 2
BATCH = 4
TIMEOUT_S = 300

pytestmark = pytest.mark.xdist_group("gloo")  # one gloo job at a time (test_distributed.py says why)


def _train(data: str, log: Path, *extra: str, signal_after_step: int | None = None) -> subprocess.CompletedProcess:
    """A torchrun job of WORLD ranks; with `signal_after_step`, SIGTERM to the whole job (as
    SLURM and Kubernetes send it) once every rank has logged that step."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           "--standalone", str(SCRIPT), "--data", data,
           "--epochs", "1", "--batch-size", str(BATCH), "--workers", "1", "--image-size", "32", "--width", "8",
           "--quiet", "--log-keys", str(log), *extra]
    # Its own session, so that a timeout kills torchrun, the ranks and their workers together.
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:
        if signal_after_step is not None:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline and popen.poll() is None and not (
                    log.exists() and {row["rank"] for row in map(json.loads, log.read_text().splitlines())
                                      if row["step"] >= signal_after_step} == set(range(WORLD))):
                time.sleep(0.05)
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            stdout, stderr = popen.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(f"timed out after {TIMEOUT_S} s\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}")
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if signal_after_step is not None:
        return proc  # torchrun itself exits as SIGTERM'd; the ranks' part is checked by the caller
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def _checksum(stdout: str) -> str:
    """The final-weights fingerprint rank 0 prints."""
    lines = [line for line in stdout.splitlines() if "weights checksum" in line]
    assert len(lines) == 1, stdout
    return lines[0].rsplit(" ", 1)[-1]


def _per_rank(log: Path) -> dict[int, list[list[str]]]:
    """{rank: [batch keys, in step order]} from the --log-keys file."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    out: dict[int, list[tuple[int, list[str]]]] = collections.defaultdict(list)
    for row in rows:
        out[row["rank"]].append((row["step"], row["keys"]))
    return {rank: [keys for _, keys in sorted(steps)] for rank, steps in out.items()}


def _check_exactly_once(per_rank: dict[int, list[list[str]]], all_keys: list[str]) -> None:
    assert sorted(per_rank) == list(range(WORLD))
    counts = {len(batches) for batches in per_rank.values()}
    assert len(counts) == 1, f"ranks saw different batch counts: { {r: len(b) for r, b in per_rank.items()} }"
    pad = -len(all_keys) % WORLD  # DistributedSampler convention: repeat samples to even the ranks
    seen = collections.Counter(k for batches in per_rank.values() for batch in batches for k in batch)
    assert set(seen) == set(all_keys), "some samples never reached a rank, or unknown keys appeared"
    assert sum(seen.values()) == len(all_keys) + pad
    assert sum(n - 1 for n in seen.values()) == pad, f"repeated beyond the padding: {seen.most_common(3)}"
    for rank, batches in per_rank.items():
        mine = [k for batch in batches for k in batch]
        assert len(mine) == len(set(mine)), f"rank {rank} saw a sample twice"
        assert len(mine) == (len(all_keys) + pad) // WORLD


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, list[str]]:
    """21 tiny JPEGs (7 + 9 + 5 over 3 classes) packed into ~7 small shards; its keys."""
    root = tmp_path_factory.mktemp("ddp")
    src, dst = root / "src", root / "ds"
    make_image_folder(src, num_classes=3, images_per_class=[7, 9, 5], size_range=((48, 40), (64, 56)))
    shardstream.pack(str(src), str(dst), shard_size="16KB", progress=False, workers=1)
    source = shardstream.open_dataset(str(dst))
    keys = [sample["__key__"] for ref in source.shards for sample in ref.reader()]
    assert len(keys) == len(set(keys)) == 21 and len(source.shards) > 1
    return str(dst), keys


@pytest.fixture(scope="module")
def full_run(dataset, tmp_path_factory) -> tuple[dict[int, list[list[str]]], str]:
    """One uninterrupted epoch: ({rank: batch keys}, final weights checksum)."""
    data, _ = dataset
    log = tmp_path_factory.mktemp("full") / "keys.jsonl"
    proc = _train(data, log)
    assert "[rank 0/2] epoch 0: 3/3 batches" in proc.stdout and "[rank 1/2] epoch 0: 3/3 batches" in proc.stdout
    return _per_rank(log), _checksum(proc.stdout)


def test_one_epoch_splits_exactly(dataset, full_run):
    _, keys = dataset
    per_rank, _ = full_run
    _check_exactly_once(per_rank, keys)
    # 21 samples over 2 ranks: 11 each (one padded repeat), batches of 4, 4 and 3.
    assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]] == [4, 4, 3]


def test_decode_on_device_trains_to_the_same_weights(dataset, full_run, tmp_path):
    """--decode-on-device moves the JPEG decode out of the workers; on CPU ranks it decodes
    the crops the workers drew with the CPU transform's code, so training sees the same
    batches and ends with the same weights, bit for bit."""
    data, keys = dataset
    per_rank, checksum = full_run
    log = tmp_path / "keys.jsonl"
    proc = _train(data, log, "--decode-on-device")
    assert _per_rank(log) == per_rank
    assert _checksum(proc.stdout) == checksum


def test_preempt_and_resume_mid_epoch(dataset, full_run, tmp_path):
    data, keys = dataset
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "keys.jsonl"
    _train(data, log, "--steps", "2", "--checkpoint", str(ckpt))
    first = _per_rank(log)
    assert {r: len(b) for r, b in first.items()} == {0: 2, 1: 2}
    assert ckpt.exists()

    proc = _train(data, log, "--checkpoint", str(ckpt), "--resume")
    assert "mid-epoch" in proc.stdout
    both = _per_rank(log)  # both runs appended to the same log; steps continue from the checkpoint
    assert {r: len(b) for r, b in both.items()} == {0: 3, 1: 3}
    _check_exactly_once(both, keys)
    # Exact resume: the same batches, in the same order, as the uninterrupted run, and
    # (model, optimizer and augmentation restored too) the same final weights, bit for bit.
    assert both == full_run[0]
    assert _checksum(proc.stdout) == full_run[1]


def test_sigterm_stops_every_rank_after_the_same_step_and_resumes_exactly(dataset, full_run, tmp_path):
    """README's preemption recipe, as tools/train_ddp.py runs it: SIGTERM to the whole job (the
    ranks, their DataLoader workers and torchrun) mid-epoch; the ranks agree on the flag, stop
    after the same step, rank 0 checkpoints, and the resumed job ends as the uninterrupted one."""
    data, keys = dataset
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "keys.jsonl"
    proc = _train(data, log, "--checkpoint", str(ckpt), "--step-sleep", "0.5", signal_after_step=1)
    assert proc.stdout.count("(stopped by SIGTERM)") == WORLD, proc.stdout + proc.stderr[-3000:]
    first = _per_rank(log)
    assert len({len(batches) for batches in first.values()}) == 1 and len(first[0]) < 3  # the same step, mid-epoch
    assert ckpt.exists()
    proc = _train(data, log, "--checkpoint", str(ckpt), "--resume")
    assert "mid-epoch" in proc.stdout
    both = _per_rank(log)
    _check_exactly_once(both, keys)
    assert both == full_run[0] and _checksum(proc.stdout) == full_run[1]
