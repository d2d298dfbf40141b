"""Fault injection with real processes and real failures.

(a) A DataLoader worker process is SIGKILLed (by a transform that kills its own process
    on a chosen sample): the training loop gets torch's RuntimeError "DataLoader worker
    ... exited unexpectedly" promptly, never a hang.
(b) The disk fills up while packing (a small tmpfs when this process may mount one, and
    RLIMIT_FSIZE in a subprocess otherwise and as well): pack raises, writes no manifest,
    publishes no partial shard, and `resume` completes the same dataset once there is room.
(c) `on_error="skip"` over 30 samples of which 2 are corrupt JPEGs, on 2 ranks: every rank
    yields its planned count, exactly the 2 bad samples are lost and counted, and a cap
    (`ErrorPolicy(mode="skip", max_skips=1)`) raises `TooManyErrors`.
(d) `shardstream pack` SIGKILLed once 2 shard indexes exist, then `pack --resume`:
    byte-identical to an uninterrupted pack.

Every child process runs under a timeout, so a hang fails the test instead of the run.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import torch.utils.data
import zstandard

import shardstream
from shardstream import ShardstreamError, StreamingDataset
from shardstream.format import MANIFEST_NAME, ShardIndex
from shardstream.policy import ErrorPolicy, TooManyErrors
from shardstream.synthetic import synthetic_jpeg

try:  # tests/ may or may not be a package
    from ._mounts import remount, tmpfs
except ImportError:
    from _mounts import remount, tmpfs

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

CHILD_TIMEOUT = 120  # seconds: generous for a loaded 2-core machine; a hang still fails
SEEKABLE_MAGIC = 0x8F92EAB1


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(shardstream.__file__).parent.parent),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_child(script: str, *args: str, timeout: float = CHILD_TIMEOUT) -> dict:
    """Run `script` in a fresh interpreter; its last stdout line is JSON. A timeout fails the test."""
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                              timeout=timeout, env=_child_env())
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"child process hung (no result within {timeout} s); stderr: {e.stderr!r}")
    lines = proc.stdout.strip().splitlines()
    assert lines, f"child printed nothing (exit {proc.returncode}); stderr:\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    result["returncode"] = proc.returncode
    result["stderr"] = proc.stderr
    return result


def visible_files(root: Path) -> dict[str, bytes]:
    """The files directly in a dataset folder, hidden ones (scratch, journal) left out."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")}


def assert_whole_shard(path: Path) -> int:
    """A published shard is complete: seek table, end-of-archive, a readable tar; its index (if any) agrees."""
    data = path.read_bytes()
    assert struct.unpack("<I", data[-4:])[0] == SEEKABLE_MAGIC, f"{path.name} has no seek table"
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    assert raw.endswith(bytes(1024)), f"{path.name} lacks the end-of-archive blocks"
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        names = [m.name for m in tar.getmembers()]
    assert names
    index_path = path.with_name(path.name + ".idx")
    if index_path.exists():
        index = ShardIndex.from_bytes(index_path.read_bytes(), str(index_path))
        assert [s["__key__"] for s in shardstream.open_shard(str(path))] == list(index.keys)
    return len(names)


def assert_no_partial_dataset(dst: Path) -> list[str]:
    """What an interrupted pack may leave: no manifest, whole shards only, at most one without its index."""
    assert not (dst / MANIFEST_NAME).exists(), "a manifest was written by a failed pack"
    if not dst.exists():
        return []
    names = sorted(visible_files(dst))
    shards = [n for n in names if n.endswith(".tar.zst")]
    indexes = [n for n in names if n.endswith(".tar.zst.idx")]
    assert names == sorted(shards + indexes), f"unexpected published files: {names}"
    assert all(i[: -len(".idx")] in shards for i in indexes), "an index without its shard"
    assert len(set(shards) - {i[: -len(".idx")] for i in indexes}) <= 1
    for name in shards:
        assert_whole_shard(dst / name)
    return shards


def leftover_parts(dst: Path) -> list[str]:
    return sorted(str(p.relative_to(dst)) for p in dst.rglob("*.part")) if dst.exists() else []


# -- (a) a DataLoader worker killed -----------------------------------------------------------------------

_KILL_WORKER = """
import json, os, signal, sys, time
import torch.utils.data
import shardstream

class KillOwnProcess:
    '''A transform that SIGKILLs the process it runs in, on one sample, inside a worker only.'''
    def __init__(self, key):
        self.key = key
    def __call__(self, sample):
        if sample["__key__"] == self.key and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return sample["__key__"]

url, key = sys.argv[1:3]
results = {}
for flavour in ("torch", "shardstream"):
    dataset = shardstream.StreamingDataset(url, decode=None, transform=KillOwnProcess(key))
    if flavour == "torch":
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    else:
        loader = shardstream.DataLoader(dataset, num_workers=2)
    seen, started = [], time.monotonic()
    try:
        for item in loader:
            seen.append(item)
        results[flavour] = {"error": None, "seen": len(seen), "seconds": time.monotonic() - started}
    except BaseException as e:
        if flavour == "shardstream" and not isinstance(e, shardstream.WorkerDiedError):
            # torch's SIGCHLD handler raised in the loop's own code, rarely with a loop this short:
            # the loader names the death when asked, as bench asks
            e = loader._worker_death(e) or e
        results[flavour] = {"error": type(e).__name__, "runtime_error": isinstance(e, RuntimeError),
                            "message": str(e)[:500], "seen": len(seen),
                            "killed_key_seen": key in seen, "seconds": time.monotonic() - started}
    if flavour == "shardstream":  # the next epoch starts fresh workers rather than raising again
        dataset.transform.key = None
        loader.set_epoch(1)
        results[flavour]["next_epoch"] = sum(1 for _ in loader)
print(json.dumps(results))
"""


