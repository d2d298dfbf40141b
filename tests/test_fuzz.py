"""Property-based robustness of the readers on mutated, hostile and truncated files.

A small valid dataset is written once per compression (`ShardWriter`, varied fields, a
pax long name, small frames so that every shard has several zstd frames). Hypothesis
then mutates one of its files and every way of reading it must either return samples or
raise a `shardstream.ShardstreamError` subclass: never another exception type, never a
hang (each read path runs under a watchdog).

Mutations (one source of truth, `draw_mutation`, shared with tools/fuzz_report.py):

* file-level, on a shard, an index or the manifest: flip bytes at random offsets,
  truncate at a random length, insert random garbage at a random offset, overwrite a
  header block (a tar header, a zstd frame header, the start of a msgpack map);
* raw, on a shard's tar stream, written back consistently (zstd frames recompressed with
  their checksums, index and manifest checksums updated): byte flips and forged tar
  headers with valid header checksums and hostile fields. This reaches the tar parser
  behind the zstd checksums, as a hostile (not merely damaged) dataset would.

Read paths (each under its own watchdog):

* ``dataset``: `open_dataset(dir)`, each shard's `reader()` iterated fully, `reader[i]`;
* ``shard``: `open_shard(path)` on the shard with its index but no manifest (the index
  is trusted as found);
* ``noindex``: `open_shard(path)` on a copy of the shard without its index (plain tar:
  `StreamTarReader` iterated, `len`, `[i]`; `.tar.zst`: streamed).

Extra properties: for zstd, a file-level mutation can never change the bytes of a
returned sample (frame checksums); for uncompressed shards read through an index, field
bytes may change but not the set of fields; a changed index read through the manifest is
always a `CorruptIndexError` (its SHA-256 is in the manifest); a manifest mutation never
changes what a shard returns. Field decoders and hostile manifests have their own tests.

Every bug this file found has a minimal reproducer below: an ordinary regression test once
fixed, ``xfail(strict=True)`` while open. Open bugs are also listed in `KNOWN_BUGS`
(exceptions, hangs), `SILENT_BUGS` (wrong samples without an error) and `DECODE_KNOWN`, and
the property tests accept exactly those signatures (so they keep guarding everything
else); when a fix makes a reproducer XPASS, remove its xfail mark and its entry.
RELIABILITY.md has the details.

CI runs 60 derandomized examples per target. For a long, randomized run:
``SHARDSTREAM_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import shutil
import signal
import sys
import tarfile
import threading
import traceback
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack
import numpy as np
import pytest
import torch  # noqa: F401 - imported up front: the image decoder imports it lazily, and a watchdog must not interrupt that
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardstream
from shardstream import CorruptIndexError, DecodeError, ManifestError, ShardstreamError
from shardstream.decode import Decoder
from shardstream import reader as reader_module
from shardstream.format import MANIFEST_NAME, Manifest, ShardIndex
from shardstream.shardfile import seek_table
from shardstream.synthetic import synthetic_jpeg

try:  # tests/ may or may not be a package
    from .test_format import python_cut
except ImportError:
    from test_format import python_cut

# -- settings --------------------------------------------------------------------------------------

_LONG = int(os.environ.get("SHARDSTREAM_FUZZ_EXAMPLES", "0") or 0)
MAX_EXAMPLES = _LONG or 60
WATCHDOG_S = float(os.environ.get("SHARDSTREAM_FUZZ_TIMEOUT", "5"))
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=not _LONG,  # CI: the same examples every run; long runs explore
    database=None,  # no .hypothesis folder in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

PACKAGE_DIR = os.path.dirname(shardstream.__file__)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BLOCK = 512

# -- the dataset -----------------------------------------------------------------------------------

N_SAMPLES = 11
SHARD_SIZE = 32000  # two shards (6 and 5 samples)
FRAME_SIZE = 8000  # three data frames per shard, about two samples each
LONG_KEY = "long/" + "k" * 110  # member names over 100 bytes: a pax record


def make_samples() -> list[dict[str, Any]]:
    """Deterministic samples with varied fields (images, ints, text, json, npy, msgpack, raw)."""
    out = []
    for i in range(N_SAMPLES):
        s: dict[str, Any] = {
            "__key__": LONG_KEY if i == 7 else f"part{i % 2}/sample_{i:03d}",
            "cls": i % 3,
            "txt": f"text of sample {i} " * (i + 1),
            "json": {"i": i, "tags": ["t"] * (i % 4)},
        }
        if i % 2 == 0:
            s["jpg"] = synthetic_jpeg(i, 24 + i, 16 + i, quality=60)
        if i % 3 == 0:
            s["npy"] = np.arange(i + 2, dtype=np.int16)
        if i % 4 == 1:
            s["msgpack"] = {"n": i, "b": bytes(range(i))}
        if i == 5:
            s["bin"] = np.random.default_rng(5).bytes(1500)
        out.append(s)
    return out


def build_dataset(root: str | Path, compression: str) -> str:
    root = str(root)
    with shardstream.ShardWriter(root, shard_size=SHARD_SIZE, compression=compression, frame_size=FRAME_SIZE) as w:
        for s in make_samples():
            w.write(s)
    return root


def _strip(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sample.items() if k != "__url__"}


@dataclasses.dataclass(repr=False)
class Corpus:
    """A valid dataset, its bytes, and where its structures lie (for targeted mutations)."""

    root: str  # pristine files (never modified)
    work: str  # the dataset directory mutated and restored for each example
    noindex: str  # copies of the shards without their index files
    compression: str
    files: dict[str, bytes]
    shards: list[str]
    indexes: dict[str, ShardIndex]  # by shard name
    raw: dict[str, bytes]  # the uncompressed tar stream of each shard
    header_offsets: dict[str, list[int]]  # tar header blocks in the raw stream
    record_spans: dict[str, list[tuple[int, int]]]  # pax / long-name record data in the raw stream (unchecksummed)
    frame_offsets: dict[str, list[int]]  # zstd: data frames, end frame, seek table (file offsets)
    originals: dict[str, dict[str, Any]]  # sample by key, without __url__

    @property
    def names(self) -> list[str]:
        return sorted(self.files)

    def __repr__(self) -> str:  # hypothesis prints the fixture with a failing example: keep it short
        return f"Corpus({self.compression!r}, {self.root!r})"


def make_corpus(base: str | Path, compression: str) -> Corpus:
    base = Path(base)
    root = build_dataset(base / "pristine", compression)
    work, noindex = base / "work", base / "noindex"
    shutil.copytree(root, work)
    noindex.mkdir()
    files = {p.name: p.read_bytes() for p in Path(root).iterdir() if p.is_file()}
    source = shardstream.open_dataset(root)
    shards = [ref.name for ref in source.shards]
    indexes, raw, headers, frames, originals, records = {}, {}, {}, {}, {}, {}
    for ref in source.shards:
        shutil.copy(Path(root) / ref.name, noindex / ref.name)
        reader = ref.reader()
        index = reader.index
        indexes[ref.name] = index
        data = files[ref.name]
        if compression == "zstd":
            raw[ref.name] = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
            frames[ref.name] = [int(o) for o in index.frame_offsets] + [len(data) - _seek_table_size(data)]
        else:
            raw[ref.name] = data
            frames[ref.name] = []
        headers[ref.name], records[ref.name] = _tar_headers(raw[ref.name])
        for s in reader:
            originals[s["__key__"]] = _strip(s)
    assert len(shards) >= 2 and len(originals) == N_SAMPLES
    if compression == "zstd":
        assert all(len(indexes[s].frame_offsets) >= 4 for s in shards), "want several frames per shard"
    return Corpus(root, str(work), str(noindex), compression, files, shards, indexes, raw, headers, records, frames,
                  originals)


def _seek_table_size(data: bytes) -> int:
    return int.from_bytes(data[-9:-5], "little") * 8 + 9 + 8


def _tar_headers(raw: bytes) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets of every header block, and the spans of pax / long-name record data (not covered by a checksum)."""
    out, records = [], []
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for m in tar.getmembers():
            out.append(m.offset)  # the first header block of the member (a pax record's, if any)
            if m.offset_data - BLOCK != m.offset:
                out.append(m.offset_data - BLOCK)  # the ustar header after a pax record
                records.append((m.offset + BLOCK, m.offset_data - BLOCK))
    return out, records


