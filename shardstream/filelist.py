"""A pack source given as a file list: `.txt` or `.csv` rows of ``path[,label]``.

Paths are relative to the list's folder (or absolute), labels integer class indices
or class names, the same kind on every row; a header row, blank lines and `#`
comments are left out. A row naming a file that an earlier row names is not packed
twice: it is kept as a `Repeat`, which `pack` fails on or skips under its error
policy, as a row naming an image of a format pack does not store (an `Unstored`). Classes come from every row, so that leaving a row out never renumbers them.
"""

from __future__ import annotations

import csv
import os
import re
import warnings
from typing import Iterable, Iterator

from .columns import MAX_CLASS
from .errors import PackError
from .sourcefile import (IMAGE_FIELDS, Listing, Repeat, SourceFile, Unstored, image_field, make_keys_unique,
                         other_images, sample_key)

__all__ = ["list_file"]


def _read_rows(path: str) -> list[tuple[int, str, str | None]]:
    """The (line number, path, label or None) rows of a file list; blank lines and `#` comments left out.

    A comment is a line that begins with `#`: a path cell that begins with one, quoted
    (``"#1.jpg",cat``), is a path. A path cell is read without the spaces around it
    (``a.jpg, cat``), unless a file is named with them (``" b.jpg"``)."""
    rows: list[tuple[int, str, str | None]] = []
    root = os.path.dirname(os.path.abspath(path))
    line = 0
    row_from = 1  # where the row being read begins, at the latest: errors name it
    # Whether csv's next request for a line begins a row. csv reads no further than the row
    # it is on, so a request that comes with no row finished since is for a quoted cell's
    # next line (`"x<newline>#y.jpg",1`), which is no comment however it begins.
    row_starts = True

    def uncommented(lines: Iterable[str]) -> Iterator[str]:
        # On the lines as written, before csv takes the quotes off: only there is a quoted `#` a path.
        nonlocal line, row_starts
        for line, text in enumerate(lines, 1):
            if row_starts and text.startswith("#"):
                continue
            if "\0" in text:  # before csv: Python 3.10's refuses the line ("line contains NUL"), later ones read it
                raise PackError(f"line {line}: the line holds a NUL byte, which no file name or label can", url=path)
            row_starts = False
            yield text

    try:
        # utf-8-sig: Excel's "CSV UTF-8" and PowerShell begin with a byte-order mark, which
        # would otherwise be the first path's first character.
        with open(path, newline="", encoding="utf-8-sig") as f:
            for row in csv.reader(uncommented(f)):
                row_from, row_starts = line + 1, True
                if not row or not row[0].strip():
                    continue
                if len(row) > 2:
                    raise PackError(f"line {line}: expected 'path[,label]', got {len(row)} columns", url=path)
                cell = row[0]
                named = cell if cell != cell.strip() and os.path.lexists(os.path.join(root, cell)) else cell.strip()
                if len(row) == 2 and _comma_in_path(row, root):
                    raise PackError(f"line {line}: the path holds a comma ({','.join(row)!r} is a file): quote it "
                                    f"(\"{','.join(row)}\"), as CSV does", url=path)
                # An empty label cell (`a.jpg,`) is no label: as a label it would be a class named ""
                # and turn integer labels into names, every class index moved by one.
                rows.append((line, named, (row[1].strip() or None) if len(row) == 2 else None))
    except csv.Error as e:  # a quote left open reads on to the end, past csv's field limit
        raise PackError(f"the row from line {row_from} on does not parse as CSV ({e}): a quote left open?",
                        url=path) from None
    except UnicodeDecodeError as e:
        raise PackError(f"the file list is not UTF-8 text (byte {e.start})", url=path) from None
    return rows


