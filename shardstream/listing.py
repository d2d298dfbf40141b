"""What a pack source holds: an image folder (one subfolder per class) or a file list.

The listing decides sample keys, fields and labels, and is the same on every machine
that sees the same files: it depends on relative paths only. It reads folders (or the
list) and looks no file up: a file's size and modification time come from
`look_up_files`, asked for the files a pack will read, so that each of the N parts of
a pack in parts stats its own share of the source, not all of it N times over. A
file's field is what its name's extension gives; what its bytes really are is known
when it is read: `sniff_image` tells, so that `pack` refuses a format it does not
store and reports a name that lies about one it does.
"""

from __future__ import annotations

import csv
import os
import re
import stat
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import PackError
from .columns import MAX_CLASS

__all__ = ["Listing", "SourceFile", "Repeat", "list_source", "look_up_files", "printable", "sniff_image",
           "IMAGE_FIELDS"]

# File extension -> field name. The field says what the name says the bytes are, so .jpeg
# and .JPG become `jpg`, which is what WebDataset's decoders and `fields=("jpg", "cls")`
# expect. A name can lie (ImageNet holds a PNG named .JPEG): the field stays the name's,
# so that every sample has it, and readers that sniff the bytes (Pillow, shardstream's
# decoders) read them; `pack` reports such files, which JPEG-only decoders refuse.
IMAGE_FIELDS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}

# The first bytes of image formats -> (field, format name). The formats pack stores have a
# field, for comparing with the one the name gives; the others are named only, for the
# message that refuses them. WebP (RIFF....WEBP) is tested apart.
_SIGNATURES: tuple[tuple[bytes, str | None, str], ...] = (
    (b"\xff\xd8\xff", "jpg", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "png", "PNG"),
    (b"GIF87a", None, "GIF"),
    (b"GIF89a", None, "GIF"),
    (b"BM", None, "BMP"),
    (b"II*\x00", None, "TIFF"),
    (b"MM\x00*", None, "TIFF"),
    (b"\x00\x00\x01\x00", None, "ICO"),
    (b"8BPS", None, "Photoshop"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", None, "JPEG 2000"),
    (b"\xff\x0a", None, "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", None, "JPEG XL"),
)
_ISO_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIF", b"heix": "HEIF", b"mif1": "HEIF", b"msf1": "HEIF"}


def sniff_image(data: bytes) -> tuple[str | None, str | None]:
    """(field, format name) of the image format `data` starts as, from its first bytes.

    The field is ``"jpg"``, ``"png"`` or ``"webp"`` for the formats `pack` stores, None
    for another format (named: ``"GIF"``, ``"BMP"``, ``"TIFF"``, ...); both are None for
    bytes that start as no image format known here. Whether the rest is a whole, readable
    image is `imagecheck.check_image`'s question.
    """
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp", "WebP"
    for magic, field, name in _SIGNATURES:
        if data.startswith(magic):
            return field, name
    if data[4:8] == b"ftyp" and data[8:12] in _ISO_BRANDS:
        return None, _ISO_BRANDS[data[8:12]]
    return None, None


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
        return f"duplicate of line {self.first_line}"


@dataclass(frozen=True)
class Listing:
    root: str
    files: tuple[SourceFile, ...]  # sorted by path, keys unique
    classes: tuple[str, ...]
    ignored: tuple[str, ...]  # files that are not images, by relative path
    repeated: tuple[Repeat, ...] = ()  # file list rows left out of `files`, as naming a file again


def _key(relpath: str) -> str:
    # A key is the path without the file's extension, the other dots of its name made '_'
    # (WebDataset splits a member's name at its first dot), and must not climb out of a
    # folder when a shard is extracted ('..' made '_up_').
    folder, _, name = relpath.rpartition("/")
    return _key_prefix(folder) + _stem_key(name)


def _key_prefix(folder: str) -> str:
    """The part of the keys of the files in `folder` (a relative path) that the folder gives."""
    parts = [("_up_" if p == ".." else p) for p in folder.split("/") if p not in ("", ".")]
    return "".join(p + "/" for p in parts)


def _stem_key(name: str) -> str:
    return name.rsplit(".", 1)[0].replace(".", "_")


def _image_field(name: str) -> str | None:
    """The field a file name's extension gives (`IMAGE_FIELDS`), None for another file.
    As os.path.splitext splits (leading dots start no extension: ".jpg" has none), at a
    third of its cost: a listing asks it of every file."""
    dot = name.rfind(".")
    if dot <= 0 or not name[:dot].lstrip("."):
        return None
    return IMAGE_FIELDS.get(name[dot:].lower())


def _unique_keys(files: list[SourceFile]) -> None:
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


def list_source(src: str) -> Listing:
    """List an image folder or a `.txt`/`.csv` file list of ``path[,label]`` lines."""
    if os.path.isdir(src):
        return _list_folder(src)
    if os.path.isfile(src) and src.lower().endswith((".txt", ".csv")):
        return _list_file(src)
    raise PackError("source must be an image folder or a .txt/.csv file list", url=src)


def _list_folder(root: str) -> Listing:
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    for name in classes:
        if printable(name) != name:
            raise PackError("class folder name is not UTF-8", url=printable(os.path.join(root, name)))
    files: list[SourceFile] = []
    ignored: list[str] = [e.name for e in os.scandir(root) if e.is_file()]
    for hidden in sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name.startswith(".")):
        # Not a class, but its files are counted: nothing in the source goes unaccounted.
        for folder, names in _walk(os.path.join(root, hidden)):
            ignored += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names]
    for label, name in enumerate(classes):
        for folder, names in _walk(os.path.join(root, name), within=root):
            # Slicing, not os.path.relpath: relpath normalises both paths on every call,
            # 30 µs a file, which is minutes on a dataset of millions. What the folder gives
            # of the paths and keys is worked out once a folder, not once a file.
            prefix = folder[len(root) :].lstrip(os.sep).replace(os.sep, "/") + "/"
            key_prefix = _key_prefix(prefix)
            for file in names:
                field = _image_field(file)
                if field is None:
                    ignored.append(prefix + file)
                else:
                    files.append(SourceFile(prefix + file, key_prefix + _stem_key(file), field, label))
    if not files:
        raise PackError("no images found (expected one subfolder of images per class)", url=root)
    _unique_keys(files)
    return Listing(root, tuple(files), tuple(classes), tuple(sorted(ignored)))