# -- drawing mutations -------------------------------------------------------------------------------


class Chooser:
    """Where random choices come from: hypothesis (`HypothesisChooser`) or `random.Random`."""

    def integer(self, lo: int, hi: int) -> int:  # inclusive
        raise NotImplementedError

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def blob(self, lo: int, hi: int) -> bytes:
        raise NotImplementedError


class HypothesisChooser(Chooser):
    def __init__(self, data: Any):
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options: Sequence[Any]) -> Any:
        return self.data.draw(st.sampled_from(list(options)))

    def blob(self, lo: int, hi: int) -> bytes:
        return self.data.draw(st.binary(min_size=lo, max_size=hi))


class RandomChooser(Chooser):
    def __init__(self, rng: Any):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def blob(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One mutation of one file. `kind` is flip, truncate, insert, overwrite (file bytes) or
    raw (in-place edit of a shard's uncompressed tar stream, written back consistently)."""

    target: str
    kind: str
    offset: int = 0
    data: bytes = b""
    edits: tuple[tuple[int, int], ...] = ()  # flip: (offset, xor mask)
    note: str = ""

    def __repr__(self) -> str:  # short enough for a failure report, exact enough to replay
        data = self.data if len(self.data) <= 48 else self.data[:48] + b"..."
        return (f"Mutation({self.target!r}, {self.kind!r}, offset={self.offset}, data={data!r}, "
                f"edits={self.edits!r}, note={self.note!r})")


FILE_KINDS = ("flip", "truncate", "insert", "overwrite")

# Size fields for forged tar headers: valid, odd and hostile spellings. Negative sizes once
# hung or crashed the parser (fixed; `hostile_sizes=False` leaves them out).
SIZE_FIELDS = (
    b"00000000000\0", b"00000000001\0", b"00000000777\0", b"00000001000\0", b"00000100000\0",
    b"77777777777\0", b"20000000001\0", b"\x80" + (1 << 40).to_bytes(11, "big"), b"\x80" + bytes(11),
    b"zzzzzzzzzzz\0", b"           ", b"0000_001000\0", b" 1000      \0", b"\0" * 12,
)
NEGATIVE_SIZE_FIELDS = (b"-0000000001\0", b"-0000001000\0", b"-0000002000\0", b"     -1000\0 ")
TYPEFLAGS = (b"0", b"\0", b"7", b"1", b"2", b"5", b"x", b"L", b"g", b"K", b"S", b"V", b"\xff")


def forge_header(name: bytes, size_field: bytes, typeflag: bytes, *, magic: bytes = b"ustar\x0000",
                 prefix: bytes = b"") -> bytes:
    """A 512-byte tar header with these fields and a valid checksum."""
    ti = tarfile.TarInfo("x")
    block = bytearray(ti.tobuf(format=tarfile.USTAR_FORMAT))
    block[0:100] = name[:100].ljust(100, b"\0")
    block[124:136] = size_field[:12].ljust(12, b"\0")
    block[156:157] = typeflag
    block[257:265] = magic[:8].ljust(8, b"\0")
    block[345:500] = prefix[:155].ljust(155, b"\0")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def draw_mutation(ch: Chooser, corpus: Corpus, family: str, *, hostile_sizes: bool = True) -> Mutation:
    """A mutation of the given family: "shard", "raw", "index" or "manifest"."""
    if family == "raw":
        return _draw_raw(ch, corpus, hostile_sizes)
    if family == "shard":
        target = ch.choice(corpus.shards)
    elif family == "index":
        target = ch.choice([s + ".idx" for s in corpus.shards])
    elif family == "manifest":
        target = MANIFEST_NAME
    else:
        raise ValueError(family)
    data = corpus.files[target]
    size = len(data)
    kind = ch.choice(FILE_KINDS)
    if kind == "flip":
        edits = tuple((ch.integer(0, size - 1), ch.integer(1, 255)) for _ in range(ch.integer(1, 4)))
        return Mutation(target, "flip", edits=edits)
    if kind == "truncate":
        return Mutation(target, "truncate", offset=ch.integer(0, size - 1))
    if kind == "insert":
        return Mutation(target, "insert", offset=ch.integer(0, size), data=ch.blob(1, 600))
    # overwrite a header block
    if target.endswith(".tar"):
        offset = ch.choice(corpus.header_offsets[target])
        content = ch.choice(("random", "zeros", "forged"))
        if content == "forged":
            blob = forge_header(ch.blob(0, 100), ch.choice(SIZE_FIELDS), ch.choice(TYPEFLAGS))
            blob = bytearray(blob)
            blob[148] ^= ch.integer(1, 7)  # not raw: the file-level forgery keeps a wrong checksum
            blob = bytes(blob)
        else:
            blob = ch.blob(BLOCK, BLOCK) if content == "random" else bytes(BLOCK)
        return Mutation(target, "overwrite", offset=offset, data=blob, note=content)
    if target.endswith(".zst"):
        offset = ch.choice(corpus.frame_offsets[target])
        content = ch.choice(("random", "zeros", "magic"))
        n = ch.integer(1, 18)
        blob = ch.blob(n, n) if content == "random" else bytes(n) if content == "zeros" else ZSTD_MAGIC + ch.blob(1, 14)
        return Mutation(target, "overwrite", offset=offset, data=blob, note=content)
    offset = ch.choice((0, 1, ch.integer(0, size - 1)))  # a msgpack map header, or anywhere
    return Mutation(target, "overwrite", offset=offset, data=ch.blob(1, 16))


def _draw_raw(ch: Chooser, corpus: Corpus, hostile_sizes: bool) -> Mutation:
    shard = ch.choice(corpus.shards)
    raw = corpus.raw[shard]
    end = corpus.header_offsets[shard][-1] + BLOCK  # keep edits inside the members
    if ch.choice(("flip", "forge")) == "flip":
        edits = tuple((ch.integer(0, end - 1), ch.integer(1, 255)) for _ in range(ch.integer(1, 4)))
        return Mutation(shard, "raw", edits=edits, note="flip")
    offset = ch.choice(corpus.header_offsets[shard])
    old_name = raw[offset : offset + 100].split(b"\0", 1)[0]
    other = raw[ch.choice(corpus.header_offsets[shard]) :][:100].split(b"\0", 1)[0]
    name = ch.choice((old_name, other, b"", b"../../escape.txt", b"/abs.txt", b"a" * 100, b"\xff\xfe.jpg",
                      old_name.replace(b".", b"_", 1), ch.blob(0, 100)))
    sizes = SIZE_FIELDS + (NEGATIVE_SIZE_FIELDS if hostile_sizes else ())
    size = ch.choice(sizes)
    typeflag = ch.choice(TYPEFLAGS)
    magic = ch.choice((b"ustar\x0000", b"ustar  \0", b"\0" * 8))
    prefix = ch.choice((b"", b"", b"pre/fix", b"\xff"))
    blob = forge_header(name, size, typeflag, magic=magic, prefix=prefix)
    return Mutation(shard, "raw", offset=offset, data=blob, note="forge")


# -- applying mutations --------------------------------------------------------------------------------


def apply_mutation(corpus: Corpus, m: Mutation) -> dict[str, bytes]:
    """The files a mutation changes: {name: new bytes}."""
    if m.kind == "raw":
        return _apply_raw(corpus, m)
    data = bytearray(corpus.files[m.target])
    if m.kind == "flip":
        for offset, mask in m.edits:
            data[offset] ^= mask
    elif m.kind == "truncate":
        del data[m.offset :]
    elif m.kind == "insert":
        data[m.offset : m.offset] = m.data
    elif m.kind == "overwrite":
        data[m.offset : m.offset + len(m.data)] = m.data
    else:
        raise ValueError(m.kind)
    return {m.target: bytes(data)}


def _apply_raw(corpus: Corpus, m: Mutation) -> dict[str, bytes]:
    shard = m.target
    raw = bytearray(corpus.raw[shard])
    if m.edits:
        for offset, mask in m.edits:
            raw[offset] ^= mask
    else:
        raw[m.offset : m.offset + len(m.data)] = m.data
    raw = bytes(raw)
    out: dict[str, bytes] = {}
    info = _manifest_entry(corpus, shard)
    if corpus.compression == "zstd":
        index = corpus.indexes[shard]
        bounds = [int(o) for o in index.frame_raw_offsets]
        cctx = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
        pieces = [raw[a:b] for a, b in zip(bounds[:-1], bounds[1:])] + [raw[bounds[-1] :]]
        frames = [cctx.compress(p) for p in pieces]
        data = b"".join(frames) + seek_table([(len(f), len(p)) for f, p in zip(frames, pieces)])
        offsets = np.cumsum([0] + [len(f) for f in frames[:-1]]).astype(np.int64)
        new_index = dataclasses.replace(index, frame_offsets=offsets).to_bytes()  # keeps every other field
        out[info["index"]] = new_index
        info.update(index_bytes=len(new_index), index_sha256=hashlib.sha256(new_index).hexdigest())
    else:
        data = raw
    out[shard] = data
    info.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest = msgpack.unpackb(corpus.files[MANIFEST_NAME], raw=False)
    manifest["shards"] = [info if s["name"] == shard else s for s in manifest["shards"]]
    out[MANIFEST_NAME] = msgpack.packb(manifest, use_bin_type=True)
    return out


def _manifest_entry(corpus: Corpus, shard: str) -> dict[str, Any]:
    manifest = msgpack.unpackb(corpus.files[MANIFEST_NAME], raw=False)
    return dict(next(s for s in manifest["shards"] if s["name"] == shard))


# -- reading under a watchdog, and classifying what happened ---------------------------------------------


class Hang(BaseException):
    """Raised by the watchdog in the reading thread (BaseException: no library handler eats it)."""


@dataclasses.dataclass
class Outcome:
    kind: str  # "samples", "error" (a ShardstreamError), "known" (a KNOWN_BUGS signature), "other", "hang"
    label: str  # "samples", the error class, or the exception signature
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    detail: str = ""
    error: BaseException | None = dataclasses.field(default=None, repr=False)


def _library_frames(error: BaseException) -> list[str]:
    """'module.function' of every shardstream frame in the traceback, outermost first."""
    out = []
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith(PACKAGE_DIR + os.sep):
            out.append(f"{os.path.basename(frame.filename)[:-3]}.{frame.name}")
    return out


def signature(error: BaseException) -> str:
    """Exception type and the innermost shardstream frame and line: 'ValueError@tario.py:285 (iter_stream_members)'."""
    where = "?"
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith(PACKAGE_DIR + os.sep):
            where = f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
            break
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ in ("builtins", __name__) else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}@{where}"


@dataclasses.dataclass(frozen=True)
class KnownBug:
    id: str
    summary: str
    matches: Callable[[BaseException], bool]
    reproducer: str  # the xfail test that pins it


KNOWN_BUGS: tuple[KnownBug, ...] = (
    # Empty: every exception or hang the fuzzing found is fixed and pinned by a regression test below
    # (tar-negative-size-hang, tar-negative-size-read, index-offset-read-size, index-frame-bounds).
)


def classify(error: BaseException) -> Outcome:
    if isinstance(error, ShardstreamError):
        return Outcome("error", type(error).__name__, detail=str(error)[:200], error=error)
    for bug in KNOWN_BUGS:
        try:
            hit = bug.matches(error)
        except Exception:
            hit = False
        if hit:
            return Outcome("known", f"{bug.id}: {signature(error)}", detail=repr(error)[:200], error=error)
    kind = "hang" if isinstance(error, Hang) else "other"
    return Outcome(kind, signature(error), detail="".join(traceback.format_exception(error))[-1500:], error=error)


def watched(fn: Callable[[], list[dict[str, Any]]], timeout: float | None = None) -> Outcome:
    """Run `fn` with a SIGALRM watchdog (`timeout`, default WATCHDOG_S); its samples, or the classified exception."""
    timeout = WATCHDOG_S if timeout is None else timeout
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        raise RuntimeError("the fuzz watchdog needs the main thread (SIGALRM)")

    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"read did not finish within {timeout} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            samples = fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as error:  # noqa: BLE001 - classified; KeyboardInterrupt still propagates
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        return classify(error)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return Outcome("samples", "samples", samples)


def _picks(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1}) if n else []


