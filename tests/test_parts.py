"""Packing in parts (`pack --part I/N`) and `merge`: the same dataset as a single pack."""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import shardstream as ss
from shardstream.errors import ManifestError, ShardstreamError
from shardstream.parts import merge
from shardstream.synthetic import make_image_folder

from _data import killed_after_first_shard


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    make_image_folder(root / "src", num_classes=3, images_per_class=[7, 9, 5], size_range=((32, 24), (48, 40)))
    ss.pack(str(root / "src"), str(root / "single"), shard_size="8KB", progress=False)
    return root


def files(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if not name.startswith(".")}


def samples(url: str) -> dict[str, bytes]:
    return {s["__key__"]: s["jpg"] for ref in ss.open_dataset(url).shards for s in ref.reader()}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardstream.cli", *args], capture_output=True, text=True, timeout=120)


def killed_after_removing(monkeypatch, first: Callable[[str], bool], run: Callable[[], object]) -> None:
    """`run()`, killed (a KeyboardInterrupt) right after it removes the first file `first` picks."""
    from shardstream.storage import Store

    remove = Store.remove

    def removing(store, name):
        remove(store, name)
        if first(name):
            raise KeyboardInterrupt

    monkeypatch.setattr(Store, "remove", removing)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(Store, "remove", remove)


def test_parts_in_any_order_with_a_rerun_merge_into_the_single_pack(source, tmp_path):
    dst = str(tmp_path / "parts")
    for part in (2, 0, 1):
        ss.pack(str(source / "src"), dst, shard_size="8KB", part=(part, 3), progress=False)
    first = files(dst)
    ss.pack(str(source / "src"), dst, shard_size="8KB", part=(1, 3), overwrite=True, progress=False)  # a rerun
    assert files(dst) == first  # idempotent: the same bytes
    manifest = merge(dst)
    single = ss.open_dataset(str(source / "single")).manifest
    assert samples(dst) == samples(str(source / "single"))
    assert (manifest.classes, manifest.class_counts) == (single.classes, single.class_counts)
    assert not {n for n in os.listdir(dst) if n.startswith(".shardstream")}  # journals cleaned up


def test_merged_dataset_streams_exactly_once(source, tmp_path):
    dst = str(tmp_path / "parts")
    for part in range(2):
        ss.pack(str(source / "src"), dst, shard_size="8KB", part=(part, 2), progress=False)
    merge(dst)
    keys = collections.Counter()
    for rank in range(3):
        ds = ss.StreamingDataset(dst, decode=None, fields=("__key__",), shuffle=True, rank=rank, world_size=3)
        keys.update(k for (k,) in ds)
    assert set(keys) == set(samples(str(source / "single")))
    assert sum(keys.values()) == 21  # 21 divides by 3: no padding


def test_a_part_looks_up_only_the_files_it_packs(source, tmp_path, monkeypatch):
    """Every part lists the whole source, but stats only its own slice: on a cluster file system
    N parts stat'ing every file is N times the source's files in metadata round trips (and, at
    1M files, most of a part's time before its first frame)."""
    looked_up: collections.Counter = collections.Counter()
    real_stat = os.stat

    def counting_stat(path, *args, **kwargs):
        looked_up[os.fspath(path)] += 1
        return real_stat(path, *args, **kwargs)

    images = {str(p) for p in (source / "src").rglob("*.jpg")}
    packed: dict[int, set[str]] = {}
    for part in range(3):
        looked_up.clear()
        monkeypatch.setattr(os, "stat", counting_stat)
        ss.pack(str(source / "src"), str(tmp_path / "parts"), shard_size="8KB", part=(part, 3), workers=1,
                progress=False)
        monkeypatch.undo()
        packed[part] = {p for p in images if looked_up[p]}
        # Its listing's stat and the one that keeps a FIFO from being opened, each of its files alone.
        assert {looked_up[p] for p in packed[part]} == {2}
    assert set().union(*packed.values()) == images and sum(map(len, packed.values())) == len(images)
    assert merge(str(tmp_path / "parts")).samples == len(images)


def test_a_missing_part_begun_and_killed_is_said_to_resume(source, tmp_path, monkeypatch):
    dst = str(tmp_path / "parts")
    ss.pack(str(source / "src"), dst, shard_size="8KB", part=(0, 2), progress=False)
    killed_after_first_shard(monkeypatch, lambda: ss.pack(str(source / "src"), dst, shard_size="8KB", part=(1, 2),
                                                          progress=False))
    with pytest.raises(ShardstreamError, match=re.escape("missing 1 of 2 parts: part 1 (manifest.part-00001-of-00002"
                                                         ".msgpack; begun and not finished: still running, or "
                                                         "stopped (--resume continues it))")):
        merge(dst)


def test_merge_of_a_single_pack_says_so(source):
    with pytest.raises(ShardstreamError, match="no part manifests .* found \\(a dataset's manifest is there: a "
                                               "single pack's, with nothing to merge\\)"):
        merge(str(source / "single"))


def test_a_missing_part_is_named(source, tmp_path):
    dst = str(tmp_path / "parts")
    for part in (0, 2):
        ss.pack(str(source / "src"), dst, shard_size="8KB", part=(part, 3), progress=False)
    with pytest.raises(ShardstreamError, match=r"part 1 \(manifest\.part-00001-of-00003\.msgpack\)"):
        merge(dst)
    result = cli("merge", dst)
    assert result.returncode == 1 and "part 1" in result.stderr
    assert not os.path.exists(os.path.join(dst, "manifest.msgpack"))


