"""The work of one frame, run in the pack workers: read its files, check them, shrink them, build its bytes.

A frame (a few images) is the unit of parallel work. `build_job` is a function of its
job alone (shard number, entries, source root, options, whether to skip bad files), and
its `FrameResult` carries all that the caller needs to append the frame and account for
it (skips, bytes read, misnamed and kept-whole files), so it runs the same in the
caller, in a thread or in a process (framepool.py), and the output does not depend on
where it ran.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from .errors import PackError, reason
from .imagecheck import check_image, sniff_image
from .format import MAX_FRAME_BYTES
from .packplan import PackOptions, tar_size
from .shardfile import Frame, build_frame
from .shrink import shrink_or_keep
from .sourcefile import SourceFile, printable

__all__ = ["FrameResult", "build_job"]


# The Pillow format of each image field, that a shrunk image is encoded in.
_PILLOW_FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


@dataclass
class FrameResult:
    shard: int
    frame: Frame
    skipped: list[tuple[str, str]]
    bytes_in: int
    misnamed: list[tuple[str, str]] = field(default_factory=list)  # as PackSummary's
    kept_whole: list[tuple[str, str]] = field(default_factory=list)
    shrunk: int = 0  # images `max_side` shrank


def _check_fits(entry: SourceFile, size: int, shrinking: bool = False) -> None:
    """A PackError where an image of `size` bytes would make a sample larger than any frame
    may hold: written, no reader would read it (FORMAT.md, limits)."""
    if tar_size(entry, size) > MAX_FRAME_BYTES:
        also = "; --max-side reads no file this large" if shrinking else ""
        raise PackError(f"{size} bytes: larger than a sample may be ({MAX_FRAME_BYTES} bytes in the tar, "
                        f"FORMAT.md){also}")


def build_job(job: tuple[int, list[SourceFile], str, PackOptions, bool]) -> FrameResult:
    shard, entries, root, opts, skip = job
    samples, skipped, bytes_in = [], [], 0
    misnamed: list[tuple[str, str]] = []
    kept_whole: list[tuple[str, str]] = []
    shrunk = 0
    frame_bytes = 0  # the tar bytes of the samples taken
    for entry in entries:
        path = entry.full_path(root)
        try:
            if printable(entry.path) != entry.path:  # its key could not be written into a tar
                raise PackError("file name is not UTF-8", url=printable(path))
            found = os.stat(path)
            if not stat.S_ISREG(found.st_mode):  # a FIFO or a device: opening it would wait forever
                raise PackError("not a regular file", url=printable(path))
            # Refused before 2 GiB are read; with --max-side too, where it might have shrunk: an image
            # within Pillow's pixel limit is far smaller than that, so such a file is mostly other bytes.
            _check_fits(entry, found.st_size, shrinking=opts.max_side is not None)
            with open(path, "rb") as f:
                data = f.read()
            original = data
            kind = check_image(data, path)
            read = len(data)
            kept = None
            if opts.max_side is not None:
                # Encoded again, if at all, in the format of its field: then the field tells the truth.
                data, kept = shrink_or_keep(data, opts.max_side, opts.quality, path=path,
                                            as_format=_PILLOW_FORMATS[entry.field])
            _check_fits(entry, len(data))  # as stored (and a file grown since it was looked at)
            taken = tar_size(entry, len(data))
            if frame_bytes + taken > MAX_FRAME_BYTES:
                # Planned smaller than it came (grown since it was listed; kept whole where it was to
                # shrink): taken, it made a frame no reader reads, in a pack that said it was done.
                raise PackError(f"{len(data)} bytes, with the {frame_bytes} of the images before it in its frame: "
                                f"past the {MAX_FRAME_BYTES} bytes a frame may hold (the plan took it for smaller: "
                                f"grown since it was listed at {entry.size} bytes, or kept whole by --max-side)")
        except (OSError, PackError) as e:
            # The manifest records the reason, which must be reproducible: no absolute path.
            why = e.detail if isinstance(e, PackError) else f"unreadable: {reason(e)}"
            if not skip:
                # What to do, in the message (a note is lost on the way from a worker process): found
                # by a walk, only a file list's errors said it.
                raise PackError(f"{why} (--on-error skip, on_error='skip', packs the rest, and lists each file "
                                "left out)", url=printable(path)) from None
            skipped.append((printable(entry.path), why))
            continue
        except MemoryError:  # this machine's limit, not a bad image: never a skip, but named
            raise PackError("out of memory while reading and checking it (a smaller --workers, or more memory)",
                            url=printable(path)) from None
        bytes_in += read
        if kind != entry.field:  # the name lies: stored as named all the same, and reported unless shrunk
            stored, name = sniff_image(data)
            if stored != entry.field:
                misnamed.append((entry.path, name or kind))
        if kept is not None:
            kept_whole.append((entry.path, kept))
        elif data is not original:  # `shrink_or_keep` returns the bytes it was given unless it shrank them
            shrunk += 1
        frame_bytes += taken
        fields = [(entry.field, data)]
        if entry.label is not None:
            fields.append(("cls", str(entry.label).encode("ascii")))
        samples.append((entry.key, sorted(fields)))
    return FrameResult(shard, build_frame(samples, opts.compression, opts.level), skipped, bytes_in, misnamed,
                       kept_whole, shrunk)