def read_dataset(root: str) -> list[dict[str, Any]]:
    out = []
    source = shardstream.open_dataset(root)
    for ref in source.shards:
        reader = ref.reader()
        samples = list(reader)
        n = len(reader)
        assert len(samples) == n, f"{ref.name}: iterated {len(samples)} samples, len() says {n}"
        out += samples
        out += [reader[i] for i in _picks(n)]
    return out


def read_shard(path: str) -> list[dict[str, Any]]:
    reader = shardstream.open_shard(path)
    out = list(reader)
    if isinstance(reader, shardstream.ShardReader) or path.endswith(".tar"):
        n = len(reader)
        out += [reader[i] for i in _picks(n)]
    return out


PATHS_BY_FAMILY = {"shard": ("dataset", "shard", "noindex"), "raw": ("dataset", "shard", "noindex"),
                   "index": ("dataset", "shard"), "manifest": ("dataset",)}


def run_mutation(corpus: Corpus, m: Mutation, family: str,
                 timeout: float | None = None) -> tuple[dict[str, bytes], dict[str, Outcome]]:
    """Apply `m` in the work folder, read it every relevant way, restore; (changed files, outcome by path)."""
    changed = apply_mutation(corpus, m)
    shard = m.target[: -len(".idx")] if m.target.endswith(".idx") else m.target
    for name, data in changed.items():
        Path(corpus.work, name).write_bytes(data)
        if name in corpus.shards:
            Path(corpus.noindex, name).write_bytes(data)
    outcomes: dict[str, Outcome] = {}
    try:
        for path in PATHS_BY_FAMILY[family]:
            if path == "dataset":
                outcomes[path] = watched(lambda: read_dataset(corpus.work), timeout)
            elif path == "shard":
                outcomes[path] = watched(lambda: read_shard(os.path.join(corpus.work, shard)), timeout)
            else:
                outcomes[path] = watched(lambda: read_shard(os.path.join(corpus.noindex, shard)), timeout)
    finally:
        for name in changed:
            Path(corpus.work, name).write_bytes(corpus.files[name])
            if name in corpus.shards:
                Path(corpus.noindex, name).write_bytes(corpus.files[name])
    return changed, outcomes