def _walk(top: str, within: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """(folder, sorted file names) for `top` and every folder below it, in sorted order.

    Symlinked folders are followed, as the class folders themselves are (and as
    torchvision's ImageFolder does), each real folder at most once per walk, so a link
    to an ancestor cannot loop. A link to a folder elsewhere in `within` (the dataset's
    root) but not in `top` is not followed: the images there are another class's (or
    none's), and would be packed again under this one's label.
    """
    top_real = os.path.realpath(top)
    root_real = os.path.realpath(within) if within is not None else None
    visited = {top_real}
    for folder, dirs, names in os.walk(top, followlinks=True, onerror=_unlistable):
        kept = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(folder, d))
            elsewhere = root_real is not None and _inside(real, root_real) and not _inside(real, top_real)
            if real not in visited and not elsewhere:
                visited.add(real)
                kept.append(d)
        dirs[:] = kept
        yield folder, sorted(names)


def _unlistable(error: OSError) -> None:
    # os.walk passes over a folder it cannot list: its images would be lost without a word.
    raise PackError(f"cannot list the folder: {error.strerror or error}", url=printable(str(error.filename))) from error


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


# Stats of a listing's files go to threads where one in a single thread takes longer than
# this: on NFS or Lustre a stat is a round trip to a metadata server (hundreds of
# microseconds to milliseconds), which threads overlap; on a local disk with its metadata
# cached it is 5-10 µs, and threads only cost (the GIL changes hands at every call: 4 to
# 16 threads made 200k stats 1.5-2.5x slower than one; measured here).
SLOW_STAT_S = 50e-6
STAT_THREADS = 16
_STAT_CHUNK = 256  # files stat'd at a time
# Chunks stat'd in the calling thread first, whose median time tells the kind of file system:
# one chunk alone misleads where its folder alone is not in the cache yet.
_PROBE_CHUNKS = 4


