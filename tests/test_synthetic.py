"""The synthetic image folders that the demo, tests and benchmarks pack."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shardstream.synthetic import make_image_folder

TINY = ((48, 40), (64, 48))


def test_same_images_for_any_number_of_workers(tmp_path):
    one = make_image_folder(tmp_path / "one", num_classes=2, images_per_class=6, size_range=TINY, workers=1)
    two = make_image_folder(tmp_path / "two", num_classes=2, images_per_class=6, size_range=TINY, workers=2)
    assert [p.relative_to(tmp_path / "one") for p in one] == [p.relative_to(tmp_path / "two") for p in two]
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in two]


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_started_either_way_write_the_folder(tmp_path, method):
    """Regression: the workers' parent-death check took the caller for their parent, which a forkserver
    worker's is not (the server is): every worker exited at once, and the pool started new ones forever."""
    code = ("import multiprocessing, sys; from shardstream.synthetic import make_image_folder; "
            f"multiprocessing.set_start_method({method!r}); "
            f"print(len(make_image_folder(sys.argv[1], num_classes=2, images_per_class=4, size_range={TINY!r}, "
            "workers=2)))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "images")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["8"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_end_with_a_parent_killed_outright(tmp_path):
    """A pool worker would otherwise wait on its task queue forever (its siblings hold the write end)."""
    code = ("import sys; from shardstream.synthetic import make_image_folder; "
            "make_image_folder(sys.argv[1], num_classes=4, images_per_class=10_000, workers=2)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "images")], start_new_session=True)
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert proc.poll() is None, "the generator ended before its pool started"
            assert time.monotonic() < deadline, "the pool's workers never started"
            workers = psutil.Process(proc.pid).children()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the parent alone, not its process group
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"pool workers outlived their parent: {alive}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def test_pool_workers_leave_ctrl_c_to_their_caller():
    """Regression: Ctrl-C reaches every process of a terminal's group, and each pool worker of `demo` (or
    tools/make_images.py) printed a KeyboardInterrupt traceback while its caller stopped the pool."""
    code = ("import signal; from shardstream.synthetic import _die_with; _die_with(None); "
            "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