def short_reads(corpus: Corpus, m: Mutation, outcomes: dict[str, Outcome]) -> int:
    """Reads that returned samples but not all of the shard's samples, whole (no error): only possible without
    an index, where a tar that ends early at a member boundary is accepted (as GNU tar does)."""
    shard = m.target[: -len(".idx")] if m.target.endswith(".idx") else m.target
    if shard not in corpus.shards:
        return 0
    keys = set(corpus.indexes[shard].keys)
    short = 0
    for path, outcome in outcomes.items():
        if path != "noindex" or outcome.kind != "samples":
            continue
        got = {s["__key__"]: set(s) - {"__url__"} for s in outcome.samples}
        if set(got) != keys or any(got[k] != set(corpus.originals[k]) for k in got if k in corpus.originals):
            short += 1
    return short


SILENT_BUGS = {
    # Fixed since, no longer tolerated: zstd-checksum-flag, zero-block-drops-fields, truncated-zstd-stream
    # (see RELIABILITY.md).
    "format-limit": "not a bug: a tar header changed so that its byte-sum checksum still matches (e.g. two flips "
                    "of +2 and -2), or a changed pax path record (member data), cannot be detected by any tar reader; "
                    "uncompressed shards have no other checksum",
}


def _header_changed_checksum_intact(corpus: Corpus, shard: str, data: bytes) -> bool:
    """True if a member's name or header changed in a way no tar reader can notice, a limit of the format, not of
    shardstream: a header that still passes its checksum (a plain byte sum: flips of +2 and -2 cancel), or the
    data of a pax / long-name record (member data, covered by no checksum at all)."""
    from shardstream import tario

    original = corpus.raw[shard]
    if any(data[a:b] != original[a:b] for a, b in corpus.record_spans[shard]):
        return True
    for h in corpus.header_offsets[shard]:
        block = data[h : h + BLOCK]
        if len(block) == BLOCK and block != original[h : h + BLOCK] and any(block):
            try:
                tario.parse_header(block, "", h, True)
                return True
            except ShardstreamError:
                continue
    return False


def check_outcomes(corpus: Corpus, m: Mutation, family: str, changed: dict[str, bytes],
                   outcomes: dict[str, Outcome], known: list[str] | None = None) -> list[str]:
    """The properties; returns the violations (empty when all hold).

    Deviations explained by a known silent bug (SILENT_BUGS) are not violations; they are appended to
    `known` as "bug-id: path: what", for the fuzz report.
    """
    problems: list[str] = []
    known = [] if known is None else known
    for path, outcome in outcomes.items():
        if outcome.kind in ("other", "hang"):
            problems.append(f"{path}: {outcome.kind} {outcome.label}\n{outcome.detail}")
    # zstd: frame checksums make a file-level mutation unable to change a returned sample.
    if corpus.compression == "zstd" and family in ("shard", "manifest", "index"):
        for path, outcome in outcomes.items():
            if family == "index" and path == "shard":
                continue  # an index without a manifest is trusted as found
            for s in outcome.samples:
                original = corpus.originals.get(s["__key__"])
                if _strip(s) == original:
                    continue
                problems.append(f"{path}: sample {s['__key__']!r} returned with changed bytes")
                break
    # Uncompressed: a file-level mutation may change a returned field's bytes, never which fields a sample
    # has through an index. Read without an index, a zero block is the end of the archive and a tar may
    # end at a member boundary (accepted, as GNU tar does: see `short_reads`), so there the fields are a subset.
    # Exempt: changes no tar checksum covers (`_header_changed_checksum_intact`), a limit of the format.
    if corpus.compression == "none" and family == "shard":
        for path, outcome in outcomes.items():
            for s in outcome.samples:
                original = corpus.originals.get(s["__key__"])
                fields = set(_strip(s)) - {"__key__"}
                expected = set(original or ()) - {"__key__"}
                if original is not None and (fields <= expected if path == "noindex" else fields == expected):
                    continue
                what = (f"{path}: sample {s['__key__']!r} returned with fields {sorted(fields)}, "
                        f"expected {sorted(expected)}")
                if _header_changed_checksum_intact(corpus, m.target, changed[m.target]):
                    known.append(f"format-limit: {what}")  # any tar reader takes such a header as it is
                else:
                    problems.append(what)
                break
    # A changed index, read through its manifest: the checksum there must catch it.
    if family == "index" and changed[m.target] != corpus.files[m.target]:
        outcome = outcomes["dataset"]
        if outcome.kind != "error" or outcome.label != "CorruptIndexError":
            problems.append(f"dataset: a changed index gave {outcome.label}, not CorruptIndexError")
    # A manifest cannot change what a shard holds.
    if family == "manifest":
        for s in outcomes["dataset"].samples:
            if _strip(s) != corpus.originals.get(s["__key__"]):
                problems.append(f"dataset: manifest mutation changed sample {s['__key__']!r}")
                break
    return problems