def test_parts_of_two_packs_copied_into_one_folder_are_refused_not_merged_in_part(source, tmp_path):
    """Found by the forty-third session's walk: parts of a 2-part pack and of a 3-part one copied into one folder
    (a sync of two attempts): parts 0 and 1 of each hid the other's in the listing, and `merge` merged the 3
    parts without a word of the other manifests. It says the parts disagree on their number, as `verify` does."""
    dst = tmp_path / "both"
    dst.mkdir()
    for total in (2, 3):
        for index in range(total):
            ss.pack(str(source / "src"), str(tmp_path / f"in-{total}"), shard_size="8KB", part=(index, total),
                    progress=False)
        for path in (tmp_path / f"in-{total}").iterdir():
            if path.is_file():
                shutil.copy(path, dst / path.name)
    dst = str(dst)
    with pytest.raises(ShardstreamError, match=r"part manifests disagree on the number of parts: \[2, 3\]"):
        merge(dst)
    assert not os.path.exists(os.path.join(dst, "manifest.msgpack"))
    from shardstream.verify import verify_dataset

    problems = [str(p) for p in verify_dataset(dst, decode_images=False).problems]
    assert problems[0] == f"merge: {dst}: part manifests disagree on the number of parts: [2, 3]", problems


def test_a_shard_file_removed_by_a_second_run_of_the_part_is_said_in_words(tmp_path):
    """Found by the forty-third session's walk: two runs of one part at once (a scheduler's replacement beside
    the original) each remove the other's files in progress as they start, and the first failed with a bare
    "<scratch path>: No such file or directory". The data stayed right (the second run finished, and merged);
    the message names the shard and what happened."""
    from shardstream.scratch import cleanup_scratch
    from shardstream.storage import Store

    writer = ss.ShardWriter(str(tmp_path / "ds"))
    with pytest.raises(ss.StorageError, match=r"shard-000000\.tar\.zst: its file in progress \(.*\.part\) was "
                                              r"removed while it was written: another run of this pack \(or part\) "
                                              r"began in the same folder\? Run one at a time"):
        with writer:
            for i in range(3):  # past a frame: the shard's scratch file is there
                writer.write({"__key__": f"s{i}", "bin": bytes(1_500_000)})
            cleanup_scratch(Store(str(tmp_path / "ds"), {}), ["shard-000000.tar.zst"])  # as another run starts


def test_a_ray_rerun_without_flags_names_the_finished_parts_of_its_own_pack_only(source, tmp_path):
    from shardstream.errors import PackError
    from shardstream.executors import _refuse_finished_parts

    dst = str(tmp_path / "parts")
    ss.pack(str(source / "src"), dst, shard_size="8KB", part=(1, 2), progress=False)
    _refuse_finished_parts(dst, 3, None)  # another pack's part (the parts themselves refuse its files)
    with pytest.raises(PackError, match=r"parts 1 of 2 are packed already, by an earlier run: --resume"):
        _refuse_finished_parts(dst, 2, None)


def test_a_resume_that_differs_only_as_a_fix_does_is_told_apart(tmp_path):
    """The Ray executor starts over a part whose earlier run differs from this one only as a fix after a failure
    does (another on_error, an image repaired), and refuses any other difference as a single pack does (found by
    review: a mistyped option made every part of an unfinished Ray pack start over, its work thrown away)."""
    from shardstream.errors import ResumeMismatchError

    make_image_folder(tmp_path / "src", num_classes=2, images_per_class=4, size_range=((32, 24), (40, 32)))
    broken = tmp_path / "src" / "class_001" / "img_00002.jpg"
    broken.write_bytes(broken.read_bytes()[:150])
    with pytest.raises(ss.PackError):
        ss.pack(str(tmp_path / "src"), str(tmp_path / "ds"), shard_size="8KB", progress=False, workers=1)
    with pytest.raises(ShardstreamError, match=r"shard_size 8000 then, 9000 now") as mistyped:
        ss.pack(str(tmp_path / "src"), str(tmp_path / "ds"), shard_size="9KB", progress=False, workers=1,
                resume=True, on_error="skip")
    assert not isinstance(mistyped.value, ResumeMismatchError)
    with pytest.raises(ResumeMismatchError, match=r"\(on_error 'fail' then, 'skip' now\); run as it ran"):
        ss.pack(str(tmp_path / "src"), str(tmp_path / "ds"), shard_size="8KB", progress=False, workers=1,
                resume=True, on_error="skip")


def _parts_packed_apart(source: Path, tmp_path: Path, *packs: tuple[int, int, dict]) -> str:
    """Parts (index, total, pack options) packed each into a folder of its own, then put in one: parts
    packed at once, where none saw the others' manifests as it began."""
    dst = tmp_path / "parts"
    dst.mkdir(parents=True)
    for index, total, options in packs:
        alone = tmp_path / f"alone-{index}"
        ss.pack(str(options.pop("src", source / "src")), str(alone), shard_size="8KB", part=(index, total),
                progress=False, **options)
        for path in alone.iterdir():
            if path.is_file():
                shutil.copy(path, dst / path.name)
    return str(dst)


