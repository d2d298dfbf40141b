"""`pack`: an image folder or a file list into shards, in parallel, reproducibly.

The work is planned before it starts, from the file listing and file sizes alone:
the sorted listing is shuffled with `seed`, cut into shards of about `shard_size`
bytes, and each shard into frames of about `frame_size`. A frame (a few images) is
the unit of parallel work: workers read, check and compress frames, and the caller
appends them in order. The output therefore depends only on the input and the
options, never on `workers`, and parallelism does not need many shards.

The workers are threads or processes, by the images' size (framepool.py); each builds
whole frames (framebuild.py), checking every image first (imagecheck.py), and the plan
is made before they start (packplan.py). The frames are appended to their shards, and
the manifest made, by packoutput.py.

Nothing is lost silently: every file of the source is packed, skipped with a reason
(recorded in the manifest), or counted as not an image. An image is stored under the
field its file name gives, byte for byte: where the name lies about a format pack
stores (ImageNet's PNG named .JPEG), the bytes stay what they are, and the summary
lists each such file.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from PIL import Image

from .arguments import flag, integer
from .cpus import usable_cpus
from .decode import pixel_limit
from .errors import PackError, ShardstreamError, shown_name
from .format import INDEX_SUFFIX, MANIFEST_NAME, Manifest, ShardInfo
from .framebuild import FrameResult, build_job
from .framepool import pool_context, process_results, thread_results, threads_pay
from .journal import FOLDER as JOURNAL_FOLDER, Journal
from .listing import list_source, look_up_files
from .packoutput import dataset_manifest, write_shards
from .packplan import PackOptions, order, part_slice, plan_frames, shrunk_estimates
from .parts import (MAX_PARTS, RULES, check_part_agrees, other_journals, other_packs, part_shards,
                    unlisted_single_shards, unplanned_part_shards, unplanned_single_shards)
from .scratch import cleanup_scratch
from .shardfile import FRAME_SIZE, IMAGE_LEVEL
from .shrink import DEFAULT_QUALITY
from .sourcefile import Listing, SourceFile, image_field, other_images, printable
from .storage import Store
from .urls import expand_home, local_path
from .writer import (MAX_COUNT, check_compression, check_level_used, parse_size, remove_dataset, shard_name,
                     write_manifest)

__all__ = ["pack", "PackSummary"]

ON_ERROR = ("fail", "skip")


def _check_outside(src: str, store: Store) -> None:
    """Refuse a destination inside the source folder: the next pack of that source would list
    the dataset as one of its classes (an empty one, and its files as not images), and
    change the class table of the same command."""
    if not (store.local and os.path.isdir(src)):
        return
    folder, dst = os.path.realpath(src), os.path.realpath(local_path(store.root))
    if os.path.commonpath([folder, dst]) == folder:
        raise PackError("the destination lies inside the source folder, where the next pack of it would list the "
                        "dataset among the images (as a class): choose a destination outside it", url=store.root)


@dataclass
class PackSummary:
    """What a pack did.

    `misnamed` lists (file, format) for each image whose content is another stored
    format than its name says (``"PNG"`` for a PNG named .jpg): it is stored as named,
    under the field of its name (`jpg`), byte for byte, so that ``fields=("jpg", "cls")``
    finds every sample. Readers that tell the format from the bytes (shardstream's
    decoders, Pillow) read it; JPEG-only decoders (nvJPEG, DALI's JPEG path) refuse it.
    One that `max_side` shrank is encoded in its field's format and is not listed.
    `kept_whole` lists (file, why) for each image larger than `max_side` that kept its
    bytes (``"animated"``); `shrunk` counts the images it shrank (None without `max_side`).
    These cover, as `bytes_in` does, the shards this run packed:
    a resumed pack does not see the earlier run's, nor does a finished pack's rerun. The
    manifest records what was skipped.
    """

    samples: int
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: int = 0
    misnamed: list[tuple[str, str]] = field(default_factory=list)
    kept_whole: list[tuple[str, str]] = field(default_factory=list)
    shrunk: int | None = None
    resumed: int = 0  # of `samples`, those an earlier run packed (`resume=True`), not in `seconds`
    # Of `ignored`, the images of formats pack does not store, by extension ({".bmp": 3}): a
    # torchvision ImageFolder reads some of them, and they would go unnoticed in a count.
    other_images: dict[str, int] = field(default_factory=dict)
    # Of `ignored`, the images beside an image folder's class folders: in no class, so not packed.
    unclassed: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rate = (self.samples - self.resumed) / self.seconds if self.seconds else 0.0
        earlier = f" ({self.resumed} of them by an earlier run)" if self.resumed else ""
        timed = f" in {self.seconds:.2f} s ({rate:,.0f} img/s)" if self.resumed < self.samples else ""
        lines = [
            f"packed {self.samples} samples{earlier} into {self.shards} shard{'' if self.shards == 1 else 's'}{timed}",
            f"bytes in {self.bytes_in / 1e6:,.1f} MB" + (" (this run's)" if self.resumed else "")
            + f", out {self.bytes_out / 1e6:,.1f} MB" + (" (the whole dataset's)" if self.resumed else ""),
            f"skipped {len(self.skipped)}, not images {self.ignored}",
        ]
        if self.other_images:
            counts = ", ".join(f"{n} {extension}" for extension, n in self.other_images.items())
            lines.append(f"  not images include images pack does not store: {counts} (convert them to JPEG, PNG "
                         "or WebP to pack them)")
        if self.unclassed:
            shown = ", ".join(map(shown_name, self.unclassed[:5])) + (", ..." if len(self.unclassed) > 5 else "")
            lines.append(f"  not images include {len(self.unclassed)} images beside the class folders, in no class "
                         f"(move them into one to pack them): {shown}")
        lines += [f"  skipped {shown_name(path)}: {shown_name(reason)}" for path, reason in self.skipped]
        if self.misnamed:
            lines.append(f"content differs from its name: {len(self.misnamed)}, stored as named: shardstream's "
                         "decoders read them, JPEG-only decoders (nvJPEG, DALI's JPEG path) refuse them")
            lines += [f"  {shown_name(path)} is {kind}" for path, kind in self.misnamed]
        if self.shrunk is not None:
            lines.append(f"shrunk to max_side: {self.shrunk}")
        if self.kept_whole:
            lines.append(f"kept whole, larger than max_side: {len(self.kept_whole)}")
            lines += [f"  kept whole {shown_name(path)}: {why}" for path, why in self.kept_whole]
        return "\n".join(lines)


# -- what this pack replaces, and what identifies its input ------------------------------


def _siblings_shard(part: tuple[int, int] | None) -> Callable[[str], bool]:
    """Whether a shard name is another part's of this pack (of the same number of parts),
    which that part, perhaps at work at once with this one (Ray), writes and must keep."""
    if part is None:
        return lambda name: False
    others = tuple(f"shard-p{i:05d}-" for i in range(part[1]) if i != part[0])
    return lambda name: name.startswith(others)


def _clear_other_packs(store: Store, part: tuple[int, int] | None, *, overwrite: bool, resume: bool,
                       finished_part: bool, journaled: bool) -> None:
    """Refuse (or, with `overwrite`, remove) what another pack left in `store` that this one
    would overwrite or mix with (`parts.other_packs`): a part's shard names do not say how
    many parts there are, so part 0 of 3 would overwrite part 0 of 2's shards. A pack of
    the other layout killed before its manifest left shards and a journal that nothing
    lists; a single pack that resumes removes parts' shards itself (it may be the one that
    was removing them, as an overwrite, when it was killed). Files named as a single pack's
    shards that no manifest lists are this pack's earlier run's only where that run left its
    journal (`journaled`): else they are another tool's (WebDataset's `shard-%06d.tar`),
    which a pack wrote over, or with `--resume` removed."""
    manifests, shards = other_packs(store, None if part is None else part[1])
    if part is None and not (overwrite or resume):
        shards += part_shards(store)
    if part is None and not (overwrite or journaled):
        shards += unlisted_single_shards(store)
    journals = other_journals(store, None if part is None else part[1])
    # The merge of this very pack's parts: still true for a finished part's no-op rerun,
    # stale once a part is packed again (the last part to finish merges anew).
    stale_merge = (part is not None and not finished_part and MANIFEST_NAME not in manifests
                   and store.exists(MANIFEST_NAME))
    found = ([MANIFEST_NAME] if stale_merge else []) + manifests + shards + [f"{JOURNAL_FOLDER}/{j}/" for j in journals]
    if not found:
        return
    if not overwrite:
        this = "a single pack" if part is None else f"part {part[0]} of {part[1]}"
        listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ShardstreamError(f"already holds another pack's files ({listed}), which {this} would overwrite or "
                               "mix with; "
                               "pass overwrite=True (--overwrite) to replace it", url=store.root)
    if stale_merge:
        store.remove(MANIFEST_NAME)  # its shards are this pack's other parts: they stay
    elif part is None and manifests:
        # A merge of those parts lists their shards: gone first, or a crash while they are removed
        # left it listing shards that are not there. (This pack replaces it anyway.)
        store.remove(MANIFEST_NAME)
    for name in manifests:
        remove_dataset(store, name, keep=_siblings_shard(part))
    store.remove_all(_with_indexes(shards))
    for name in journals:
        Journal(store, name).clear()


def _with_indexes(names: list[str]) -> Iterator[str]:
    """`names` (shards, and indexes left without their shard), each shard's index after it."""
    for name in names:
        yield name
        if not name.endswith(INDEX_SUFFIX):
            yield name + INDEX_SUFFIX


