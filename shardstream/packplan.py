"""The plan of a pack: the options that decide its bytes, the sample order, and its cut into frames.

The work is planned before it starts, from the file listing and file sizes alone: the
sorted listing is shuffled with `seed` (`order`), a part takes its contiguous slice of
that order (`part_slice`), and `plan_frames` cuts it into shards of about `shard_size`
bytes and each shard into frames of about `frame_size`. Only the listing, the options
and (when images shrink) the image headers go in, so a rerun, a resumed pack and every
part compute the same plan, whatever `workers` is. Apart from pack.py, which runs the
plan, so that the workers (framebuild.py), which get `PackOptions` with each job, do
not import the orchestration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from . import tario
from .decode import image_size
from .format import MAX_FRAME_BYTES, ShardFill, index_cost
from .sourcefile import Listing, SourceFile
from .shrink import DEFAULT_QUALITY, shrunk_size

__all__ = ["PackOptions", "PlannedFrame", "order", "part_slice", "plan_frames", "shrunk_estimates", "tar_size"]


@dataclass(frozen=True)
class PackOptions:
    """What decides the bytes of the output (recorded in the manifest)."""

    shard_size: int
    max_samples: int | None
    compression: str
    level: int
    seed: int
    shuffle: bool
    frame_size: int
    prefix: str
    max_side: int | None = None  # shrink larger images (shrink.py); None keeps every file's bytes
    quality: int = DEFAULT_QUALITY  # of images shrunk to JPEG or WebP

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def order(listing: Listing, opts: PackOptions) -> list[SourceFile]:
    """The sample order: sorted by path (as a listing is), then shuffled by `seed` unless told not to."""
    entries = list(listing.files)
    if opts.shuffle:
        # PCG64 by name, as `default_rng` makes it today: numpy may change its default generator,
        # and parts packed beside another numpy would then slice another order (`plan.rng_for`).
        perm = np.random.Generator(np.random.PCG64(opts.seed)).permutation(len(entries))
        entries = [entries[i] for i in perm.tolist()]  # Python ints index faster than numpy's
    return entries


def part_slice(entries: list[SourceFile], index: int, parts: int) -> list[SourceFile]:
    """The index-th of `parts` contiguous slices of the (already shuffled) sample order."""
    n = len(entries)
    return entries[index * n // parts : (index + 1) * n // parts]


def tar_size(entry: SourceFile, file_bytes: int | None = None) -> int:
    """The bytes `entry`'s sample takes in the tar, its image being `file_bytes` long (by
    default its size in the listing): its members, headers and padding included."""
    # Deterministic, from the listing alone: the members' sizes in the tar, headers included
    # (a long or non-ASCII name takes a pax record: planned without it, frames of such names
    # grew to twice their size). Exact where the file keeps its bytes.
    file_bytes = entry.size if file_bytes is None else file_bytes
    size = tario.member_size(file_bytes, f"{entry.key}.{entry.field}")
    if entry.label is not None:
        size += tario.member_size(len(str(entry.label)), f"{entry.key}.cls")
    return size


def shrunk_estimates(entries: list[SourceFile], root: str, max_side: int) -> dict[str, int]:
    """Each file's expected size after shrinking to `max_side`, for planning only.

    The file's size scaled by the share of pixels kept, from the image header (the
    first 64 KB). Unreadable headers count at full size: the work step reports them.
    """
    estimates = {}
    for entry in entries:
        if entry.size <= 0:  # not a regular file (a FIFO would block the open), or empty: the work step reports it
            continue
        try:
            with open(entry.full_path(root), "rb") as f:
                head = f.read(1 << 16)
                size = image_size(head)
                if _kept_whole(head, f):  # `shrink_or_keep` keeps its bytes: planned shrunk, 3 of 760 MB made a frame
                    continue
        except Exception:  # noqa: BLE001 - any failure means: plan it at its full size
            continue
        width, height = shrunk_size(size, max_side)
        estimates[entry.path] = max(1, entry.size * width * height // max(1, size[0] * size[1]))
    return estimates


def _kept_whole(head: bytes, f: BinaryIO) -> bool:
    """Whether the image that `head` (the first 64 KB of the file `f`) begins is one
    `shrink.shrink_or_keep` keeps whole, by its header: an animated PNG (`_png_frames`), an
    animated WebP (the animation flag of its `VP8X` chunk), a JPEG holding more pictures
    (an MPO: an APP2 `MPF` segment)."""
    if head.startswith(b"\x89PNG"):
        return _png_frames(f) > 1
    if head[:4] == b"RIFF" and head[8:16] == b"WEBPVP8X" and len(head) > 20:
        return bool(head[20] & 0x02)
    return head.startswith(b"\xff\xd8") and _mpf_pictures(head) > 1


def _png_frames(f: BinaryIO) -> int:
    """The frames Pillow counts in the PNG `f` (`n_frames`), from its chunks before the image
    data, their bodies skipped (an ICC profile or a comment may put `acTL` past 64 KB): an
    `acTL`'s count, and one more where the image before the animation is not one of its
    frames (no `fcTL` before the first `IDAT`); 1 for a still."""
    f.seek(8)
    frames, framed = None, False
    while len(chunk := f.read(8)) == 8:
        length, kind = int.from_bytes(chunk[:4], "big"), chunk[4:]
        if kind == b"IDAT":
            break
        if kind == b"acTL":
            frames = int.from_bytes(f.read(4), "big")
            length -= 4
        framed |= kind == b"fcTL"
        f.seek(length + 4, 1)  # the body (what is left of it) and the CRC
    return 1 if frames is None else frames + (0 if framed else 1)


def _mpf_pictures(head: bytes) -> int:
    """The pictures a JPEG's MPF segment (APP2, ``MPF\\0``, then a TIFF structure) says it
    holds, as Pillow reads it to call a file MPO (its NumberOfImages tag, 0xB001); 0 where
    its header segments hold none. A walk of the segments, not a search: an ICC profile is
    an APP2 segment too, and EXIF text may hold the bytes ``MPF``."""
    pos = 2
    while pos + 4 <= len(head) and head[pos] == 0xFF:
        code, length = head[pos + 1], int.from_bytes(head[pos + 2 : pos + 4], "big")
        if code == 0xDA or length < 2:  # the image data begins: no more header segments
            return 0
        body = head[pos + 4 : pos + 2 + length]
        if code == 0xE2 and body[:4] == b"MPF\x00":
            return _tiff_tag(body[4:], 0xB001)
        pos += 2 + length
    return 0


def _tiff_tag(tiff: bytes, tag: int) -> int:
    """The value of `tag` (a SHORT or LONG) in the first directory of a TIFF structure; 0 if absent."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 0
    at = int.from_bytes(tiff[4:8], order)
    count = int.from_bytes(tiff[at : at + 2], order)
    for entry in range(at + 2, min(at + 2 + 12 * count, len(tiff) - 11), 12):
        if int.from_bytes(tiff[entry : entry + 2], order) == tag:
            kind = int.from_bytes(tiff[entry + 2 : entry + 4], order)
            return int.from_bytes(tiff[entry + 8 : entry + (10 if kind == 3 else 12)], order)
    return 0


