"""The records of a pack source's listing, and the rules that name its samples.

A `SourceFile` is one image of the source: its path relative to the source (the file's
identity), and the sample key, field and label the listing gives it; a `Listing` is
the whole source as listed. Keys and fields come from names alone, by the rules here,
so that every machine that sees the same relative paths names the same samples: the
folder listing (listing.py) and the file list (filelist.py) both make these records.
"""

from __future__ import annotations

import os
from typing import Iterable
from dataclasses import dataclass

__all__ = ["IMAGE_FIELDS", "OTHER_IMAGE_EXTENSIONS", "Listing", "Repeat", "SourceFile", "Unstored", "image_field",
           "key_prefix", "make_keys_unique", "other_images", "printable", "sample_key", "stem_key"]

# File extension -> field name. The field says what the name says the bytes are, so .jpeg
# and .JPG become `jpg`, which is what WebDataset's decoders and `fields=("jpg", "cls")`
# expect. A name can lie (ImageNet holds a PNG named .JPEG): the field stays the name's,
# so that every sample has it, and readers that sniff the bytes (Pillow, shardstream's
# decoders) read them; `pack` reports such files, which JPEG-only decoders refuse.
IMAGE_FIELDS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


@dataclass(slots=True)
class SourceFile:
    """One file of a listing. Slotted (a pack of 1M files holds 1M of them, and every part
    of a pack in parts lists the whole source) and not frozen: the listing settles its
    key, and `look_up_files` fills in the size and time of the files a pack reads, in
    place, where a copy of each would cost twice the memory and more than the stat
    itself. Nothing changes it after."""

    path: str  # relative to the listing's root, with '/' separators, normalised: the file's identity
    key: str
    field: str
    label: int | None
    # The file as a file list names it, where that is opened instead of the root joined with
    # `path`: normalising ".." away changes which file a path names when a folder on the way
    # is a symlink (/data/lists -> /nfs/lists: /data/lists/../imgs is /nfs/imgs).
    listed: str = ""
    # Its size (0 unless a regular file) and modification time (ns; -1 where it could not be
    # looked up), once `look_up_files` has looked it up, from one stat: the plan cuts frames
    # by sizes, and `pack --resume` refuses a source changed in place by the times. -1 both
    # until then (a listing looks no file up).
    size: int = -1
    modified: int = -1

    def full_path(self, root: str) -> str:
        """The path to open."""
        return self.listed or os.path.join(root, self.path)


@dataclass(frozen=True)
class Repeat:
    """A row of a file list naming a file that an earlier row names: packed as listed, the
    file would be two samples (`a` and `a_1`), seen twice an epoch. `pack` fails on it or
    skips the later row, under its `on_error` policy."""

    path: str  # as `SourceFile.path`
    line: int  # the repeating row's line number in the list (from 1)
    first_line: int  # the line of the row that names it first

    @property
    def reason(self) -> str:
        # The row is left out, not the file, which its first row stands for (found by a walk:
        # "duplicate of line 1" read as the file skipped, and a list less the skips lost it).
        return f"line {self.line} left out, a second row for this file: its first row, line {self.first_line}, stands for it"

    @property
    def refusal(self) -> str:
        return (f"lines {self.first_line} and {self.line} both name {self.path!r}, which would be packed twice; "
                "remove one (or pass on_error='skip', --on-error skip, to pack the first)")


@dataclass(frozen=True)
class Unstored:
    """A row of a file list naming an image of a format `pack` does not store (`a.bmp`):
    named, and labelled, it is no file to leave out as not an image without a word (as an
    image folder's `.bmp` files are, counted). `pack` fails on it or skips it, under its
    `on_error` policy."""

    path: str  # as `SourceFile.path`
    line: int  # the row's line number in the list (from 1)

    @property
    def reason(self) -> str:
        return f"a {_extension(self.path)} file: pack stores JPEG, PNG and WebP images only"

    @property
    def refusal(self) -> str:
        return (f"line {self.line} names {self.path!r}, {self.reason}; convert it (or pass on_error='skip', "
                "--on-error skip, to leave it out)")


# Extensions of image formats `pack` does not store (torchvision's ImageFolder reads some):
# a pack's summary names the files of these it left out.
OTHER_IMAGE_EXTENSIONS = frozenset({".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".heic", ".heif",
                                    ".avif", ".jfif", ".jpe", ".jp2", ".jxl"})


def _extension(path: str) -> str:
    """The extension of the file name `path` ends with, lower case ("" where none). As
    os.path.splitext splits (leading dots start no extension: ".jpg" has none), at a third
    of its cost: a listing asks it of every file."""
    name = path[path.rfind("/") + 1:]
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 and name[:dot].lstrip(".") else ""


def other_images(paths: Iterable[str]) -> dict[str, int]:
    """How many of `paths` name images of each format `pack` does not store, by extension."""
    counts: dict[str, int] = {}
    for path in paths:
        extension = _extension(path)
        if extension in OTHER_IMAGE_EXTENSIONS:
            counts[extension] = counts.get(extension, 0) + 1
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class Listing:
    """A pack source as listed: its root, its images, its class names, and what it left out."""

    root: str
    files: tuple[SourceFile, ...]  # sorted by path, keys unique
    classes: tuple[str, ...]
    ignored: tuple[str, ...]  # files that are not images, by relative path
    # File list rows left out of `files` under the error policy: naming a file again, or an
    # image pack does not store.
    left_out: tuple[Repeat | Unstored, ...] = ()


def sample_key(relpath: str) -> str:
    # A key is the path without the file's extension, the other dots of its name made '_'
    # (WebDataset splits a member's name at its first dot), and must not climb out of a
    # folder when a shard is extracted ('..' made '_up_').
    folder, _, name = relpath.rpartition("/")
    return key_prefix(folder) + stem_key(name)


def key_prefix(folder: str) -> str:
    """The part of the keys of the files in `folder` (a relative path) that the folder gives."""
    parts = [("_up_" if p == ".." else p) for p in folder.split("/") if p not in ("", ".")]
    return "".join(p + "/" for p in parts)


def stem_key(name: str) -> str:
    return name.rsplit(".", 1)[0].replace(".", "_")


def image_field(name: str) -> str | None:
    """The field a file name's extension gives (`IMAGE_FIELDS`), None for another file."""
    return IMAGE_FIELDS.get(_extension(name))


def make_keys_unique(files: list[SourceFile]) -> None:
    """Sort `files` by path and make their keys unique (`a.b.jpg` and `a_b.png` both want
    `a_b`), deterministically."""
    files.sort(key=lambda f: f.path)
    seen: dict[str, int] = {}
    for f in files:
        base = key = f.key
        while key in seen:
            seen[base] += 1
            key = f"{base}_{seen[base]}"
        seen[key] = 0
        f.key = key


def printable(path: str) -> str:
    """`path` as text that encodes as UTF-8: the bytes of a file name that is not UTF-8
    (which Python keeps as lone surrogates) are shown as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