def part_manifest_name(index: int, parts: int) -> str:
    return f"manifest.part-{index:05d}-of-{parts:05d}.msgpack"


def _files_stamp(entries: list[SourceFile]) -> str:
    """A digest of the files' sizes and modification times as looked up (-1 for a file that
    could not be: packing reports it under the error policy), for `--resume` to refuse a
    source whose files changed in place. Parts do not compare it: their copies of the source
    may be made at other times, and each looks up its own files only."""
    return hashlib.sha256("".join(f"{e.size} {e.modified}\n" for e in entries).encode()).hexdigest()


def sizes_digest(entries: list[SourceFile]) -> str:
    """A digest of the sizes of the files a pack (or part) packs, in its order: the
    manifest records it, so that a rerun of a finished pack with `resume` refuses a source
    whose files changed size since (the listing's fingerprint holds names and labels only).
    Sizes, not times: a copy of the source made elsewhere packs the same bytes."""
    return hashlib.sha256("".join(f"{e.size}\n" for e in entries).encode()).hexdigest()


def listing_fingerprint(entries: list[SourceFile]) -> str:
    """Identifies the ordered input, so that parts and resumes can check they agree.

    Of names and labels only, which decide the order and every part's slice: a part looks
    up (stats) only the files of its own slice, so no part knows the other files' sizes."""
    digest = hashlib.sha256()
    for start in range(0, len(entries), 1 << 16):  # a call per entry was most of its time
        lines = "".join(f"{e.path}\0{e.label}\n" for e in entries[start : start + (1 << 16)])
        # surrogateescape: a file name that is not UTF-8 is skipped later, not an error here
        digest.update(lines.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


# -- the whole pack ---------------------------------------------------------------------------


def pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    shard_size: int | str = "256MB",
    max_samples: int | None = None,
    compression: str = "zstd",
    level: int = IMAGE_LEVEL,
    workers: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    on_error: str = "fail",
    overwrite: bool = False,
    resume: bool = False,
    part: tuple[int, int] | None = None,
    max_side: int | None = None,
    quality: int = DEFAULT_QUALITY,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    fsync: bool = False,
) -> PackSummary:
    """Pack an image folder (one subfolder per class) or a file list into `dst`.

    `dst` is a path or fsspec URL. The same input and options give byte-identical
    shards and manifest, whatever `workers` is (default: all cores). `on_error="fail"`
    stops at the first unreadable or corrupt image, naming it; ``"skip"`` leaves it out
    and records it in the manifest. An image in a format pack does not store (GIF, BMP,
    TIFF, ...) is such an error, and so is a file list's row that names a file an earlier
    row names (``"skip"`` packs it once, from the first). An image in a stored format but
    named as another (a PNG named .jpg) is stored as named (under `jpg`, byte for byte)
    and listed in the summary's `misnamed`. `resume` continues an interrupted pack from
    its last complete shard, with the same result as an uninterrupted one. `part=(i, n)`
    packs only the i-th of n slices of the input and writes a part manifest; run every
    part (anywhere, in any order), then `merge` (parts.py). `max_side` shrinks every
    image whose longer side is larger to that side, encoded again in the format of its
    field at `quality` (JPEG, WebP; PNG losslessly); smaller images, and animated ones
    (listed in the summary's `kept_whole`), keep their bytes (shrink.py). `fsync` waits
    until every file is on the disk before the one that names it is written, so that a
    power loss cannot leave a manifest listing a lost shard (a crash of the process
    cannot, either way); local `dst` only, as object stores publish only whole uploads.
    """
    src, dst = expand_home(os.fspath(src)), os.fspath(dst)  # pathlib.Path too; dst's Store expands dst
    # Flags as flags: overwrite="no" replaced the dataset there, shuffle="no" shuffled.
    shuffle, overwrite, resume, progress, fsync = (flag(value, name) for value, name in (
        (shuffle, "shuffle"), (overwrite, "overwrite"), (resume, "resume"), (progress, "progress"), (fsync, "fsync")))
    # Whole numbers as plain ints (numpy's too): the journal and manifest write them with
    # msgpack, which refused numpy's seed; 10.5 samples a shard went into the manifest.
    level, quality = integer(level, "level"), integer(quality, "quality")
    max_samples, max_side = (integer(value, name) if value is not None else None
                             for value, name in ((max_samples, "max_samples"), (max_side, "max_side")))
    part = (integer(part[0], "part's index"), integer(part[1], "part's count")) if part is not None else None
    _check_arguments(compression, level, on_error, part, max_samples, max_side, quality, seed)
    seed = int(seed)  # a numpy integer, checked
    workers = integer(workers, "workers") if workers is not None else None
    if workers is not None and workers < 1:  # 0 meant all cores and -3 one, without a word
        raise ShardstreamError(f"workers must be a positive number (None: all cores), not {workers}")
    if parse_size(shard_size) < 1:  # 0 wrote a shard a sample
        raise ShardstreamError(f"shard_size must be at least one byte, not {shard_size!r}")
    prefix = "shard" if part is None else f"shard-p{part[0]:05d}"
    opts = PackOptions(parse_size(shard_size), max_samples, compression, level, seed, shuffle, FRAME_SIZE, prefix,
                       max_side, quality)
    store = Store(dst, storage_options or {}, durable=fsync)
    _check_outside(src, store)
    target = MANIFEST_NAME if part is None else part_manifest_name(*part)
    # A finished pack or part rerun with `resume` (a scheduler's retry after the pack, a
    # part's merge, or clearing the journal failed) has nothing left to do but tidy up; a
    # part's caller then merges as the part would have.
    complete = resume and not overwrite and store.exists(target)
    replace = store.exists(target) and not complete
    if replace and not overwrite:
        raise ShardstreamError("already holds a dataset; pass overwrite=True (--overwrite) to replace it",
                               url=store.url(target))
    # The source is listed and checked before anything in `dst` is removed: a mistyped or
    # empty source must not cost the dataset it would have replaced.
    listing = list_source(src)
    listed_skips = _rows_left_out(listing, src, on_error == "skip", part)
    entries = order(listing, opts)
    fingerprint = listing_fingerprint(entries)
    if part is not None:
        entries = part_slice(entries, *part)
    look_up_files(entries, listing.root)  # this pack's (part's) files alone
    # What the manifest records of the options, and of which listing and files (a rerun with
    # `resume` compares them); a part's also says which part it is. And what decides which
    # images are packed beyond the options (see `plan_record`), so that parts packed by other
    # versions, or under another pixel limit, are not merged into one dataset.
    options = {**opts.as_dict(), **({"part": list(part)} if part is not None else {}), "listing": fingerprint,
               "sizes": sizes_digest(entries), "pack_rules": PACK_RULES, "pixel_limit": pixel_limit()}
    if part is not None and not complete and not overwrite:
        check_part_agrees(store, part, options, compression, listing.classes, len(listing.ignored))
    # Other packs' files first, a stale merge among them: a merge that lists this part's
    # shards must be gone before they are, or a crash between would leave it listing none.
    journal = Journal(store, "main" if part is None else f"part-{part[0]:05d}-of-{part[1]:05d}")
    _clear_other_packs(store, part, overwrite=overwrite, resume=resume, finished_part=complete,
                       journaled=journal.exists())
    if replace:
        remove_dataset(store, target, noting=journal.replacing)
        journal.replaced()
    if complete:
        summary = _finished_summary(store, target, options, on_error)
        journal.clear(remove_folder=part is None)  # a kill between the manifest and this left it
        cleanup_scratch(store, [target])  # and a kill mid-manifest its scratch file, or the empty folder
        return summary
    if max_side is None:
        shrunk = None
    else:
        with warnings.catch_warnings():  # headers of images over Pillow's warning threshold, which pack takes
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            shrunk = shrunk_estimates(entries, listing.root, max_side)
    planned = plan_frames(entries, opts, shrunk)
    store.makedirs()
    # on_error decides which files are skipped, so a resume must keep it; the files' sizes
    # and times catch a source edited in place (the listing has only names and labels).
    # And what decides which images are packed beyond the options: Pillow's limit, and the
    # rules of this version (`PACK_RULES`): a resume by a version that packs otherwise mixed
    # shards that neither version would write (found by review).
    plan_record = {"options": opts.as_dict(), "listing": fingerprint, "part": list(part or ()), "on_error": on_error,
                   "files": _files_stamp(entries), "pixel_limit": pixel_limit(), "rules": PACK_RULES}
    done = journal.start(plan_record, resume)
    # After the journal's fresh start, which removes its own run's shards: others' left behind.
    planned_names = {shard_name(opts.prefix, frame.shard, compression) for frame in planned}
    if part is not None:
        store.remove_all(_with_indexes(unplanned_part_shards(store, part[0], planned_names)))
    elif overwrite or resume:  # a run that replaced a dataset, or one killed doing so, left them
        store.remove_all(_with_indexes(unplanned_single_shards(store, planned_names)))
    to_build = [frame for frame in planned if frame.shard not in done]
    jobs = [(frame.shard, frame.entries, listing.root, opts, on_error == "skip") for frame in to_build]
    job_bytes = [frame.size for frame in to_build]  # what each frame holds once built
    # A killed run's half-written shards (a fresh start's too: it may follow a killed run).
    todo = {shard_name(opts.prefix, frame.shard, compression) for frame in to_build}
    # The merged manifest's too: a merge killed mid-write left its scratch file, and no merge can be
    # under way while this part's manifest is not there yet.
    scratch_names = [target, MANIFEST_NAME, *(name for shard in todo for name in (shard, shard + INDEX_SUFFIX))]
    cleanup_scratch(store, scratch_names)
    # The CPUs this process may use (affinity, a pod's CPU limit), not the machine's: a pod limited
    # to 4 CPUs of a 128-core node started 128 workers and their frame buffers.
    workers = max(1, min(workers or usable_cpus(), len(jobs) or 1))

    start = time.perf_counter()
    finished: dict[int, tuple[ShardInfo, list[tuple[str, str]]]] = dict(done)
    results: Iterator[FrameResult]
    if workers == 1:
        results = map(build_job, jobs)
    elif threads_pay(entries) or (context := pool_context()) is None:
        results = thread_results(jobs, workers, job_bytes)
    else:  # the context is chosen before the progress bar starts its monitor thread
        results = process_results(jobs, workers, context, job_bytes)
    results = _bomb_warnings_quiet(results)
    bar = _progress(len(entries), progress)
    bar.update(sum(s.samples + len(k) for s, k in done.values()))
    try:
        written = write_shards(results, store, opts, finished, journal, bar, start)
    except BaseException:
        # An interrupt (Ctrl-C, or SIGTERM in the CLI) may land between a scratch file's
        # making and its writer's knowing of it, which then cannot drop it: this pack's
        # partial files go by name, as a resume's first step would remove them.
        cleanup_scratch(store, scratch_names)
        raise
    finally:
        bar.close()
        results.close()  # the workers stop now, not when the generator is collected

    manifest = dataset_manifest(finished, listing, entries, listed_skips, compression, options)
    if part is None:
        write_manifest(store, manifest)
    else:
        store.write(target, manifest.to_bytes())
    journal.clear(remove_folder=part is None)
    return PackSummary(
        samples=manifest.samples,
        shards=len(manifest.shards),
        bytes_in=written.bytes_in,
        bytes_out=int(manifest.shards.bytes.sum() + manifest.shards.index_bytes.sum()),
        seconds=time.perf_counter() - start,
        skipped=list(manifest.skipped),
        ignored=len(listing.ignored),
        other_images=other_images(listing.ignored),
        unclassed=[path for path in listing.ignored  # hidden ones are never images (listing.py)
                   if "/" not in path and not path.startswith(".") and image_field(path)],
        misnamed=written.misnamed,
        kept_whole=written.kept_whole,
        shrunk=None if max_side is None else written.shrunk,
        resumed=sum(info.samples for info, _ in done.values()),
    )


