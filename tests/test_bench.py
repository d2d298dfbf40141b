"""`shardstream bench` and `shardstream.bench`: the knee finder, the command, the Python API.

Timings depend on the machine (and on whatever else runs on it), so nothing here
asserts a rate: only that every worker count was measured, the outputs are well
formed, and the knee is the one `find_knee` picks from the measured rates.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import shardstream
from shardstream import cli
from shardstream.bench import BenchResult, BenchRow, bench, find_knee, round_order
from shardstream.errors import ShardstreamError
from shardstream.peakmem import TreeRSS, proc_descendants
from shardstream.synthetic import make_image_folder, synthetic_jpeg

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADER = "num_workers | images/sec | MB/s | CPUs busy | first batch s | peak RSS MB"


# -- find_knee ------------------------------------------------------------------------------


def test_knee_flat_curve_is_the_smallest():
    assert find_knee({0: 500.0, 1: 500.0, 2: 500.0, 4: 500.0}) == 0


def test_knee_rising_then_plateau():
    assert find_knee({0: 100.0, 1: 190.0, 2: 370.0, 4: 700.0, 8: 720.0, 16: 715.0}) == 4


def test_knee_noisy_plateau_is_the_first_point_within_tolerance():
    # best 1000 (at 8); 960 at 4 is within 5% (>= 950), 930 at 2 is not.
    rates = {1: 500.0, 2: 930.0, 4: 960.0, 6: 1000.0 * 0.97, 8: 1000.0, 12: 985.0}
    assert find_knee(rates) == 4
    assert find_knee(rates, tolerance=0.08) == 2
    assert find_knee(rates, tolerance=0.0) == 8


def test_knee_monotonically_rising_is_the_last():
    assert find_knee({0: 100.0, 1: 200.0, 2: 300.0, 4: 400.0}) == 4


def test_knee_single_point():
    assert find_knee({3: 42.0}) == 3


def test_knee_does_not_depend_on_key_order_and_ignores_nan():
    assert find_knee({8: 1000.0, 0: 10.0, 4: 990.0, 2: 500.0}) == 4
    assert find_knee({0: float("nan"), 1: 10.0, 2: 10.2}) == 1


def test_knee_rejects_nonsense():
    with pytest.raises(ValueError):
        find_knee({})
    with pytest.raises(ValueError):
        find_knee({0: float("nan")})
    with pytest.raises(ValueError):
        find_knee({0: 1.0}, tolerance=1.0)


def test_result_table_json_and_knee():
    rows = [BenchRow(0, 100, 1.0, 100.0, 11.0, 0.5, 300.0, 1),
            BenchRow(2, 390, 1.0, 390.0, 42.9, 0.9, 700.0, 1),
            BenchRow(4, 400, 1.0, 400.0, None, 1.1, None, 1)]
    result = BenchResult("ds", 64, "train", "cpu", 1.0, 0.2, 1000, 110_000.0, "/proc", rows)
    assert result.knee == 2 and result.rates == {0: 100.0, 2: 390.0, 4: 400.0}
    lines = result.table().splitlines()
    assert lines[0] == HEADER and len(lines) == 2 + len(rows)
    assert lines[-1].split("|")[-1].strip() == "n/a"  # unknown memory
    assert str(result).endswith("knee: num_workers=2")
    data = json.loads(json.dumps(result.to_dict()))
    assert data["knee"] == 2 and [r["num_workers"] for r in data["rows"]] == [0, 2, 4]
    assert [c["num_workers"] for c in data["counts"]] == [0, 2, 4] and data["counts"][1]["images_per_s"] == 390.0
    assert result.diagnosis() is None  # no CPU readings


def _rows_with_cpu(busy_at_knee: float) -> list[BenchRow]:
    return [BenchRow(0, 100, 1.0, 100.0, None, 0.5, None, 1, cpus_busy=1.0),
            BenchRow(4, 390, 1.0, 390.0, None, 0.9, None, 1, cpus_busy=busy_at_knee),
            BenchRow(8, 400, 1.0, 400.0, None, 1.1, None, 1, cpus_busy=busy_at_knee + 0.1)]


def test_diagnosis_at_the_knee():
    def result(busy: float, cpus: int | None = 8) -> BenchResult:
        return BenchResult("ds", 64, "train", "cpu", 1.0, 0.2, None, None, "/proc", _rows_with_cpu(busy), cpus=cpus)

    bound = result(7.2)  # 90% of 8 CPUs at the knee (4 workers)
    assert bound.knee == 4
    assert bound.diagnosis().startswith("num_workers=4 kept 7.20 of 8 CPUs busy: CPU-bound")
    assert str(bound).splitlines()[-1] == bound.diagnosis()
    assert bound.table().splitlines()[2].split("|")[3].strip() == "1.00"
    assert "the decode on the GPU" in bound.diagnosis()
    on_device = result(7.2)
    on_device.transform = "train decoded on the device"
    assert "CPU-bound" in on_device.diagnosis() and "GPU" not in on_device.diagnosis()
    idle = result(3.1)
    assert "not CPU-bound" in idle.diagnosis() and "prefetch" in idle.diagnosis()
    rising = result(3.1)
    rising.rows = rising.rows[:2]  # the knee is the most workers measured, CPUs to spare
    assert rising.knee == 4 and "measure more workers" in rising.diagnosis()
    assert result(3.1, cpus=None).diagnosis() is None
    crowded = result(3.1)  # the bench kept 3.1 of 8 busy, the machine all but 0.4 of them
    crowded.rows[1].machine_busy = 7.6
    assert "other processes held 4.50 CPUs" in crowded.diagnosis() and "prefetch" not in crowded.diagnosis()
    alone = result(3.1)
    alone.rows[1].machine_busy = 3.3  # the machine as busy as the bench: its own limit is elsewhere
    assert "not CPU-bound" in alone.diagnosis()
    latency = result(3.1)
    latency.rows[1].io["readahead_waits"] = 12  # readers waited with their read-ahead at its largest: storage
    assert latency.diagnosis() == ("num_workers=4 kept 3.10 of 8 CPUs busy: not CPU-bound, and its readers waited 12 "
                                   "times for pieces with their read-ahead window at its largest: storage latency "
                                   "limits the rate. Raise prefetch (StreamingDataset(prefetch=...)), or use cache_dir.")
    latency.rows = latency.rows[:2]  # at the most workers measured too: more workers would wait the same
    assert "storage latency" in latency.diagnosis()


def test_diagnosis_where_one_process_is_the_knee():
    """Found by the forty-third session's walk: with raw bytes (`--transform none`) one process outran its
    workers (4,840 img/s against 2,705 and 2,463), and its 1.01 CPUs of 2 busy read "not CPU-bound ... The
    limit is elsewhere: the consuming loop, or the device", on `--device cpu`. One process uses one CPU."""
    rows = [BenchRow(0, 4840, 1.0, 4840.0, None, 0.1, None, 1, cpus_busy=1.01),
            BenchRow(1, 2705, 1.0, 2705.0, None, 0.2, None, 1, cpus_busy=1.6),
            BenchRow(2, 2463, 1.0, 2463.0, None, 0.3, None, 1, cpus_busy=1.9)]
    raw = BenchResult("ds", 64, "none", "cpu", 1.0, 0.2, None, None, "/proc", rows, cpus=2)
    assert raw.knee == 0
    assert raw.diagnosis() == (
        "num_workers=0 kept 1.01 of 2 CPUs busy: about all that the training process's one thread (the loop's, decoding "
        "and collating there too) can use, so the work per image there is the limit. The workers measured did "
        "worse: handing each batch over from a worker (raw bytes are pickled through a pipe) costs more than the "
        "work it takes off the loop.")
    close = [rows[0], BenchRow(1, 4990, 1.0, 4990.0, None, 0.2, None, 1, cpus_busy=1.6), rows[2]]
    near = BenchResult("ds", 64, "none", "cpu", 1.0, 0.2, None, None, "/proc", close, cpus=2)
    assert near.knee == 0 and near.diagnosis().endswith(  # 1 worker a little faster: within the tolerance
        "The workers measured did no better by more than 5% (the knee's tolerance): handing each batch over from "
        "a worker (raw bytes are pickled through a pipe) costs about what it takes off the loop.")
    alone = BenchResult("ds", 64, "train", "cpu", 1.0, 0.2, None, None, "/proc", rows[:1], cpus=2)
    assert alone.diagnosis().endswith("Measure workers (--workers 0,1,2), which take that work off the loop.")
    idle = BenchResult("ds", 64, "train", "cpu", 1.0, 0.2, None, None, "/proc",
                       [BenchRow(0, 100, 1.0, 100.0, None, 0.1, None, 1, cpus_busy=0.5), *rows[1:2]], cpus=2)
    assert idle.knee == 1 and "CPUs busy, and it is the most workers measured" in idle.diagnosis()  # as before