def look_up_files(entries: Sequence[SourceFile], root: str) -> None:
    """Fill in each entry's size and modification time, from one stat a file.

    The files are stat'd in path order, a folder's files together, as a walk of the
    folders would: in the order of a shuffle, each stat lands in another folder. A file
    that cannot be looked up (a dangling symlink, a file list's missing file) gets size 0
    and time -1, and is reported when packing reaches it, under the error policy. Where
    a stat is slow (a network file system), the stats run in threads.
    """
    by_path = sorted(entries, key=lambda e: e.path)
    chunks = [by_path[i : i + _STAT_CHUNK] for i in range(0, len(by_path), _STAT_CHUNK)]

    def look_up(chunk: list[SourceFile]) -> float:
        start = time.perf_counter()
        for e in chunk:
            try:
                info = os.stat(e.full_path(root))
                e.size, e.modified = (info.st_size if stat.S_ISREG(info.st_mode) else 0), info.st_mtime_ns
            except OSError:
                e.size, e.modified = 0, -1
        return (time.perf_counter() - start) / len(chunk)

    probe = [look_up(chunk) for chunk in chunks[:_PROBE_CHUNKS]]
    rest = chunks[_PROBE_CHUNKS:]
    if rest and statistics.median(probe) >= SLOW_STAT_S:
        with ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="shardstream-stat") as pool:
            for _ in pool.map(look_up, rest):
                pass
    else:
        for chunk in rest:
            look_up(chunk)