def _check_arguments(compression: str, level: int, on_error: str, part: tuple[int, int] | None,
                     max_samples: int | None, max_side: int | None, quality: int, seed: int) -> None:
    check_compression(compression, level)
    # numpy's generator takes non-negative integers only: -1 failed with its ValueError from
    # deep inside the shuffle, after the source was listed.
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 1 << 64:
        # (numpy takes seeds modulo 2**64: 2**64 would shuffle as 0)
        raise ShardstreamError(f"seed must be a non-negative integer below 2**64, not {seed!r}")
    if on_error not in ON_ERROR:
        raise ShardstreamError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
    if part is not None and not 0 <= part[0] < part[1] <= MAX_PARTS:
        raise ShardstreamError(f"part must be I/N with 0 <= I < N <= {MAX_PARTS}, not {part[0]}/{part[1]}")
    # Past MAX_COUNT, each failed with msgpack's OverflowError as its journal was written.
    if max_samples is not None and not 1 <= max_samples <= MAX_COUNT:  # 0 packed one sample a shard
        raise ShardstreamError(f"max_samples must be a positive number of samples per shard, below 2**63, "
                               f"not {max_samples}")
    if max_side is not None and not 1 <= max_side <= MAX_COUNT:
        raise ShardstreamError(f"max_side must be a positive number of pixels, below 2**63, not {max_side}")
    if not 1 <= quality <= 100:
        raise ShardstreamError(f"quality must be 1..100, not {quality}")
    # Recorded in the manifest, each changed the options a rerun with `resume` compares, and
    # so refused it, for a pack with not a byte different.
    if max_side is None and quality != DEFAULT_QUALITY:
        raise ShardstreamError(f"quality ({quality}) goes with max_side: only images shrunk are encoded again")
    check_level_used(compression, level, IMAGE_LEVEL)


