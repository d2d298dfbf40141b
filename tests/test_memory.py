"""Memory bounds the docs state, measured: what a reader holds ahead, what a shard writer queues,
what pack's workers build ahead.

Peak memory is measured in a fresh Python process (`peak_growth`): its peak resident
memory (VmHWM) over a piece of work, less its resident memory before. The limits
asserted are a few times the documented bound, where the bugs they guard against
held many times more, so that the allocator's habits do not make them flaky.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shardstream
from shardstream.framepool import FRAMES_AHEAD, bytes_ahead
from shardstream.packplan import PackOptions, plan_frames
from shardstream.reader import READ_BYTES
from shardstream.shardfile import FRAME_SIZE, IMAGE_LEVEL, _Appender
from shardstream.sourcefile import SourceFile
from shardstream.synthetic import synthetic_jpeg

MB = 1 << 20
ROOT = str(Path(shardstream.__file__).resolve().parents[1])

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")


def peak_growth(setup: str, work: str) -> int:
    """Bytes by which a new Python process's peak resident memory grows over `work`, run
    after `setup` (both Python source)."""
    script = textwrap.dedent(setup) + textwrap.dedent("""
        def _status(key):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
        try:  # the peak from here on (Linux 4.0+); else since the start, a little more
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        _before = _status("VmRSS")
    """) + textwrap.dedent(work) + "\nprint(_status('VmHWM') - _before)\n"
    return int(run_python(script).split()[-1])


def run_python(script: str) -> str:
    """What a new Python process that runs `script` (Python source) prints."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_reading_compressible_samples_holds_about_prefetch_pieces(tmp_path):
    """`prefetch` pieces of up to 8 MB are read ahead, plus the one being yielded. A piece was cut by its
    compressed bytes alone, so a shard of well-compressed samples (arrays of zeros, masks, text) was one
    piece, held whole once decompressed: here 192 MB of samples stored in a few KB, for a bound of 24 MB."""
    with shardstream.ShardWriter(str(tmp_path / "ds")) as writer:
        for i in range(96):
            writer.write({"__key__": f"s{i:03d}", "bin": bytes(2 * MB), "cls": i % 2})
    prefetch = 2
    growth = peak_growth(f"""
        import shardstream
        dataset = shardstream.StreamingDataset({str(tmp_path / "ds")!r}, decode=None, prefetch={prefetch})
        dataset.counts()
    """, """
        count = sum(1 for _ in dataset)
        assert count == 96, count
    """)
    bound = (prefetch + 1) * READ_BYTES
    assert growth < 3 * bound, f"reading grew by {growth / MB:.0f} MB, for {bound / MB:.0f} MB of pieces"


def test_shard_writer_queues_frames_by_bytes_too():
    """Frames wait to be written in a queue of 8 frames (of about 1 MB) and of at most 16 MB: a frame
    holds at least one sample, and with 8 frames alone, pack's parent held 8 images of 20 MB (160 MB)
    waiting. Written into a pipe nobody reads yet, the frames put before `put` blocks are the one
    being written and those that fit in the queue."""
    read_end, write_end = os.pipe()
    digest = hashlib.sha256()
    frame_bytes = 12 * MB
    frame = bytes(frame_bytes)
    frames = 10
    drained: list[int] = []
    with os.fdopen(read_end, "rb", buffering=0) as reader, os.fdopen(write_end, "wb", buffering=0) as file:
        appender = _Appender(file, digest)
        accepted: list[int] = []

        def produce() -> None:
            for i in range(frames):
                appender.put(frame)
                accepted.append(i)

        producer = threading.Thread(target=produce)
        producer.start()
        settled, seen, deadline = 0, -1, time.monotonic() + 10
        while settled < 5 and time.monotonic() < deadline:  # until `put` has stopped returning
            time.sleep(0.05)
            settled, seen = (settled + 1, seen) if len(accepted) == seen else (0, len(accepted))
        held = len(accepted)

        def drain() -> None:
            while chunk := reader.read(1 << 20):
                drained.append(len(chunk))

        drainer = threading.Thread(target=drain)
        drainer.start()
        producer.join()
        appender.close()
        file.close()
        drainer.join()
    assert (held - 1) * frame_bytes <= 16 * MB, f"{held} frames of {frame_bytes // MB} MB taken"
    assert sum(drained) == frames * frame_bytes
    assert digest.hexdigest() == hashlib.sha256(frame * frames).hexdigest()


