"""Memory bounds the docs state, measured: what a reader holds ahead, what a shard writer queues.

Peak memory is measured in a fresh Python process (`peak_growth`): its peak resident
memory (VmHWM) over a piece of work, less its resident memory before. The limits
asserted are a few times the documented bound, where the bugs they guard against
held many times more, so that the allocator's habits do not make them flaky.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import shardstream
from shardstream.reader import READ_BYTES
from shardstream.shardfile import _Appender

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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return int(done.stdout.split()[-1])


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