def _rows_left_out(listing: Listing, src: str, skip: bool, part: tuple[int, int] | None) -> list[tuple[str, str]]:
    """The skip records of a file list's rows left out (naming a file again, or an image of
    a format pack does not store), or (unless `skip`) PackError at the first. Every part lists the source, so part 0 alone records them,
    and a merge holds each once."""
    if listing.left_out and not skip:
        raise PackError(listing.left_out[0].refusal, url=src)
    if part is not None and part[0] != 0:
        return []
    return [(printable(r.path), r.reason) for r in listing.left_out]


def _finished_summary(store: Store, name: str, options: dict[str, Any], on_error: str) -> PackSummary:
    """What the finished (part) manifest `name` holds, once it is checked to be this very
    run's (the same options; a part's, the same source listing too; no files skipped where
    `on_error` is "fail"): a retry must not pass off another pack as done."""
    manifest = Manifest.from_bytes(store.read(name), store.url(name))
    if manifest.skipped and on_error == "fail":  # the manifest's options leave the policy out
        path, reason = manifest.skipped[0]
        raise PackError(f"the earlier run of this pack skipped {len(manifest.skipped)} files under on_error 'skip' "
                        f"(the first: {path}: {reason}), which 'fail' refuses; pass on_error='skip' (--on-error skip) "
                        "to keep it, or overwrite=True (--overwrite) to pack again", url=store.url(name))
    if "listing" in manifest.options and "sizes" not in manifest.options:
        raise ShardstreamError("already holds a pack made by an earlier version of shardstream, whose record of its "
                               "source this one cannot compare; pass overwrite=True (--overwrite) to pack it again",
                               url=store.url(name))
    if manifest.options != options:
        if _but_rules(manifest.options) == _but_rules(options):
            raise ShardstreamError("already holds this pack, made by another version of shardstream or under another "
                                   "pixel limit (PIL.Image.MAX_IMAGE_PIXELS), which decide which images are packed; "
                                   "pass overwrite=True (--overwrite) to pack it again", url=store.url(name))
        raise ShardstreamError("already holds a pack made from another source or with other options; "
                               "pass overwrite=True (--overwrite) to replace it", url=store.url(name))
    return PackSummary(
        samples=manifest.samples,
        shards=len(manifest.shards),
        bytes_in=0,
        bytes_out=int(manifest.shards.bytes.sum() + manifest.shards.index_bytes.sum()),
        seconds=0.0,
        skipped=list(manifest.skipped),
        ignored=manifest.ignored,
        resumed=manifest.samples,  # every one packed by the earlier run: "0 img/s" said otherwise
    )


def _but_rules(options: dict[str, Any]) -> dict[str, Any]:
    """A manifest's `options` but what decides which images are packed beyond them (`parts.RULES`)."""
    return {name: value for name, value in options.items() if name not in RULES}


# Raised where a version of pack decides otherwise which images are packed, or their bytes
# (not the options'): 2, the readers' pixel limit and `exact` for lossy WebP re-encoded.
PACK_RULES = 2


def _bomb_warnings_quiet(results: Iterator[FrameResult]) -> Iterator[FrameResult]:
    """`results`, with Pillow's DecompressionBombWarning (images over its warning threshold,
    half its error threshold) not said wherever they are built: Pillow refuses images past
    its error threshold, the readers' limit, as it opens them (`imagecheck` says "too
    large"), and pack takes those below, which the readers decode. The filter is set once, here, for the threads (which share it) and
    the processes (which inherit it when they start, on the first result), never changed
    while they run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield from results


def _progress(total: int, enabled: bool) -> Any:
    from .progress import progress_bar

    return progress_bar(total=total, unit="img", desc="pack", disable=not enabled, smoothing=0.1)
