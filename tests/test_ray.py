"""The Ray executor: the parts of a pack as Ray tasks on a local 2-CPU Ray instance.

Ray is an optional extra (`pip install 'shardstream[ray]'`); without it these tests skip.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

import shardstream as ss
from shardstream.synthetic import make_image_folder

ray = pytest.importorskip("ray")

# One worker runs this module under `pytest -n 2 --dist loadgroup` (.ci/run), so the local Ray instance
# (`local_ray`, a dozen processes) is started once, not once in each worker.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def local_ray():
    def read_fifos_too() -> None:
        # pack refuses what is not a regular file (a FIFO without a writer would stall it forever); in this
        # module's Ray workers it reads FIFOs, so that a test can stall a part in a read of one.
        import stat
        import types

        import shardstream.framebuild as fb

        fb.stat = types.SimpleNamespace(S_ISREG=lambda mode: stat.S_ISREG(mode) or stat.S_ISFIFO(mode))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": read_fifos_too})
    yield
    ray.shutdown()


def keys(url: str) -> list[str]:
    return sorted(s["__key__"] for ref in ss.open_dataset(url).shards for s in ref.reader())


def test_ray_parts_equal_a_single_pack(tmp_path, local_ray):
    from shardstream.executors import pack_with_ray

    make_image_folder(tmp_path / "src", num_classes=3, images_per_class=[7, 9, 5], size_range=((32, 24), (48, 40)))
    ss.pack(str(tmp_path / "src"), str(tmp_path / "single"), shard_size="8KB", progress=False)
    manifest, summaries = pack_with_ray(str(tmp_path / "src"), str(tmp_path / "ray"), parts=3, shard_size="8KB",
                                        progress=False)
    single = ss.open_dataset(str(tmp_path / "single")).manifest
    assert len(summaries) == 3
    assert keys(str(tmp_path / "ray")) == keys(str(tmp_path / "single"))
    assert (manifest.classes, manifest.class_counts) == (single.classes, single.class_counts)


def test_relative_paths_name_the_same_folders_in_the_ray_workers(tmp_path, local_ray, monkeypatch):
    """Regression (found by a user's walk through packing on a cluster): the tasks got `src` and
    `dst` as typed, and Ray's workers, started elsewhere, took them against their own working
    folder: "src: ... nothing is there (part 1 of 2)". Made absolute before they go."""
    from shardstream.executors import pack_with_ray

    make_image_folder(tmp_path / "src", num_classes=2, images_per_class=[4, 3], size_range=((32, 24), (48, 40)))
    monkeypatch.chdir(tmp_path)  # the workers were started in another folder (the module's Ray began there)
    manifest, _ = pack_with_ray("src", "packed", parts=2, progress=False)
    assert manifest.samples == 7 and keys(str(tmp_path / "packed")) == sorted(
        p.relative_to(tmp_path / "src").with_suffix("").as_posix() for p in (tmp_path / "src").rglob("*.jpg"))


def _reader_present(fifo: str) -> int | None:
    """A write end of `fifo` if some process has it open for reading (then its open() returns), else None."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise
        return None


def _wait_for_reader(fifo: str, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while (fd := _reader_present(fifo)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no part opened {fifo} in {timeout} s")
        time.sleep(0.05)
    return fd


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_failing_part_stops_the_others_before_the_call_returns(tmp_path, local_ray, monkeypatch):
    """Part 0 of 2 reads a file that is not an image; part 1 one that never ends (a named pipe
    with a writer that writes nothing), and blocks in a read no KeyboardInterrupt ends.
    Part 0's file is fed only once part 1 blocks. The call must raise naming part 0, and
    return only once part 1 has stopped: by then no process reads the pipe."""
    from shardstream import executors

    monkeypatch.setattr(executors, "CANCEL_GRACE_S", 0.5)  # the blocked part needs force anyway
    (tmp_path / "src" / "a").mkdir(parents=True)
    bad, endless = str(tmp_path / "src" / "a" / "0.jpg"), str(tmp_path / "src" / "a" / "1.jpg")
    os.mkfifo(bad)
    os.mkfifo(endless)
    held: list[int] = []

    def feed() -> None:
        try:
            held.append(_wait_for_reader(endless))  # part 1 is in its read now
        finally:  # part 0 is fed even if part 1 never started, so that the call ends
            fd = _wait_for_reader(bad)
            os.write(fd, b"not an image")
            os.close(fd)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        with pytest.raises(ss.PackError, match=r"0\.jpg: .*\(part 0 of 2\)") as info:
            executors.pack_with_ray(str(tmp_path / "src"), str(tmp_path / "ray"), parts=2, shuffle=False,
                                    progress=False)
        feeder.join(10)
        assert "1.jpg" not in str(info.value)
        assert held, "part 1 never started reading"
        with pytest.raises(BrokenPipeError):  # no reader left: part 1 has stopped
            os.write(held[0], b"x")
    finally:
        for fd in held:
            os.close(fd)  # a part still reading sees the end of its file, and fails


def test_parts_asking_for_more_cpus_than_any_node_has_still_run(tmp_path, local_ray):
    """Ray keeps a task no node can hold pending forever; with the driver's log off, the pack hung silently."""
    from shardstream.executors import pack_with_ray

    make_image_folder(tmp_path / "src", num_classes=2, images_per_class=[4, 3], size_range=((32, 24), (40, 32)))
    with pytest.warns(RuntimeWarning, match="no node of the Ray cluster has 3 CPUs"):
        manifest, _ = pack_with_ray(str(tmp_path / "src"), str(tmp_path / "ray"), parts=2, cpus_per_part=3,
                                    progress=False)
    assert manifest.samples == 7


def test_a_run_after_a_failed_one_keeps_the_finished_parts_and_starts_over_the_one_that_cannot_continue(
        tmp_path, local_ray):
    """Found by the forty-third session's walk: after a Ray pack failed on a bad image (one part finished, one
    failed, one never began), no rerun of the command worked but `--overwrite`, which packs every part again:
    a plain rerun was refused by the finished part ("already holds a dataset"), and `--resume` with the fix
    (`on_error="skip"`, or the image repaired) by the failed part ("cannot resume: the earlier pack differs ...
    run without resume to start over"), which one set of options for every part cannot do for one part."""
    from shardstream.executors import pack_with_ray

    src, dst = tmp_path / "src", str(tmp_path / "ray")
    make_image_folder(src, num_classes=3, images_per_class=[7, 9, 5], size_range=((32, 24), (48, 40)))
    broken = src / "class_001" / "img_00003.jpg"
    broken.write_bytes(broken.read_bytes()[:200])
    failed = []
    for part in range(3):  # by hand, as the failed run left it: the broken image's part failed, one finished
        try:
            ss.pack(str(src), dst, shard_size="8KB", part=(part, 3), progress=False)
        except ss.PackError:
            failed.append(part)
        if failed and part != failed[0]:
            break  # one part finished beside it; the third never began
    (bad,) = failed
    finished = next(p for p in range(3) if (tmp_path / "ray" / f"manifest.part-{p:05d}-of-00003.msgpack").exists())
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").glob(f"shard-p{finished:05d}-*")}
    with pytest.raises(ss.PackError, match=rf"parts {finished} of 3 are packed already, by an earlier run: --resume"):
        pack_with_ray(str(src), dst, parts=3, shard_size="8KB", on_error="skip", progress=False)
    with pytest.raises(ss.ShardstreamError, match="shard_size") as refused:  # a mistyped option: refused, as alone
        pack_with_ray(str(src), dst, parts=3, shard_size="9KB", on_error="skip", resume=True, progress=False)
    with pytest.warns(RuntimeWarning, match=rf"part {bad} of 3 was packed from its start, its earlier run differing as "
                                            r"the fix does: cannot resume: the earlier pack differs \(on_error "
                                            r"'fail' then, 'skip' now\)$"):
        manifest, _ = pack_with_ray(str(src), dst, parts=3, shard_size="8KB", on_error="skip", resume=True,
                                    progress=False)
    assert manifest.samples == 20 and [f for f, _ in manifest.skipped] == ["class_001/img_00003.jpg"]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").glob(f"shard-p{finished:05d}-*")} == kept
    assert len(keys(dst)) == 20
