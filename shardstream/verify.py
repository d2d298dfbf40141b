"""`inspect` and `verify`: what a packed dataset holds, and whether every byte of it is sound."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import re
import tarfile
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .columns import label_of, weight_of
from .decode import decode_image, jpeg_damage
from .fields import IMAGE_EXTENSIONS, field_extension, unreadable
from .format import MANIFEST_NAME, Manifest
from .arguments import flag
from .cpus import usable_cpus
from .errors import ManifestError, MissingPartsError, ShardstreamError, shown_url
from .reader import ShardReader
from .shardfile import seek_table
from .tario import END_OF_ARCHIVE, member_key
from .epochs import shard_block
from .parts import merged_manifest, of_one_pack, part_manifests, unlisted_shards
from .plan import run_samples
from .source import ManifestShards, Source, open_dataset
from .storage import Store
from .threads import ordered_map

__all__ = ["inspect_dataset", "verify_dataset", "Problem"]


def inspect_dataset(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary of a packed dataset from its manifest alone (no shard is read)."""
    source = open_dataset(url, storage_options=storage_options)
    m = source.manifest
    assert m is not None  # open_dataset always has one
    stored = int(m.shards.bytes.sum())
    tar_bytes = int(m.shards.raw_bytes.sum())
    fields = m.shards.all_fields()
    counts = source.counts()
    block = shard_block(source, counts)
    return {
        "url": shown_url(url),  # printed and logged: a token in its query string stays out, as in errors
        "writer": m.writer,
        "format_version": m.version,
        "compression": m.compression,
        "shards": len(m.shards),
        "samples": m.samples,
        "bytes": stored,
        "index_bytes": int(m.shards.index_bytes.sum()),
        "fields": fields,
        # How it was packed (seed, shuffle, level, max_side, parts, ...): the source listing's
        # and its files' digests left out, which say nothing to read.
        "options": {k: v for k, v in m.options.items() if k not in ("listing", "sizes")},
        "classes": dict(zip(m.classes, m.class_counts)),
        "skipped": [{"file": f, "reason": r} for f, r in m.skipped],
        "ignored": m.ignored,
        "tar_bytes": tar_bytes,
        "compression_ratio": round(tar_bytes / stored, 4) if stored else 1.0,
        # How a shuffled epoch reads it (plan.shuffle_block): 0, each shard whole, front to back.
        "shuffle_block": block,
        "shuffle_blocks": int(np.maximum(counts // block, 1).sum()) if block else len(counts),
        # The fewest samples a shuffled epoch deals a DataLoader worker at a time (plan.deal_run).
        "worker_run": run_samples(source.samples_per_frame(), source.least_sample_bytes()),
    }


@dataclass
class Problem:
    shard: str
    key: str | None
    message: str
    warning: bool = False  # worth knowing, not failing for: a JPEG that decodes with data missing

    def __str__(self) -> str:
        return f"{self.shard}" + (f" sample {self.key!r}" if self.key else "") + f": {self.message}"


@dataclass
class VerifyReport:
    shards: int = 0
    samples: int = 0  # read whole: those that damage left unread are not counted
    images: int = 0  # decoded
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)  # images that decode with data missing
    # Of a pack's parts not merged yet: (the part numbers verified, of how many parts); None for a dataset.
    parts: tuple[tuple[int, ...], int] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _file_sha256(store: Any, name: str) -> tuple[str, int]:
    """Hash the whole file by ranged reads, each retried like any read, up to the first
    empty read (the end); returns the digest and the file's size.

    Ranged reads, not a size request: some servers (fsspec over HTTP) report a failed
    size request as a missing file. To the end, not to the manifest's size: bytes
    appended to a shard (a botched copy) must fail verification."""
    digest, read = hashlib.sha256(), 0
    while True:
        data = store.read(name, read, read + (16 << 20))
        if not data:
            break
        digest.update(data)
        read += len(data)
    return digest.hexdigest(), read


def verify_shard(reader: ShardReader, decode_images: bool = True,
                 compression: str | None = None) -> Iterator[Problem | int]:
    """Check one shard; yields problems, and for each sample read whole the number of its
    images that decoded (for progress, and the report's counts: a sample the damage left
    unread is no sample verified). `compression`: the manifest's, which the index must give."""
    info = reader.info
    assert info is not None
    try:
        digest, size = _file_sha256(reader.store, reader.name)
    except ShardstreamError as e:
        yield Problem(info.name, None, str(e))
        return
    if size != info.bytes:
        yield Problem(info.name, None, f"file is {size} bytes, the manifest says {info.bytes}")
    if digest != info.sha256:
        yield Problem(info.name, None, "sha256 does not match the manifest")
    try:
        if reader.store.size(info.index) != info.index_bytes:
            yield Problem(info.name, None, f"{info.index} is not the {info.index_bytes} bytes the manifest says")
        index = reader.index
        if compression is not None and index.compression != compression:  # `inspect` tells the manifest's
            yield Problem(info.name, None, f"its index says compression {index.compression!r}, the manifest "
                          f"{compression!r}")
        if index.compression == "zstd" and size == info.bytes:
            problem = _seek_table_problem(reader, size)
            if problem is not None:
                yield problem
        if index.compression == "none" and size == info.bytes:
            yield from _members_outside_the_index(reader, index, size)
        # FORMAT.md: the tar stream's size, which planning reads (samples a frame holds)
        raw = int(index.frame_raw_offsets[-1]) + len(END_OF_ARCHIVE) if index.compression == "zstd" else size
        if info.raw_bytes != raw:
            yield Problem(info.name, None, f"raw_bytes is {info.raw_bytes} in the manifest; the "
                          f"{'index gives' if index.compression == 'zstd' else 'file is'} {raw}")
    except ShardstreamError as e:
        yield _problem(reader, e)
        return
    fields: set[str] = set()
    unread = 0
    seen: dict[str, int] = {}  # key: its first sample's position
    unreadable_fields = _UnreadableFields(info.name, index)
    for position, sample in enumerate(_every_sample(reader)):  # one item a sample: read, or a Problem
        if isinstance(sample, Problem):
            unread += 1
            yield sample
            continue
        key = str(sample["__key__"])
        disagreement = _index_disagrees(index, position, sample)
        if disagreement is not None:
            yield Problem(info.name, key, disagreement)
        first = seen.setdefault(key, position)
        if first != position:  # FORMAT.md: keys are unique within a shard (`tar -x` keeps one of the two)
            yield Problem(info.name, key, f"the key of sample {first} of this shard again, at sample {position}")
        fields.update(name for name in sample if not name.startswith("__"))
        decoded = 0
        for name, value in sample.items():
            if not name.startswith("__"):
                unreadable_fields.check(position, key, name, value)
            if decode_images and not name.startswith("__") and field_extension(name) in IMAGE_EXTENSIONS:
                try:
                    decode_image(value, "pil", url=reader.url, key=key, name=name).load()  # type: ignore[union-attr,arg-type]
                except ShardstreamError as e:
                    yield Problem(info.name, key, e.detail)
                else:
                    damage = jpeg_damage(value)  # type: ignore[arg-type]
                    if damage is not None:
                        yield Problem(info.name, key, f"decodes with data missing ({damage})", warning=True)
                    decoded += 1
        yield decoded
    yield from unreadable_fields.problems()
    if not unread and fields != set(info.fields):  # samples unread may hold the others
        yield Problem(info.name, None, f"holds the fields {sorted(fields)}, the manifest says {sorted(info.fields)}")


class _UnreadableFields:
    """The fields of a shard's samples that do not read as their extension says (`cls`,
    `json`, `npy`, `txt`, `msgpack`): one problem a field and reason a shard, naming the
    first sample and how many more (a tar adopted with class names in `cls` named every
    sample of it, one line each). Warnings where shardstream reads them all the same: JSON
    with NaN (Python's reader takes it; FORMAT.md and stricter readers do not), class
    names in `cls` that the index took for no label (`shardstream index` adopts them, and
    readers leave `cls` out of `fields`)."""

    def __init__(self, shard: str, index: Any) -> None:
        self.shard, self.index = shard, index
        self.found: dict[tuple[str, bool, str], list[Any]] = {}  # (field, warning, reason): [first key, why, count]

    def check(self, position: int, key: str, name: str, value: Any) -> None:
        why = unreadable(name, value)
        if why is None:
            return
        ext = field_extension(name)
        labels = self.index.labels
        # Class names throughout (the index holds no labels: `index` adopted them so); a cls
        # that is no number beside labelled samples is damage, which readers of cls fail on.
        warning = (ext == "json" and unreadable(name, value, strict=False) is None) or (
            ext == "cls" and (labels is None or bool((labels == -1).all())))
        reason = re.sub(r"b?'[^']*'|\d+", "#", why)  # a line a kind of damage, not a sample's values
        found = self.found.setdefault((name, warning, reason), [key, why, 0])
        found[2] += 1

    def problems(self) -> Iterator[Problem]:
        for (name, warning, _), (key, why, count) in self.found.items():
            more = f" (and {count - 1} more samples of this shard)" if count > 1 else ""
            hint = ("; shardstream reads it, stricter JSON readers do not" if warning and name.endswith("json")
                    else "; the index holds no label for it: read with fields that leave cls out" if warning else "")
            yield Problem(self.shard, key, f"field {name!r}: {why}{hint}{more}", warning=warning)


def _index_disagrees(index: Any, position: int, sample: dict[str, Any]) -> str | None:
    """How the index's label or weight for the sample at `position` differs from what its
    `cls` and `weight` fields say (FORMAT.md: class-weighted and weighted sampling plan from
    the index alone, so a second writer's wrong column would go unseen), or None."""
    label = label_of(sample["cls"]) if "cls" in sample else -1
    indexed = int(index.labels[position]) if index.labels is not None else -1
    if label != indexed:
        return f"the index gives {_label_words(indexed)}, its cls field gives {_label_words(label)}"
    weight = np.float32(weight_of(sample["weight"]) if "weight" in sample else np.nan)
    stored = np.float32(index.weights[position] if index.weights is not None else np.nan)
    if weight != stored and not (np.isnan(weight) and np.isnan(stored)):
        return f"the index gives {_weight_words(stored)}, the sample has {_weight_words(weight)}"
    return None


def _label_words(label: int) -> str:
    return "no label" if label < 0 else f"label {label}"


def _weight_words(weight: np.float32) -> str:
    return "no weight" if np.isnan(weight) else f"weight {weight}"


def _members_outside_the_index(reader: ShardReader, index: Any, size: int) -> Iterator[Problem]:
    """Files of a plain tar before its index's first sample or after its last that belong
    to a sample (`tario.member_key`, WebDataset's rule): samples no reader reads (an index
    that left out the first or last sample passed, its checksums agreeing). A README, a
    directory, the end-of-archive blocks and a tool's padding are none."""
    assert reader.info is not None
    n = len(index)
    regions = [(0, int(index.sample_offsets[0]) if n else size)]
    if n:
        regions.append((int(index.sample_offsets[-1]), size))
    for start, end in regions:
        if end <= start:
            continue
        try:
            with tarfile.open(fileobj=io.BytesIO(reader.store.read(reader.name, start, end)), mode="r:") as tar:
                names = [member.name for member in tar if member.isfile() and member_key(member.name) is not None]
        except (tarfile.TarError, EOFError):
            names = []  # headers that do not parse there: the sample reads and checksums speak for the rest
        for name in names:
            yield Problem(reader.info.name, None, f"holds {name!r} outside every sample its index lists")


def _seek_table_problem(reader: ShardReader, size: int) -> Problem | None:
    """A problem if the shard's zstd seek table (FORMAT.md) is not the one its index implies:
    shardstream's readers go by the index, but other seekable-zstd tools seek by the table."""
    index = reader.index
    assert reader.info is not None
    comp, raw = index.frame_offsets.tolist(), index.frame_raw_offsets.tolist()
    frames = [(b - a, d - c) for a, b, c, d in zip(comp, comp[1:], raw, raw[1:])]
    length = len(seek_table(frames + [(0, 0)]))
    end_frame = size - length - comp[-1]  # what lies between the last data frame and the table
    # None where the file has no room for the table (none was written), or more than a seek table
    # entry holds lies between (not its end frame): the table cannot then be the one it should be.
    expected = seek_table(frames + [(end_frame, len(END_OF_ARCHIVE))]) if 0 < end_frame < 1 << 32 else None
    if expected is None or reader.store.read(reader.name, size - length, size) != expected:
        return Problem(reader.info.name, None, "the zstd seek table at its end is missing, or not the one its index "
                       "gives (tools that seek by the seekable format would read the wrong bytes)")
    return None


def _every_sample(reader: ShardReader) -> Iterator[dict[str, Any] | Problem]:
    """Every sample of the shard in order, or, for each one that cannot be read, a `Problem`
    naming it; reading goes on after it, so one damaged frame does not hide the rest of the
    shard. Once a read fails, the rest is read a unit at a time (a zstd frame, which is
    decompressed whole, or a plain tar's sample): read by pieces of many samples, every
    sample of a truncated shard was named, those before the cut too (each piece reached past it)."""
    index = reader.index
    start, n, by_units = 0, len(index), False
    while start < n:
        stop = _unit_end(index, start) if by_units else n
        at = start
        try:
            for sample in reader.read(start, stop):
                yield sample
                at += 1
            start = stop
        except ShardstreamError as e:
            if not by_units:
                start, by_units = at, True  # again from where it failed, by units
                continue
            stop = _unit_end(index, at)
            for unread in range(at, stop):
                yield _problem(reader, e, index.keys[unread])
            start = stop


def _unit_end(index: Any, at: int) -> int:
    """Where the unit of sample `at` ends: its zstd frame's end (the next frame's first
    sample), or for a plain tar the next sample."""
    if index.compression != "zstd":
        return at + 1
    frame = index.frame_of(at)
    return max(at + 1, int(np.searchsorted(index.sample_offsets, index.frame_raw_offsets[frame + 1], side="left")))


def _problem(reader: ShardReader, error: ShardstreamError, key: str | None = None) -> Problem:
    """`error`, met reading `reader`'s shard (at the sample `key`), as a problem of the shard.
    The error may be about another file than the shard (its index): that file is named."""
    assert reader.info is not None
    other = error.url is not None and error.url != reader.url
    return Problem(reader.info.name, key if key is not None else error.key,
                   (f"{posixpath.basename(error.url)}: " if other else "") + error.detail
                   + (f" (byte {error.offset})" if error.offset is not None else ""))


def verify_dataset(
    url: str, *, decode_images: bool = True, progress: bool = False, storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Check every checksum, the index against each shard, and (by default) that every image decodes.

    Shards are checked `workers` at a time (default: one per core, at least 4 for remote
    storage, whose latency threads hide), in threads: hashing, reading and Pillow's
    decoding release the GIL. The report lists the problems in shard order, whatever
    `workers` is.

    A folder of a pack's parts not merged yet (`pack --part`) has each finished part
    checked, against its part manifest: a node's output can be checked before the merge.
    What would stop their merge (parts packed with other options or of another source,
    shards missing or of other sizes) is a problem; parts not finished yet are not.
    """
    decode_images, progress = flag(decode_images, "decode_images"), flag(progress, "progress")
    report = VerifyReport()
    try:
        try:
            sources = [open_dataset(url, storage_options=storage_options)]
            _tell_unlisted(sources[0], report)
        except ManifestError:
            # Only where no manifest is there: a damaged one beside the parts it merged is the problem.
            store = Store(os.fspath(url), storage_options or {})
            sources = [] if store.exists(MANIFEST_NAME) else _unmerged_parts(store, report)
            if not sources:
                raise
    except ShardstreamError as e:
        report.problems.append(Problem("manifest", None, str(e)))
        return report
    for source in sources:
        _verify_source(source, report, decode_images, progress, workers)
    return report


def _tell_unlisted(source: Source, report: VerifyReport) -> None:
    """A warning of shard files in the dataset's folder that its manifest does not list (left by
    an earlier pack: found by a walk, `verify` said "ok" over them without a word)."""
    assert source.manifest is not None
    store = source.shards.store if isinstance(source.shards, ManifestShards) else None
    # Not of tars indexed in place: `index` leaves tars of no samples out, and their own names may be
    # shardstream's (found by review: the advice below would have removed the user's tars).
    if store is None or source.manifest.options.get("indexed_in_place"):
        return
    try:
        stray = unlisted_shards(store, source.manifest)
    except ShardstreamError:
        return  # a store that lists nothing to this reader (no autoindex, no list permission): a look, not a check
    if stray:
        report.warnings.append(Problem(
            "folder", None, f"{len(stray)} file{'s' if len(stray) > 1 else ''} named as shards that the manifest "
            f"does not list ({', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''}): an earlier pack's? Readers "
            "never open them; `shardstream pack --overwrite` into this folder removes them", warning=True))


def _unmerged_parts(store: Store, report: VerifyReport) -> list[Source]:
    """The finished parts of the pack in `store` (those whose part manifest is written), in
    part order, where it holds no dataset manifest; `report.parts` says which of how many."""
    everything = part_manifests(store)
    try:
        total, found = of_one_pack(everything, store.root)
    except ShardstreamError as e:  # none, or parts of packs in different numbers of parts
        if everything:
            report.problems.append(Problem("merge", None, str(e)))
        return []
    report.parts = (tuple(sorted(found)), total)
    sources = []
    for number in sorted(found):
        name = found[number]
        manifest = Manifest.from_bytes(store.read(name), store.url(name))
        sources.append(Source(store.url(name), ManifestShards(store, manifest.shards), manifest))
    try:  # what would stop their merge (the part manifests read: a damaged one is told once, above)
        merged_manifest(store)
    except MissingPartsError:
        pass  # the report says which parts are not finished
    except ShardstreamError as e:
        report.problems.append(Problem("merge", None, str(e)))
    return sources


def _verify_source(source: Source, report: VerifyReport, decode_images: bool, progress: bool,
                   workers: int | None) -> None:
    """`verify_dataset` of one dataset (or part), into `report`."""
    from .progress import progress_bar

    bar = progress_bar(total=source.manifest.samples if source.manifest else None, unit="sample", desc="verify", disable=not progress)

    bar_lock = threading.Lock()  # tqdm's counter is not safe to bump from several threads

    tally = _ClassTally(source.manifest.classes if source.manifest is not None else ())

    def check(reader: ShardReader) -> tuple[list[Problem], list[Problem], int, int, np.ndarray | None]:
        problems: list[Problem] = []
        warnings: list[Problem] = []
        samples = images = 0
        for item in verify_shard(reader, decode_images, source.manifest.compression if source.manifest else None):
            if isinstance(item, Problem):
                (warnings if item.warning else problems).append(item)
            else:
                samples, images = samples + 1, images + item
                with bar_lock:
                    bar.update(1)
        # The shard's labels are counted now, its reader then dropped: readers kept for a count
        # at the end held every shard's index, every key of the dataset (10 GB at 100M samples).
        labels = _label_counts(reader) if tally.wanted and not problems else None
        return problems, warnings, samples, images, labels

    problems_before = len(report.problems)  # the class counts are checked where the shards had none
    local = source.local
    workers = max(1, min(workers or max(usable_cpus(), 1 if local else 4), len(source.shards) or 1))
    readers = (_shard_reader(ref) for ref in source.shards)  # made as the threads take them
    try:
        with contextlib.closing(ordered_map(check, readers, workers, name="shardstream-verify")) as futures:
            for ref, future in zip(source.shards, futures):
                problems, warnings, samples, images, labels = future.result()
                report.shards += 1
                report.problems += problems
                report.warnings += warnings
                report.samples += samples
                report.images += images
                tally.add(ref.name, labels)
    finally:
        bar.close()
    if len(report.problems) == problems_before and tally.wanted:
        report.problems += tally.problems(source.manifest)


def _shard_reader(ref: Any) -> ShardReader:
    reader = ref.reader()
    assert isinstance(reader, ShardReader)  # a dataset with a manifest: every shard is indexed
    return reader


def _label_counts(reader: ShardReader) -> np.ndarray | None:
    """How many samples of each class index the shard's index holds, by index (up to its
    largest); None where the index records no labels."""
    labels = reader.index.labels
    return None if labels is None else np.bincount(labels[labels >= 0])


class _ClassTally:
    """The samples of each class the shard indexes hold, added up shard by shard, for
    checking the manifest's class counts once every shard is sound."""

    def __init__(self, classes: tuple[str, ...]):
        # Wanted with no classes too: labels in the indexes then contradict a manifest that
        # names none (every writer names the classes its labels index), which passed.
        self.wanted = True
        self.counts = np.zeros(len(classes), dtype=np.int64)
        self.past: Problem | None = None  # the first shard, in order, with a label past the classes

    def add(self, shard: str, labels: np.ndarray | None) -> None:
        if labels is None or self.past is not None:
            return
        if len(labels) > len(self.counts):
            self.past = Problem(shard, None, f"a label is past the manifest's {len(self.counts)} classes")
            return
        self.counts[: len(labels)] += labels

    def problems(self, manifest: Any) -> list[Problem]:
        """The manifest's class counts against the labels the indexes hold (every shard added)."""
        if self.past is not None:
            return [self.past]
        if tuple(self.counts.tolist()) != tuple(manifest.class_counts):
            return [Problem("manifest", None, f"class_counts {list(manifest.class_counts)} are not the indexes' "
                                              f"{self.counts.tolist()}")]
        return []