def test_a_part_of_other_options_is_refused_before_it_packs(source, tmp_path):
    """Regression (found by a user's walk through packing on a cluster): a part packed with other
    options than a part already there packed everything, and only then said the parts do not merge."""
    dst = str(tmp_path / "parts")
    ss.pack(str(source / "src"), dst, shard_size="8KB", part=(0, 2), progress=False)
    before = files(dst)
    with pytest.raises(ManifestError, match=re.escape("part 1 of 2 and part 0, packed already, do not merge: other "
                                                      "options (seed 7 here, 0 in part 0)")):
        ss.pack(str(source / "src"), dst, shard_size="8KB", part=(1, 2), seed=7, progress=False)
    assert files(dst) == before  # nothing packed
    other = tmp_path / "other"
    make_image_folder(other, num_classes=3, images_per_class=[7, 9, 6], size_range=((32, 24), (48, 40)))
    with pytest.raises(ManifestError, match="do not merge: another source listing"):
        ss.pack(str(other), dst, shard_size="8KB", part=(1, 2), progress=False)
    assert files(dst) == before
    ss.pack(str(other), dst, shard_size="8KB", part=(0, 2), progress=False, overwrite=True)  # packing anew: let be


def test_inconsistent_options_are_refused_naming_the_odd_part(source, tmp_path):
    """Parts packed at once, none seeing another's manifest: the merge refuses, naming the part that
    differs from most (not part 1, compared with a bad part 0), each value with its parts."""
    dst = _parts_packed_apart(source, tmp_path, (0, 3, {"seed": 7}), (1, 3, {}), (2, 3, {}))
    with pytest.raises(ManifestError, match=re.escape("part 0 was packed with other options than parts 1, 2 (part 0: "
                                                      "seed 7, not 0): pack it again with the others' options "
                                                      "(--overwrite)")):
        merge(dst)
    # Odd parts that differ each their own way are each told (found by review: part 2's level was
    # not named, and part 1's seed was said of it).
    dst = _parts_packed_apart(source, tmp_path / "five", (0, 5, {}), (1, 5, {"seed": 7}), (2, 5, {"level": 5}),
                              (3, 5, {}), (4, 5, {}))
    with pytest.raises(ManifestError, match=re.escape("parts 1, 2 were packed with other options than parts 0, 3, 4 "
                                                      "(part 1: seed 7, not 0; part 2: level 5, not -1)")):
        merge(dst)


def test_a_bad_part_0_is_named_and_does_not_make_the_right_parts_refuse(source, tmp_path):
    """Found by a walk of a cluster pack: the check before packing read part 0 alone, so with part 0
    packed with a wrong seed every later (right) part refused and was told to copy it; a merge with a
    part missing named only the missing one; and two parts that differ called part 0's options right."""
    dst = _parts_packed_apart(source, tmp_path, (0, 4, {"seed": 7}), (1, 4, {}), (2, 4, {}))
    with pytest.raises(ss.ShardstreamError, match=re.escape("part 0 was packed with other options than parts 1, 2 "
                                                            "(part 0: seed 7, not 0)")):
        merge(dst)  # part 3 missing too: the odd part is named first
    ss.pack(str(source / "src"), dst, shard_size="8KB", part=(3, 4), progress=False)  # agrees with most: packs
    with pytest.raises(ManifestError, match=re.escape("part 0 was packed with other options than parts 1, 2, 3")):
        merge(dst)
    tie = _parts_packed_apart(source, tmp_path / "tie", (0, 2, {"seed": 7}), (1, 2, {}))
    with pytest.raises(ManifestError, match="no options are most parts' \\(part 0: .*seed 7.*; part 1: .*seed 0") \
            as error:
        merge(tie)
    assert "others' options" not in str(error.value)


def test_parts_of_another_source_are_refused(source, tmp_path):
    other = tmp_path / "other"
    make_image_folder(other, num_classes=3, images_per_class=[7, 9, 6], size_range=((32, 24), (48, 40)))
    dst = _parts_packed_apart(source, tmp_path, (0, 2, {}), (1, 2, {"src": other}))
    # Named as another source, not as other options printed whole, which differed in the listing's digest alone.
    with pytest.raises(ManifestError, match="part 1 listed another source than part 0") as error:
        merge(dst)
    assert "options" not in str(error.value)


def test_parts_packed_under_other_rules_are_refused(source, tmp_path, monkeypatch):
    """Found by the thirty-ninth session's note: parts packed by versions that decide otherwise which
    images are packed (`pack.PACK_RULES`), or under another pixel limit (Pillow's, which pack takes
    images up to twice of), merged into one dataset that neither would pack. Refused before a part
    packs, at the merge, and by a rerun of a finished pack; parts that agree merge as before."""
    import importlib

    from PIL import Image

    from shardstream.verify import verify_dataset

    packing = importlib.import_module("shardstream.pack")  # the module: `shardstream.pack` names the function
    src = str(source / "src")
    dst = str(tmp_path / "parts")
    ss.pack(src, dst, shard_size="8KB", part=(0, 2), progress=False)
    before = files(dst)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS * 2)
    with pytest.raises(ManifestError, match=re.escape("part 1 of 2 and part 0, packed already, do not merge: another "
                                                      "version of shardstream or another pixel limit")):
        ss.pack(src, dst, shard_size="8KB", part=(1, 2), progress=False)
    assert files(dst) == before  # nothing packed
    monkeypatch.undo()

    monkeypatch.setattr(packing, "PACK_RULES", 1)
    apart = tmp_path / "apart"
    ss.pack(src, str(apart), shard_size="8KB", part=(1, 2), progress=False)
    monkeypatch.undo()
    for path in apart.iterdir():
        if path.is_file():
            shutil.copy(path, Path(dst) / path.name)
    with pytest.raises(ManifestError, match=re.escape("part 1 was packed by another version of shardstream or under "
                                                      "another pixel limit (PIL.Image.MAX_IMAGE_PIXELS) than part 0 "
                                                      "(part 0: packing rules 2")) as error:
        merge(dst)
    assert "part 1: packing rules 1" in str(error.value)
    assert "packed by another version" in verify_dataset(dst).problems[0].message

    ss.pack(src, dst, shard_size="8KB", part=(1, 2), progress=False, overwrite=True)  # this version: they merge
    merge(dst)
    assert samples(dst) == samples(str(source / "single"))
    single = str(tmp_path / "single")
    ss.pack(src, single, shard_size="8KB", progress=False)
    monkeypatch.setattr(packing, "PACK_RULES", 3)
    with pytest.raises(ShardstreamError, match="already holds this pack, made by another version of shardstream"):
        ss.pack(src, single, shard_size="8KB", resume=True, progress=False)