def test_diagnosis_under_a_cpu_quota():
    """Regression: under a cgroup's CPU quota (Docker --cpus, a Kubernetes limit) the affinity still names
    every CPU of the machine, so a rate bounded by the quota read "kept 0.5 of 2 CPUs busy: not CPU-bound...
    storage". The quota is the CPUs the rate is measured against now; the machine's CPUs stay the measure
    of how crowded it is."""
    rows = _rows_with_cpu(1.9)  # 1.9 CPUs busy at the knee (4 workers)
    quota = BenchResult("ds", 64, "train", "cpu", 1.0, 0.2, None, None, "/proc", rows, cpus=64, cpu_quota=2.0)
    assert quota.diagnosis().startswith("num_workers=4 kept 1.90 of 2 CPUs busy (the CPU quota of its cgroup): "
                                        "CPU-bound")
    assert json.loads(json.dumps(quota.to_dict()))["cpu_quota"] == 2.0
    loose = BenchResult("ds", 64, "train", "cpu", 1.0, 0.2, None, None, "/proc", rows, cpus=8, cpu_quota=16.0)
    assert loose.diagnosis().startswith("num_workers=4 kept 1.90 of 8 CPUs busy: not CPU-bound")


# -- rounds, and what the result says of its rows (built here: no timing) -------------------------------


def _row(num_workers: int, rate: float, round_: int = 1, *, first: float = 0.1, epochs: int = 1,
         **readings: Any) -> BenchRow:
    return BenchRow(num_workers, int(rate), 1.0, float(rate), None, first, None, epochs, round=round_, **readings)


def _result(rows: list[BenchRow], **settings: Any) -> BenchResult:
    return BenchResult("ds", settings.pop("batch_size", 64), settings.pop("transform", "train"), "cpu", 1.0, 0.2,
                       settings.pop("samples", None), None, "/proc", rows, **settings)


def test_rounds_alternate_the_order_of_the_counts():
    assert [round_order([0, 1, 2, 4], r) for r in (1, 2, 3, 4)] == [[0, 1, 2, 4], [4, 2, 1, 0]] * 2
    assert round_order((3,), 2) == [3]


def test_the_knee_is_found_from_each_counts_median():
    """Regression: the knee rested on one sample a count (knees of 1, 2, 2, 4 and 4 in five identical runs on a
    shared machine). One round's high rate at 1 worker does not make 1 the knee: its median does not."""
    rates = {0: [100, 104, 98], 1: [190, 420, 200], 2: [380, 390, 330], 4: [400, 385, 395]}
    rows = [_row(n, rates[n][r - 1], r) for r in (1, 2, 3) for n in round_order(list(rates), r)]
    result = _result(rows, rounds=3)
    assert find_knee({n: r[1] for n, r in rates.items()}) == 1  # round 2 alone
    assert result.rates == {0: 100, 1: 200, 2: 380, 4: 395} and result.knee == 2
    one = {c.num_workers: c for c in result.counts}[1]
    assert (one.rounds, one.low, one.high) == (3, 190, 420)
    lines = result.table().splitlines()
    assert [cell.strip() for cell in lines[0].split("|")][:3] == ["num_workers", "images/sec", "min-max"]
    assert [cell.strip() for cell in lines[3].split("|")][:3] == ["1", "200.0", "190-420"]
    assert result.legend().startswith("each figure the median of 3 rounds")
    data = json.loads(json.dumps(result.to_dict()))
    assert len(data["rows"]) == 12 and [c["images_per_s"] for c in data["counts"]] == [100, 200, 380, 395]
    two = _result(rows[:8], rounds=2)  # an even number of rounds: the mean of the middle two
    assert two.rates[1] == 305.0 and two.legend().startswith("each figure the median of 2 rounds")
    assert _result(rows[:4]).legend() is None and "min-max" not in _result(rows[:4]).table()


@pytest.mark.parametrize("cpus, quota", [(2, None), (8, None), (64, 1.5)])
def test_the_cpu_bound_verdict_follows_the_figure_printed(cpus, quota):
    """Regression: at the 85% threshold the diagnosis printed "kept 1.7 of 2 CPUs busy: not CPU-bound" (1.66,
    rounded to one place). The figure is printed as the table prints it, and judged as printed."""
    usable = min(cpus, quota or cpus)
    for step in range(201):
        busy = usable * (0.8 + step * 0.0005)
        text = _result([_row(0, 100, cpus_busy=busy)], cpus=cpus, cpu_quota=quota).diagnosis()
        printed = float(re.search(r"kept ([0-9.]+) of", text).group(1))
        assert printed == round(busy, 2)
        assert ("CPU-bound." in text and "not CPU-bound" not in text) == (printed >= 0.85 * usable - 1e-9), text
    flat = [_row(0, 1, cpus_busy=1.66), _row(1, 1, cpus_busy=1.66)]  # the knee 0, not the most measured
    assert "kept 1.66 of 2 CPUs busy: not CPU-bound" in _result(flat, cpus=2).diagnosis()
    assert "kept 1.70 of 2 CPUs busy: CPU-bound" in _result([_row(0, 1, cpus_busy=1.704)], cpus=2).diagnosis()


