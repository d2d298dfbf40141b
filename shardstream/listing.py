"""What a pack source holds: an image folder (one subfolder per class) or a file list.

The listing decides sample keys, fields and labels (by sourcefile.py's rules), and is
the same on every machine that sees the same files: it depends on relative paths
only. It reads folders (or the list: filelist.py) and looks no file up: a file's size
and modification time come from `look_up_files`, asked for the files a pack will read,
so that each of the N parts of a pack in parts stats its own share of the source, not
all of it N times over. A file's field is what its name's extension gives; what its
bytes really are is known when it is read (`imagecheck.sniff_image`), so that `pack`
refuses a format it does not store and reports a name that lies about one it does.
"""

from __future__ import annotations

import os
import stat
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

from .errors import PackError
from .filelist import list_file
from .sourcefile import Listing, SourceFile, image_field, key_prefix, make_keys_unique, printable, stem_key

__all__ = ["list_source", "look_up_files", "SLOW_STAT_S"]


def list_source(src: str) -> Listing:
    """List an image folder or a `.txt`/`.csv` file list of ``path[,label]`` lines."""
    if os.path.isdir(src):
        return _list_folder(src)
    if os.path.isfile(src) and src.lower().endswith((".txt", ".csv")):
        return list_file(src)
    found = "a file of another kind" if os.path.lexists(src) else "nothing is there"
    raise PackError(f"source must be an image folder or a .txt/.csv file list, and {found}", url=src)


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether `entry` is a folder or a link to one; a link in a loop is none (counted as not an
    image, as one within a class folder is: found by a walk, it stopped the whole pack)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _list_folder(root: str) -> Listing:
    with os.scandir(root) as scanned:
        entries = list(scanned)
    classes = sorted(e.name for e in entries if _is_dir(e) and not e.name.startswith("."))
    for name in classes:
        if printable(name) != name:
            raise PackError("class folder name is not UTF-8", url=printable(os.path.join(root, name)))
    files: list[SourceFile] = []
    ignored: list[str] = [e.name for e in entries if not _is_dir(e)]  # links that lead nowhere (or in a loop) too
    for hidden in sorted(e.name for e in entries if _is_dir(e) and e.name.startswith(".")):
        # Not a class, but its files are counted: nothing in the source goes unaccounted.
        for folder, names in _walk(os.path.join(root, hidden), within=root):  # no link back in: counted twice
            ignored += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names]
    for label, name in enumerate(classes):
        for folder, names in _walk(os.path.join(root, name), within=root):
            # Slicing, not os.path.relpath: relpath normalises both paths on every call,
            # 30 µs a file, which is minutes on a dataset of millions. What the folder gives
            # of the paths and keys is worked out once a folder, not once a file.
            prefix = folder[len(root) :].lstrip(os.sep).replace(os.sep, "/") + "/"
            folder_keys = key_prefix(prefix)
            # Hidden files and folders are no images, whatever their names end with: macOS
            # copies leave an AppleDouble `._x.jpg` beside every image, and tools keep copies
            # (`.ipynb_checkpoints`) or thumbnails (`.thumbnails`) there.
            hidden = "/." in prefix
            for file in names:
                field = None if hidden or file.startswith(".") else image_field(file)
                if field is None:
                    ignored.append(prefix + file)
                else:
                    files.append(SourceFile(prefix + file, folder_keys + stem_key(file), field, label))
    if not files:
        raise PackError("no images found (expected one subfolder of images per class)", url=root)
    make_keys_unique(files)
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
    # os.walk's order (each folder, then its folders depth first, sorted), with a stack of our own:
    # Python 3.11's os.walk recurses, and a folder nested 1,000 deep ended `pack` in a RecursionError.
    stack = [top]
    while stack:
        folder = stack.pop()
        dirs, names = _entries(folder)
        kept = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(folder, d))
            elsewhere = root_real is not None and _inside(real, root_real) and not _inside(real, top_real)
            if real not in visited and not elsewhere:
                visited.add(real)
                kept.append(d)
        yield folder, sorted(names)
        stack.extend(os.path.join(folder, d) for d in reversed(kept))


def _entries(folder: str) -> tuple[list[str], list[str]]:
    """The names in `folder` of its folders (links to folders too) and of the rest, as
    os.walk tells them apart; a folder that cannot be listed is an error (`_unlistable`)."""
    dirs, names = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    is_dir = False
                (dirs if is_dir else names).append(entry.name)
    except OSError as error:
        _unlistable(error)
    return dirs, names


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