def test_cli_part_and_merge(source, tmp_path):
    dst = str(tmp_path / "parts")
    for part in ("0/2", "1/2"):
        result = cli("pack", str(source / "src"), dst, "--shard-size", "8KB", "--part", part, "--quiet", "--no-merge")
        assert result.returncode == 0, result.stderr
    assert not os.path.exists(os.path.join(dst, "manifest.msgpack"))  # --no-merge
    result = cli("merge", dst)
    assert result.returncode == 0 and "merged 2 parts: 21 samples" in result.stdout
    assert cli("pack", str(source / "src"), dst, "--part", "2/2").returncode == 2  # I must be < N: a usage error


def test_cli_last_part_to_finish_merges(source, tmp_path):
    """Without a merge step: the parts that finish while others are missing say so; the last one merges, giving
    the manifest `merge` gives; parts that do not agree make the last one fail, naming the problem."""
    dst = str(tmp_path / "parts")
    for part in ("2/3", "0/3"):
        result = cli("pack", str(source / "src"), dst, "--shard-size", "8KB", "--part", part, "--quiet")
        assert result.returncode == 0 and "the last part to finish merges" in result.stdout, result.stderr
        assert not os.path.exists(os.path.join(dst, "manifest.msgpack"))
    result = cli("pack", str(source / "src"), dst, "--shard-size", "8KB", "--part", "1/3", "--quiet")
    assert result.returncode == 0 and "all 3 parts done: merged 21 samples" in result.stdout, result.stderr
    merged = files(dst)
    merge(dst)
    assert files(dst) == merged, "merging again writes the same bytes"
    assert samples(dst) == samples(str(source / "single"))

    other = str(tmp_path / "other")
    cli("pack", str(source / "src"), other, "--shard-size", "8KB", "--part", "0/2", "--quiet")
    result = cli("pack", str(source / "src"), other, "--shard-size", "8KB", "--part", "1/2", "--seed", "7", "--quiet")
    assert result.returncode == 1 and "do not merge" in result.stderr and "other options" in result.stderr
    assert not os.path.exists(os.path.join(other, "manifest.msgpack"))


def test_cli_resume_of_a_finished_part_is_a_no_op_that_merges(source, tmp_path):
    """A scheduler's retry (SLURM, Kubernetes OnFailure) reruns the same `--part I/N --resume`
    line after a part finished but its merge did not: the rerun repacks nothing and merges."""
    dst = str(tmp_path / "parts")
    line = ("pack", str(source / "src"), dst, "--shard-size", "8KB", "--quiet", "--resume")
    assert cli(*line, "--part", "0/2").returncode == 0
    assert cli(*line, "--part", "1/2", "--no-merge").returncode == 0  # as if it died before merging
    parts = files(dst)
    result = cli(*line, "--part", "1/2")
    assert result.returncode == 0 and "all 2 parts done: merged 21 samples" in result.stdout, result.stderr
    assert {name: data for name, data in files(dst).items() if name != "manifest.msgpack"} == parts
    assert samples(dst) == samples(str(source / "single"))
    # A finished part is not passed off as another run's: other options are refused, and nothing changes.
    result = cli(*line, "--part", "1/2", "--seed", "7")
    assert result.returncode == 1 and "other options" in result.stderr and "--overwrite" in result.stderr
    assert {name: data for name, data in files(dst).items() if name != "manifest.msgpack"} == parts


def test_a_part_refuses_another_pack_without_overwrite(source, tmp_path):
    """Part shard names say the part's number, not how many parts there are: part 0 of 3 would overwrite
    part 0 of 2's shards, and part 0 of 1 a single pack's manifest. Without --overwrite a part refuses a
    destination that holds another pack, naming it; with --overwrite it replaces it whole."""
    src, dst = str(source / "src"), str(tmp_path / "parts")
    for part in ("0/2", "1/2"):
        assert cli("pack", src, dst, "--shard-size", "8KB", "--part", part, "--quiet").returncode == 0
    merged = files(dst)
    result = cli("pack", src, dst, "--shard-size", "8KB", "--part", "0/3", "--quiet")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "manifest.part-00000-of-00002.msgpack" in result.stderr and "--overwrite" in result.stderr
    assert files(dst) == merged
    # The same part again, finished, with --resume: a no-op that merges as before.
    result = cli("pack", src, dst, "--shard-size", "8KB", "--part", "1/2", "--quiet", "--resume")
    assert result.returncode == 0 and "all 2 parts done" in result.stdout, result.stderr
    assert files(dst) == merged

    single = str(source / "single")
    before = files(single)
    result = cli("pack", src, single, "--shard-size", "8KB", "--part", "0/1", "--quiet")
    assert result.returncode == 1 and "manifest.msgpack" in result.stderr and "--overwrite" in result.stderr
    assert files(single) == before

    for part in ("0/3", "1/3", "2/3"):
        result = cli("pack", src, dst, "--shard-size", "8KB", "--part", part, "--quiet", "--overwrite")
        assert result.returncode == 0, result.stderr
    assert "all 3 parts done: merged 21 samples" in result.stdout
    assert not [name for name in files(dst) if "-of-00002" in name]
    assert samples(dst) == samples(single)