def printable(path: str) -> str:
    """`path` as text that encodes as UTF-8: the bytes of a file name that is not UTF-8
    (which Python keeps as lone surrogates) are shown as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _read_rows(path: str) -> list[tuple[int, str, str | None]]:
    """The (line number, path, label or None) rows of a file list; blank lines and `#` comments left out."""
    rows: list[tuple[int, str, str | None]] = []
    try:
        # utf-8-sig: Excel's "CSV UTF-8" and PowerShell begin with a byte-order mark, which
        # would otherwise be the first path's first character.
        with open(path, newline="", encoding="utf-8-sig") as f:
            for number, row in enumerate(csv.reader(f), 1):
                if not row or not row[0].strip() or row[0].startswith("#"):
                    continue
                if len(row) > 2:
                    raise PackError(f"line {number}: expected 'path[,label]', got {len(row)} columns", url=path)
                # An empty label cell (`a.jpg,`) is no label: as a label it would be a class named ""
                # and turn integer labels into names, every class index moved by one.
                rows.append((number, row[0].strip(), (row[1].strip() or None) if len(row) == 2 else None))
    except UnicodeDecodeError as e:
        raise PackError(f"the file list is not UTF-8 text (byte {e.start})", url=path) from None
    return rows


def _is_header(first_cell: str, root: str) -> bool:
    """Whether the first row is a header (`path,label`, `image,label`, `filename`, ...):
    its path cell has no image extension and names no existing file. Such a row names
    nothing to pack or skip, so dropping it loses no sample, and a header's label
    cell never becomes a class (which would renumber integer labels as names)."""
    if os.path.splitext(first_cell)[1].lower() in IMAGE_FIELDS:
        return False
    # A folder is no file (a header `images,label` over an `images/` folder is still a header).
    path = first_cell if os.path.isabs(first_cell) else os.path.join(root, first_cell)
    return not (os.path.isfile(path) or os.path.islink(path))


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: str.isdigit() takes "²", which int() refuses


def _check_label_kinds(labels: set[str], path: str) -> None:
    """Refuse labels that are neither all class indices nor names: a stray non-integer among
    integers (a header kept, a typo) or numbers written as decimals ("1.0", as pandas writes
    them) would make every label a name, sorted as text: 10 before 2, every class renumbered."""
    integers = sorted(label for label in labels if _INTEGER.fullmatch(label))
    names = sorted(label for label in labels if not _INTEGER.fullmatch(label))
    if integers and names:
        raise PackError(f"labels mix class indices ({integers[0]!r}) and names ({names[0]!r}): give every row an "
                        "integer class index, or every row a class name", url=path)
    if names and all(_is_number(label) for label in names):
        raise PackError(f"labels are numbers but not integers ({names[0]!r}): write class indices as integers "
                        "(1, not 1.0)", url=path)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _relative(file: str, root: str) -> str:
    """A file list row's path relative to the list's folder `root` (absolute), normalised, with
    '/' separators: os.path.relpath(os.path.join(root, file), root), at a fraction of its
    cost (it made absolute both paths of every row: 20 µs a row, minutes for a list of
    millions, in every part of a pack in parts)."""
    if not os.path.isabs(file):
        rel = os.path.normpath(file)
        if not rel.startswith(os.pardir):  # one that climbs may climb past the top ("/.." is "/")
            return rel.replace(os.sep, "/")
        file = os.path.join(root, file)
    full, inside = os.path.normpath(file), root.rstrip(os.sep) + os.sep
    rel = full[len(inside) :] if full.startswith(inside) else ""
    if not rel or rel.startswith(os.sep):  # outside `root`, or "//a" (which POSIX keeps apart from "/a")
        rel = os.path.relpath(full, root)
    return rel.replace(os.sep, "/")


def _list_file(path: str) -> Listing:
    root = os.path.dirname(os.path.abspath(path))
    rows = _read_rows(path)
    if rows and _is_header(rows[0][1], root):
        rows = rows[1:]
    # Classes come from every row, a repeated one too: leaving a row out (as skipping a
    # corrupt image does) never renumbers the classes.
    labels = {label for _, _, label in rows if label is not None}
    unlabelled = next((number for number, _, label in rows if label is None), None)
    if labels and unlabelled is not None:
        raise PackError(f"line {unlabelled} has no label, and other lines have one", url=path)
    _check_label_kinds(labels, path)
    if labels and all(_INTEGER.fullmatch(label) for label in labels):
        # Integer labels are class indices as given.
        top = max(int(label) for label in labels)
        if min(int(label) for label in labels) < 0:
            raise PackError("integer labels must not be negative", url=path)
        if top > MAX_CLASS:  # the class table would hold `top` names (3e9: gigabytes before any packing)
            raise PackError(f"integer label {top} is above the largest class index, {MAX_CLASS}", url=path)
        classes = tuple(str(i) for i in range(top + 1))
        index = {str(i): i for i in range(top + 1)} | {label: int(label) for label in labels}
    else:
        classes = tuple(sorted(labels))
        index = {name: i for i, name in enumerate(classes)}
    files, ignored, repeated = [], [], []
    first_lines: dict[str, int] = {}
    for number, file, label in rows:
        # Normalised, so that "a.jpg", "./a.jpg" and its full path are one file, listed once.
        rel = _relative(file, root)
        if rel in first_lines:
            repeated.append(Repeat(rel, number, first_lines[rel]))
            continue
        first_lines[rel] = number
        field = _image_field(os.path.basename(file))
        if field is None:
            ignored.append(rel)
            continue
        # The path as listed is kept only where it is not the root joined with `rel` (a million
        # rows of a list in normal form need none).
        listed = "" if rel == file else file if os.path.isabs(file) else os.path.join(root, file)
        files.append(SourceFile(rel, _key(rel), field, None if label is None else index[label], listed))
    if not files:
        raise PackError("the file list names no images (rows are 'path[,label]', comma-separated; a row's path "
                        "needs an image extension: .jpg, .jpeg, .png, .webp)", url=path)
    _unique_keys(files)
    return Listing(root, tuple(files), classes, tuple(sorted(ignored)), tuple(repeated))