def test_killed_dataloader_worker_raises_promptly(packed):
    """torch.utils.data.DataLoader and shardstream.DataLoader, one child process for both (one torch import)."""
    keys = [s["__key__"] for ref in shardstream.open_dataset(packed).shards for s in ref.reader()]
    victim = keys[len(keys) // 2]  # mid-epoch: some items were delivered before the kill
    results = _run_child(_KILL_WORKER, packed, victim)
    assert results.pop("returncode") == 0, results["stderr"][-2000:]  # the main process survives and reports
    results.pop("stderr")
    assert set(results) == {"torch", "shardstream"}
    # torch says one or the other, by which of its checks sees the dead worker first (its SIGCHLD handler,
    # or the queue's timeout): both name the worker. shardstream's loader names its pid and the signal, in
    # an error a handler of torch's RuntimeError still catches.
    assert results["torch"]["error"] == "RuntimeError", results["torch"]
    assert re.search(r"DataLoader worker .*(exited unexpectedly|is killed by signal)", results["torch"]["message"])
    assert results["shardstream"]["error"] == "WorkerDiedError", results["shardstream"]
    assert re.match(r"DataLoader worker \(pid \d+\) killed by SIGKILL ", results["shardstream"]["message"])
    for flavour, result in results.items():
        assert result["runtime_error"], (flavour, result)
        assert not result["killed_key_seen"] and 0 < result["seen"] < len(keys), (flavour, result)
        assert result["seconds"] < 60, f"{flavour}: took {result['seconds']:.1f} s to notice the dead worker"
    assert results["shardstream"]["next_epoch"] == len(keys)


# A training script stopped as a scheduler stops a job: SIGTERM to every process of it. Its handler, as a
# training loop's should be, only notes the signal; the loop saves its checkpoint after the step. It waits for
# its workers to have ended first: the save comes after their end, as a large checkpoint's save does.
_SIGTERM_TO_THE_JOB = """
import json, os, signal, sys, time
import torch
import shardstream

def slow(sample):  # the loop waits on the workers
    time.sleep(0.3)
    return sample

if __name__ == "__main__":  # (workers started by spawn or forkserver import this file)
    url, checkpoint, when, method = sys.argv[1:5]
    dataset = shardstream.StreamingDataset(url, decode=None, fields=("__key__", "cls"), batch_size=2,
                                           transform=slow if when == "waiting" else None)
    loader = shardstream.DataLoader(dataset, num_workers=2, multiprocessing_context=method)
    stopping = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    def save_and_exit():
        time.sleep(0.5)  # a save that takes a while: the workers must not end under it
        torch.save(loader.state_dict(), checkpoint)
        sys.exit(128 + stopping[0])
    for step, batch in enumerate(loader):
        print(json.dumps(list(batch[0])), flush=True)
        if stopping:  # seen at the end of the step after the one the SIGTERM came in (or its wait)
            save_and_exit()
        if step == 1:
            print("training", flush=True)  # the test sends SIGTERM now: during this step, or the wait for the next
            deadline = time.monotonic() + 30
            while when == "step" and not stopping and time.monotonic() < deadline:
                time.sleep(0.01)
            if when == "step":
                save_and_exit()
"""


# Workers started by spawn (found by review): the native threads a new interpreter starts as it imports numpy,
# before `worker_init_fn` held SIGTERM back, took the job's SIGTERM, and the workers died. forkserver's (the
# forty-third session): the job's SIGTERM ended the fork server, whose end made every worker it forked look
# dead to multiprocessing (status 255), though they lived.
@pytest.mark.parametrize(("when", "method"), [("step", "fork"), ("waiting", "fork"), ("waiting", "spawn"),
                                              ("waiting", "forkserver")])
def test_sigterm_to_the_whole_job_lets_the_training_loop_save_its_checkpoint(packed, tmp_path, when, method):
    """Regression: SLURM (at preemption, `scancel`) and container runtimes signal every process of a job. The
    DataLoader workers died of the SIGTERM, and torch's SIGCHLD handler raised "DataLoader worker is killed by
    signal: Terminated" in the training process, wherever it was: in the save of the checkpoint its SIGTERM
    handler had asked for (four runs in four with a 200 MB model), so a preempted job never resumed. Then
    workers ended at once with status 0, and a loop waiting for its next batch when the SIGTERM came never got
    one: WorkerDiedError, no checkpoint (four runs in four). The workers now serve on while the training process
    lives, end with it, and the checkpoint resumes the epoch exactly."""
    checkpoint = tmp_path / "data.pt"
    script = tmp_path / "train.py"
    script.write_text(_SIGTERM_TO_THE_JOB)
    # numpy's own thread pool as it is by default: its threads, which a new interpreter starts before
    # `worker_init_fn` runs, are the ones that took the SIGTERM
    env = {k: v for k, v in _child_env().items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    proc = subprocess.Popen([sys.executable, str(script), packed, str(checkpoint), when, method],
                            start_new_session=True, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    received = []
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while (line := proc.stdout.readline()) != "training\n":
            assert line and time.monotonic() < deadline, "the training loop never reached its second step"
            received += json.loads(line)
        os.killpg(proc.pid, signal.SIGTERM)
        out, stderr = proc.communicate(timeout=60)
        received += [key for line in out.splitlines() for key in json.loads(line)]  # the batch waited for
        for _ in range(100):  # the workers end with the training process
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the workers outlived the training process")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM and not stderr, stderr[-2000:]
    assert len(out.splitlines()) == (1 if when == "waiting" else 0)

    def loader() -> shardstream.DataLoader:
        return shardstream.DataLoader(StreamingDataset(packed, decode=None, fields=("__key__", "cls"), batch_size=2))

    rest = loader()
    rest.load_state_dict(torch.load(checkpoint))
    received += [key for batch in rest for key in batch[0]]
    assert received == [key for batch in loader() for key in batch[0]]


_POOL_AFTER_THE_LOADERS_FORK_SERVER = """
import multiprocessing, multiprocessing.forkserver, time
from shardstream.loader import sigterm_held_for_new_workers

def blocked(pid):  # whether SIGTERM (15: bit 14) is held back in process `pid`
    line = next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigBlk:"))
    return bool(int(line.split()[1], 16) >> 14 & 1)

if __name__ == "__main__":
    with sigterm_held_for_new_workers("forkserver"):  # as shardstream.DataLoader starts its workers
        pass
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    pool = multiprocessing.get_context("forkserver").Pool(1)
    worker = pool.apply(__import__("os").getpid)
    pool.apply_async(time.sleep, (120,))
    time.sleep(0.3)
    said = {"server": blocked(server), "worker": blocked(worker), "here": blocked(__import__("os").getpid())}
    started = time.monotonic()
    pool.terminate()  # SIGTERM to its workers: held back, and it waits for them forever
    pool.join()
    print(said, round(time.monotonic() - started, 1))
"""


def test_the_fork_server_the_loader_starts_holds_sigterm_back_and_what_it_forks_does_not(tmp_path):
    """The fork server that workers started by forkserver come from is started with SIGTERM held back (a job's
    SIGTERM ended it, and with it every worker seemed dead), and lets it through in each process it forks: a
    `Pool`'s workers, which its `terminate()` ends by SIGTERM, would otherwise never end."""
    script = tmp_path / "pool.py"
    script.write_text(_POOL_AFTER_THE_LOADERS_FORK_SERVER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=_child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    said, seconds = done.stdout.rsplit(" ", 1)
    assert said == "{'server': True, 'worker': False, 'here': False}" and float(seconds) < 10, done.stdout


# -- (b) disk full while packing ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pack_source(make_folder) -> Path:
    """3 classes x 10 JPEGs (~5 KB each) plus a non-image file."""
    return make_folder(num_classes=3, images_per_class=10, seed=5)


PACK_OPTS = dict(shard_size="20KB", level=3, progress=False)


@pytest.fixture(scope="module")
def clean_pack(pack_source, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("clean") / "ds"
    shardstream.pack(str(pack_source), str(dst), workers=1, **PACK_OPTS)
    return dst


def _pack_into_small_tmpfs(pack_source: Path, clean_pack: Path, tmp_path: Path, fraction: float, workers: int):
    total = sum(len(b) for b in visible_files(clean_pack).values())
    size = max(4096, int(total * fraction) // 4096 * 4096)
    mount = tmp_path / "mnt"
    dst = mount / "ds"
    with tmpfs(mount, size):
        with pytest.raises((OSError, ShardstreamError)) as info:
            shardstream.pack(str(pack_source), str(dst), workers=workers, **PACK_OPTS)
        shards = assert_no_partial_dataset(dst)
        leftovers = leftover_parts(dst)
        # Room again (the disk was cleaned up): resuming finishes the same dataset.
        remount(mount, f"size={4 * total + (1 << 20)}")
        shardstream.pack(str(pack_source), str(dst), workers=workers, resume=True, **PACK_OPTS)
        resumed = visible_files(dst)
        hidden = sorted(p.name for p in dst.iterdir() if p.name.startswith("."))
    return info.value, shards, leftovers, resumed, hidden


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fraction", [0.25, 0.6, 0.97])
def test_disk_full_tmpfs_leaves_no_manifest_and_resumes(pack_source, clean_pack, tmp_path, fraction, workers):
    error, shards, leftovers, resumed, hidden = _pack_into_small_tmpfs(pack_source, clean_pack, tmp_path, fraction,
                                                                       workers)
    if isinstance(error, OSError):
        assert error.errno in (errno.ENOSPC, errno.EFBIG), error
    assert not leftovers, f"partial files left behind: {leftovers}"
    assert resumed == visible_files(clean_pack), "resume after a full disk differs from a clean pack"
    assert not hidden, f"hidden folders left after the resumed pack: {hidden}"


_PACK_UNDER_RLIMIT = """
import errno, json, resource, signal, sys
import shardstream
src, dst, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    shardstream.pack(src, dst, shard_size="20KB", level=3, progress=False, workers=int(sys.argv[4]))
    print(json.dumps({"error": None}))
except BaseException as e:
    print(json.dumps({"error": type(e).__name__, "shardstream": isinstance(e, shardstream.ShardstreamError),
                      "errno": getattr(e, "errno", None), "filename": getattr(e, "filename", None),
                      "message": str(e)}))
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_disk_full_rlimit_leaves_no_manifest_and_resumes(pack_source, clean_pack, tmp_path, workers):
    dst = tmp_path / "ds"
    result = _run_child(_PACK_UNDER_RLIMIT, str(pack_source), str(dst), "12000", str(workers))
    assert result["error"] is not None, "pack succeeded although no shard file may exceed 12000 bytes"
    assert result["shardstream"] or result["errno"] == errno.EFBIG, result
    assert_no_partial_dataset(dst)
    assert not leftover_parts(dst), leftover_parts(dst)
    shardstream.pack(str(pack_source), str(dst), workers=workers, resume=True, **PACK_OPTS)
    assert visible_files(dst) == visible_files(clean_pack)


@pytest.mark.parametrize("how", ["rlimit", "tmpfs"])
def test_disk_full_error_names_the_file(pack_source, clean_pack, tmp_path, how):
    if how == "rlimit":
        dst = tmp_path / "ds"
        result = _run_child(_PACK_UNDER_RLIMIT, str(pack_source), str(dst), "12000", "1")
        message, filename = result["message"], result["filename"]
    else:
        error = _pack_into_small_tmpfs(pack_source, clean_pack, tmp_path, 0.6, 1)[0]
        dst = tmp_path / "mnt" / "ds"
        message, filename = str(error), getattr(error, "filename", None)
    assert str(dst) in message or (filename and str(dst) in str(filename)), message


# -- (c) corrupt samples under on_error="skip" -------------------------------------------------------------

N_SKIP = 30
BAD = {5: "truncated", 20: "garbage"}  # global sample ids: one in each rank's half of the epoch


@pytest.fixture(scope="module")
def corrupt_dataset(tmp_path_factory) -> tuple[str, list[str], set[str]]:
    """30 samples (jpg + cls) written as they are, 2 of them corrupt JPEGs; several shards."""
    url = str(tmp_path_factory.mktemp("skip") / "ds")
    keys, bad = [], set()
    with shardstream.ShardWriter(url, shard_size="12KB") as w:
        for i in range(N_SKIP):
            jpg = synthetic_jpeg(i, 32, 24, quality=70)
            if BAD.get(i) == "truncated":
                jpg = jpg[: len(jpg) // 2]
            elif BAD.get(i) == "garbage":
                jpg = b"this is not a JPEG at all\n" * 8
            key = f"s{i:03d}"
            w.write({"__key__": key, "jpg": jpg, "cls": i % 3})
            keys.append(key)
            if i in BAD:
                bad.add(key)
    assert len(shardstream.open_dataset(url).shards) >= 3
    return url, keys, bad


def _skip_dataset(url: str, **kwargs) -> StreamingDataset:
    return StreamingDataset(url, decode="rgb8", fields=("__key__", "jpg"), **kwargs)


def _epoch(dataset: StreamingDataset, num_workers: int) -> list[str]:
    """The keys of one epoch: in this process, or through a torch DataLoader with worker processes."""
    if num_workers == 0:
        return [key for key, _ in dataset]
    it = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers))
    try:
        return [key for key, _ in it]
    finally:
        it._shutdown_workers()  # now: after an error torch's re-raise keeps the iterator in a reference cycle


def _release(caplog) -> None:
    """After an expected error, drop what still holds the failed epoch's generators (and so its prefetch
    threads): pytest's captured log records (their arguments are the skipped errors, with tracebacks) and
    the traceback's reference cycle (OBSERVATION in RELIABILITY.md)."""
    caplog.clear()
    gc.collect()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_keeps_every_rank_at_its_planned_count(corrupt_dataset, num_workers, caplog):
    url, keys, bad = corrupt_dataset
    yielded, skipped = [], 0
    caplog.set_level(logging.WARNING, logger="shardstream")
    for rank in range(2):
        dataset = _skip_dataset(url, on_error="skip", rank=rank, world_size=2)
        planned = len(dataset)
        got = _epoch(dataset, num_workers)
        assert planned == N_SKIP // 2
        assert len(got) == planned, f"rank {rank} yielded {len(got)} of {planned} planned samples"
        assert dataset.skipped == 1, f"rank {rank} counted {dataset.skipped} skips"
        yielded += got
        skipped += dataset.skipped
    assert skipped == len(bad) == 2
    # Lost = counted: the bad samples are missing, every good one is there, and the places of the
    # bad ones were filled by repeats of good ones.
    assert set(yielded) == set(keys) - bad
    assert len(yielded) - len(set(yielded)) == skipped
    if num_workers == 0:  # each skip is logged, naming the sample (worker processes log on their own)
        logged = [r.getMessage() for r in caplog.records if "skipped bad sample" in r.getMessage()]
        assert len(logged) == 2 and all(any(k in m for m in logged) for k in bad), logged


@pytest.mark.parametrize(("num_workers", "decode_threads"), [(0, 0), (2, 0), (0, 2)])
def test_stand_ins_and_padding_are_marked_so_that_each_good_sample_counts_once(corrupt_dataset, num_workers,
                                                                             decode_threads, caplog):
    """30 samples on 4 ranks: 2 repeats pad the ranks, and 2 bad samples' places hold stand-ins.
    Every one of those carries ``__pad__`` True; the rest are the good samples, each once."""
    url, keys, bad = corrupt_dataset
    unmarked, marked = [], []
    for rank in range(4):
        dataset = StreamingDataset(url, fields=("__key__", "jpg", "__pad__"), on_error="skip", rank=rank,
                                   world_size=4, shuffle=True, seed=5, decode_threads=decode_threads)
        if num_workers:
            it = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers))
            try:
                got = [(key, bool(pad)) for key, _, pad in it]
            finally:
                it._shutdown_workers()
        else:
            got = [(key, pad) for key, _, pad in dataset]
        assert all(isinstance(pad, bool) for _, pad in got)
        unmarked += [key for key, pad in got if not pad]
        marked += [key for key, pad in got if pad]
    assert sorted(unmarked) == sorted(set(keys) - bad)
    assert len(marked) == 4 * 8 - N_SKIP + len(bad)
    _release(caplog)


def _last_two_bad(tmp_path: Path) -> str:
    """10 samples (jpg + cls), s008 and s009 truncated JPEGs: the pass ends on bad samples."""
    url = str(tmp_path / "ds")
    with shardstream.ShardWriter(url, shard_size="12KB") as w:
        for i in range(10):
            jpg = synthetic_jpeg(i, 32, 24, quality=70)
            w.write({"__key__": f"s{i:03d}", "jpg": jpg[: len(jpg) // 2] if i >= 8 else jpg, "cls": i % 3})
    return url


def test_a_stand_in_a_resumed_run_reads_again_is_marked(tmp_path, caplog):
    """The last samples of a pass bad, their stand-in is the last good one the run before
    yielded, read again after a resume: marked, as in the uninterrupted run, at every place."""
    url = _last_two_bad(tmp_path)

    def dataset() -> StreamingDataset:
        return StreamingDataset(url, fields=("__key__", "__pad__"), decode="rgb8",
                                on_error=ErrorPolicy(mode="skip", max_skips=2),
                                transform=lambda sample: {**sample, "jpg": sample["jpg"].shape})

    whole = list(dataset())
    assert whole == [(f"s{i:03d}", False) for i in range(8)] + [("s007", True), ("s007", True)]
    for k in range(len(whole)):
        ds = dataset()
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = ds.state_dict()
        it.close()
        resumed = dataset()
        resumed.load_state_dict(state)
        assert head + list(resumed) == whole, f"resumed after {k}"
    _release(caplog)


def test_skip_stands_in_the_next_good_sample_and_resumes_exactly_at_every_place(corrupt_dataset, caplog):
    """A bad sample's place gets the next good sample of its worker, so a run resumed at any
    place, the bad ones included, yields what the uninterrupted run did from there on (with
    the last good one before it as the stand-in, a run resumed at a bad place had none)."""
    url, _, bad = corrupt_dataset

    def dataset() -> StreamingDataset:
        return _skip_dataset(url, on_error=ErrorPolicy(mode="skip", max_skips=len(bad)), shuffle=True, seed=3,
                             rank=0, world_size=1)

    whole = [key for key, _ in dataset()]
    places = [i for i, key in enumerate(whole) if key not in bad and i > 0 and whole[i - 1] == key]
    assert len(places) == len(bad) and not bad & set(whole)
    for place in places:  # the stand-in is the sample after the bad one, yielded twice in a row
        assert whole[place - 1] == whole[place]
    for k in range(len(whole)):
        ds = dataset()
        it = iter(ds)
        head = [next(it)[0] for _ in range(k)]
        state = json.loads(json.dumps(ds.state_dict()))
        it.close()
        resumed = dataset()
        resumed.load_state_dict(state)
        assert head + [key for key, _ in resumed] == whole, f"resumed at place {k}"
    _release(caplog)


@pytest.mark.parametrize("decode_threads", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_a_resume_with_only_bad_samples_left_pads_with_the_last_good_one_before(tmp_path, caplog, batch_size,
                                                                                 decode_threads):
    """Regression: the last samples of a pass bad, the uninterrupted run pads their places with the last good
    one before them; a run resumed after that good one had nothing good left and raised TooManyErrors, on
    every restart: the checkpoint could never be resumed (17 places of a review's sweep). It pads with the
    good one the run before yielded last, read again."""
    url = _last_two_bad(tmp_path)

    def dataset() -> StreamingDataset:
        collate = (lambda batch: [key for key, _ in batch]) if batch_size else None
        return _skip_dataset(url, on_error=ErrorPolicy(mode="skip", max_skips=2), batch_size=batch_size,
                             collate_fn=collate, decode_threads=decode_threads)

    def keys(items) -> list:
        return [item if batch_size else item[0] for item in items]

    whole = keys(dataset())
    assert whole == ([["s000", "s001", "s002"], ["s003", "s004", "s005"], ["s006", "s007", "s007"], ["s007"]]
                     if batch_size else [f"s{i:03d}" for i in range(8)] + ["s007", "s007"])
    for k in range(len(whole)):
        ds = dataset()
        it = iter(ds)
        head = keys(next(it) for _ in range(k))
        state = json.loads(json.dumps(ds.state_dict()))
        it.close()
        resumed = dataset()
        resumed.load_state_dict(state)
        assert head + keys(resumed) == whole, f"resumed after {k}"
    _release(caplog)


def test_an_epoch_ended_by_a_bad_image_leaves_no_threads_behind(tmp_path):
    """Regression: the error of a bad image, raised again in the loop, held in its traceback the frames that
    held the epoch's stages; caught by the loop, which went on to the next epoch, they lived, thread pools
    and read-ahead and all, until the cyclic garbage collector ran (126 threads after 60 epochs). The stages
    are closed as the epoch's items end."""
    import gc
    import threading

    url = str(tmp_path / "ds")
    with shardstream.ShardWriter(url, shard_size="12KB") as w:
        for i in range(20):
            jpg = synthetic_jpeg(i, 32, 24, quality=70)
            w.write({"__key__": f"s{i:03d}", "jpg": jpg[: len(jpg) // 2] if i == 10 else jpg, "cls": i % 3})
    dataset = _skip_dataset(url, decode_threads=2, prefetch=2)
    before = threading.active_count()
    gc.disable()  # the time between two of its collections, in a large process
    try:
        for epoch in range(3):
            dataset.set_epoch(epoch)
            with pytest.raises(shardstream.DecodeError):
                for _ in dataset:
                    pass
            time.sleep(0.2)  # pools shutting down
            assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
    finally:
        gc.enable()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_skipped_unreadable_sample_is_held_in_no_reference_cycle(tmp_path, prefetch, caplog):
    """Regression: under "skip", a sample whose frame cannot be read was stored as its error,
    whose traceback held the frames around it, and those the run's other samples; raised
    again to be skipped, its traceback took in the sample holding it. Reference cycles: each
    epoch with a bad sample kept megabytes until the cyclic GC ran (8 MB an epoch of 1 MB
    samples). Here what a collection finds unreachable is kept and searched."""
    import gc

    url = str(tmp_path / "ds")
    with shardstream.ShardWriter(url, frame_size=1) as w:  # a frame a sample
        for i in range(12):
            w.write({"__key__": f"s{i:03d}", "bin": bytes([i]) * 3000})
    info = shardstream.open_dataset(url).shards[0]
    index = info.reader().index
    frame = index.frame_of(list(index.keys).index("s005"))
    path = tmp_path / "ds" / info.name
    data = bytearray(path.read_bytes())
    data[(int(index.frame_offsets[frame]) + int(index.frame_offsets[frame + 1])) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    dataset = StreamingDataset(url, decode=None, fields=("__key__",), on_error="skip", prefetch=prefetch)
    caplog.set_level(logging.ERROR, logger="shardstream")  # a captured warning would hold the error
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for epoch in range(2):
            dataset.set_epoch(epoch)
            assert [key for (key,) in dataset].count("s005") == 0
        gc.collect()
        cyclic = [obj for obj in gc.garbage
                  if isinstance(obj, shardstream.ShardstreamError) or (isinstance(obj, dict) and "__error__" in obj)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert dataset.skipped == 2
    assert cyclic == [], cyclic[:3]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_skip_is_for_bad_data_not_for_storage(tmp_path, prefetch):
    """A shard that is gone is not a bad sample: it raises a StorageError naming it under
    "skip" too, rather than quietly dropping a shard's samples within the skip cap."""
    url = str(tmp_path / "ds")
    with shardstream.ShardWriter(url, shard_size="12KB") as w:
        for i in range(N_SKIP):
            w.write({"__key__": f"s{i:03d}", "jpg": synthetic_jpeg(i, 32, 24, quality=70), "cls": i % 3})
    gone = shardstream.open_dataset(url).shards[1].name
    os.remove(os.path.join(url, gone))
    dataset = StreamingDataset(url, decode=None, fields=("__key__",), prefetch=prefetch,
                               on_error=ErrorPolicy(mode="skip", max_skips=N_SKIP))
    with pytest.raises(shardstream.StorageError, match=gone):
        list(dataset)
    assert dataset.skipped == 0


def test_skip_over_the_cap_raises_too_many_errors(corrupt_dataset, caplog):
    url, _, _ = corrupt_dataset
    capped = _skip_dataset(url, on_error=ErrorPolicy(mode="skip", max_skips=1), rank=0, world_size=1)
    with pytest.raises(TooManyErrors, match="exceed the limit"):
        _epoch(capped, 0)
    assert capped.skipped == 2  # the second skip is the one over the cap
    _release(caplog)
    capped = _skip_dataset(url, on_error=ErrorPolicy(mode="skip", max_skips=1), rank=0, world_size=1)
    with pytest.raises(TooManyErrors):  # raised in a worker, re-raised in the main process by the DataLoader
        _epoch(capped, 2)
    _release(caplog)
    # Within the cap, one worker skips both and still yields all 30.
    allowed = _skip_dataset(url, on_error=ErrorPolicy(mode="skip", max_skips=2), rank=0, world_size=1)
    assert len(_epoch(allowed, 0)) == N_SKIP and allowed.skipped == 2


def test_skip_default_cap_is_one_percent_but_at_least_one(corrupt_dataset, caplog):
    """The default cap is max(1, 1% of a worker's planned samples): 2 bad samples in one worker's 30 are too many."""
    url, _, _ = corrupt_dataset
    dataset = _skip_dataset(url, on_error="skip", rank=0, world_size=1)
    with pytest.raises(TooManyErrors):
        _epoch(dataset, 0)
    assert dataset.skipped == 2
    _release(caplog)


def test_raise_mode_names_the_bad_sample(corrupt_dataset, caplog):
    url, keys, bad = corrupt_dataset
    dataset = _skip_dataset(url, rank=0, world_size=1)
    with pytest.raises(shardstream.DecodeError) as info:
        _epoch(dataset, 0)
    key, url_ = info.value.key, info.value.url
    del info
    _release(caplog)
    assert key == min(bad) and url_


def test_an_error_from_a_loader_worker_keeps_its_url_and_key(corrupt_dataset, caplog):
    """torch's DataLoader raises a worker's error anew from its text (url and key unset);
    shardstream.DataLoader's workers send it whole."""
    url, keys, bad = corrupt_dataset
    dataset = _skip_dataset(url, rank=0, world_size=1)
    loader = shardstream.DataLoader(dataset, num_workers=2)
    with pytest.raises(shardstream.DecodeError) as info:
        for _ in loader:
            pass
    error = info.value
    del info
    _release(caplog)
    assert error.key in bad
    shard = next(s for s in shardstream.open_dataset(url).shards
                 if error.key in {x["__key__"] for x in shardstream.open_shard(os.path.join(url, s.name))})
    assert error.url is not None and error.url.endswith(shard.name)
    assert f"sample {error.key!r}" in str(error)
    notes = "".join(getattr(error, "__notes__", []))
    assert re.search(r"Raised in DataLoader worker process [01]; its traceback there:\n.*DecodeError", notes, re.S)
    # The failed epoch's workers are gone; the next epoch starts fresh ones and fails the same way.
    with pytest.raises(shardstream.DecodeError) as again:
        list(loader)
    assert again.value.key in bad
    del again
    _release(caplog)


def test_a_worker_error_that_does_not_pickle_is_raised_as_it_is():
    """An item that fails to pickle would be dropped by torch's queue feeder thread (a hang), so
    `carry_errors` sends only what pickles, and otherwise raises the error for torch to carry as text."""
    from shardstream.dataset import carry_errors
    from shardstream.errors import RaisedInWorker

    class LocalError(ShardstreamError):  # a local class: pickled by reference, it cannot be found
        pass

    def items(error):
        yield 1
        raise error

    assert [type(x) for x in carry_errors(items(ShardstreamError("bad", url="u", key="k")), 3)] == [int, RaisedInWorker]
    sent = list(carry_errors(items(ShardstreamError("bad", url="u", key="k")), 3))[1]
    with pytest.raises(ShardstreamError) as info:
        sent.reraise()
    assert (info.value.url, info.value.key) == ("u", "k")
    assert "Raised in DataLoader worker process 3" in "".join(info.value.__notes__)
    unpicklable = carry_errors(items(LocalError("local", key="k")), 0)
    assert next(unpicklable) == 1
    with pytest.raises(LocalError, match="sample 'k': local"):
        next(unpicklable)


# -- (d) pack --resume after SIGKILL --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resume_source(make_folder) -> Path:
    return make_folder(num_classes=3, images_per_class=40, seed=11)


RESUME_ARGS = ["--shard-size", "20KB", "--level", "19", "--quiet"]


def _cli_pack(src: Path, dst: Path, workers: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardstream.cli", "pack", str(src), str(dst), "--workers", str(workers),
            *RESUME_ARGS, *extra]


@pytest.fixture(scope="module")
def resume_reference(resume_source, tmp_path_factory) -> dict[str, bytes]:
    dst = tmp_path_factory.mktemp("resume-ref") / "ds"
    subprocess.run(_cli_pack(resume_source, dst, 1), check=True, capture_output=True, timeout=CHILD_TIMEOUT,
                   env=_child_env())
    return visible_files(dst)


def _killed_pack(src: Path, dst: Path, workers: int, *extra: str) -> None:
    """`shardstream pack` into `dst`, SIGKILLed (with its worker processes) once two shards are out."""
    proc = subprocess.Popen(_cli_pack(src, dst, workers, *extra), start_new_session=True, env=_child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while len(list(dst.glob("*.idx"))) < 2 and proc.returncode is None:
            assert time.monotonic() < deadline, "no two shard indexes appeared"
            time.sleep(0.002)
            proc.poll()
        with contextlib.suppress(ProcessLookupError):  # it may have finished (then the assert below says so)
            os.killpg(proc.pid, signal.SIGKILL)  # the packer and its worker processes
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, f"the pack ended before it could be killed: {stderr[-1000:]}"


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_after_sigkill_is_byte_identical(resume_source, resume_reference, tmp_path, workers):
    dst = tmp_path / "ds"
    _killed_pack(resume_source, dst, workers)
    published = assert_no_partial_dataset(dst)
    assert 2 <= len(published) < len([n for n in resume_reference if n.endswith(".tar.zst")])
    # What the resume may take as done: the whole shards with their indexes.
    indexed = sum(len(shardstream.open_shard(str(dst / n))) for n in published if (dst / f"{n}.idx").exists())

    resumed = subprocess.run(_cli_pack(resume_source, dst, workers, "--resume"), capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT, env=_child_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert visible_files(dst) == resume_reference, "resumed pack differs from an uninterrupted one"
    # The summary's rate is of what this run packed: the killed run's samples (its journaled shards,
    # whole with their indexes) are said apart, not counted in it.
    said = re.search(r"packed (\d+) samples \((\d+) of them by an earlier run\) into .* in ([\d.]+) s \(([\d,]+) img/s\)",
                     resumed.stdout)
    assert said, resumed.stdout
    total, earlier, seconds, rate = int(said[1]), int(said[2]), float(said[3]), int(said[4].replace(",", ""))
    assert 0 < earlier <= indexed < total
    assert abs(rate - (total - earlier) / seconds) <= 0.05 * rate + 1  # seconds are shown rounded
    # No hidden leftovers: the journal is gone, and the killed run's half-written files with it.
    hidden = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.relative_to(dst).as_posix()[0] == ".")
    assert not hidden, f"left behind: {hidden}"


def test_resume_refuses_another_error_policy(resume_source, tmp_path):
    """Regression: on_error decides which files are skipped, but a resume with another policy went on."""
    dst = tmp_path / "ds"
    _killed_pack(resume_source, dst, 1, "--on-error", "skip")
    resumed = subprocess.run(_cli_pack(resume_source, dst, 1, "--resume", "--on-error", "fail"),
                             capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=_child_env())
    assert resumed.returncode != 0 and "cannot resume" in resumed.stderr


@pytest.mark.parametrize("change", ["same size, new time", "new size, same time"])
def test_resume_refuses_a_source_changed_in_place(make_folder, tmp_path, change):
    """Regression: a file rewritten at the same size after the kill was packed into a mix of old and
    new shards. Its size tells too, though the listing's fingerprint no longer holds sizes (a part
    looks up its own files only), and with its time put back."""
    src = make_folder(num_classes=3, images_per_class=40, seed=12)
    dst = tmp_path / "ds"
    _killed_pack(src, dst, 1)
    victim = sorted(src.rglob("*.jpg"))[-1]
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    if change == "same size, new time":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    else:
        victim.write_bytes(bytes(data[:-3]) + b"\xff\xd9")  # a byte shorter, still ending as a JPEG does
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    resumed = subprocess.run(_cli_pack(src, dst, 1, "--resume"), capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT, env=_child_env())
    assert resumed.returncode != 0 and "cannot resume" in resumed.stderr


def test_resume_of_a_finished_pack_tidies_up_and_refuses_another(resume_source, resume_reference, tmp_path):
    """A scheduler's retry of a pack that finished (perhaps killed between writing the manifest and
    clearing its journal) succeeds without packing, and removes the journal; with other options it refuses."""
    dst = tmp_path / "ds"
    subprocess.run(_cli_pack(resume_source, dst, 1), check=True, capture_output=True, timeout=CHILD_TIMEOUT,
                   env=_child_env())
    leftover = dst / ".shardstream-pack" / "main" / "plan.msgpack"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"left by a kill")
    again = subprocess.run(_cli_pack(resume_source, dst, 1, "--resume"), capture_output=True, text=True,
                           timeout=CHILD_TIMEOUT, env=_child_env())
    assert again.returncode == 0, again.stderr[-2000:]
    assert visible_files(dst) == resume_reference and not (dst / ".shardstream-pack").exists()
    other = subprocess.run(_cli_pack(resume_source, dst, 1, "--resume", "--seed", "5"), capture_output=True,
                           text=True, timeout=CHILD_TIMEOUT, env=_child_env())
    assert other.returncode != 0 and "other options" in other.stderr


# -- (d2) pack stopped by SIGTERM (a scheduler) or Ctrl-C ------------------------------------------------------


@pytest.fixture(scope="module")
def large_source(tmp_path_factory) -> Path:
    """Images of ~110 KB: pack builds their frames in threads (framepool.THREADS_FROM_BYTES), not processes."""
    from shardstream.synthetic import make_image_folder

    root = tmp_path_factory.mktemp("large") / "src"
    make_image_folder(root, num_classes=2, images_per_class=12, seed=5)
    return root


@pytest.fixture(scope="module")
def large_part_reference(large_source, tmp_path_factory) -> dict[str, bytes]:
    dst = tmp_path_factory.mktemp("large-ref") / "ds"
    subprocess.run(_cli_pack(large_source, dst, 1, "--part", "1/2"), check=True, capture_output=True,
                   timeout=CHILD_TIMEOUT, env=_child_env())
    return visible_files(dst)


def _pack_under_way(src: Path, dst: Path, workers: int, *extra: str) -> subprocess.Popen:
    """`shardstream pack` into `dst`, in a process group of its own, once two shards are out: mid-pack."""
    proc = subprocess.Popen(_cli_pack(src, dst, workers, *extra), start_new_session=True, env=_child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + CHILD_TIMEOUT
    while len(list(dst.glob("*.idx"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            _, stderr = _ended(proc)
            pytest.fail(f"the pack ended, or wrote no two shards in time, before it was signalled: {stderr[-1000:]}")
        time.sleep(0.002)
    return proc


def _ended(proc: subprocess.Popen, timeout: float = 30) -> tuple[str, str]:
    """The stdout and stderr of `proc` once it exits; one that does not within `timeout` (hung), killed with
    its process group, fails the test."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the pack did not exit within {timeout} s of the signal: {stderr[-2000:]}")


@pytest.mark.parametrize("sent, images, extra", [
    ("SIGTERM", "small", ()),  # a scheduler's stop, to the pack process alone (Kubernetes, `kill`): processes
    ("SIGINT", "small", ()),  # Ctrl-C at a terminal: every process of the group
    ("SIGTERM", "large", ("--part", "1/2")),  # threads, one part of a pack (an array job preempted)
])
def test_pack_stopped_by_a_signal_ends_its_workers_leaves_no_scratch_and_resumes(sent, images, extra, tmp_path,
                                                                                 request):
    """Regression: SIGTERM ended the pack on the spot (Python's default): status -15 and no word; its worker
    processes were left to notice by themselves, its partial shard stayed in `.shardstream-tmp`. It now stops
    as Ctrl-C does: the workers ended before it exits, the partial shard dropped, a message naming the signal,
    the status 128 + its number (143; 130 for Ctrl-C), and `--resume` gives what an uninterrupted pack does."""
    psutil = pytest.importorskip("psutil")
    src = request.getfixturevalue("resume_source" if images == "small" else "large_source")
    reference = request.getfixturevalue("resume_reference" if images == "small" else "large_part_reference")
    dst = tmp_path / "ds"
    proc = _pack_under_way(src, dst, 2, *extra)
    workers = psutil.Process(proc.pid).children()
    assert bool(workers) == (images == "small")  # worker processes for small images, threads for large
    signum = getattr(signal, sent)
    if sent == "SIGINT":
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    _, stderr = _ended(proc)

    assert proc.returncode == 128 + signum, stderr[-2000:]
    stopped = "terminated (SIGTERM)" if sent == "SIGTERM" else "interrupted"
    assert stderr == f"shardstream pack: {stopped}; --resume continues from the last complete shard\n"
    assert not [w.pid for w in workers if psutil.pid_exists(w.pid)], "worker processes outlived the pack"
    assert not (dst / ".shardstream-tmp").exists(), sorted(p.name for p in (dst / ".shardstream-tmp").iterdir())
    assert 2 <= len(assert_no_partial_dataset(dst)) < len([n for n in reference if n.endswith(".tar.zst")])

    resumed = subprocess.run(_cli_pack(src, dst, 2, "--resume", *extra), capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT, env=_child_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert visible_files(dst) == reference, "resumed pack differs from an uninterrupted one"
    # No hidden file remains: no partial shard, no journal (a part's empty folders stay until the merge).
    hidden = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()
                    and p.relative_to(dst).as_posix()[0] == ".")
    assert not hidden, f"left behind: {hidden}"


_CTRL_C_AS_A_SHARD_FILE_IS_MADE = """
import os, signal, sys
import shardstream
import shardstream.shardfile as shardfile

made = []
scratch_file = shardfile.scratch_file

def interrupted(store, name):
    path, f = scratch_file(store, name)
    made.append(path)
    if len(made) == 3:  # the third shard's: two are out
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode, before its writer holds the file
    return path, f

shardfile.scratch_file = interrupted
shardstream.pack(sys.argv[1], sys.argv[2], shard_size="20KB", workers=1, progress=False)
"""


def test_pack_interrupted_as_a_shard_file_is_made_leaves_no_scratch(resume_source, tmp_path):
    """Regression: Ctrl-C (or SIGTERM, in the CLI) landing between the making of a shard's scratch file and its
    writer's holding it left the partial file in `.shardstream-tmp` (about one Ctrl-C in four, in the test
    above): the pack now removes its shards' scratch files by name when it stops."""
    dst = tmp_path / "ds"
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_AS_A_SHARD_FILE_IS_MADE, str(resume_source), str(dst)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=_child_env())
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
    assert len(assert_no_partial_dataset(dst)) == 2
    assert not (dst / ".shardstream-tmp").exists(), sorted(p.name for p in (dst / ".shardstream-tmp").iterdir())


_CTRL_C_IN_A_DEL_AS_THE_THIRD_SHARD_BEGINS = """
import os, signal, sys
import shardstream.cli as cli
import shardstream.shardfile as shardfile

made = []
scratch_file = shardfile.scratch_file

class Dropping:
    def __del__(self):  # Ctrl-C handled here, in a __del__: Python prints its exception and drops it
        os.kill(os.getpid(), signal.SIGINT)

def third(store, name):
    made.append(name)
    if len(made) == 3:
        Dropping()  # made and gone at once
    return scratch_file(store, name)

shardfile.scratch_file = third
sys.exit(cli.main(["pack", sys.argv[1], sys.argv[2], "--shard-size", "20KB", "--workers", "1", "--quiet"]))
"""


def test_a_ctrl_c_dropped_in_a_del_still_stops_the_pack(resume_source, tmp_path):
    """Regression (a clean-clone suite: a SIGINT to the pack's group, 118 of 120 shards to go, and the manifest
    written): Python runs a signal handler at the next bytecode, also in a `__del__` or a weakref callback,
    where the KeyboardInterrupt it raises is printed and dropped; the pack ran on to its end, and then said it
    was interrupted, with status 130. The CLI raises a dropped interrupt again, and the pack stops there."""
    dst = tmp_path / "ds"
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_DEL_AS_THE_THIRD_SHARD_BEGINS, str(resume_source),
                           str(dst)], capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=_child_env())
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-2000:]
    assert proc.stderr == "shardstream pack: interrupted; --resume continues from the last complete shard\n"
    assert 2 <= len(assert_no_partial_dataset(dst)) < 10
    assert not (dst / ".shardstream-tmp").exists(), sorted(p.name for p in (dst / ".shardstream-tmp").iterdir())


def test_pack_workers_leave_ctrl_c_to_the_pack(resume_source, resume_reference, tmp_path):
    """Regression: Ctrl-C signals every process of the terminal's group, in no set order. A pack worker that
    handled it first raised KeyboardInterrupt and printed its traceback (about one Ctrl-C in three), or, when
    the signal reached the workers alone, died and failed the pack. The pack process decides: a worker that
    gets SIGINT goes on, silent, and this pack finishes as if nothing happened."""
    psutil = pytest.importorskip("psutil")
    dst = tmp_path / "ds"
    proc = _pack_under_way(resume_source, dst, 2)
    workers = psutil.Process(proc.pid).children()
    assert workers
    for worker in workers:
        os.kill(worker.pid, signal.SIGINT)
    _, stderr = _ended(proc, timeout=CHILD_TIMEOUT)
    assert proc.returncode == 0 and not stderr, stderr[-2000:]
    assert visible_files(dst) == resume_reference


def test_pack_workers_end_when_the_pack_is_killed_outright(tmp_path):
    """SIGKILL of the pack process alone (the OOM killer, a scheduler stopping the main pid): its forked workers
    held the parent's ends of each other's pipes, never saw their tasks end, and lived on for good."""
    psutil = pytest.importorskip("psutil")
    from shardstream.synthetic import make_image_folder

    make_image_folder(tmp_path / "src", num_classes=4, images_per_class=15, size_range=((200, 150), (260, 200)))
    dst = tmp_path / "ds"
    pack = subprocess.Popen([sys.executable, "-m", "shardstream.cli", "pack", str(tmp_path / "src"), str(dst),
                             "--shard-size", "100KB", "--workers", "2", "--level", "19", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (dst.is_dir() and any(p.suffix == ".idx" for p in dst.iterdir())):  # its workers are at work
        assert pack.poll() is None and time.monotonic() < deadline, "the pack ended before it could be killed"
        time.sleep(0.01)
    workers = psutil.Process(pack.pid).children()
    assert workers
    os.kill(pack.pid, signal.SIGKILL)
    pack.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    for worker in alive:
        worker.kill()
    assert not alive


def test_a_pack_worker_that_dies_is_named_with_the_images_it_was_building(tmp_path, monkeypatch):
    """A worker ended outright (the OOM killer, a crashing decoder) gave "Broken pipe" about one time in three
    (the next job was sent to it before its end was read), and otherwise named no image."""
    from shardstream import ShardstreamError, framepool
    from shardstream.synthetic import make_image_folder

    make_image_folder(tmp_path / "src", num_classes=2, images_per_class=10, size_range=((60, 40), (80, 60)))
    build, parent, victim = framepool.build_job, os.getpid(), "class_001/img_00004.jpg"

    def dies_on_the_victim(job):
        if os.getpid() != parent and any(entry.path == victim for entry in job[1]):
            os._exit(3)
        return build(job)

    monkeypatch.setattr(framepool, "build_job", dies_on_the_victim)  # forked workers inherit it
    packing = sys.modules["shardstream.pack"]  # the module (shardstream.pack is the function)
    monkeypatch.setattr(packing, "pool_context", lambda: __import__("multiprocessing").get_context("fork"))
    for attempt in range(5):
        with pytest.raises(ShardstreamError, match=rf"exited unexpectedly \(exit code 3\) while building .*{victim}"):
            shardstream.pack(str(tmp_path / "src"), str(tmp_path / f"ds{attempt}"), shard_size="8KB", workers=2,
                             progress=False)


def test_the_fraction_cap_of_an_elastic_resume_counts_the_whole_epoch(tmp_path):
    """Regression (found by review): after a resume onto another layout, the default cap (1%
    of a worker's samples) was taken of what was left: 3 bad samples of 400 passed the run
    (cap 4) and its resume on the same layout, and failed its resume on 2 ranks (cap 1 of
    50 left) on every restart. The cap counts the worker's share of the whole epoch."""
    bad = {330, 340, 350}
    with shardstream.ShardWriter(str(tmp_path / "ds"), shard_size="40KB") as writer:
        for i in range(400):
            jpg = b"not an image\n" * 10 if i in bad else synthetic_jpeg(i, 16, 16, quality=70)
            writer.write({"__key__": f"s{i:03d}", "jpg": jpg})

    def dataset(rank: int = 0, world_size: int = 1) -> shardstream.StreamingDataset:
        return shardstream.StreamingDataset(str(tmp_path / "ds"), decode="rgb8", fields=("__key__", "jpg"),
                                            on_error="skip", rank=rank, world_size=world_size, batch_size=10,
                                            collate_fn=lambda batch: [key for key, _ in batch])

    ds = dataset()
    it = iter(ds)
    seen = [key for _ in range(30) for key in next(it)]
    state = ds.state_dict()
    it.close()
    rest = []
    for rank in range(2):
        resumed = dataset(rank, 2)
        resumed.load_state_dict(state)
        rest += [key for batch in resumed for key in batch]
    assert set(seen) | set(rest) == {f"s{i:03d}" for i in range(400)} - {f"s{i:03d}" for i in bad}


@pytest.mark.parametrize("settings", [{"max_skips": "5"}, {"max_skips": -3}, {"max_skips": True},
                                      {"max_fraction": float("nan")}, {"max_fraction": "0.5"}, {"max_fraction": 50}])
def test_an_error_policy_with_a_cap_that_is_no_number_is_refused_where_made(settings):
    """Regression (found by review): only `mode` was checked; a cap of "5", -3 or NaN failed at
    the first bad sample, hours into a run, as a bare TypeError or ValueError."""
    with pytest.raises(ValueError, match="max_skips is a count|max_fraction is a fraction"):
        shardstream.ErrorPolicy(mode="skip", **settings)
    assert shardstream.ErrorPolicy(mode="skip", max_skips=0, max_fraction=1).max_skips == 0


def test_samples_lost_to_a_bad_frame_are_named(tmp_path, caplog):
    """Regression (found by review): a frame whose checksum fails loses every sample in it,
    and neither the skips logged under on_error="skip" (4 alike lines, "byte 0: bad zstd
    frame 0") nor the error under "raise" named one. The skips name each sample, and the
    error the frame's first and last."""
    with shardstream.ShardWriter(str(tmp_path / "ds"), max_samples=4) as writer:
        for i in range(12):
            writer.write({"__key__": f"s{i:03d}", "bin": os.urandom(300)})
    shard = tmp_path / "ds" / "shard-000001.tar.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF  # within the shard's one frame
    shard.write_bytes(bytes(data))
    with pytest.raises(shardstream.CorruptShardError, match=r"frame 0 \(samples 's004' to 's007'\)"):
        list(StreamingDataset(str(tmp_path / "ds"), decode=None))
    caplog.set_level(logging.WARNING, logger="shardstream")
    ds = StreamingDataset(str(tmp_path / "ds"), decode=None, on_error=ErrorPolicy(mode="skip", max_fraction=1.0))
    assert len(list(ds)) == 12 and ds.skipped == 4
    logged = sorted(re.search(r"sample '(s\d+)'", r.getMessage())[1] for r in caplog.records
                    if "skipped bad sample" in r.getMessage())
    assert logged == ["s004", "s005", "s006", "s007"]


def test_a_worker_whose_whole_share_is_bad_names_the_last_sample(tmp_path):
    """Regression (found by review): a worker whose every sample failed (a bad frame held its
    share) raised "all 4 samples of this worker failed; nothing good to pad with", naming no
    shard or sample and reading as a cap passed; it names them now, and says no cap applies."""
    with shardstream.ShardWriter(str(tmp_path / "ds")) as writer:
        for i in range(4):
            writer.write({"__key__": f"s{i:03d}", "bin": os.urandom(300)})
    shard = tmp_path / "ds" / "shard-000000.tar.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    ds = StreamingDataset(str(tmp_path / "ds"), decode=None, on_error=ErrorPolicy(mode="skip", max_skips=100))
    with pytest.raises(TooManyErrors, match="whatever the caps") as raised:
        list(ds)
    assert raised.value.url == str(shard) and raised.value.key == "s003"