def test_merge_checks_every_index(source, tmp_path):
    dst = tmp_path / "parts"
    for part in range(2):
        ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(part, 2), progress=False)
    index = sorted(dst.glob("shard-p00001-*.idx"))[0]
    kept = index.read_bytes()
    index.unlink()  # an interrupted copy of a part's output
    with pytest.raises(ManifestError, match=rf"part 1 lists {index.name} \({len(kept)} bytes\), which is missing"):
        merge(str(dst))
    index.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))  # the same size, other bytes
    with pytest.raises(ManifestError, match="not the index it wrote"):
        merge(str(dst))
    index.write_bytes(kept)
    shard = sorted(dst.glob("shard-p00000-*.tar.zst"))[-1]
    whole = shard.read_bytes()
    size = len(whole)
    shard.write_bytes(whole + b"\0")  # a byte appended, by a copy tool gone wrong
    with pytest.raises(ManifestError, match=rf"part 0 lists {shard.name} \({size} bytes\), which is {size + 1} "
                                            "bytes here: changed since"):
        merge(str(dst))
    shard.write_bytes(whole[:-7])  # an interrupted copy
    with pytest.raises(ManifestError, match=rf"which is {size - 7} bytes here: cut short"):
        merge(str(dst))
    shard.write_bytes(whole)
    assert merge(str(dst)).samples == 21 and samples(str(dst)) == samples(str(source / "single"))


def test_verify_checks_the_finished_parts_before_the_merge(source, tmp_path):
    """Regression (found by a user's walk through packing in parts): `verify` of a node's part before
    the merge said only that no manifest was there."""
    from shardstream.verify import verify_dataset

    dst = tmp_path / "parts"
    ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(1, 3), progress=False)
    report = verify_dataset(str(dst))
    listed = ss.Manifest.from_bytes((dst / "manifest.part-00001-of-00003.msgpack").read_bytes(), "part")
    assert report.ok and report.parts == ((1,), 3)
    assert (report.shards, report.samples) == (len(listed.shards), listed.samples) and listed.samples > 0
    result = cli("verify", str(dst), "--quiet")
    assert result.returncode == 0 and "; parts 1 of 3, not merged (2 parts not finished)" in result.stdout
    ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(0, 3), progress=False)
    shard = sorted(dst.glob("shard-p00000-*.tar.zst"))[0]
    data = bytearray(shard.read_bytes())
    data[-40] ^= 1
    shard.write_bytes(bytes(data))
    report = verify_dataset(str(dst))
    assert report.parts == ((0, 1), 3) and not report.ok
    assert report.problems[0].shard == shard.name and "sha256 does not match" in report.problems[0].message
    part_0 = ss.Manifest.from_bytes((dst / "manifest.part-00000-of-00003.msgpack").read_bytes(), "part")
    assert report.shards == len(part_0.shards) + len(listed.shards)
    result = cli("verify", str(dst), "--quiet")
    assert result.returncode == 1 and "; parts 0, 1 of 3, not merged (1 part not finished)" in result.stdout
    # Merged, with its manifest damaged (the parts' manifests still beside it): the manifest is the problem,
    # not the parts (found by the review: verify said "ok" over a dataset no reader opens).
    shard.write_bytes(bytes(data[:-40] + bytes([data[-40] ^ 1]) + data[-39:]))  # repaired
    ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(2, 3), progress=False)
    assert merge(str(dst)).samples == 21 and verify_dataset(str(dst)).ok
    manifest = dst / "manifest.msgpack"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    report = verify_dataset(str(dst))
    assert not report.ok and report.parts is None and "not valid msgpack" in report.problems[0].message


def test_verify_of_unmerged_parts_names_what_would_stop_their_merge(source, tmp_path):
    """Found by the thirty-eighth session's walk: `verify` of every part, finished and sound
    each but packed with other seeds, said "ok" and exited 0, and `merge` then refused them."""
    import shutil

    from shardstream.verify import verify_dataset

    dst, other = tmp_path / "parts", tmp_path / "other"
    ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(0, 2), progress=False)
    ss.pack(str(source / "src"), str(other), shard_size="8KB", part=(1, 2), seed=5, progress=False)
    for path in other.glob("*p00001*"):
        shutil.copy(path, dst / path.name)
    shutil.copy(other / "manifest.part-00001-of-00002.msgpack", dst)
    report = verify_dataset(str(dst))
    assert report.parts == ((0, 1), 2) and report.shards > 0 and len(report.problems) == 1
    assert report.problems[0].shard == "merge" and "packed with other options" in report.problems[0].message
    result = cli("verify", str(dst), "--quiet")
    assert result.returncode == 1 and "PROBLEM merge: " in result.stdout and "seed" in result.stdout
    with pytest.raises(ss.ShardstreamError, match="packed with other options"):
        merge(str(dst))
    # With a part not finished, a finished part of another source is told too (found by review: "ok").
    elsewhere, third = tmp_path / "src2", tmp_path / "third"
    shutil.copytree(source / "src", elsewhere)
    next(elsewhere.rglob("*.jpg")).unlink()
    dst = tmp_path / "three"
    ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(0, 3), progress=False)
    ss.pack(str(elsewhere), str(third), shard_size="8KB", part=(1, 3), progress=False)
    for path in third.glob("*p00001*"):
        shutil.copy(path, dst / path.name)
    shutil.copy(third / "manifest.part-00001-of-00003.msgpack", dst)
    report = verify_dataset(str(dst))
    assert report.parts == ((0, 1), 3) and [p.shard for p in report.problems] == ["merge"]
    assert "listed another source than" in report.problems[0].message
    # A damaged part manifest is told once, as the part's (the merge's checks are not run on it).
    part = dst / "manifest.part-00001-of-00003.msgpack"
    part.write_bytes(part.read_bytes()[:20])
    report = verify_dataset(str(dst))
    assert len(report.problems) == 1 and report.problems[0].shard == "manifest", report.problems