class PlannedFrame(NamedTuple):
    """One frame of the plan: the shard it belongs to, its files in order, and its size.

    The size, known before any image is read, is what the pack holds of the frame once
    built (its tar bytes; a file shrunk is held at its expected size shrunk, not at the
    size of the file read). Counted once, where the cut needs it: 2 us a file.
    """

    shard: int
    entries: list[SourceFile]
    size: int


def plan_frames(entries: list[SourceFile], opts: PackOptions,
                file_bytes: dict[str, int] | None = None) -> list[PlannedFrame]:
    """Cut the ordered entries into frames, each of one shard.

    `file_bytes` overrides the expected size of some files (those that will shrink).
    """
    jobs: list[PlannedFrame] = []
    shard, fill = 0, ShardFill(opts.shard_size, opts.max_samples)
    frame: list[SourceFile] = []
    frame_total = 0
    for entry in entries:
        size = tar_size(entry, (file_bytes or {}).get(entry.path))
        cost = index_cost(entry.key)
        if not fill.takes(size, cost):
            if frame:
                jobs.append(PlannedFrame(shard, frame, frame_total))
            shard, frame, frame_total = shard + 1, [], 0
            fill.start_next()
        if frame and frame_total + size > MAX_FRAME_BYTES:  # joined, a frame no reader reads
            jobs.append(PlannedFrame(shard, frame, frame_total))
            frame, frame_total = [], 0
        frame.append(entry)
        frame_total += size
        fill.add(size, cost)
        if frame_total >= opts.frame_size:
            jobs.append(PlannedFrame(shard, frame, frame_total))
            frame, frame_total = [], 0
    if frame:
        jobs.append(PlannedFrame(shard, frame, frame_total))
    return jobs