def _comma_in_path(row: list[str], root: str) -> bool:
    """Whether a row read as path and label is one path holding a comma, unquoted: its
    "label" ends as an image's name and the cells joined name a file. Split, the path named
    nothing and the row went for a header when it came first (its image left out without a
    word), or stopped the pack at "line 1 has no label". Looked up only where the label
    looks like a file name: a stat a row would cost a list of millions seconds."""
    if os.path.splitext(row[1].strip())[1].lower() not in IMAGE_FIELDS:
        return False
    joined = ",".join(row)
    return os.path.lexists(joined if os.path.isabs(joined) else os.path.join(root, joined))


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


# Integer labels whose largest passes this, and ten times the labels used, are warned of (`list_file`).
SPARSE_LABELS_WARNED = 100_000


def list_file(path: str) -> Listing:
    """The listing of the file list at `path`: its images, their labels and classes, and the
    rows left out (not images, or naming a file again)."""
    root = os.path.dirname(os.path.abspath(path))
    rows = _read_rows(path)
    if rows and _is_header(rows[0][1], root):
        rows = rows[1:]
    # Classes come from every row, a repeated one too: leaving a row out (as skipping a
    # corrupt image does) never renumbers the classes.
    labels = {label for _, _, label in rows if label is not None}
    unlabelled = next((number for number, _, label in rows if label is None), None)
    if labels and unlabelled is not None:
        labelled = next(number for number, _, label in rows if label is not None)
        raise PackError(f"line {unlabelled} has no label, and other lines have one (line {labelled})", url=path)
    _check_label_kinds(labels, path)
    if labels and all(_INTEGER.fullmatch(label) for label in labels):
        # Integer labels are class indices as given.
        top = max(int(label) for label in labels)
        if min(int(label) for label in labels) < 0:
            raise PackError("integer labels must not be negative", url=path)
        if top > MAX_CLASS:  # the class table would hold `top` names (3e9: gigabytes before any packing)
            raise PackError(f"integer label {top} is above the largest class index, {MAX_CLASS}", url=path)
        if top + 1 > SPARSE_LABELS_WARNED and top + 1 > 10 * len(labels):
            # Allowed (the indices are the user's), and each index up to the largest gets a name and a
            # count in the manifest: one label of 2**24 - 1 made a 157 MB manifest for one sample.
            warnings.warn(f"{path}: integer labels go up to {top} for {len(labels):,} distinct classes: the "
                          f"manifest names every class index up to the largest ({top + 1:,} names); number the "
                          f"classes 0..{len(labels) - 1}, or label them by name, for a small manifest",
                          stacklevel=2)
        classes = tuple(str(i) for i in range(top + 1))
        index = {str(i): i for i in range(top + 1)} | {label: int(label) for label in labels}
    else:
        classes = tuple(sorted(labels))
        index = {name: i for i, name in enumerate(classes)}
    files, ignored, left_out = [], [], []
    first_lines: dict[str, int] = {}
    for number, file, label in rows:
        # Normalised, so that "a.jpg", "./a.jpg" and its full path are one file, listed once.
        rel = _relative(file, root)
        field = image_field(os.path.basename(file))
        if rel in first_lines:
            # An image named again would be packed twice; another file is ignored, once.
            if field is not None or other_images([rel]):
                left_out.append(Repeat(rel, number, first_lines[rel]))
            continue
        first_lines[rel] = number
        if field is None:
            if other_images([rel]):
                left_out.append(Unstored(rel, number))
            else:
                ignored.append(rel)
            continue
        # The path as listed is kept only where it is not the root joined with `rel` (a million
        # rows of a list in normal form need none).
        listed = "" if rel == file else file if os.path.isabs(file) else os.path.join(root, file)
        files.append(SourceFile(rel, sample_key(rel), field, None if label is None else index[label], listed))
    if not files:
        raise PackError("the file list names no images (rows are 'path[,label]', comma-separated; a row's path "
                        "needs an image extension: .jpg, .jpeg, .png, .webp)", url=path)
    make_keys_unique(files)
    return Listing(root, tuple(files), classes, tuple(sorted(ignored)), tuple(left_out))