def test_merge_asks_the_store_once_for_every_size_and_reads_each_index_once(source, tmp_path, monkeypatch):
    """merge asked the store, shard after shard, whether the shard and its index were there and the shard's
    size: 4 requests in a row a shard, so that on S3 a merge of 500k shards took hours. One listing
    gives every size, and each index is read once, for its hash."""
    from shardstream.storage import Store

    dst = str(tmp_path / "parts")
    for part in range(2):
        ss.pack(str(source / "src"), dst, shard_size="8KB", part=(part, 2), progress=False)
    calls: collections.Counter = collections.Counter()
    for name in ("exists", "size", "read", "list", "sizes"):
        if hasattr(Store, name):
            def counted(self, *args, _real=getattr(Store, name), _name=name, **kwargs):
                calls[_name] += 1
                return _real(self, *args, **kwargs)
            monkeypatch.setattr(Store, name, counted)
    shards = len(merge(dst).shards)
    assert shards > 4
    # The listings of the part manifests and of every file's size; the 2 part manifests and each index read.
    assert calls == {"list": 1, "sizes": 1, "read": 2 + shards}


def test_a_part_rerun_removes_the_stale_merge_before_its_own_shards(source, tmp_path, monkeypatch):
    """A crash between the removals must not leave a merged manifest that lists removed shards."""
    dst = tmp_path / "parts"
    for part in range(2):
        ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(part, 2), progress=False)
    merge(str(dst))
    killed_after_removing(monkeypatch, lambda name: name.startswith("shard-p00001-"),  # the part's first shard
                          lambda: ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(1, 2),
                                          overwrite=True, progress=False))
    if (dst / "manifest.msgpack").exists():  # what a reader finds must be whole
        listed = ss.open_dataset(str(dst)).manifest.shards
        assert all((dst / shard.name).exists() for shard in listed)
    else:
        assert (dst / "manifest.part-00000-of-00002.msgpack").exists()  # the other part stays for the rerun


def test_a_single_pack_over_a_merged_one_removes_the_merge_before_the_parts_shards(source, tmp_path, monkeypatch):
    """Regression: a single pack with overwrite over a pack in parts removed the part manifests and their
    shards first, the merged manifest that lists those shards last: killed between, it listed shards that
    were gone. The merge goes first now."""
    dst = tmp_path / "parts"
    for part in range(2):
        ss.pack(str(source / "src"), str(dst), shard_size="8KB", part=(part, 2), progress=False)
    merge(str(dst))
    killed_after_removing(monkeypatch, lambda name: name.startswith("shard-p"),  # the parts' first shard
                          lambda: ss.pack(str(source / "src"), str(dst), shard_size="8KB", overwrite=True,
                                          progress=False))
    assert not (dst / "manifest.msgpack").exists()  # nothing listing a shard that is gone


def test_an_index_left_without_its_part_shard_is_swept(source, tmp_path):
    """Regression: a removal killed between a part's shard and its index (or remote removals done in another
    order) left the index, which no sweep matched: only shard names were. It goes with the part's rerun."""
    src, dst = str(source / "src"), tmp_path / "parts"
    for part in range(2):
        ss.pack(src, str(dst), shard_size="4KB", part=(part, 2), progress=False)
    orphan = dst / "shard-p00000-000999.tar.zst.idx"
    orphan.write_bytes(b"the index of a shard removed")
    ss.pack(src, str(dst), shard_size="4KB", part=(0, 2), overwrite=True, progress=False)
    assert not orphan.exists()
    listed = {name for shard in merge(str(dst)).shards for name in (shard.name, shard.index)}
    assert sorted(name for name in files(str(dst)) if not name.startswith("manifest")) == sorted(listed)


def test_a_part_packed_again_removes_what_a_killed_merge_left(source, tmp_path):
    """Regression: a merge killed while writing the dataset manifest left its scratch file for good: the
    parts' runs cleaned their own files only. A part not finished yet cleans it (no merge can be under way
    while one of its parts is missing)."""
    from shardstream.scratch import SCRATCH

    src, dst = str(source / "src"), tmp_path / "parts"
    ss.pack(src, str(dst), shard_size="8KB", part=(0, 2), progress=False)
    left = dst / SCRATCH / ".manifest.msgpack.k1ll3d.part"
    left.write_bytes(b"half a manifest")
    ss.pack(src, str(dst), shard_size="8KB", part=(1, 2), progress=False)
    assert not left.exists()


