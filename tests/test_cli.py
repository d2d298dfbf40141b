"""The `shardstream` command, run as a separate process: pack, inspect, verify."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import textwrap
import sys

import numpy as np
import pytest

import shardstream
from shardstream import open_dataset
from shardstream.format import MANIFEST_NAME

try:  # tests/ may or may not be a package
    from . import _data as D
except ImportError:
    import _data as D


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardstream.cli", *map(str, args)],
        capture_output=True, text=True, timeout=120,
    )


def cli_pack(src, dst, *extra) -> subprocess.CompletedProcess:
    return cli("pack", src, dst, "--shard-size", "60KB", "--workers", "1", "--quiet", *extra)


def cli_here(capsys, *args: object) -> tuple[int, str]:
    """`cli(*args)` run in this process, for argument checks that end the command before it does any work:
    (exit status, stderr). `python -m shardstream.cli` is `sys.exit(main())`, so the status is the one the
    process exits with (argparse's usage errors are SystemExit(2)); `test_usage_errors` checks that through a
    real process. Saves an interpreter start (~1 s of CPU) a case."""
    from shardstream.cli import main

    capsys.readouterr()
    try:
        status = main([str(arg) for arg in args])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def problem_shards(stdout: str) -> set[str]:
    return {line.split()[1].rstrip(":") for line in stdout.splitlines() if line.startswith("PROBLEM ")}


def test_pack_inspect_verify(image_folder, tmp_path, packed, dataset_files):
    dst = tmp_path / "ds"
    done = cli_pack(image_folder, dst)
    assert done.returncode == 0, done.stderr
    assert "packed 21 samples" in done.stdout
    # The command gives what the library gives for the same options, byte for byte.
    assert dataset_files(dst) == dataset_files(packed)

    shown = cli("inspect", dst, "--json")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["samples"] == 21
    assert info["classes"] == {"class_000": 7, "class_001": 7, "class_002": 7}
    assert info["shards"] == len(list(dst.glob("shard-*.tar.zst"))) >= 2
    assert info["compression"] == "zstd"
    assert info["fields"] == ["cls", "jpg"]
    assert info["skipped"] == [] and info["ignored"] == 1
    assert info["bytes"] == sum(p.stat().st_size for p in dst.glob("shard-*.tar.zst"))
    # How it was packed, as the manifest records it, its digests of the source left out.
    assert info["options"]["seed"] == 0 and info["options"]["max_side"] is None
    assert "listing" not in info["options"] and "sizes" not in info["options"]

    text = cli("inspect", dst)
    assert text.returncode == 0 and "21 samples" in text.stdout and "class_001: 7" in text.stdout
    assert "packed with: " in text.stdout and ", seed 0, shuffle True," in text.stdout

    checked = cli("verify", dst, "--quiet")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "PROBLEM" not in checked.stdout
    assert f"verified {info['shards']} shards, 21 samples, 21 images decoded: ok" in checked.stdout


def test_pack_options_uncompressed_sorted(image_folder, tmp_path):
    dst = tmp_path / "ds"
    done = cli_pack(image_folder, dst, "--compression", "none", "--no-shuffle", "--max-samples", "4")
    assert done.returncode == 0, done.stderr
    manifest = open_dataset(str(dst)).manifest
    assert manifest.compression == "none"
    assert all(s.name.endswith(".tar") and s.samples <= 4 for s in manifest.shards)
    keys = [s["__key__"] for ref in open_dataset(str(dst)).shards for s in ref.reader()]
    assert keys == sorted(keys) and len(keys) == 21
    assert cli("verify", dst, "--quiet", "--no-decode").returncode == 0


def test_verify_counts_as_decoded_only_the_images_that_decode(tmp_path):
    """Regression: an image that failed to decode was counted among the "images decoded"."""
    from shardstream.synthetic import synthetic_jpeg
    from shardstream.verify import verify_dataset

    good = synthetic_jpeg(0, 32, 24)
    with shardstream.ShardWriter(str(tmp_path / "ds")) as writer:
        for i, jpg in enumerate([good, good[: len(good) // 3], good, b"not a jpeg"]):
            writer.write({"__key__": f"s{i}", "jpg": jpg})
    report = verify_dataset(str(tmp_path / "ds"))
    assert report.samples == 4 and report.images == 2 and len(report.problems) == 2


@pytest.mark.parametrize("dataset", ["packed", "packed_plain"])
def test_verify_names_a_corrupted_shard(request, tmp_path, dataset):
    copy = tmp_path / "ds"
    shutil.copytree(request.getfixturevalue(dataset), copy)
    shards = open_dataset(str(copy)).manifest.shards
    victim = copy / shards[1].name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(bytes(data))

    checked = cli("verify", copy, "--quiet")
    assert checked.returncode == 1
    assert problem_shards(checked.stdout) == {shards[1].name}
    assert "sha256" in checked.stdout


def test_verify_names_bytes_appended_to_a_shard(packed, tmp_path):
    """A shard with bytes appended (a botched copy, two uploads concatenated) is not the shard
    the manifest lists, though its first `bytes` bytes are: verify names it and both sizes."""
    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    shard = open_dataset(str(copy)).manifest.shards[0]
    with open(copy / shard.name, "ab") as f:
        f.write(b"GARBAGE-GARBAGE")
    checked = cli("verify", copy, "--quiet")
    assert checked.returncode == 1 and problem_shards(checked.stdout) == {shard.name}
    assert f"file is {shard.bytes + 15} bytes, the manifest says {shard.bytes}" in checked.stdout


def test_verify_warns_of_shard_files_the_manifest_does_not_list(packed, tmp_path):
    """Left by the thirty-eighth session: shard files in a dataset's folder that its manifest does
    not list (an earlier pack's, killed or of another number of parts) verified "ok" without a
    word. They are a warning (readers never open them), named, with what removes them."""
    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    first = open_dataset(str(copy)).manifest.shards[0].name
    for stray in ("shard-000099.tar.zst", "shard-p00001-000000.tar.zst.idx"):
        shutil.copy(copy / first, copy / stray)
    (copy / "notes-000001.tar").write_bytes(b"")  # not named as shardstream names shards: not its business
    checked = cli("verify", copy, "--quiet", "--no-decode")
    assert checked.returncode == 0 and "ok (1 warning)" in checked.stdout
    assert ("WARNING folder: 2 files named as shards that the manifest does not list (shard-000099.tar.zst, "
            "shard-p00001-000000.tar.zst.idx): an earlier pack's?") in checked.stdout



def test_the_look_for_unlisted_shard_files_never_fails_verify_nor_blames_tars_indexed_in_place(packed, tmp_path,
                                                                                                  monkeypatch):
    """Found by review: a store that refuses listings (nginx without autoindex, S3 without list
    permission) made `verify` fail before any shard ("could not list"), and a tar of no samples,
    which `index` leaves out of its manifest, was called an earlier pack's, with advice to
    `pack --overwrite` the folder: the user's tars gone."""
    from shardstream import StorageError
    from shardstream.adopt import index_tars
    from shardstream.storage import Store
    from shardstream.verify import verify_dataset

    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    shutil.copy(copy / open_dataset(str(copy)).manifest.shards[0].name, copy / "shard-000099.tar.zst")

    def refused(self, suffix=""):
        raise StorageError("could not list: PermissionError", url=self.root)

    with monkeypatch.context() as patched:
        patched.setattr(Store, "list", refused)
        report = verify_dataset(str(copy), decode_images=False)
    assert report.ok and not report.warnings and report.shards == len(open_dataset(str(copy)).manifest.shards)
    tars = tmp_path / "tars"
    tars.mkdir()
    for i, members in enumerate((2, 0)):  # the second holds no sample: left out of the manifest
        with tarfile.open(tars / f"shard-{i:06d}.tar", "w") as tar:
            for j in range(members):
                info = tarfile.TarInfo(f"s{i}{j}.txt")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
    index_tars(str(tars))
    report = verify_dataset(str(tars), decode_images=False)
    assert report.ok and not report.warnings and report.samples == 2


def _edited_manifest(packed, tmp_path, edit) -> str:
    import msgpack

    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    raw = msgpack.unpackb((copy / MANIFEST_NAME).read_bytes())
    edit(raw)
    (copy / MANIFEST_NAME).write_bytes(msgpack.packb(raw))
    return str(copy)


@pytest.mark.parametrize(("what", "edit", "message"), [
    ("a class twice", lambda m: m["classes"].__setitem__(0, m["classes"][1]), "a class name is listed twice"),
    ("class counts", lambda m: m["class_counts"].__setitem__(0, m["class_counts"][0] + 1),
     "class_counts .* are not the indexes'"),
    ("a label past the classes", lambda m: (m.__setitem__("classes", m["classes"][:1]),
                                            m.__setitem__("class_counts", [sum(m["class_counts"])])),
     "a label is past the manifest's 1 classes"),
    ("a shard's fields", lambda m: m["shards"][0].__setitem__("fields", ["bls", "jpg"]), "holds the fields"),
    ("an index's size", lambda m: m["shards"][1].__setitem__("index_bytes", m["shards"][1]["index_bytes"] + 1),
     "is not the .* bytes the manifest says"),
    ("the version", lambda m: m.__setitem__("version", 0), "format version 0 does not exist"),
    # Regression: the one size of a shard's entry verify did not check (planning reads it).
    ("a shard's tar size", lambda m: m["shards"][0].__setitem__("raw_bytes", m["shards"][0]["raw_bytes"] + 512000),
     r"raw_bytes is \d+ in the manifest; the index gives \d+"),
])
def test_verify_checks_what_the_manifest_says_against_the_files(packed, tmp_path, what, edit, message):
    """Single-bit flips in the manifest that verify passed: every shard and index hashed right, but the class
    table, counts, fields or sizes it lists were not the files'."""
    from shardstream.verify import verify_dataset

    report = verify_dataset(_edited_manifest(packed, tmp_path, edit), decode_images=False)
    assert not report.ok and any(re.search(message, str(p)) for p in report.problems), (what, report.problems)


def test_verify_missing_shard_and_missing_manifest(packed, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    name = open_dataset(str(copy)).manifest.shards[0].name
    (copy / name).unlink()
    checked = cli("verify", copy, "--quiet")
    assert checked.returncode == 1 and name in problem_shards(checked.stdout)

    (copy / MANIFEST_NAME).unlink()
    checked = cli("verify", copy, "--quiet")
    assert checked.returncode == 1 and "PROBLEM manifest" in checked.stdout


def test_pack_fails_on_truncated_jpeg(image_folder_copy, tmp_path):
    victim = image_folder_copy / "class_001" / "img_00003.jpg"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    dst = tmp_path / "ds"

    done = cli_pack(image_folder_copy, dst)
    assert done.returncode == 1
    assert "class_001/img_00003.jpg" in done.stderr
    assert done.stderr.startswith("shardstream pack: error:")
    assert "Traceback" not in done.stderr
    assert not (dst / MANIFEST_NAME).exists()

    skipped = cli_pack(image_folder_copy, dst, "--on-error", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert "class_001/img_00003.jpg" in skipped.stdout
    info = json.loads(cli("inspect", dst, "--json").stdout)
    assert info["samples"] == 20
    assert [s["file"] for s in info["skipped"]] == ["class_001/img_00003.jpg"]
    assert info["classes"] == {"class_000": 7, "class_001": 6, "class_002": 7}


def test_pack_refuses_to_overwrite(image_folder, tmp_path):
    dst = tmp_path / "ds"
    assert cli_pack(image_folder, dst).returncode == 0
    again = cli_pack(image_folder, dst, "--seed", "3")
    assert again.returncode == 1 and "--overwrite" in again.stderr
    assert open_dataset(str(dst)).manifest.options["seed"] == 0
    forced = cli_pack(image_folder, dst, "--seed", "3", "--overwrite")
    assert forced.returncode == 0, forced.stderr
    assert open_dataset(str(dst)).manifest.options["seed"] == 3


def test_usage_errors(tmp_path):
    assert cli("pack", tmp_path).returncode == 2  # no destination: argparse's usage error
    missing = cli("pack", tmp_path / "nope", tmp_path / "ds", "--quiet")
    assert missing.returncode == 1 and "nope" in missing.stderr
    assert cli("inspect", tmp_path / "nothing").returncode == 1
    for size in ("1.2.3MB", ".MB", "12XB"):  # a clean usage error naming the value, never a traceback
        bad = cli("pack", tmp_path / "nope", tmp_path / "ds", "--shard-size", size, "--quiet")
        assert bad.returncode == 2 and f"bad size {size!r}" in bad.stderr, bad.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["--workers", "0"], "expected a positive integer, got '0'"),
    (["--workers", "-3"], "expected a positive integer, got '-3'"),
    (["--shard-size", "0"], "a shard size must be at least one byte, not '0'"),
    (["--shard-size", "0.4"], "a shard size must be at least one byte"),
    (["--part", "3/2"], "expected I/N with 0 <= I < N <= 100000 (e.g. 0/4), got '3/2'"),
    (["--part", "0/100001"], "expected I/N with 0 <= I < N <= 100000"),  # part numbers have five digits
    (["--part", "a/b"], "expected I/N with 0 <= I < N"),
    (["--part=-1/2"], "expected I/N with 0 <= I < N"),
    (["--seed=-1"], "expected a non-negative integer below 2**64, got '-1'"),
    (["--level", "50"], "zstd level must be 1..22"),
    (["--max-side", "0"], "expected a positive integer, got '0'"),
    (["--quality", "101"], "expected an integer 1..100, got '101'"),
    # Regression: past 2**64 each ended in msgpack's OverflowError (exit 1) and left a journal in DST.
    (["--max-samples", str(2**64)], f"expected a positive integer below 2**63, got '{2**64}'"),
    (["--max-side", str(2**63)], f"expected a positive integer below 2**63, got '{2**63}'"),
    (["--shard-size", str(2**64)], "more than 2**63 bytes"),
    (["--shard-size", "9" * 400], "more than 2**63 bytes"),  # a float's inf: int() failed
    (["--seed", str(2**64)], f"expected a non-negative integer below 2**64, got '{2**64}'"),
    # Regression: each was recorded in the manifest for a pack not a byte different, and a rerun with
    # --resume then refused the pack as made with other options.
    (["--quality", "50"], "--quality goes with --max-side"),
    (["--compression", "none", "--level", "5"], "--level goes with --compression zstd"),
])
def test_bad_pack_arguments_are_usage_errors(image_folder, tmp_path, capsys, extra, message):
    """Regression: `--workers 0` or `-3` packed with all cores or one, `--shard-size 0` wrote a shard a
    sample, and a bad --part or shard size exited 1 as a data problem would: now each is a usage error (2).
    So are a seed, level, --max-side or --quality out of range (`--seed=-1` ended in numpy's traceback)."""
    status, stderr = cli_here(capsys, "pack", image_folder, tmp_path / "ds", "--shard-size", "60KB", "--workers", "1",
                              "--quiet", *extra)  # cli_pack's arguments
    assert status == 2 and message in stderr, stderr
    assert stderr.startswith("usage: shardstream pack ")  # the command's usage (was the top level's)
    assert not (tmp_path / "ds").exists()


def test_a_reader_that_goes_away_ends_the_command_quietly(packed):
    """Regression: `shardstream inspect DST | head -1` printed "error: Broken pipe" and exited 1. As Unix tools
    do, it ends quietly, with the status a shell gives a process SIGPIPE ends (141)."""
    command = [sys.executable, "-c", "import sys; from shardstream.cli import main; sys.exit(main())",
               "inspect", str(packed)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.close()  # the reader has gone before the first line
        stderr = proc.stderr.read().decode()
        status = proc.wait(timeout=120)
    assert status == 141 and stderr == "", (status, stderr)


def _with_the_reader_gone(*args: object, unbuffered: bool = False) -> tuple[int, str]:
    """Run `shardstream ARGS` with its stdout's reader gone before the first line: (status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"  # as many container images set it
    with subprocess.Popen([sys.executable, "-m", "shardstream.cli", *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env) as proc:
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        return proc.wait(timeout=120), stderr


@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_reader_gone_stops_nothing_the_command_does_after_telling(image_folder, packed, tmp_path, unbuffered):
    """Regression (found by a review of the command line): the last part of `pack --part` printed its summary, met
    the reader gone (`| true`; at once where PYTHONUNBUFFERED is set), and exited 141 before it merged: no
    manifest, the pack never whole. And output shorter than stdout's buffer was first written at exit, where the
    reader gone was Python's "Exception ignored" on stderr and status 120. The command does its work, then
    exits 141, quietly."""
    assert _with_the_reader_gone("inspect", packed, unbuffered=unbuffered) == (141, "")
    dst = tmp_path / "parts"
    assert cli_pack(image_folder, dst, "--part", "0/2").returncode == 0
    assert not (dst / MANIFEST_NAME).exists()
    options = ("--shard-size", "60KB", "--workers", "1", "--quiet", "--part", "1/2")
    assert _with_the_reader_gone("pack", image_folder, dst, *options, unbuffered=unbuffered) == (141, "")
    assert open_dataset(str(dst)).manifest.samples == len(list(image_folder.rglob("*.jpg")))


def test_a_reader_of_both_outputs_gone_stops_neither_a_pack_nor_the_demo(image_folder, tmp_path):
    """Regression (found by the review of this session's changes): `shardstream pack ... 2>&1 | head` closes the
    progress bar's stderr too, and tqdm let the write's BrokenPipeError through: the pack stopped midway, no
    manifest; and `demo` told its steps with print(), so with PYTHONUNBUFFERED set it stopped after step 1."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONUNBUFFERED"] = "1"
    tars = tmp_path / "tars"  # a compressed tar among them: `index` warns it is left out (a warning's line on
    tars.mkdir()              # a stderr whose reader had gone stopped the command: found by the third review)
    for name in ("a.tar", "b.tar.gz"):
        with tarfile.open(tars / name, "w:gz" if name.endswith("gz") else "w") as tf:
            info = tarfile.TarInfo(f"{name[0]}.txt")
            info.size = 2
            tf.addfile(info, io.BytesIO(b"hi"))
    runs = {"pack": ("pack", image_folder, tmp_path / "ds", "--shard-size", "60KB", "--workers", "1"),
            "demo": ("demo", "--images", 20, "--classes", 2, "--workers", 0, "--keep", tmp_path / "demo"),
            "index": ("index", tars)}
    for name, args in runs.items():
        with subprocess.Popen([sys.executable, "-m", "shardstream.cli", *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env) as proc:
            proc.stdout.close()  # `2>&1 | head`, gone before the first line
            assert proc.wait(timeout=300) == 141, name
    assert open_dataset(str(tmp_path / "ds")).manifest.samples == len(list(image_folder.rglob("*.jpg")))
    assert open_dataset(str(tmp_path / "demo" / "shards")).manifest.samples == 20
    assert open_dataset(str(tars)).manifest.samples == 1


def test_a_stream_closed_before_the_command_began_stops_nothing(image_folder, packed, tmp_path):
    """Found by the fourth review of this session's changes: `inspect >&-` (Python's sys.stdout is None then)
    ended in an AttributeError, status 1; `pack 2>&-` stopped at its progress bar's first write (EBADF, which
    tqdm lets through), no manifest; and an error told on a stderr whose reader had gone gave status 120, not 1.
    The work is done, and the status is the command's."""
    def run(fd: int, *args: object) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardstream.cli", *map(str, args)], timeout=120,
                              preexec_fn=lambda: os.close(fd), stdout=subprocess.DEVNULL if fd != 1 else None,
                              stderr=subprocess.DEVNULL if fd != 2 else None)

    assert run(1, "inspect", packed).returncode == 0
    assert run(2, "pack", image_folder, tmp_path / "ds", "--shard-size", "60KB", "--workers", "1").returncode == 0
    assert open_dataset(str(tmp_path / "ds")).manifest.samples == len(list(image_folder.rglob("*.jpg")))
    with subprocess.Popen([sys.executable, "-m", "shardstream.cli", "inspect", tmp_path / "missing"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        proc.stderr.close()
        assert proc.wait(timeout=120) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_an_output_on_a_full_disk_stops_no_work(image_folder, tmp_path):
    """Found by the fifth review of this session's changes: with stderr on a full disk (ENOSPC), a pack stopped
    at its progress bar's first write, before its first shard, and its error escaped `main` (told on that same
    stderr). Diagnostics that cannot be written are dropped; stdout that cannot be written fails the command
    (status 1) once its work is done."""
    def pack(dst, **streams):
        with open("/dev/full", "w") as full:
            return subprocess.run([sys.executable, "-m", "shardstream.cli", "pack", image_folder, dst, "--shard-size",
                                   "60KB", "--workers", "1"], timeout=120,
                                  **{name: full for name in streams}, **{k: subprocess.DEVNULL for k in
                                                                         ("stdout", "stderr") if k not in streams})
    expected = len(list(image_folder.rglob("*.jpg")))
    assert pack(tmp_path / "a", stderr=True).returncode == 0
    assert open_dataset(str(tmp_path / "a")).manifest.samples == expected
    assert pack(tmp_path / "b", stdout=True).returncode == 1
    assert open_dataset(str(tmp_path / "b")).manifest.samples == expected


def test_bench_file_options_are_checked_before_the_run(packed, tmp_path):
    """`--plot curve` wrote curve.png and said "wrote curve"; --json and --plot naming one file let the plot
    replace the JSON; `demo --keep s3://...` made a local folder named `s3:` (found by a review of the command
    line). The plot's file is named as it is written, the others are usage errors."""
    from shardstream.commands import plot_file

    assert plot_file("curve") == "curve.png" and plot_file("curve.svg") == "curve.svg"
    same = cli("bench", packed, "--workers", "0", "--json", tmp_path / "r.png", "--plot", tmp_path / "r")
    assert same.returncode == 2 and "--json and --plot name the same file" in same.stderr, same.stderr
    keep = cli("demo", "--keep", "s3://bucket/demo")
    assert keep.returncode == 2 and "--keep takes a local folder, not a URL" in keep.stderr, keep.stderr


def test_index_of_a_packed_dataset_says_it_is_one(packed):
    result = cli("index", packed)
    assert result.returncode == 1 and "already a shardstream dataset" in result.stderr, result.stderr


def test_a_urllib3_error_is_described_without_its_deprecated_pool_property():
    """urllib3 2's NewConnectionError has a deprecated `pool` property that warns: reading it put a stray warning
    line before every connection error, and raised a FutureWarning where warnings are errors."""
    import warnings

    import urllib3.exceptions

    from shardstream.errors import described

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert described(urllib3.exceptions.NewConnectionError(None, "Connection refused")) == \
            "NewConnectionError: None: Connection refused"
        assert described(urllib3.exceptions.ReadTimeoutError(None, "/x", "Read timed out.")) == \
            "ReadTimeoutError: Read timed out."


def test_demo_runs_the_whole_path(tmp_path):
    """The README's first command: make, pack, verify, two epochs through 2 workers with each image exactly
    once (the demo asserts it), and a resume onto the same batches; it says which library decodes the crops."""
    result = cli("demo", "--images", 48, "--classes", 3, "--workers", 2, "--keep", tmp_path / "demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "made 48 ImageNet-like JPEGs" in out
    assert "48 images decoded, ok" in out
    assert out.count("each image exactly once") == 2
    assert "the same 1 batch as the uninterrupted run" in out
    assert "JPEG crops decoded by " in out
    from shardstream.reader import TARCUT
    assert ("samples cut out of shards in C" if TARCUT else "the _tarcut extension is not built") in out
    assert (tmp_path / "demo" / "shards").is_dir()


def test_demo_makes_exactly_the_images_asked_for(tmp_path):
    """Regression: `demo --images 5 --classes 10` made 10 images (one a class) and resumed after 0 batches;
    `--images 13 --classes 4` made 12. Now the count is exact, and fewer images than classes a usage error."""
    result = cli("demo", "--images", 13, "--classes", 4, "--workers", 0, "--keep", tmp_path / "demo")
    assert result.returncode == 0 and "made 13 ImageNet-like JPEGs" in result.stdout, result.stderr
    result = cli("demo", "--images", 5, "--classes", 10)
    assert result.returncode == 2 and "--images (5) must be at least --classes (10)" in result.stderr


def test_verify_in_threads_reports_what_one_thread_reports(tmp_path):
    """Shards are checked several at once; the report (problems in shard order, counts) is the same as one
    worker's: images that do not decode in two shards (their checksums are sound) and a shard with a flipped
    byte (sha256)."""
    from PIL import Image

    from shardstream import ShardWriter
    from shardstream.verify import verify_dataset

    good = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(good, "JPEG")
    dst = tmp_path / "ds"
    with ShardWriter(str(dst), max_samples=4) as writer:
        for i in range(24):
            writer.write({"__key__": f"s{i:03d}", "jpg": b"not a jpeg" if i in (5, 17) else good.getvalue(), "cls": i % 3})
    shards = open_dataset(str(dst)).manifest.shards
    assert len(shards) == 6
    victim = dst / shards[3].name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(bytes(data))

    one, three = (verify_dataset(str(dst), workers=w) for w in (1, 3))
    assert [str(p) for p in one.problems] == [str(p) for p in three.problems]
    flipped = [(shards[3].name, f"s{i:03d}") for i in range(12, 16)]  # its one frame fails: every sample named
    assert [(p.shard, p.key) for p in one.problems if p.key] == [(shards[1].name, "s005")] + flipped + [
        (shards[4].name, "s017")]
    assert any(p.shard == shards[3].name and "sha256" in p.message for p in one.problems)
    # The flipped shard's 4 samples are never read (its frame fails its checksum): 20 samples verified, of whose
    # images 2 do not decode. (Regression: the samples were the manifest's 24, read or not.)
    assert (one.shards, one.samples, one.images) == (three.shards, three.samples, three.images) == (6, 20, 18)
    (dst / shards[0].name).unlink()  # a shard gone: none of its samples verified
    assert (verify_dataset(str(dst)).samples, verify_dataset(str(dst), decode_images=False).samples) == (16, 16)


def test_verify_checks_the_index_labels_and_weights_against_the_samples(tmp_path):
    """Regression: `verify` compared only the index's label totals with the manifest's class counts, so an
    index with two samples' labels swapped, or weights for samples that have none (a second writer's bug,
    its checksums made right), passed; class-weighted and weighted sampling plan from these columns."""
    import dataclasses
    import hashlib

    import msgpack
    import numpy as np

    from shardstream import ShardWriter
    from shardstream.verify import verify_dataset

    dst = tmp_path / "ds"
    with ShardWriter(str(dst)) as writer:
        for i in range(6):
            writer.write({"__key__": f"s{i}", "txt": "x", "cls": i % 3, **({"weight": "0.5"} if i < 3 else {})})
    assert verify_dataset(str(dst)).ok
    (shard,) = open_dataset(str(dst)).shards
    index = shard.reader().index
    labels, weights = index.labels.copy(), index.weights.copy()
    labels[[0, 1]] = labels[[1, 0]]  # the totals, and so the class counts, stay
    weights[4] = 2.0  # s4 has no weight field
    new = dataclasses.replace(index, labels=labels, weights=weights).to_bytes()
    (dst / shard.info.index).write_bytes(new)
    manifest = msgpack.unpackb((dst / MANIFEST_NAME).read_bytes(), raw=False)
    manifest["shards"][0].update(index_bytes=len(new), index_sha256=hashlib.sha256(new).hexdigest())
    (dst / MANIFEST_NAME).write_bytes(msgpack.packb(manifest, use_bin_type=True))
    assert not np.array_equal(open_dataset(str(dst)).shards[0].reader().index.labels, index.labels)
    report = verify_dataset(str(dst))
    assert [(p.key, p.message) for p in report.problems] == [
        ("s0", "the index gives label 1, its cls field gives label 0"),
        ("s1", "the index gives label 0, its cls field gives label 1"),
        ("s4", "the index gives weight 2.0, the sample has no weight"),
    ]


def test_verify_names_the_samples_of_every_bad_frame_and_checks_the_frames_between(tmp_path):
    """Regression: a shard's first frame that failed its checksum ended the shard's check, naming no sample:
    a second bad frame went unreported, and the good frames after the first were never read. Now every
    sample of a bad frame is named, and each frame is checked on its own."""
    from PIL import Image

    from shardstream import ShardWriter
    from shardstream.verify import verify_dataset

    good = io.BytesIO()
    Image.new("RGB", (32, 24), (30, 200, 30)).save(good, "JPEG")
    dst = tmp_path / "ds"
    with ShardWriter(str(dst), frame_size=3 * len(good.getvalue())) as writer:
        for i in range(16):
            writer.write({"__key__": f"s{i:03d}", "jpg": good.getvalue() if i != 7 else b"not a jpeg", "cls": 0})
    (shard,) = open_dataset(str(dst)).shards
    index = shard.reader().index
    frames = [[k for k, o in zip(index.keys, index.sample_offsets[:-1])
               if index.frame_raw_offsets[f] <= o < index.frame_raw_offsets[f + 1]] for f in range(len(index.frame_offsets) - 1)]
    assert len(frames) >= 4 and "s007" not in frames[0] + frames[-1]
    data = bytearray((dst / shard.name).read_bytes())
    for f in (0, len(frames) - 1):  # the first and the last frame
        data[(int(index.frame_offsets[f]) + int(index.frame_offsets[f + 1])) // 2] ^= 0xFF
    (dst / shard.name).write_bytes(bytes(data))

    report = verify_dataset(str(dst))
    named = [p.key for p in report.problems if p.key]
    assert named == frames[0] + ["s007"] + frames[-1]
    assert all("bad zstd frame" in p.message for p in report.problems if p.key in frames[0] + frames[-1])
    # the frames between are read and decoded: every image of them but s007, which does not decode
    assert report.images == 16 - len(frames[0]) - len(frames[-1]) - 1, "the frames between are read and decoded"


def test_verify_checks_the_seek_table_against_the_index(packed, tmp_path):
    """Regression: nothing read a shard's zstd seek table, which other seekable-zstd tools seek by: one
    whose entry was altered (the manifest's checksum made to match) verified as sound."""
    import hashlib

    import msgpack

    from shardstream.verify import verify_dataset

    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    assert verify_dataset(str(copy), decode_images=False).ok
    raw = msgpack.unpackb((copy / MANIFEST_NAME).read_bytes())
    entry = raw["shards"][0]
    data = bytearray((copy / entry["name"]).read_bytes())
    frames = int.from_bytes(data[-9:-5], "little")
    first_entry = len(data) - 9 - 8 * frames  # the first frame's compressed size
    data[first_entry] ^= 0x01
    (copy / entry["name"]).write_bytes(bytes(data))
    entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (copy / MANIFEST_NAME).write_bytes(msgpack.packb(raw))
    report = verify_dataset(str(copy), decode_images=False)
    assert [(p.shard, p.key) for p in report.problems] == [(entry["name"], None)]
    assert "seek table" in report.problems[0].message
    # Regression: a shard without its table (another writer may leave it out) failed verify with
    # struct.error, no shard reported; now it is reported, and the next shard's problem too.
    cut = bytes(data[: -(8 + 8 * frames + 9)])  # a skippable frame's header, the entries, the footer
    (copy / entry["name"]).write_bytes(cut)
    entry["sha256"], entry["bytes"] = hashlib.sha256(cut).hexdigest(), len(cut)
    raw["shards"][1]["sha256"] = "0" * 64
    (copy / MANIFEST_NAME).write_bytes(msgpack.packb(raw))
    report = verify_dataset(str(copy), decode_images=False)
    assert [(p.shard, p.key) for p in report.problems] == [(entry["name"], None), (raw["shards"][1]["name"], None)]
    assert "seek table at its end is missing" in report.problems[0].message


def test_verify_reports_a_key_repeated_in_a_shard(tmp_path, monkeypatch):
    """Regression: a key that comes back later in a shard verified as sound, though FORMAT.md says keys are
    unique within a shard (`tar -x` keeps one of the two) and `index` refuses such a tar. The writer refuses
    it too, so its check is switched off to make one."""
    from shardstream.seenkeys import SeenKeys
    from shardstream.verify import verify_dataset

    monkeypatch.setattr(SeenKeys, "check_new", lambda self, key: None)
    with shardstream.ShardWriter(str(tmp_path / "ds"), compression="none") as writer:
        for key in ("a", "b", "a", "c"):
            writer.write({"__key__": key, "txt": key})
    report = verify_dataset(str(tmp_path / "ds"))
    assert [(p.shard, p.key, p.message) for p in report.problems] == [
        ("shard-000000.tar", "a", "the key of sample 0 of this shard again, at sample 2")]


def test_verify_holds_the_indexes_of_the_shards_at_work_not_of_every_shard(tmp_path, monkeypatch):
    """verify kept a reader per shard to the end, to count the classes there: every shard's index (every key
    of the dataset) stayed in memory, 10 GB at 100M samples. The indexes loaded and still held, at any time,
    are those of the shards at work, however many shards there are; the class counts are still checked."""
    import msgpack

    from shardstream import ShardWriter
    from shardstream.verify import verify_dataset

    dst = tmp_path / "ds"
    with ShardWriter(str(dst), max_samples=2, classes=("a", "b", "c")) as writer:
        for i in range(80):
            writer.write({"__key__": f"s{i:03d}", "cls": i % 3, "txt": "x"})
    held = D.watch_held_indexes(monkeypatch)
    report = verify_dataset(str(dst), decode_images=False, workers=2)
    loaded, most_held = held()
    assert report.ok and report.shards == loaded == 40, report.problems
    assert most_held <= 12  # the threads' shards and those queued ahead of them (4 a thread), not 40

    raw = msgpack.unpackb((dst / MANIFEST_NAME).read_bytes())
    raw["class_counts"][0] += 1
    (dst / MANIFEST_NAME).write_bytes(msgpack.packb(raw))
    assert [p.message for p in verify_dataset(str(dst), decode_images=False).problems] == [
        "class_counts [28, 27, 26] are not the indexes' [27, 27, 26]"]


def test_the_librarys_warnings_are_one_line_each_named_once(capsys):
    """Found by the forty-third session's walk: a warning the library words for a program's log ("shardstream:
    http://... ignores Range requests") read "shardstream bench: warning: shardstream: ..." on the command line."""
    import warnings

    from shardstream.cli import _warnings_as_lines

    with warnings.catch_warnings(), _warnings_as_lines("bench"):
        warnings.simplefilter("always")
        warnings.warn("shardstream: http://127.0.0.1:1 ignores Range requests")
        warnings.warn("a tar left out", UserWarning)
    assert capsys.readouterr().err == ("shardstream bench: warning: http://127.0.0.1:1 ignores Range requests\n"
                                       "shardstream bench: warning: a tar left out\n")


def test_verify_says_a_bad_frames_samples_in_one_line(tmp_path, capsys):
    """Found by the forty-third session's walk: one bad frame of 9 samples printed 9 PROBLEM lines, each with the
    frame's error. Its samples are one line now; the count still counts each sample."""
    from shardstream.cli import main

    with shardstream.ShardWriter(str(tmp_path / "ds"), frame_size=100_000) as writer:
        for k in range(30):  # 20 KB each: 5 samples a frame
            writer.write({"__key__": f"s{k:02d}", "bin": np.random.default_rng(k).bytes(20_000)})
    shard = tmp_path / "ds" / "shard-000000.tar.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "ds"), "--quiet"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "PROBLEM shard-000000.tar.zst: sha256 does not match the manifest"
    assert re.fullmatch(r"PROBLEM shard-000000\.tar\.zst samples 's15' to 's19' \(5\): bad zstd frame 3 \(samples "
                        r"'s15' to 's19'\): .*", lines[1]), lines
    assert lines[2:] == ["verified 1 shard, 25 samples, 0 images decoded: 6 problems"]
    from shardstream.commands import _problem_lines
    from shardstream.verify import Problem

    apart = [Problem("s.tar", key, "cannot identify image file") for key in ("s2", "s5", "s7")]  # one error, apart
    assert _problem_lines(apart) == [f"s.tar sample {k!r}: cannot identify image file" for k in ("s2", "s5", "s7")]


def test_bad_paths_and_arguments_are_one_line_errors(packed, image_folder, tmp_path):
    """A file where a dataset folder should be, a destination that cannot be made, bad JSON in
    --storage-options, a --json that cannot be written, counts that make no sense: one line naming the
    problem, never a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a dataset\n")
    cases = [
        (("inspect", a_file), 1, str(a_file)),
        (("bench", a_file, "--quiet"), 1, str(a_file)),
        (("pack", image_folder, a_file, "--quiet"), 1, str(a_file)),
        (("pack", image_folder, a_file / "ds", "--quiet"), 1, str(a_file)),
        (("inspect", packed, "--storage-options", "{bad"), 1, "--storage-options"),
        (("inspect", packed, "--storage-options", "[1]"), 1, "--storage-options"),
        # checked before the benchmark runs (1000 s a worker count: the cli() timeout would end it)
        (("bench", packed, "--json", tmp_path / "nope" / "x.json", "--seconds", 1000, "--quiet"), 1, "nope"),
        (("demo", "--classes", 0), 2, "--classes"),
        (("demo", "--workers", -1), 2, "--workers"),
        (("demo", "--images", 8, "--keep", a_file), 1, str(a_file)),
    ]
    for args, status, named in cases:
        result = cli(*args)
        assert result.returncode == status, (args, result.stderr)
        assert "Traceback" not in result.stderr, (args, result.stderr)
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"shardstream {args[0]}: error:") and named in last, (args, result.stderr)
    # verify reports what it cannot read as a problem of the dataset, as for a missing folder
    result = cli("verify", a_file, "--quiet")
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout, result
    problem = result.stdout.splitlines()[0]
    assert problem.startswith("PROBLEM manifest:") and str(a_file) in problem and "a file, not a dataset folder" in problem, result


def test_demo_reuses_a_kept_folder_only_if_it_holds_what_it_would_make(tmp_path):
    """A rerun with --keep says it reused the images (it made none) and counts them; a rerun with another
    --images is refused, naming what the folder holds, instead of failing its own exactly-once check."""
    keep = tmp_path / "demo"
    first = cli("demo", "--images", 12, "--classes", 3, "--workers", 0, "--keep", keep)
    assert first.returncode == 0 and "made 12 ImageNet-like JPEGs" in first.stdout, first.stderr
    other = cli("demo", "--images", 24, "--classes", 3, "--workers", 0, "--keep", keep)
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "holds 12 images in 3 classes" in other.stderr and "not the 24" in other.stderr
    again = cli("demo", "--images", 12, "--classes", 3, "--workers", 0, "--keep", keep)
    assert again.returncode == 0, again.stderr
    assert "reused the 12 ImageNet-like JPEGs" in again.stdout and "made 12" not in again.stdout
    assert "12 images decoded, ok" in again.stdout and again.stdout.count("each image exactly once") == 2


def test_demo_exits_non_zero_when_a_check_fails(tmp_path, monkeypatch, capsys):
    from shardstream import cli as cli_module
    from shardstream import demo
    from shardstream.verify import Problem, VerifyReport

    broken = VerifyReport(shards=1, samples=6, images=6, problems=[Problem("shard-000000.tar.zst", None, "bad")])
    monkeypatch.setattr(demo, "verify_dataset", lambda url: broken)
    status = cli_module.main(["demo", "--images", "6", "--classes", "3", "--workers", "0", "--keep", str(tmp_path / "d")])
    assert status == 1 and "shardstream demo: check failed: verify" in capsys.readouterr().err


def test_verify_names_a_missing_index(packed, tmp_path):
    """The shard is there, its index is not: verify names the index, not the shard, as missing."""
    copy = tmp_path / "ds"
    shutil.copytree(packed, copy)
    shard = open_dataset(str(copy)).manifest.shards[0]
    (copy / shard.index).unlink()
    checked = cli("verify", copy, "--quiet")
    assert checked.returncode == 1 and problem_shards(checked.stdout) == {shard.name}
    assert f"PROBLEM {shard.name}: {shard.index}: file not found" in checked.stdout, checked.stdout


def test_the_error_policy_names_the_readme_uses_are_public():
    """README: `ErrorPolicy(mode="skip", max_skips=N)` ... raises `TooManyErrors`."""
    import shardstream as ss
    from shardstream.policy import ErrorPolicy, TooManyErrors

    assert ss.ErrorPolicy is ErrorPolicy and ss.TooManyErrors is TooManyErrors
    assert {"ErrorPolicy", "TooManyErrors"} <= set(ss.__all__)
    assert ss.ErrorPolicy(mode="skip", max_skips=3).max_skips == 3


def test_the_names_imported_on_first_use_are_typed_for_type_checkers():
    """`StreamingDataset`, `DataLoader`, ... are imported on first use (`__getattr__`), which type checkers
    and IDEs do not run: they saw each as `Any`. Each is imported for them under TYPE_CHECKING, from the
    module that defines it."""
    import ast
    import inspect

    import shardstream as ss

    block = next(node for node in ast.parse(inspect.getsource(ss)).body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.asname: node.module for node in block.body for alias in node.names}
    assert typed == ss._LAZY


def test_verify_warns_of_a_jpeg_that_decodes_with_data_missing(tmp_path):
    """Regression: a JPEG with bit rot mid-file (its end intact) decodes, libjpeg filling what is lost, so pack
    took it and verify said ok, while the image was garbled. verify now names it, as a warning: it decodes, as
    Pillow and torchvision decode it, and datasets such as ImageNet hold a few such files."""
    pytest.importorskip("simplejpeg")
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:240, 0:320]
    pixels = np.stack([x * 255 // 319, y * 255 // 239, (x + y) % 256], -1).astype(np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, "JPEG", quality=90)
    good = encoded.getvalue()
    bad = bytearray(good)
    bad[len(bad) // 3 : len(bad) // 3 + 1000] = b"\x55" * 1000
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "good.jpg").write_bytes(good)
    (tmp_path / "src" / "c" / "rot.jpg").write_bytes(bytes(bad))
    assert cli_pack(tmp_path / "src", tmp_path / "ds").returncode == 0
    result = cli("verify", tmp_path / "ds", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("WARNING")] == [
        line for line in lines if "sample 'c/rot': decodes with data missing (Corrupt JPEG data" in line]
    assert len([line for line in lines if line.startswith("WARNING")]) == 1
    assert lines[-1].endswith("images decoded: ok (1 warning)")


@pytest.mark.parametrize(("extra", "message"), [
    (["--parts", "3"], "--parts and --ray-address go with --executor ray"),
    (["--ray-address", "auto"], "--parts and --ray-address go with --executor ray"),
    (["--no-merge"], "--no-merge goes with --part I/N"),
])
def test_pack_options_of_another_mode_are_refused(image_folder, tmp_path, extra, message):
    """Regression: `pack SRC DST --parts 3` (without --executor ray) packed one ordinary dataset, exit 0.
    A usage error (2), as argparse's own."""
    result = cli_pack(image_folder, tmp_path / "ds", *extra)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(("absent", "command", "extra"), [
    (("ray",), ("pack", "{src}", "{dst}", "--executor", "ray"), "ray"),
    # Options besides headers and timeouts read through fsspec's HTTP, which needs aiohttp.
    (("aiohttp",), ("inspect", "http://127.0.0.1:9/ds", "--storage-options", '{"client_kwargs": {"trust_env": false}}'),
     "http"),
])
def test_a_missing_extra_is_named_in_one_line(image_folder, tmp_path, monkeypatch, capsys, absent, command, extra):
    """Regression: `pack --executor ray` without ray ended in a two-part traceback, and an http://
    dataset without the http extra in "No module named 'aiohttp'". One line, naming the extra to install."""
    from shardstream import cli

    for module in absent:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    args = [arg.replace("{src}", str(image_folder)).replace("{dst}", str(tmp_path / "ds")) for arg in command]
    assert cli.main([*args, "--quiet"] if command[0] == "pack" else args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"shardstream {command[0]}: error:") and f"pip install 'shardstream[{extra}]'" in err, err
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("text", ['{"key": "AKIAEXAMPLE", "secret": "TOPSECRETVALUE",}', '["TOPSECRETVALUE"]'])
def test_bad_storage_options_are_not_echoed(text, tmp_path):
    """Regression: a typo in --storage-options put the whole JSON text, secret key included, in the error."""
    result = cli("inspect", tmp_path, "--storage-options", text)
    assert result.returncode == 1 and "--storage-options (or SHARDSTREAM_STORAGE_OPTIONS)" in result.stderr
    assert "TOPSECRETVALUE" not in result.stdout + result.stderr


def test_a_child_forked_under_the_command_dies_of_sigterm_quietly():
    """Regression: the CLI's SIGTERM handler (SIGTERM stops a command as Ctrl-C does) was
    inherited by forked children, so `Pool.terminate` at the end of a pool raised `Terminated`
    in each worker: `shardstream demo` printed a worker's traceback. A child dies of it quietly."""
    script = textwrap.dedent("""
        import multiprocessing, time
        from shardstream.cli import _sigterm_interrupts

        def work(started):
            started.set()
            time.sleep(30)

        context = multiprocessing.get_context("fork")
        with _sigterm_interrupts():
            started = context.Event()
            child = context.Process(target=work, args=(started,))
            child.start()
            assert started.wait(30)  # signalled at once after a fork, before Python is set up, it is lost
            child.terminate()
            child.join(30)
            print(child.exitcode)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-15"] and "Traceback" not in done.stderr, (done.stdout, done.stderr)


@pytest.mark.parametrize("sent, status, said", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                                 ("SIGINT", 130, "interrupted")])
def test_a_signal_whose_exception_python_drops_still_ends_the_command_with_its_status(sent, status, said):
    """Regression (clean-clone suites, once each: SIGTERM, then a Ctrl-C to a pack's process group): the
    signal's handler ran inside a weakref callback, where Python prints an exception raised and drops it;
    `pack` ran on to its end and exited 0, not 143 or 130. The command's exit status still says that a
    signal ended it."""
    script = textwrap.dedent("""
        import os, signal, sys, weakref
        from shardstream import cli

        class Thing:
            pass

        def run(args):
            thing = Thing()
            ref = weakref.ref(thing, lambda ref: os.kill(os.getpid(), signal.SENT))  # handled in the callback
            del thing
            return 0

        args = cli.build_parser().parse_args(["inspect", "/tmp"])
        args.run = run
        cli.build_parser = lambda: type("Parser", (), {"parse_args": lambda self, argv: args})()
        sys.exit(cli.main([]))
    """)
    done = subprocess.run([sys.executable, "-c", script.replace("SENT", sent)], capture_output=True, text=True,
                          timeout=60)
    # Said once, in the command's line: Python's "Exception ignored" traceback above it is kept quiet.
    assert done.returncode == status and done.stderr == f"shardstream inspect: {said}\n", done.stderr


def test_a_child_forked_under_the_command_has_sigterms_default():
    """Regression: a forked child kept the CLI's Python SIGTERM handler, which runs only between bytecodes: a
    SIGTERM arriving just before the child blocked in a lock went unhandled while the lock was held, and
    `demo`'s pool worker, waiting on the lock `Pool.terminate` holds, outlived the terminate: the demo hung
    (twice in about 140 runs under load). The child has the kernel's default, which needs no Python."""
    script = textwrap.dedent("""
        import multiprocessing, signal
        from shardstream.cli import _sigterm_interrupts

        def report(queue):
            queue.put(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)

        context = multiprocessing.get_context("fork")
        with _sigterm_interrupts():
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # the command's own
            queue = context.SimpleQueue()
            child = context.Process(target=report, args=(queue,))
            child.start()
            print(queue.get())
            child.join(30)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], (done.stdout, done.stderr)