def test_diagnosis_names_storage_levers_for_remote_shards_only():
    """Regression: the fallback always said "storage (raise prefetch, use cache_dir)"; the cache serves remote
    shards alone, and local reads wait on no requests."""
    def result(local: bool | None, transform: str = "train", waits: int = 0) -> BenchResult:
        rows = [_row(0, 100, cpus_busy=1.0), _row(2, 390, cpus_busy=3.0, io={"readahead_waits": waits}),
                _row(4, 400, cpus_busy=3.1)]
        return _result(rows, transform=transform, cpus=8, local=local)

    local = result(True).diagnosis()
    assert "its shards are local" in local and "the consuming loop, or the device." in local
    assert "raise prefetch" not in local and "use cache_dir" not in local
    assert "raw bytes are pickled" in result(True, transform="none").diagnosis()
    assert "storage (raise prefetch, use cache_dir)" in result(False).diagnosis()
    assert result(None).diagnosis() == result(False).diagnosis()  # not known: as before
    assert result(True, waits=3).diagnosis().endswith("Raise prefetch (StreamingDataset(prefetch=...)).")
    assert result(False, waits=3).diagnosis().endswith("or use cache_dir.")
    # Measured with a cache already (found by review): not told to use one.
    cached = [_row(0, 100, cpus_busy=1.0), _row(2, 390, cpus_busy=3.0), _row(4, 400, cpus_busy=3.1)]
    assert "cache_dir" not in _result(cached, cpus=8, local=False, cache_dir="/nvme/cache").diagnosis()


def test_measure_more_workers_only_where_there_are_cpus_for_them():
    """Regression: "the most workers measured: measure more workers" fired at 4 workers on 2 CPUs; and a single
    count has no curve to find a knee on."""
    rows = [_row(0, 100, cpus_busy=1.0), _row(1, 200, cpus_busy=1.0), _row(4, 400, cpus_busy=1.2)]
    assert "measure more workers" in _result(rows, cpus=8).diagnosis()
    for crowded in (_result(rows, cpus=2), _result(rows, cpus=64, cpu_quota=1.5)):
        assert "measure more workers" not in crowded.diagnosis() and "not CPU-bound" in crowded.diagnosis()
    # One count, with CPUs to spare: more may pay (found by review: it read "the limit is the consuming loop").
    single = _result([_row(2, 400, cpus_busy=1.2)], cpus=8)
    assert "measure more workers" in single.diagnosis()
    assert any("there is no curve to find a knee on" in note for note in single.notes())
    assert not any("no curve" in note for note in _result(rows, cpus=8).notes())
    # A run stopped after its first count measured several, as planned: the partial note says so.
    stopped = _result([_row(0, 100, cpus_busy=1.0)], cpus=8, workers=[0, 1, 2, 4], partial=True)
    assert not any("no curve" in note for note in stopped.notes())
    assert any(note.startswith("partial: stopped after 1 of the 4 measurements") for note in stopped.notes())


def test_every_round_is_checked_for_other_processes():
    """Regression: contention was checked on the knee's row alone; a row below the knee that other processes
    disturbed reads low and can move the knee up. Every row is checked, and the note names count and round."""
    quiet = {"cpus_busy": 1.0, "machine_busy": 1.1}
    rows = [_row(0, 100, 1, **quiet), _row(1, 150, 1, cpus_busy=1.0, machine_busy=7.5), _row(2, 380, 1, **quiet),
            _row(2, 390, 2, **quiet), _row(1, 190, 2, **quiet), _row(0, 104, 2, **quiet)]
    result = _result(rows, cpus=8, rounds=2)
    assert result.knee == 2
    (note,) = [n for n in result.notes() if n.startswith("other processes")]
    assert "num_workers=1 (round 1)" in note and "num_workers=0" not in note
    assert "below the knee (num_workers=1) that can move the knee up" in note
    assert [row["disturbed_by"] for row in result.to_dict()["rows"]] == [None, 6.5, None, None, None, None]
    rows[1].machine_busy, rows[3].machine_busy = 1.1, 7.5  # disturbed above (at) the knee: it cannot move it up
    (note,) = [n for n in _result(rows, cpus=8, rounds=2).notes() if n.startswith("other processes")]
    assert "num_workers=2 (round 2)" in note and "move the knee" not in note
    assert not [n for n in _result(rows[:1], cpus=8).notes() if n.startswith("other processes")]


def test_rows_that_measured_epoch_restarts_are_named():
    """A dataset smaller than a batch a worker, or with epochs so short that a window holds several, measures
    their starts as much as steady streaming. Counted in epochs (found by a walk: the time between epochs,
    which holds the batches workers made meanwhile, read as 62% of a window at 4 workers where the rate per
    busy CPU lost 5-10%). The diagnosis then says there is no steady rate to diagnose."""
    rows = [_row(0, 100, epochs=30, restart_s=0.3), _row(1, 100, epochs=2, restart_s=0.05),
            _row(1, 100, 2, epochs=9, restart_s=0.12), _row(4, 100, epochs=50, restart_s=0.9)]
    notes = _result(rows, batch_size=8, samples=20, rounds=2).notes()
    assert any("fewer than a batch of 8 for each worker at num_workers=4:" in note for note in notes)
    (short,) = [note for note in notes if note.startswith("epochs are short")]
    assert "a measurement's window held up to 30 at num_workers=0, 9 at num_workers=1 of them" in short
    assert "num_workers=4" not in short  # said already: smaller than a batch a worker
    assert not [note for note in _result(rows[1:2]).notes() if note.startswith("epochs are short")]
    small = _result([_row(0, 100, epochs=30, cpus_busy=0.9), _row(1, 90, epochs=30, cpus_busy=0.9)], cpus=2,
                    batch_size=64, samples=20)
    assert "fewer than a batch for each worker, so the rate is of epochs ending and starting" in small.diagnosis()