def test_a_merge_removes_what_a_killed_merge_of_this_host_left(source, tmp_path):
    """Regression: with every part finished, a merge killed while writing the dataset manifest left its
    scratch file for good (a merge run again, or a finished part's --resume, removed nothing), one more per
    killed merge. Scratch files say which process of which host wrote them: a merge removes those of ended
    processes of its own host, and keeps a running one's, and those of other hosts, which it cannot ask."""
    from shardstream.scratch import _HOST, SCRATCH, _writer_tag

    src, dst = str(source / "src"), tmp_path / "parts"
    for i in range(2):
        ss.pack(src, str(dst), shard_size="8KB", part=(i, 2), progress=False)
    ended = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True).stdout)
    (dst / SCRATCH).mkdir(exist_ok=True)
    left = {kind: dst / SCRATCH / f".manifest.msgpack.{tag}.x1y2z3.part" for kind, tag in [
        ("ended", f"{_HOST}-{ended}-1"), ("other host", f"elsewhere-{ended}-1"), ("running", _writer_tag())]}
    for path in left.values():
        path.write_bytes(b"half a manifest")
    merge(str(dst))
    assert {kind: path.exists() for kind, path in left.items()} == {"ended": False, "other host": True,
                                                                   "running": True}


def test_a_single_pack_over_one_killed_while_replacing_leaves_none_of_its_shards(source, tmp_path, monkeypatch):
    """Regression: an overwrite removes the old dataset's manifest, then its shards; killed between, they
    stayed listed by no manifest, and a rerun, fresh or resumed, knew nothing of them: 36 shards of an old
    pack with smaller shards stayed beside the new one for good. A single pack that overwrites, or resumes,
    removes the shard files it does not plan."""
    src, dst = str(source / "src"), tmp_path / "ds"
    ss.pack(src, str(dst), shard_size="2KB", progress=False)  # many small shards
    killed_after_removing(monkeypatch, lambda name: name == "manifest.msgpack",
                          lambda: ss.pack(src, str(dst), shard_size="64KB", overwrite=True, progress=False))
    ss.pack(src, str(dst), shard_size="64KB", resume=True, progress=False)
    listed = {name for shard in ss.open_dataset(str(dst)).manifest.shards for name in (shard.name, shard.index)}
    assert sorted(name for name in files(str(dst)) if not name.startswith("manifest")) == sorted(listed)
    assert samples(str(dst)) == samples(str(source / "single"))


def killed_after_publishing(monkeypatch, shards: int, run: Callable[[], object]) -> None:
    """`run()`, killed (a KeyboardInterrupt) right after it publishes its `shards`-th shard index."""
    from shardstream.storage import Store

    put, published = Store.put, []

    def publishing(store, file, name):
        put(store, file, name)
        published.append(name.endswith(".idx"))
        if sum(published) == shards:
            raise KeyboardInterrupt

    monkeypatch.setattr(Store, "put", publishing)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(Store, "put", put)


@pytest.mark.parametrize("killed", ["single", "part"])
def test_a_pack_of_the_other_layout_refuses_or_removes_what_a_killed_pack_left(source, tmp_path, monkeypatch, killed):
    """Regression: a single pack killed before its manifest left its shards and journal, and parts packed into
    the same folder then left them beside their merge for good (shard-000000.tar.zst holding samples the
    parts hold too, for anything that globs shard names); a part killed so, then a single pack, the same. The
    pack of the other layout refuses the folder, naming what it holds, or with overwrite removes it all."""
    src, dst = str(source / "src"), tmp_path / "ds"
    single = lambda **kw: ss.pack(src, str(dst), shard_size="8KB", workers=1, progress=False, **kw)  # noqa: E731
    parts = lambda **kw: [ss.pack(src, str(dst), shard_size="8KB", workers=1, progress=False,  # noqa: E731
                                  part=(i, 2), **kw) for i in range(2)]
    first, then = (single, parts) if killed == "single" else (lambda: parts()[0], single)
    killed_after_publishing(monkeypatch, 2, first)
    left = sorted(os.listdir(dst))
    assert any(name.endswith(".tar.zst") for name in left) and ".shardstream-pack" in left
    with pytest.raises(ShardstreamError, match="already holds another pack") as refused:
        then()
    assert ("shard-000000.tar.zst" if killed == "single" else "shard-p00000-000000.tar.zst") in str(refused.value)
    assert sorted(os.listdir(dst)) == left
    then(overwrite=True)
    if killed == "single":
        merge(str(dst))  # the CLI's last part merges; the API's caller does
    listed = {name for shard in ss.open_dataset(str(dst)).manifest.shards for name in (shard.name, shard.index)}
    leftover = {os.path.relpath(os.path.join(root, name), dst) for root, _, names in os.walk(dst) for name in names}
    part_manifests = {f"manifest.part-0000{i}-of-00002.msgpack" for i in range(2)} if killed == "single" else set()
    assert leftover == listed | {"manifest.msgpack"} | part_manifests
    assert samples(str(dst)) == samples(str(source / "single"))


def test_an_overwrite_from_a_source_that_fails_keeps_the_dataset(source, tmp_path):
    dst = tmp_path / "ds"
    ss.pack(str(source / "src"), str(dst), shard_size="8KB", progress=False)
    before = files(dst)
    with pytest.raises(ShardstreamError):
        ss.pack(str(tmp_path / "mistyped"), str(dst), shard_size="8KB", overwrite=True, progress=False)
    (tmp_path / "dup.csv").write_text(f"{source}/src/class_000/img_00000.jpg,0\n{source}/src/class_000/img_00000.jpg,0\n")
    with pytest.raises(ShardstreamError, match="both name"):
        ss.pack(str(tmp_path / "dup.csv"), str(dst), shard_size="8KB", overwrite=True, progress=False)
    assert files(dst) == before