# -- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Corpus]:
    return {c: make_corpus(tmp_path_factory.mktemp(f"fuzz-{c}"), c) for c in ("zstd", "none")}


def _fuzz_one(corpus: Corpus, data: Any, family: str, *, hostile_sizes: bool = True) -> None:
    m = draw_mutation(HypothesisChooser(data), corpus, family, hostile_sizes=hostile_sizes)
    changed, outcomes = run_mutation(corpus, m, family)
    for path, outcome in outcomes.items():
        event(f"{path}: {outcome.label}")
    known: list[str] = []
    problems = check_outcomes(corpus, m, family, changed, outcomes, known)
    for note in known:
        event(f"known silent bug {note.split(':')[0]}")
    assert not problems, f"{m!r}\n" + "\n".join(problems)


# -- the property tests ----------------------------------------------------------------------------------

COMPRESSIONS = ("zstd", "none")


@pytest.mark.parametrize("compression", COMPRESSIONS)
@FUZZ
@given(data=st.data())
def test_mutated_shard_files(corpora, compression, data):
    """Flip, truncate, insert into, overwrite a header block of a shard file."""
    _fuzz_one(corpora[compression], data, "shard")


@pytest.mark.parametrize("compression", COMPRESSIONS)
@FUZZ
@given(data=st.data())
def test_hostile_tar_streams(corpora, compression, data):
    """Byte flips and forged (checksum-valid) tar headers behind valid zstd frames and checksums."""
    _fuzz_one(corpora[compression], data, "raw")


@pytest.mark.skipif(not reader_module.TARCUT, reason="the _tarcut extension is not built")
@pytest.mark.parametrize("family", ("shard", "raw"))
@pytest.mark.parametrize("compression", COMPRESSIONS)
@FUZZ
@given(data=st.data())
def test_c_and_python_cut_agree(corpora, compression, family, data):
    """`_tarcut` handles the common layout and hands anything else to the Python parser: on every
    damaged or hostile shard both give the same samples, or errors of the same class."""
    corpus = corpora[compression]
    m = draw_mutation(HypothesisChooser(data), corpus, family)
    _, fast = run_mutation(corpus, m, family)
    with python_cut():
        _, slow = run_mutation(corpus, m, family)
    for path in fast:
        assert (fast[path].kind, fast[path].label) == (slow[path].kind, slow[path].label), (m, path, fast[path], slow[path])
        assert fast[path].samples == slow[path].samples, (m, path)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@FUZZ
@given(data=st.data())
def test_mutated_index_files(corpora, compression, data):
    _fuzz_one(corpora[compression], data, "index")


@pytest.mark.parametrize("compression", COMPRESSIONS)
@FUZZ
@given(data=st.data())
def test_mutated_manifest(corpora, compression, data):
    _fuzz_one(corpora[compression], data, "manifest")


def test_fixture_dataset_reads_back(corpora):
    """The pristine datasets themselves: every path returns every sample, unchanged."""
    for corpus in corpora.values():
        assert len(read_dataset(corpus.root)) == N_SAMPLES + sum(len(_picks(len(corpus.indexes[s]))) for s in corpus.shards)
        for shard in corpus.shards:
            for s in read_shard(os.path.join(corpus.noindex, shard)):
                assert _strip(s) == corpus.originals[s["__key__"]]
        assert LONG_KEY in corpus.originals  # the pax record is exercised


def test_fuzz_harness_catches_what_it_should(corpora):
    """The checker itself: a non-shardstream exception and a hang are reported, a ShardstreamError is not."""
    def boom() -> list:
        raise KeyError("x")

    def loop() -> list:
        while True:
            pass

    assert watched(boom).kind == "other"
    assert watched(loop, timeout=0.2).kind == "hang"
    assert watched(lambda: (_ for _ in ()).throw(CorruptIndexError("x"))).kind == "error"
    corpus = corpora["zstd"]
    payload = corpus.frame_offsets[corpus.shards[0]][0] + 40
    changed, outcomes = run_mutation(corpus, Mutation(corpus.shards[0], "flip", edits=((payload, 1),)), "shard")
    assert all(o.kind == "error" for o in outcomes.values()), outcomes


# -- reproducers of the bugs found: regression tests once fixed, xfail(strict) while open ---------------------


def _forged_plain_shard(corpus: Corpus, size_field: bytes) -> dict[str, bytes]:
    """The first shard with its first member header replaced by a checksum-valid one with this size field
    (written back consistently: zstd frames recompressed, index and manifest checksums updated)."""
    shard = corpus.shards[0]
    first = corpus.raw[shard][:100].split(b"\0", 1)[0]  # the first member's own name
    return _apply_raw(corpus, Mutation(shard, "raw", offset=0, data=forge_header(first, size_field, b"0")))


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_bug_negative_tar_size_hangs_indexed_reader(corpora, compression):
    corpus = corpora[compression]
    changed = _forged_plain_shard(corpus, b"-0000001000\0")
    with _files(corpus, changed):
        outcome = watched(lambda: list(shardstream.open_dataset(corpus.work).shards[0].reader()), timeout=2)
    assert outcome.kind == "error", f"{outcome.kind}: {outcome.label}"