def test_storage_counters_are_shown_for_remote_shards():
    io = {"requests": 10, "bytes": 5e6, "remote_bytes": 2e6, "retries": 0, "wait_s": 4.0, "readahead_waits": 0}
    rows = [_row(2, 300, 1, io=dict(io)), _row(2, 310, 2, io=dict(io, retries=3, readahead_waits=2))]
    remote = _result(rows, rounds=2, local=False)
    table = remote.io_table()
    assert [cell.strip() for cell in table.splitlines()[0].split("|")] == [
        "num_workers", "requests", "MB read", "MB from store", "retries", "read-ahead waits", "wait s (all threads)"]
    assert [cell.strip() for cell in table.splitlines()[2].split("|")] == ["2", "10", "5.0", "2.0", "3", "1", "4.00"]
    assert "MB read counts cached copies' reads too" in table
    assert "wait s sums the time each reading thread spent in storage calls" in table and table in str(remote)
    assert "the store failed requests, and they were retried: 3 at num_workers=2" in "\n".join(remote.notes())
    assert "cache hits" in _result(rows, local=False, cache_dir="/c").io_table()
    local = _result(rows, rounds=2, local=True)
    assert local.io_table() is None and any("read-ahead window" in note for note in local.notes())
    assert [row["io"]["retries"] for row in local.to_dict()["rows"]] == [0, 3]


def test_the_plot_title_says_what_was_measured():
    assert _result([]).title() == "ds: transform=train, batch 64, cpu"
    assert _result([], decode_threads=2, prefetch=8).title() == ("ds: transform=train, batch 64, cpu, "
                                                                 "2 decode threads, prefetch 8")