def test_resume_of_a_finished_pack_refuses_a_file_that_changed_size(source, tmp_path):
    """The listing's fingerprint holds names and labels only (a part looks up its own files alone):
    the manifest's digest of the packed files' sizes tells a finished pack's rerun that a file was
    rewritten in place, where it would have passed the old pack off as done. A part's digest is of
    its own files: a change in another part's leaves it done."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    single, parts = str(tmp_path / "ds"), str(tmp_path / "parts")
    ss.pack(str(src), single, shard_size="8KB", progress=False)
    for part in range(2):
        ss.pack(str(src), parts, shard_size="8KB", part=(part, 2), progress=False)
    merge(parts)
    in_part_0 = {s["__key__"] for ref in ss.open_dataset(parts).shards if "-p00000-" in ref.name for s in ref.reader()}
    victim = next(p for p in sorted(src.rglob("*.jpg")) if p.relative_to(src).with_suffix("").as_posix() in in_part_0)
    before = victim.stat()
    victim.write_bytes(victim.read_bytes() + b"\0")  # a byte longer, its time put back
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ShardstreamError, match="made from another source or with other options"):
        ss.pack(str(src), single, shard_size="8KB", resume=True, progress=False)
    with pytest.raises(ShardstreamError, match="made from another source or with other options"):
        ss.pack(str(src), parts, shard_size="8KB", part=(0, 2), resume=True, progress=False)
    assert ss.pack(str(src), parts, shard_size="8KB", part=(1, 2), resume=True, progress=False).samples > 0


def test_what_an_earlier_version_left_is_refused_naming_the_version(source, tmp_path, monkeypatch):
    """Journals, finished packs and parts of the versions whose listing stat'd every file record no
    sizes digest (and another fingerprint): refused as such, not as another source or other options."""
    import dataclasses

    import msgpack

    from shardstream.format import Manifest

    def as_an_earlier_version_wrote_it(path):
        manifest = Manifest.from_bytes(path.read_bytes(), str(path))
        options = {k: v for k, v in manifest.options.items() if k != "sizes"}
        path.write_bytes(dataclasses.replace(manifest, options=options).to_bytes())

    src, single, parts = str(source / "src"), tmp_path / "ds", tmp_path / "parts"
    ss.pack(src, str(single), shard_size="8KB", progress=False)
    as_an_earlier_version_wrote_it(single / "manifest.msgpack")
    with pytest.raises(ShardstreamError, match="earlier version of shardstream"):
        ss.pack(src, str(single), shard_size="8KB", resume=True, progress=False)

    for part in range(2):
        ss.pack(src, str(parts), shard_size="8KB", part=(part, 2), progress=False)
    as_an_earlier_version_wrote_it(parts / "manifest.part-00001-of-00002.msgpack")
    with pytest.raises(ManifestError, match=r"parts \[1\] were packed by an earlier version"):
        merge(str(parts))

    killed_after_first_shard(monkeypatch, lambda: ss.pack(src, str(tmp_path / "killed"), shard_size="8KB",
                                                          progress=False))
    plan = tmp_path / "killed" / ".shardstream-pack" / "main" / "plan.msgpack"
    written = msgpack.unpackb(plan.read_bytes())
    written["modified"] = written.pop("files")  # the stamp's name and content before
    plan.write_bytes(msgpack.packb(written))
    with pytest.raises(ShardstreamError, match="journaled by an earlier version"):
        ss.pack(src, str(tmp_path / "killed"), shard_size="8KB", resume=True, progress=False)


def test_resume_of_a_finished_pack_refuses_a_changed_source(source, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    dst = str(tmp_path / "ds")
    ss.pack(str(src), dst, shard_size="8KB", progress=False)
    assert ss.pack(str(src), dst, shard_size="8KB", resume=True, progress=False).samples == 21  # nothing changed
    (src / "class_000" / "img_00000.jpg").unlink()  # new images arrive, one goes
    shutil.copy(src / "class_001" / "img_00000.jpg", src / "class_000" / "new.jpg")
    with pytest.raises(ShardstreamError, match="made from another source or with other options"):
        ss.pack(str(src), dst, shard_size="8KB", resume=True, progress=False)


def test_a_pack_in_another_number_of_parts_leaves_no_shard_of_the_old_one(source, tmp_path):
    """Part 0 of 3 removes the 2-part manifests, but keeps the shards of part 1 of 2 (numbered as part
    1 of 3's, which may be writing them at once): part 1 of 3 packs fewer shards than part 1 of 2 did,
    and those past its own stayed in the dataset's folder, listed by no manifest."""
    src, dst = str(source / "src"), str(tmp_path / "parts")
    for part in range(2):
        ss.pack(src, dst, shard_size="4KB", part=(part, 2), progress=False)
    old = set(files(dst))
    for part in range(3):
        ss.pack(src, dst, shard_size="4KB", part=(part, 3), overwrite=True, progress=False)
    manifest = merge(dst)
    listed = {name for shard in manifest.shards for name in (shard.name, shard.index)}
    assert {name for name in old if name.startswith("shard")} - listed  # the old parts had shards the new ones do not write
    assert sorted(name for name in files(dst) if not name.startswith("manifest")) == sorted(listed)
    assert samples(dst) == samples(str(source / "single"))