# Opens the images of `jobs` in order, holding the first open until the others have stopped
# (the other workers build ahead meanwhile), and says which were opened while it was held.
_FRAMES_AHEAD_SCRIPT = """
import json, os, sys, time
from shardstream import framepool
from shardstream.listing import list_source, look_up_files
from shardstream.packplan import PackOptions, order, plan_frames
from shardstream.shardfile import FRAME_SIZE, IMAGE_LEVEL

src, log_path, kind, budget = {src!r}, {log!r}, {kind!r}, {budget}
listing = list_source(src)
opts = PackOptions(256 << 20, None, "zstd", IMAGE_LEVEL, 0, False, FRAME_SIZE, "shard")
entries = order(listing, opts)
look_up_files(entries, listing.root)
planned = plan_frames(entries, opts)
jobs = [(frame.shard, frame.entries, listing.root, opts, False) for frame in planned]
job_bytes = [frame.size for frame in planned]
first = jobs[0][1][0].full_path(listing.root)
log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

def lines():
    with open(log_path) as f:
        return f.read().split()

def hold_first(event, args):
    # A slow first image: the open of its file waits until another image has been opened and
    # the opening has stopped for half a second (in the worker, thread or process, that opens it).
    if event != "open" or not isinstance(args[0], str) or not args[0].endswith(".jpg"):
        return
    os.write(log, (args[0] + "\\n").encode())
    if args[0] != first:
        return
    deadline, size, settled = time.monotonic() + 30, -1, 0
    while settled < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.stat(log_path).st_size
        settled, size = (settled + 1 if now == size and len(lines()) > 1 else 0), now
    os.write(log, b"released\\n")

sys.addaudithook(hold_first)
if kind == "threads":
    results = framepool.thread_results(jobs, 2, job_bytes, budget)
else:
    results = framepool.process_results(jobs, 2, framepool.pool_context(), job_bytes, budget)
got = [result.bytes_in for result in results]
opened = lines()
held = opened[1:opened.index("released")]
print(json.dumps({{"held": [os.path.getsize(path) for path in held], "got": got,
                  "planned": [sum(entry.size for entry in frame.entries) for frame in planned]}}))
"""


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_pack_builds_frames_ahead_bounded_by_bytes_too(tmp_path, kind):
    """The frames handed out beyond the one due were bounded in number alone, 4 per worker: while
    one image was slow, the other workers built and held the next frames, each of one whole image
    where images are large. With 64 workers and images of 20 MB, that was 256 frames, about 15 GB
    while built, and a big machine's pack was OOM-killed. Their planned bytes are bounded too now;
    the frame due always goes, one larger than the bound too. Here images of 2 MB (one a frame) and
    one of 6 MB, 2 workers, a bound of 5 MB: they held 7 frames (18 MB) while the first was slow."""
    budget = 5 * MB
    jpg = synthetic_jpeg(0, 64, 48)
    (tmp_path / "src" / "c").mkdir(parents=True)
    for i in range(8):
        size = 6 * MB if i == 4 else 2 * MB  # larger than the bound: it goes alone, when due
        # Zeros in the scan, before the end-of-image marker: a readable JPEG of `size` bytes.
        (tmp_path / "src" / "c" / f"{i}.jpg").write_bytes(jpg[:-2] + bytes(size - len(jpg)) + jpg[-2:])
    out = json.loads(run_python(_FRAMES_AHEAD_SCRIPT.format(
        src=str(tmp_path / "src"), log=str(tmp_path / "opened.log"), kind=kind, budget=budget)).splitlines()[-1])
    assert out["got"] == out["planned"], "every frame comes back, in plan order"
    assert out["held"], "no frame was built beside the slow one"
    assert sum(out["held"]) <= budget, f"{len(out['held'])} frames of {sum(out['held']) / MB:.0f} MB built ahead"


@pytest.mark.parametrize("sizes", ["photos", "just under a frame"])
def test_frames_of_small_images_are_bounded_by_number_before_bytes(sizes):
    """The bound on the bytes of the frames ahead must not slow packs of ordinary photos: a frame of
    images under a frame's size plans less than two frames' size, so any 4 x workers frames of them
    fit in `bytes_ahead(workers)`, and their packs run as before, bounded by the number of frames.
    Planned here for photos of 64 KB on average (ImageNet's mean is 110 KB) and for the worst case."""
    rng = np.random.default_rng(0)
    if sizes == "photos":
        files = rng.lognormal(np.log(50 << 10), 0.7, 20_000).astype(int).clip(1, FRAME_SIZE - 4096)
    else:  # two a frame, each just under a frame's size with its tar headers
        files = np.full(4_000, FRAME_SIZE - 4096)
    entries = [SourceFile(f"c/{i:05d}.jpg", f"c/{i:05d}", "jpg", 0, size=int(size)) for i, size in enumerate(files)]
    opts = PackOptions(256 << 20, None, "zstd", IMAGE_LEVEL, 0, False, FRAME_SIZE, "shard")
    planned = np.array([frame.size for frame in plan_frames(entries, opts)])
    for workers in (1, 2, 8, 64, 256):
        window = FRAMES_AHEAD * workers
        most = np.convolve(planned, np.ones(window, dtype=np.int64), "valid").max()
        assert most <= bytes_ahead(workers), f"{window} frames plan {most / MB:.0f} MB with {workers} workers"