@pytest.mark.parametrize("layout", ["v2", "v1", "v1-container"])
def test_cpu_quota_from_cgroups(tmp_path, layout):
    from shardstream.cpus import cpu_quota as _cpu_quota

    mount = tmp_path / "sys"
    if layout == "v2":  # the least along the path: the pod's 1.5 CPUs below the node's "max"
        proc = "0::/kubepods/pod1/ctr\n"
        for folder, limit in (("", "max 100000"), ("kubepods/pod1", "150000 100000"), ("kubepods/pod1/ctr", "max")):
            (mount / folder).mkdir(parents=True, exist_ok=True)
            (mount / folder / "cpu.max").write_text(limit + "\n")
    else:  # v1; in a container the mount is the container's own cgroup, named from the host's root
        proc = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"
        top = mount / "cpu,cpuacct" / ("" if layout == "v1-container" else "docker/abc")
        top.mkdir(parents=True)
        (top / "cpu.cfs_quota_us").write_text("50000\n")
        (top / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cgroup").write_text(proc)
    assert _cpu_quota(str(tmp_path / "cgroup"), str(mount)) == (1.5 if layout == "v2" else 0.5)
    (tmp_path / "none").write_text("0::/\n")
    assert _cpu_quota(str(tmp_path / "none"), str(tmp_path / "empty")) is None
    assert _cpu_quota(str(tmp_path / "missing"), str(mount)) is None


def test_the_cpus_a_process_may_use_are_its_affinitys_or_its_quotas(monkeypatch):
    """Found by a walk of the Kubernetes recipe: pack's default workers were `os.cpu_count()`, the machine's,
    so a pod limited to 4 CPUs of a 128-core node started 128. The affinity, or the quota where less."""
    from shardstream import cpus

    monkeypatch.setattr(cpus, "cpus_here", lambda: 128)
    monkeypatch.setattr(cpus, "cpu_quota", lambda: 3.5)
    assert cpus.usable_cpus() == 4
    monkeypatch.setattr(cpus, "cpu_quota", lambda: None)
    assert cpus.usable_cpus() == 128
    monkeypatch.setattr(cpus, "cpus_here", lambda: 1)  # `taskset -c 0`
    assert cpus.usable_cpus() == 1


def test_a_bench_reads_the_machines_cpus_beside_its_own():
    """Regression: bench counted only its own processes' CPU, and blamed storage for a rate that other
    processes, holding the CPUs, bounded. Each row now has the machine-wide reading too (Linux)."""
    from shardstream.bench import _machine_busy_seconds

    if _machine_busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    start = _machine_busy_seconds()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # this process alone keeps one CPU busy for 0.3 s
        pass
    assert _machine_busy_seconds() - start >= 0.25


# -- the command and the function, on a tiny packed dataset ------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("bench")
    make_image_folder(root / "src", num_classes=2, images_per_class=8, size_range=((64, 48), (96, 80)))
    shardstream.pack(str(root / "src"), str(root / "ds"), progress=False, workers=1)
    return str(root / "ds")


def run_cli(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardstream.cli", "bench", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


def check_json(path: Path, workers: list[int], rounds: int = 1) -> dict:
    data = json.loads(path.read_text())
    # Every round's rows, in the order measured: the counts as given, then reversed, ...
    assert [(row["round"], row["num_workers"]) for row in data["rows"]] == [
        (r, n) for r in range(1, rounds + 1) for n in round_order(workers, r)]
    assert data["rounds"] == rounds and data["workers"] == workers and data["partial"] is False
    for row in data["rows"]:
        assert {"requests", "bytes", "retries", "wait_s", "readahead_waits"} <= set(row["io"])
        assert 0 <= row["restart_s"] <= row["seconds"]
        assert row["images"] > 0 and row["images_per_s"] > 0 and row["seconds"] > 0
        assert row["mb_per_s"] > 0 and row["first_batch_s"] > 0 and row["epochs"] >= 1
        assert row["peak_rss_mb"] is None or row["peak_rss_mb"] > 0
        assert row["cpus_busy"] is None or 0 < row["cpus_busy"] <= data["cpus"] + 0.5  # readings have jitter
    assert data["cpus"] >= 1
    assert data["samples"] == 16 and data["bytes_per_sample"] > 0
    for count in data["counts"]:  # each count's figures are its rounds' medians
        rates = [row["images_per_s"] for row in data["rows"] if row["num_workers"] == count["num_workers"]]
        assert count["rounds"] == rounds and count["images_per_s"] == statistics.median(rates)
        assert (count["low"], count["high"]) == (min(rates), max(rates))
    assert [count["num_workers"] for count in data["counts"]] == workers
    assert data["knee"] == find_knee({count["num_workers"]: count["images_per_s"] for count in data["counts"]})
    return data


def test_cli_bench_table_knee_and_json(tiny, tmp_path):
    done = run_cli(tiny, "--workers", "0,1", "--rounds", "2", "--seconds", "0.5", "--warmup", "0.2", "--json",
                   "out.json", "--batch-size", "4", cwd=tmp_path)  # a batch for each worker: a rate to diagnose
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [cell.strip() for cell in lines[0].split("|")] == [
        "num_workers", "images/sec", "min-max", "MB/s", "CPUs busy", "first batch s", "peak RSS MB"]
    assert [line.split("|")[0].strip() for line in lines[2:4]] == ["0", "1"]  # a line a count, not a round
    assert lines[4].startswith("each figure the median of 2 rounds")
    data = check_json(tmp_path / "out.json", [0, 1], rounds=2)
    assert f"knee: num_workers={data['knee']}" in lines
    diagnosis = lines[lines.index(f"knee: num_workers={data['knee']}") + 1]
    assert diagnosis.startswith(f"num_workers={data['knee']} kept ") and f"of {data['cpus']} CPUs busy" in diagnosis
    assert "bench" in done.stderr  # the progress bar


def test_cli_bench_plot(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    done = run_cli(tiny, "--rounds", "1", "--workers", "0", "--seconds", "0.3", "--warmup", "0.1",
                   "--transform", "none",
                   "--plot", "curve.png", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_bench_measures_with_the_prefetch_and_cache_it_is_given(tiny, tmp_path, monkeypatch, capsys):
    """`--prefetch N` and `--cache-dir DIR --cache-limit SIZE` (what the diagnosis says to raise, or use,
    where readers waited on storage) reach every dataset the bench makes, and the result says what it
    measured with."""
    from shardstream.dataset import StreamingDataset

    given = []
    original = StreamingDataset.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        given.append((self.prefetch, (self._cache.root, self._cache.limit) if self._cache else None))

    monkeypatch.setattr(StreamingDataset, "__init__", recording)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", tiny, "--rounds", "1", "--workers", "0,1", "--seconds", "0.2", "--warmup", "0",
                     "--transform", "none",
                     "--prefetch", "5", "--cache-dir", "cache", "--cache-limit", "1MB", "--json", "out.json",
                     "--quiet"]) == 0
    cache = (str(tmp_path / "cache"), 1_000_000)
    assert given[0] != (5, cache) and len(given) >= 3 and set(given[1:]) == {(5, cache)}  # the probe aside, all
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["prefetch"] == 5 and data["cache_dir"] == "cache" and data["local"] is True
    assert "cache_dir cache keeps remote shards only" in capsys.readouterr().out  # this dataset is local
    for bad, said in ((["--prefetch", "-2"], "--prefetch"), (["--cache-limit", "1GB"], "--cache-limit goes with"),
                      (["--cache-dir", "c", "--cache-limit", "lots"], "bad size"), (["--rounds", "0"], "--rounds")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", tiny, *bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, bad


def test_cli_bench_plot_without_matplotlib(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.chdir(tmp_path)
    status = cli.main(["bench", tiny, "--rounds", "1", "--workers", "0", "--seconds", "0.3", "--warmup", "0.1",
                       "--transform", "val",
                       "--plot", "curve.png", "--json", "out.json", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "matplotlib is not installed" in err and "shardstream[plot]" in err
    assert not (tmp_path / "curve.png").exists()
    assert out.splitlines()[0] == HEADER and "knee: num_workers=0" in out
    check_json(tmp_path / "out.json", [0])


def test_cli_bench_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", str(tmp_path), "--workers", "0,x"])
    assert exit_.value.code == 2 and "counts from 0 to" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", str(tmp_path), "--workers", "0,2,0"])
    assert exit_.value.code == 2 and "each worker count once" in capsys.readouterr().err
    assert cli.main(["bench", str(tmp_path / "nothing"), "--workers", "0", "--quiet"]) == 1
    assert capsys.readouterr().err.startswith("shardstream bench: error:")
    # infinity passed `> 0`, then failed in a comparison with None: refused by the parser, or the bench
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", str(tmp_path), "--workers", "0", "--seconds", "inf", "--quiet"])
    assert exit_.value.code == 2
    # Regression: a bad --warmup, or options that do not go together, exited 1 (an error on the data), not 2
    # (a usage error) as README says and as the other options' values do.
    for bad in (["--warmup", "inf"], ["--warmup", "-1"], ["--warmup", "nan"],
                ["--transform", "none", "--decode-on-device"], ["--transform", "none", "--decode-threads", "2"],
                ["--decode-on-device", "--decode-threads", "2"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", str(tmp_path), "--workers", "0", "--quiet", *bad])
        assert exit_.value.code == 2, bad
        assert "usage:" in capsys.readouterr().err


def _image_tars(folder, field: str) -> str:
    """Two tars of 8 small JPEGs each under `field`, no labels; their brace pattern."""
    import io
    import tarfile

    from PIL import Image

    for s in range(2):
        with tarfile.open(folder / f"shard-{s:03d}.tar", "w") as tf:
            for i in range(8):
                data = io.BytesIO()
                Image.new("RGB", (40, 30), (s, i, 0)).save(data, format="JPEG")
                info = tarfile.TarInfo(f"s{s}_{i}.{field}")
                info.size = len(data.getvalue())
                tf.addfile(info, io.BytesIO(data.getvalue()))
    return str(folder / "shard-{000..001}.tar")


def test_bench_of_tars_without_labels(tmp_path):
    """Other tools' tars named by a brace pattern, without `cls`: bench asked for `cls` and failed."""
    result = bench(_image_tars(tmp_path, "jpg"), rounds=1, workers=[0], batch_size=4, transform="train", seconds=0.3,
                   warmup=0.0)
    assert result.rows[0].images > 0


def test_bench_of_images_in_another_field(tmp_path):
    """Regression (found by a user's walk adopting WebDataset data): tars holding `.jpeg` members were refused
    ("no field 'jpg;png;webp'"), with advice (`fields=`) that bench had no option for."""
    (tmp_path / "jpeg").mkdir()
    result = bench(_image_tars(tmp_path / "jpeg", "jpeg"), rounds=1, workers=[0], batch_size=4, transform="val",
                   seconds=0.3, warmup=0.0)
    assert result.rows[0].images > 0
    (tmp_path / "bmp").mkdir()
    pattern = _image_tars(tmp_path / "bmp", "bmp")  # JPEG bytes: decoders go by the bytes, the field by its name
    with pytest.raises(ShardstreamError, match="no field 'jpg;jpeg;png;webp'"):
        bench(pattern, workers=[0], batch_size=4, transform="val", seconds=0.3, warmup=0.0)
    result = run_cli(pattern, "--rounds", "1", "--workers", "0", "--batch-size", "4", "--transform", "val", "--seconds",
                     "0.3", "--warmup", "0", "--image-field", "bmp", "--quiet", cwd=tmp_path)
    assert result.returncode == 0 and "knee: num_workers=0" in result.stdout, result.stderr
    with pytest.raises(ShardstreamError, match="image_field 'image': an image field is named by its format"):
        bench(pattern, workers=[0], image_field="image")



def test_an_image_field_the_dataset_lacks_is_named_as_the_option(tiny):
    """Found by the forty-third session's walk: `bench --image-field png` over JPEGs said "no shard has the field
    'png' that fields= names", an argument bench does not have."""
    with pytest.raises(ShardstreamError, match=r"image_field 'png' \(--image-field\): no shard has it; the "
                                               r"dataset's fields are \['cls', 'jpg'\]"):
        bench(tiny, workers=[0], image_field="png", seconds=0.3, warmup=0.0)


def test_bench_of_a_dataset_where_only_some_samples_are_labelled(tmp_path):
    """Regression: a dataset whose manifest has classes, but not for every sample (FORMAT.md:
    labels are -1 where a sample has none), was read without fault, and the bench asked every
    sample for `cls`: MissingFieldError. It measures such a dataset without labels."""
    with shardstream.ShardWriter(str(tmp_path / "ds")) as writer:
        for i in range(16):
            writer.write({"__key__": f"s{i:03d}", "jpg": synthetic_jpeg(i, 40, 30), **({"cls": i % 3} if i % 2 else {})})
    result = bench(str(tmp_path / "ds"), rounds=1, workers=[0], batch_size=4, transform="val", seconds=0.3, warmup=0.0)
    assert result.rows[0].images > 0


def test_bench_function(tiny):
    rows = []
    result = bench(tiny, workers=(1, 0), batch_size=4, transform="train", seconds=0.3, warmup=0.1, rounds=2,
                   on_row=rows.append)
    # Each round measures every count once, the second in the other order.
    assert [(r.round, r.num_workers) for r in result.rows] == [(1, 1), (1, 0), (2, 0), (2, 1)] and rows == result.rows
    assert result.rounds == 2 and result.seconds == 0.3 and result.local is True
    assert all(r.images > 0 and r.images % 4 == 0 for r in result.rows)  # 16 samples: whole batches of 4
    assert result.knee == find_knee(result.rates)
    assert result.bytes_per_sample == pytest.approx(
        sum(s.bytes for s in shardstream.open_dataset(tiny).manifest.shards) / 16)
    assert json.loads(json.dumps(result.to_dict()))["knee"] == result.knee
    # The workers of every run are shut down before bench returns.
    assert not [p for p in TreeRSS().descendants() if _is_python_child(p)]


def _is_python_child(pid: int) -> bool:
    """A Python process, other than those multiprocessing keeps for the whole session once any
    test has started a process by spawn or forkserver: the resource tracker, and the fork server."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"python" in cmdline and b"resource_tracker" not in cmdline and b"forkserver" not in cmdline


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_a_worker_killed_mid_bench_is_named_in_one_line(tiny, tmp_path, monkeypatch):
    """Regression: a worker killed outright (the out-of-memory killer, a crash in a decoder) ended the command
    with a 60-line traceback through torch's signal handler, or a bare "Connection reset by peer" (killed
    while it handed over a batch), instead of an error naming the worker count and the signal. The worker
    kills itself, in its third batch's collate: a kill from a thread of the test landed once while the
    worker held the lock of an event torch shares with this process, which then waited on it forever
    (torch's hazard with any kill, rare; not this test's question)."""
    import signal

    import torch.utils.data

    from shardstream import bench as bench_module

    collate, batches, pid_file = bench_module._list_collate, [0], tmp_path / "killed"

    def dies_in_its_third_batch(batch: list) -> list:
        batches[0] += 1  # this process's count: each forked worker has its own
        if batches[0] == 3 and torch.utils.data.get_worker_info() is not None:
            pid_file.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return collate(batch)

    monkeypatch.setattr(bench_module, "_list_collate", dies_in_its_third_batch)
    before = set(TreeRSS().descendants())
    with pytest.raises(ShardstreamError) as error:
        bench(tiny, rounds=1, workers=[1], batch_size=4, transform="none", seconds=60, warmup=0.0)
    assert str(error.value) == (f"num_workers=1: DataLoader worker (pid {pid_file.read_text()}) killed by SIGKILL "
                                "(killed outright: by the out-of-memory killer, or a crash in native code "
                                "such as a decoder)")
    assert not [p for p in TreeRSS().descendants() if p not in before and _is_python_child(p)]


def test_bad_data_met_in_a_bench_worker_is_one_line_without_the_workers_traceback(tmp_path, capsys):
    """Found by the forty-third session's walk: `bench --workers 2,1` over a damaged shard printed its error,
    then the DataLoader worker's whole traceback (60 lines, the note `shardstream.DataLoader` adds for
    programs' logs), where `--workers 0` printed the error alone."""
    bad = tmp_path / "bad"
    make_image_folder(tmp_path / "src", num_classes=2, images_per_class=8, size_range=((64, 48), (96, 80)))
    shardstream.pack(str(tmp_path / "src"), str(bad), progress=False, workers=1, shard_size="20KB")
    shard = sorted(bad.glob("*.tar.zst"))[-1]  # not the first: its first sample is read here, to check the fields
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    status = cli.main(["bench", str(bad), "--workers", "2,1", "--rounds", "1", "--seconds", "0.5", "--warmup", "0",
                       "--quiet"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"shardstream bench: error: .*shard-\d+\.tar\.zst, byte \d+: bad zstd frame [^\n]*\n"
                        r"  Raised in DataLoader worker process 0\n", err), err


def test_a_bench_over_http_keeps_the_token_and_password_out_of_its_result(tiny, tmp_path):
    """Regression: the result named the dataset as given, so the JSON (made to be shared) and the plot's
    title held an HTTP URL's password and its query string (a token, a signature) whole."""
    from shardstream import http_ranges
    from shardstream.benchresult import save_json
    from shardstream.testing import HTTPTestServer

    with HTTPTestServer(tiny) as server:
        url = server.url.replace("http://", "http://alice:s3cret@") + "/?sig=TOKEN123"
        result = bench(url, rounds=1, workers=[0], batch_size=4, transform="none", seconds=0.2, warmup=0.0)
        http_ranges._pool.get().clear()  # the server's keep-alive handlers end
    save_json(result, tmp_path / "out.json")
    saved = (tmp_path / "out.json").read_text()
    assert result.dataset == server.url.replace("http://", "http://***@") + "/?..."
    assert "s3cret" not in saved and "TOKEN123" not in saved and json.loads(saved)["dataset"] == result.dataset


def test_a_bench_over_http_counts_its_storage_work_and_caches(tiny, tmp_path):
    """Remote shards: every row keeps the dataset's storage counters over its window, the text shows them
    (wait s said to sum the reading threads), and `cache_dir` (the diagnosis's advice) can be tried."""
    from shardstream import http_ranges
    from shardstream.shared import IO_FIELDS
    from shardstream.testing import HTTPTestServer

    with HTTPTestServer(tiny) as server:
        result = bench(server.url, rounds=2, workers=[0], batch_size=4, transform="none", seconds=0.2, warmup=0.0,
                       cache_dir=str(tmp_path / "cache"), cache_limit="10MB")
        http_ranges._pool.get().clear()  # the server's keep-alive handlers end
    assert result.local is False and result.cache_dir == str(tmp_path / "cache")
    assert [r.round for r in result.rows] == [1, 2] and all(set(IO_FIELDS) <= set(r.io) for r in result.rows)
    assert any(files for _, _, files in os.walk(tmp_path / "cache"))  # the shards were cached
    assert "wait s (all threads)" in str(result) and "cache misses" in str(result)


def test_bench_with_the_decode_on_the_device_side(tiny):
    """Without CUDA the device side decodes on the CPU: the same images reach the consumer,
    so the rows count whole batches, and the result says which path it measured."""
    result = bench(tiny, rounds=1, workers=[0, 1], batch_size=4, transform="train", seconds=0.3, warmup=0.1,
                   decode_on_device=True)
    assert [r.num_workers for r in result.rows] == [0, 1]
    assert all(r.images > 0 and r.images % 4 == 0 for r in result.rows)
    assert result.transform == "train decoded on the device"
    with pytest.raises(ShardstreamError, match="decode_on_device"):
        bench(tiny, workers=[0], transform="none", decode_on_device=True)


def test_bench_with_decode_threads(tiny):
    """Each iterating process decodes in threads (the main one at 0 workers, the worker at 1): whole batches
    reach the consumer, the result says how many threads, and the combinations with nothing to decode in
    threads are refused."""
    result = bench(tiny, rounds=1, workers=[0, 1], batch_size=4, transform="val", seconds=0.3, warmup=0.1,
                   decode_threads=2)
    assert [r.num_workers for r in result.rows] == [0, 1]
    assert all(r.images > 0 and r.images % 4 == 0 for r in result.rows)
    assert result.decode_threads == 2 and result.to_dict()["decode_threads"] == 2
    for bad in ({"transform": "none"}, {"decode_on_device": True}):
        with pytest.raises(ShardstreamError, match="decode_threads"):
            bench(tiny, workers=[0], decode_threads=2, **bad)
    with pytest.raises(ShardstreamError, match="decode_threads"):
        bench(tiny, workers=[0], decode_threads=-1)


def test_bench_raw_bytes_counts_mb(tiny):
    result = bench(tiny, rounds=1, workers=[0], batch_size=5, transform="none", seconds=0.3, warmup=0.0)
    (row,) = result.rows
    assert row.images > 0 and row.mb_per_s == pytest.approx(row.images_per_s * result.bytes_per_sample / 1e6)


def test_bench_rejects_bad_arguments(tiny):
    with pytest.raises(ShardstreamError, match="transform"):
        bench(tiny, transform="random")
    for rounds in (0, 1.5):
        with pytest.raises(ShardstreamError, match="rounds must be 1 or more"):
            bench(tiny, rounds=rounds)
    with pytest.raises(ShardstreamError, match="prefetch must be 0 or more"):
        bench(tiny, prefetch=-1)
    with pytest.raises(ShardstreamError, match="workers"):
        bench(tiny, workers=[-1])
    with pytest.raises(ShardstreamError, match="workers"):
        bench(tiny, workers=[])
    with pytest.raises(ShardstreamError, match="each count once"):  # regression: rows the knee did not read
        bench(tiny, workers=[0, 2, 0])
    # Regression: a bad tolerance failed in the knee, once every worker count had been measured.
    for tolerance in (5, -0.1, float("nan")):
        started = time.monotonic()
        with pytest.raises(ShardstreamError, match="tolerance"):
            bench(tiny, workers=[0, 1], seconds=30, tolerance=tolerance)
        assert time.monotonic() - started < 10


def test_bench_cuda_unavailable(tiny):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ShardstreamError, match="CUDA is not available"):
        bench(tiny, workers=[0], device="cuda")


# Ctrl-C (a real SIGINT, sent by the bench process to itself) as the workers of the first worker count are
# shut down: the known point, found by torch's shutdown of its workers, which this wraps.
_CTRL_C_AT_SHUTDOWN = """
import os, signal, sys
import torch.utils.data.dataloader as torch_loader
from shardstream import cli

shutdown = torch_loader._MultiProcessingDataLoaderIter._shutdown_workers

def interrupted_shutdown(self):
    if not getattr(self, "interrupted", False):
        self.interrupted = True
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: inside this shutdown
    shutdown(self)

torch_loader._MultiProcessingDataLoaderIter._shutdown_workers = interrupted_shutdown
sys.exit(cli.main(["bench", sys.argv[1], "--rounds", "1", "--workers", "1,0", "--seconds", "0.2", "--warmup", "0",
                   "--batch-size", "4",
                   "--transform", "none", "--quiet"]))
"""


def test_cli_bench_ctrl_c_while_workers_shut_down_stops_it(tiny):
    """Regression: the workers of each worker count were shut down by the garbage collector, in torch's
    `__del__`, where a Ctrl-C was printed as "Exception ignored" and lost: the bench went on to the next
    worker count (and printed its table, exit status 0)."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_AT_SHUTDOWN, tiny], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "shardstream bench: interrupted", proc.stderr
    assert HEADER not in proc.stdout


def test_cli_bench_ctrl_c_prints_and_saves_what_was_measured(tiny, tmp_path, monkeypatch, capsys):
    """Regression: a Ctrl-C discarded the rows already measured (minutes of them, with rounds). The table of
    what was measured is printed and the JSON written, marked partial, before the exit with 130."""
    import shardstream.bench as bench_module

    run_one, calls = bench_module._run_one, []

    def stopped_in_the_third(make_loader, num_workers, **kwargs):
        calls.append(num_workers)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run_one(make_loader, num_workers, **kwargs)

    monkeypatch.setattr(bench_module, "_run_one", stopped_in_the_third)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", tiny, "--workers", "0,1,2", "--rounds", "2", "--seconds", "0.1", "--warmup", "0",
                     "--batch-size", "4", "--transform", "none", "--json", "out.json", "--quiet"]) == 130
    out, err = capsys.readouterr()
    assert err.strip() == "shardstream bench: interrupted"
    lines = out.splitlines()
    assert [line.split("|")[0].strip() for line in lines[2:4]] == ["0", "1"]
    assert lines[4].startswith("each figure the median of the rounds measured (2 planned)")
    assert "partial: stopped after 2 of the 6 measurements planned (2 rounds of 3 counts); num_workers=2 not " \
           "measured" in lines and "wrote out.json (partial)" in lines
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["partial"] is True and data["workers"] == [0, 1, 2]
    assert [row["num_workers"] for row in data["rows"]] == [0, 1]


# SIGTERM (as a scheduler stops a job) while the workers of the second measurement read, from a timer: the
# process then says what it had measured and exits 143, with none of its worker processes left.
_SIGTERM_MID_ROW = """
import os, signal, sys, threading
import shardstream.bench as bench_module
from shardstream import cli
from shardstream.peakmem import TreeRSS

run_one, calls = bench_module._run_one, []

def terminated_in_the_second(make_loader, num_workers, **kwargs):
    calls.append(num_workers)
    if len(calls) == 2:
        kwargs["seconds"] = 60
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return run_one(make_loader, num_workers, **kwargs)

bench_module._run_one = terminated_in_the_second
status = cli.main(["bench", sys.argv[1], "--workers", "0,2", "--rounds", "2", "--seconds", "0.2", "--warmup", "0",
                   "--batch-size", "4", "--transform", "none", "--quiet", "--json", sys.argv[2]])
left = [p for p in TreeRSS().descendants() if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
print("left:", left)
sys.exit(status)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_cli_bench_sigterm_mid_measurement_keeps_the_rows_and_ends_the_workers(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_MID_ROW, tiny, str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "shardstream bench: terminated (SIGTERM)", proc.stderr
    assert proc.stdout.splitlines()[2].split("|")[0].strip() == "0" and "left: []" in proc.stdout
    assert json.loads((tmp_path / "out.json").read_text())["partial"] is True


def test_more_workers_than_cpus_is_said_once(tiny, monkeypatch):
    """torch warned twice for each count above the CPUs, each row and round (as the loader is made and as it
    starts its workers); bench runs such counts on purpose, and says so once."""
    import warnings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # one CPU, for torch too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = bench(tiny, workers=[0, 2], rounds=2, batch_size=4, transform="none", seconds=0.05, warmup=0.0)
    said = [str(w.message) for w in caught]
    assert result.cpus == 1 and len(result.rows) == 4
    assert [m for m in said if "more than" in m] == [
        "num_workers=2 more than the 1 CPU here (torch suggests at most 1): measured as asked, to see whether "
        "more workers still pay"]
    assert not [m for m in said if "This DataLoader will create" in m]


# -- memory --------------------------------------------------------------------------------------


def _tree(method: str) -> TreeRSS:
    """A TreeRSS that reads the process tree by `method` ("/proc" or "psutil")."""
    if method == "psutil":
        pytest.importorskip("psutil")
    tree = TreeRSS()
    tree.method = method
    if method == "psutil":
        import psutil

        tree._psutil, tree._proc = psutil, psutil.Process(os.getpid())
    return tree


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
@pytest.mark.parametrize("method", ["/proc", "psutil"])
def test_memory_counts_child_processes(method):
    tree = _tree(method)
    alone = tree.total()
    child = subprocess.Popen([sys.executable, "-c", "import sys; x = bytearray(64 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        seen = False
        for _ in range(200):  # until the child has its 64 MB
            if child.pid in tree.descendants() and tree.total() > alone + (48 << 20):
                seen = True
                break
            threading.Event().wait(0.05)
        assert seen
        assert child.pid in proc_descendants(os.getpid())
        assert TreeRSS(exclude=[child.pid]).total() < tree.total()
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_bench_runs_zero_workers_with_one_torch_thread(tiny, monkeypatch):
    """The 0-worker run iterates in this process: with torch's one intra-op thread, as a DataLoader worker
    runs (torch's default there starts OpenMP threads beside each resize), and torch's setting is restored."""
    import torch

    import shardstream.bench as bench_module

    threads = {}
    run_one = bench_module._run_one

    def recording(make_loader, num_workers, **kwargs):
        threads[num_workers] = torch.get_num_threads()
        return run_one(make_loader, num_workers, **kwargs)

    monkeypatch.setattr(bench_module, "_run_one", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bench(tiny, rounds=1, workers=[0, 1], batch_size=4, transform="val", seconds=0.2, warmup=0.0)
        assert threads == {0: 1, 1: 2}
        assert torch.get_num_threads() == 2
        # Decoded on the device side, on the CPU (no CUDA here), this process decodes at every
        # worker count: one thread for each row (with torch's default, 46 against 1443 img/s).
        threads.clear()
        bench(tiny, rounds=1, workers=[0, 1], batch_size=4, transform="val", seconds=0.2, warmup=0.0,
              decode_on_device=True)
        assert threads == {0: 1, 1: 1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
@pytest.mark.parametrize("method", ["/proc", "psutil"])
def test_cpu_time_counts_children_alive_and_ended(method):
    tree = _tree(method)
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\nimport sys; sys.stdin.read()"
    before = tree.cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE)
    try:
        for _ in range(200):  # until the child has spun
            if tree.cpu_seconds() - before >= 0.6:
                break
            threading.Event().wait(0.05)
        alive = tree.cpu_seconds() - before
        assert alive >= 0.6  # the live child's CPU counts
        excluded = _tree(method)
        excluded.exclude = {child.pid}
        assert excluded.cpu_seconds() - before < alive
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert tree.cpu_seconds() - before >= 0.6  # and still counts once it has ended and been waited for


def test_cli_bench_refuses_up_front_what_would_fail_late_or_fork_without_end(tiny, tmp_path, monkeypatch, capsys):
    """Regression (found by review): `--workers 100000` forked workers until memory ran out
    (the dataset refused them in the first one's iteration); a `--plot` type matplotlib
    cannot write failed after every row had run; `--device mps` on a build without it was
    torch's traceback. Each is refused before anything is measured."""
    from shardstream import DataLoader, cli
    from shardstream.shared import SLOTS

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", tiny, "--workers", f"0,{SLOTS + 1}"])
    assert exit_.value.code == 2 and f"from 0 to {SLOTS}" in capsys.readouterr().err
    with pytest.raises(ShardstreamError, match=f"from 0 to {SLOTS}"):
        bench(tiny, workers=[0, 100_000])
    with pytest.raises(ValueError, match=f"num_workers must be below {SLOTS + 1}"):
        DataLoader(shardstream.StreamingDataset(tiny), num_workers=100_000)
    try:
        import matplotlib
    except ImportError:
        matplotlib = None
    if matplotlib is not None:
        assert cli.main(["bench", tiny, "--workers", "0", "--plot", "curve.xyz", "--quiet"]) == 1
        assert "--plot curve.xyz: matplotlib writes" in capsys.readouterr().err
    if not torch_has_mps():
        assert cli.main(["bench", tiny, "--workers", "0", "--device", "mps", "--quiet"]) == 1
        assert "device 'mps': this build of torch has no backend for it" in capsys.readouterr().err


def torch_has_mps() -> bool:
    import torch

    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def test_a_row_counts_a_few_batches_a_worker_however_short_its_window(tiny):
    """Regression (found by review): `--seconds 0.000001` counted one batch a row, taken
    already queued: 2.74 CPUs busy on a 2-CPU machine, and a knee of noise. A row's window
    holds at least a few batches a worker."""
    from shardstream.bench import MIN_BATCHES_PER_WORKER

    result = bench(tiny, rounds=1, workers=[0, 2], batch_size=2, transform="none", seconds=1e-6, warmup=0.0)
    for row in result.rows:
        assert row.images >= MIN_BATCHES_PER_WORKER * max(1, row.num_workers) * 2, row