def test_bug_negative_tar_size_crashes_stream_reader(corpora):
    corpus = corpora["none"]
    changed = _forged_plain_shard(corpus, b"-0000001000\0")
    with _files(corpus, changed):
        outcome = watched(lambda: read_shard(os.path.join(corpus.noindex, corpus.shards[0])), timeout=2)
    assert outcome.kind == "error", f"{outcome.kind}: {outcome.label}"


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_bug_huge_index_offset_is_memory_error(corpora, compression):
    corpus = corpora[compression]
    shard = corpus.shards[0]
    index = corpus.indexes[shard]
    if compression == "zstd":
        frames = index.frame_offsets.copy()
        frames[-1] = 1 << 50
        bad = dataclasses.replace(index, frame_offsets=frames)
    else:
        offsets = index.sample_offsets.copy()
        offsets[-1] = 1 << 50
        bad = dataclasses.replace(index, sample_offsets=offsets)
    with _files(corpus, {shard + ".idx": bad.to_bytes()}):
        outcome = watched(lambda: list(shardstream.open_shard(os.path.join(corpus.work, shard))))
    assert outcome.kind == "error", f"{outcome.kind}: {outcome.label}"


def test_bug_index_frame_bounds_negative_read(corpora):
    """Was: frame_raw_offsets[0] past sample_offsets[0] made frame_of(0) -1, and reader[0] a negative read (ValueError)."""
    corpus = corpora["zstd"]
    shard = corpus.shards[0]
    index = corpus.indexes[shard]
    raw = index.frame_raw_offsets.copy()
    raw[0] = 100  # the first frame no longer starts where the first sample does
    with _files(corpus, {shard + ".idx": dataclasses.replace(index, frame_raw_offsets=raw).to_bytes()}):
        outcome = watched(lambda: [shardstream.open_shard(os.path.join(corpus.work, shard))[0]])
    assert outcome.kind == "error", f"{outcome.kind}: {outcome.label}"


def test_bug_frame_without_checksum_flag_is_accepted(corpora):
    corpus = corpora["zstd"]
    shard = corpus.shards[0]
    frame = corpus.frame_offsets[shard][0]
    data = bytearray(corpus.files[shard])
    data[frame + 4] &= ~0x04  # Frame_Header_Descriptor: Content_Checksum_flag off
    silent = []
    for position in range(frame + 6, min(frame + 134, corpus.frame_offsets[shard][1])):  # header and first block
        mutated = bytearray(data)
        mutated[position] ^= 0x01
        with _files(corpus, {shard: bytes(mutated)}):
            outcome = watched(lambda: list(shardstream.open_dataset(corpus.work).shards[0].reader()))
        if any(_strip(s) != corpus.originals[s["__key__"]] for s in outcome.samples):
            silent.append(position)
    assert not silent, f"{len(silent)} single-byte payload flips returned changed samples, e.g. byte {silent[0]}"


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_bug_zero_block_inside_a_sample_drops_fields(corpora, compression):
    corpus = corpora[compression]
    shard = corpus.shards[0]
    third = corpus.header_offsets[shard][2]  # the third member of the first sample
    if compression == "none":
        data = bytearray(corpus.files[shard])
        data[third : third + BLOCK] = bytes(BLOCK)
        changed = {shard: bytes(data)}
    else:  # the same raw damage behind valid zstd frames and checksums
        changed = _apply_raw(corpus, Mutation(shard, "raw", offset=third, data=bytes(BLOCK)))
    key = corpus.indexes[shard].keys[0]
    with _files(corpus, changed):
        outcome = watched(lambda: [shardstream.open_dataset(corpus.work).shards[0].reader()[0]])
    assert outcome.kind == "error" or _strip(outcome.samples[0]) == corpus.originals[key], (
        f"returned {sorted(_strip(outcome.samples[0]))}, the shard holds {sorted(corpus.originals[key])}")


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_truncated_tar_zst_without_index_raises(corpora, damage):
    corpus = corpora["zstd"]
    shard = corpus.shards[0]
    frame = corpus.frame_offsets[shard][1]  # the second data frame
    if damage == "cut":
        candidates = [corpus.files[shard][: frame + 100]]
    else:  # single-byte flips in the frame header and first block header
        candidates = []
        for position in range(frame + 4, frame + 16):
            for mask in (0x08, 0x10, 0x20, 0x40, 0x58, 0x80):
                data = bytearray(corpus.files[shard])
                data[position] ^= mask
                candidates.append(bytes(data))
    silent = 0
    for data in candidates:
        with _files(corpus, {shard: data}):
            outcome = watched(lambda: read_shard(os.path.join(corpus.noindex, shard)))
        if outcome.kind == "samples" and len(outcome.samples) < len(corpus.indexes[shard]):
            silent += 1
    assert not silent, f"{silent} of {len(candidates)} damaged streams returned fewer samples without error"


class _files:
    """Context manager: write `changed` into the corpus work folder, restore on exit."""

    def __init__(self, corpus: Corpus, changed: dict[str, bytes]):
        self.corpus, self.changed = corpus, changed

    def __enter__(self) -> None:
        for name, data in self.changed.items():
            Path(self.corpus.work, name).write_bytes(data)
            if name in self.corpus.shards:
                Path(self.corpus.noindex, name).write_bytes(data)

    def __exit__(self, *exc: Any) -> None:
        for name in self.changed:
            Path(self.corpus.work, name).write_bytes(self.corpus.files[name])
            if name in self.corpus.shards:
                Path(self.corpus.noindex, name).write_bytes(self.corpus.files[name])


# -- hostile manifests -------------------------------------------------------------------------------------


def _manifest_dict(corpus: Corpus) -> dict[str, Any]:
    return msgpack.unpackb(corpus.files[MANIFEST_NAME], raw=False)


def _with_manifest(corpus: Corpus, body: Any) -> _files:
    data = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return _files(corpus, {MANIFEST_NAME: data})


def _set_shard(field: str, value: Any) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        m["shards"][0][field] = value
    return change


def _set(field: str, value: Any) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        m[field] = value
    return change


HOSTILE_MANIFESTS = {
    "name with slash": _set_shard("name", "sub/shard-000000.tar.zst"),
    "name parent": _set_shard("name", "../shard-000000.tar.zst"),
    "name dotdot": _set_shard("name", ".."),
    "name absolute": _set_shard("name", "/etc/passwd"),
    "name backslash": _set_shard("name", "..\\evil"),
    "name NUL": _set_shard("name", "shard\0.tar"),
    "name empty": _set_shard("name", ""),
    "index parent": _set_shard("index", "../x.idx"),
    "negative samples": lambda m: (m["shards"][0].__setitem__("samples", -1), m.__setitem__("samples", -1)),
    "samples str": _set_shard("samples", "5"),
    "samples float": _set_shard("samples", 5.0),
    "samples bool": _set("samples", True),
    "total disagrees": _set("samples", 10**12),
    "shards not a list": _set("shards", {"a": 1}),
    "shard entry not a map": _set("shards", [1, 2]),
    "shard entry missing name": lambda m: m["shards"][0].pop("name"),
    "format wrong": _set("format", "webdataset"),
    "format missing": lambda m: m.pop("format"),
    "version newer": _set("version", 2),
    "version str": _set("version", "1"),
    "compression unknown": _set("compression", "lz4"),
    "compression int": _set("compression", 3),
    "classes not a list": _set("classes", "abc"),
    "options not a map": _set("options", [1]),
    "skipped entry int": _set("skipped", [1]),
    "skipped entry empty map": _set("skipped", [{}]),
    "skipped not a list": _set("skipped", 7),
    "ignored str": _set("ignored", "0"),
    "writer int": _set("writer", 1),
    "not a map": lambda m: None,  # replaced below by a list
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifest_is_manifest_error(corpora, case):
    corpus = corpora["zstd"]
    body: Any = _manifest_dict(corpus)
    HOSTILE_MANIFESTS[case](body)
    if case == "not a map":
        body = [1, 2, 3]
    with _with_manifest(corpus, body):
        outcome = watched(lambda: read_dataset(corpus.work))
    assert outcome.kind == "error" and outcome.label == "ManifestError", f"{outcome.label}: {outcome.detail}"


@pytest.mark.parametrize("header", [
    b"\xc6\x80\x00\x00\x00",  # bin 32 of 2 GiB
    b"\xdb\x80\x00\x00\x00",  # str 32 of 2 GiB
    b"\xdd\x80\x00\x00\x00",  # array of 2**31 items
    b"\xdf\x80\x00\x00\x00",  # map of 2**31 pairs
    b"\xdd\x03\xff\xff\xff",  # array just under the unpacker's limit (2**26 - 1 items)
    b"\xdf\x00\x00\xff\xff",  # map of 65535 pairs
    b"\x81\xa6shards\xdd\x03\xff\xff\xff",  # a valid map whose shard list claims 2**26 - 1 entries
])
@pytest.mark.parametrize("kind", ["manifest", "index"])
def test_msgpack_size_claims_refused_without_allocating(corpora, header, kind):
    """A few bytes claiming a 2 GB string, a huge array or map: refused, with no large allocation."""
    data = header + b"\x00" * 16
    tracemalloc.start()
    try:
        if kind == "manifest":
            with pytest.raises(ManifestError):
                Manifest.from_bytes(data, "hostile.msgpack")
        else:
            with pytest.raises(CorruptIndexError):
                ShardIndex.from_bytes(data, "hostile.idx")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB allocated for a {len(data)}-byte input"
    corpus = corpora["zstd"]
    with _with_manifest(corpus, data) if kind == "manifest" else _files(corpus, {corpus.shards[0] + ".idx": data}):
        outcome = watched(lambda: read_dataset(corpus.work))
    assert outcome.kind == "error", outcome.label


def test_msgpack_field_decoder_refuses_huge_claims():
    decoder = Decoder(images=None)
    for claim in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff"):
        tracemalloc.start()
        try:
            with pytest.raises(DecodeError):
                decoder({"__key__": "k", "msgpack": claim + b"\x00" * 8})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, claim


def _absurd_count(m: dict, count: int) -> None:
    others = sum(s["samples"] for s in m["shards"][1:])
    m["shards"][0]["samples"] = count
    m["samples"] = count + others


@pytest.mark.parametrize("count", [2**40, 2**63 - 1, 2**64 - 64])
def test_absurd_sample_counts_are_manifest_error(corpora, count):
    corpus = corpora["zstd"]
    body = _manifest_dict(corpus)
    _absurd_count(body, count)
    with _with_manifest(corpus, body):
        outcome = watched(lambda: [shardstream.open_dataset(corpus.work)])
        assert outcome.kind == "error" and outcome.label == "ManifestError", outcome.label


@pytest.mark.parametrize("count", [2**40, 2**64 - 64])
def test_absurd_sample_counts_in_streaming_dataset(corpora, count):
    corpus = corpora["zstd"]
    body = _manifest_dict(corpus)
    _absurd_count(body, count)
    with _with_manifest(corpus, body):
        outcome = watched(lambda: [len(shardstream.StreamingDataset(corpus.work, decode=None))])
    assert outcome.kind == "error", f"{outcome.label}: {outcome.detail[-300:]}"


_SPARSE_MANIFEST = r"""
import json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))  # a 2 GiB read cannot fit
import shardstream
try:
    shardstream.open_dataset(sys.argv[1])
    print(json.dumps({"outcome": "opened"}))
except shardstream.ShardstreamError as e:
    print(json.dumps({"outcome": type(e).__name__, "message": str(e)}))
except BaseException as e:
    tb = traceback.extract_tb(e.__traceback__)[-1]
    print(json.dumps({"outcome": type(e).__name__, "at": f"{tb.filename}:{tb.lineno}"}))
"""


def test_two_gigabyte_manifest_is_refused_without_reading_it(tmp_path):
    import json
    import subprocess

    build_dataset(tmp_path / "ds", "zstd")
    with open(tmp_path / "ds" / MANIFEST_NAME, "r+b") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SPARSE_MANIFEST, str(tmp_path / "ds")], capture_output=True,
                          text=True, timeout=120, env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "ManifestError", result


# -- decoding -----------------------------------------------------------------------------------------------

JPEG = synthetic_jpeg(3, 48, 32, quality=80)


def _decode(field: str, data: bytes, images: Any = "rgb8", timeout: float | None = None) -> Outcome:
    return watched(lambda: [Decoder(images=images)({"__key__": "k", "__url__": "u", field: data})], timeout)


@FUZZ
@given(length=st.integers(0, len(JPEG) - 3))
def test_truncated_jpeg_is_decode_error(length):
    """A JPEG cut anywhere before its end-of-image marker is a DecodeError, never a partial image."""
    outcome = _decode("jpg", JPEG[:length])
    assert outcome.kind == "error" and outcome.label == "DecodeError", (outcome.label, outcome.detail)


@FUZZ
@given(data=st.binary(max_size=2048))
def test_garbage_jpeg_is_decode_error(data):
    outcome = _decode("jpg", data)
    assert outcome.kind == "error" and outcome.label == "DecodeError", (outcome.label, outcome.detail)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(JPEG) - 1), st.integers(1, 255)), min_size=1, max_size=6),
       cut=st.integers(0, len(JPEG)), insert=st.binary(max_size=64))
def test_mutated_jpeg_decodes_or_is_decode_error(edits, cut, insert):
    data = bytearray(JPEG)
    for offset, mask in edits:
        data[offset] ^= mask
    data[cut:cut] = insert
    outcome = _decode("jpg", bytes(data))
    assert outcome.kind in ("samples", "error"), (outcome.label, outcome.detail)
    if outcome.kind == "error":
        assert outcome.label == "DecodeError"
    else:
        image = outcome.samples[0]["jpg"]
        assert image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(JPEG) - 1), st.integers(1, 255)), min_size=1, max_size=6),
       cut=st.integers(0, len(JPEG)), insert=st.binary(max_size=64), seed=st.integers(0, 2**31))
def test_mutated_jpeg_through_the_fused_crop_decodes_or_is_decode_error(edits, cut, insert, seed):
    """The same through `RandomResizedCropJPEG`, whose region decoder (C, libjpeg-turbo) and header reading
    take the mutated bytes first: an image of the output size or a DecodeError, never a crash or another error."""
    from shardstream.transforms import RandomResizedCropJPEG

    data = bytearray(JPEG)
    for offset, mask in edits:
        data[offset] ^= mask
    data[cut:cut] = insert
    torch.manual_seed(seed)
    outcome = _decode("jpg", bytes(data), images=RandomResizedCropJPEG(16))
    assert outcome.kind in ("samples", "error"), (outcome.label, outcome.detail)
    if outcome.kind == "error":
        assert outcome.label == "DecodeError"
    else:
        image = outcome.samples[0]["jpg"]
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)


def _npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


FIELD_SEEDS = {
    "cls": b"12",
    "txt": "héllo".encode(),
    "json": b'{"a": [1, 2, {"b": null}]}',
    "msgpack": msgpack.packb({"a": [1, b"x"]}, use_bin_type=True),
    "npy": _npy_bytes(np.arange(12, dtype=np.int32).reshape(3, 4)),
    "png": None,  # filled below
}
_png = io.BytesIO()
__import__("PIL.Image").Image.new("RGB", (7, 5), (1, 2, 3)).save(_png, "PNG")
FIELD_SEEDS["png"] = _png.getvalue()

DECODE_KNOWN: dict[str, tuple[tuple[type, ...], str]] = {
    # field: (exception types the decoder lets escape, the decode.py function). Empty: the escapes found
    # (EOFError, tokenize.TokenError, SyntaxError, MemoryError from .npy, RecursionError from .json) are fixed.
}


def known_decoder_bug(field: str, outcome: Outcome) -> bool:
    types, function = DECODE_KNOWN.get(field, ((), ""))
    return (outcome.kind == "other" and isinstance(outcome.error, types) and "@decode.py:" in outcome.label
            and outcome.label.endswith(f"({function})"))


@pytest.mark.parametrize("field", sorted(FIELD_SEEDS))
@FUZZ
@given(data=st.data())
def test_mutated_field_decodes_or_is_decode_error(field, data):
    seed = FIELD_SEEDS[field]
    blob = bytearray(seed)
    how = data.draw(st.sampled_from(["flip", "truncate", "insert", "garbage"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del blob[data.draw(st.integers(1, len(blob))) :]  # empty input is pinned by its own test
    elif how == "insert":
        at = data.draw(st.integers(0, len(blob)))
        blob[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        blob = bytearray(data.draw(st.binary(min_size=1, max_size=256)))
    outcome = _decode(field, bytes(blob))
    if known_decoder_bug(field, outcome):
        event(f"known decoder bug: {outcome.label}")
        return
    assert outcome.kind in ("samples", "error"), (outcome.label, outcome.detail)
    if outcome.kind == "error":
        assert outcome.label == "DecodeError", outcome.label


def _npy_header(text: str) -> bytes:
    header = text.encode("latin1")
    pad = -(10 + len(header) + 1) % 64
    header += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


@pytest.mark.parametrize(("field", "data"), [
    pytest.param("npy", b"", id="npy-empty"),
    pytest.param("npy", _npy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (3,"), id="npy-unbalanced-header"),
    pytest.param("npy", _npy_header("{'descr': ',<i4', 'fortran_order': False, 'shape': (3,), }"), id="npy-bad-descr"),
    pytest.param("npy", _npy_header("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"),
                 id="npy-claims-8TB"),
    pytest.param("json", b"[" * 5000, id="json-deeply-nested"),
])
def test_bug_field_decoder_lets_exceptions_escape(field, data):
    outcome = _decode(field, data, images=None)
    assert outcome.kind == "error" and outcome.label == "DecodeError", f"{outcome.label}"


def test_field_error_that_says_nothing_is_named_by_its_type():
    """msgpack's FormatError on a reserved byte has no text: the DecodeError ended in "cannot decode field
    'msgpack': " and told nothing of what was wrong."""
    with pytest.raises(DecodeError) as info:
        Decoder()({"__key__": "k", "__url__": "u", "msgpack": b"\xc1"})
    assert info.value.detail == "cannot decode field 'msgpack': FormatError"
    assert (info.value.url, info.value.key) == ("u", "k")


# -- tars written by other tools: .tar.gz read front to back ---------------------------------------------------


def _tar_gz(root: Path) -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(4):
            data = (f"sample {i} " * 200).encode()
            info = tarfile.TarInfo(f"s{i:02d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = root / "other.tar.gz"
    path.write_bytes(__import__("gzip").compress(raw.getvalue(), mtime=0))
    return path


def test_bug_corrupt_tar_gz_raises_zlib_error(tmp_path):
    path = _tar_gz(tmp_path)
    good = path.read_bytes()
    escaped = []
    for position in range(10, min(len(good) - 8, 200)):  # the deflate stream (not the gzip header/trailer)
        data = bytearray(good)
        data[position] ^= 0x10
        path.write_bytes(bytes(data))
        outcome = watched(lambda: read_shard(str(path)))
        if outcome.kind not in ("samples", "error"):
            escaped.append((position, outcome.label))
    assert not escaped, f"{len(escaped)} single-bit flips escaped, e.g. byte {escaped[0][0]}: {escaped[0][1]}"


def test_the_fuzz_report_tool_runs():
    """Regression: `tools/fuzz_report.py`, whose figures RELIABILITY.md quotes, failed at its
    start (the harness's import of a sibling test module) and nothing noticed. A short run
    must end with its contract line: no other exceptions, no hangs."""
    import subprocess

    tool = Path(__file__).resolve().parent.parent / "tools" / "fuzz_report.py"
    done = subprocess.run([sys.executable, str(tool), "30", "--decode", "30"], capture_output=True, text=True,
                          timeout=300, cwd=tool.parent.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "**other exceptions: 0** (must be 0); **hangs: 0** (must be 0)" in done.stdout
