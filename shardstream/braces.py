"""Brace patterns: the shard names a pattern such as ``shards-{000000..000099}.tar`` stands for."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from itertools import product
from typing import Iterator

from .errors import BracePatternError
from .urls import split_query

__all__ = ["expand_braces", "folder_named", "names_shards", "BracePatternError", "MAX_BRACE_NAMES"]

# WebDataset's patterns, as its `braceexpand` dependency (0.1.7) expands them, which follows bash:
# lists ``{train,val}``, ranges ``{0..99}``, ``{9..0}``, ``{0..10..2}``, ``{a..e}``, zero padding
# from either end (``{07..10}``, ``{1..010}``), nesting, and several braces in one pattern (every
# combination, the rightmost brace varying fastest). A backslash makes the next character plain
# (``\{``, ``\\``), in a URL's query string too. Where braceexpand differs, it is on purpose: a
# string without braces is a URL as it is, backslashes and all (braceexpand drops them); an escaped
# backslash inside braces stays one (braceexpand 0.1.7 unescapes nested text once per level); a
# ``}`` that closes no ``{`` (``a}{b``) and a range of mixed kinds (``{1..a}``, ``{a..c..x}``) are
# errors (braceexpand leaves them as text: names of no shard).

MAX_BRACE_NAMES = 1_000_000  # past this, a typo in a range: every name becomes a ShardRef in memory
MAX_BRACE_DEPTH = 64
_INT_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?")
_LETTER_RANGE = re.compile(r"([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?")
_RANGE_LIKE = re.compile(r"-?[A-Za-z0-9]+\.\.-?[A-Za-z0-9]+(?:\.\.-?[A-Za-z0-9]+)?")
_LETTERS = string.ascii_uppercase + string.ascii_lowercase  # bash's order: Z..a is Z, a
_ESCAPE = re.compile(r"\\(.)")
_SHARD_SUFFIXES = (".tar", ".tgz", ".gz", ".zst", ".bz2", ".tbz2", ".xz", ".txz")  # what StreamTarReader reads
# Tars read only front to back: no index is made in place for them (`shardstream index`).
COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


@dataclass(frozen=True)
class _Ints:
    """An integer range: `count` numbers from `start` by `step` (negative to count down), `width` digits."""

    start: int
    step: int
    count: int
    width: int

    def names(self) -> list[str]:
        return [f"{self.start + k * self.step:0{self.width}d}" for k in range(self.count)]


@dataclass(frozen=True)
class _Choice:
    """``{x,y,z}`` (or a letter range): each option's names in turn."""

    options: tuple[tuple["_Part", ...], ...]


_Part = str | _Ints | _Choice  # a pattern is a tuple of parts: it stands for their product


def _closing(text: str, at: int) -> int:
    """The index of the ``}`` that closes the ``{`` at `at` (-1 if none), escapes skipped."""
    depth, i = 0, at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _parse(text: str, pattern: str, depth: int = 0) -> tuple[_Part, ...]:
    """`text` (all or part of `pattern`) as a tuple of parts; literal text comes unescaped."""
    if depth > MAX_BRACE_DEPTH:
        raise BracePatternError(f"braces nested more than {MAX_BRACE_DEPTH} deep", url=pattern)
    parts: list[_Part] = []
    literal, i = 0, 0  # where the current literal started; the scan position
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "}":
            raise BracePatternError(f"unbalanced braces: the '}}' at offset {i} closes no '{{'", url=pattern)
        if c == "{":
            end = _closing(text, i)
            if end < 0:
                raise BracePatternError(f"unbalanced braces: the '{{' at offset {i} is never closed", url=pattern)
            if literal < i:
                parts.append(_ESCAPE.sub(r"\1", text[literal:i]))
            parts.extend(_expression(text[i + 1 : end], pattern, depth + 1))
            i = literal = end + 1
            continue
        i += 1
    if literal < len(text):
        parts.append(_ESCAPE.sub(r"\1", text[literal:]))
    return tuple(parts)


def _expression(expr: str, pattern: str, depth: int) -> tuple[_Part, ...]:
    """The parts that ``{expr}`` stands for: a range, a list, or (neither) itself in braces, expanded inside."""
    if match := _INT_RANGE.fullmatch(expr):
        lo, hi, step = match.groups()
        padded = any(s.startswith(("0", "-0")) for s in (lo, hi) if s not in ("0", "-0"))
        start, end, by = int(lo), int(hi), int(step or 1) or 1
        return (_Ints(start, by if start < end else -by, abs(end - start) // by + 1,
                      max(len(lo), len(hi)) if padded else 0),)
    if match := _LETTER_RANGE.fullmatch(expr):
        lo, hi, step = match.groups()
        a, b, by = _LETTERS.index(lo), _LETTERS.index(hi), int(step or 1) or 1
        letters = _LETTERS[a : b + 1 : by] if a <= b else _LETTERS[a : b - 1 if b else None : -by]
        return (_Choice(tuple((c,) for c in letters)),)
    options, start, level, i = [], 0, 0, 0  # split at the commas outside nested braces
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            i += 1
        elif c in "{}":
            level += 1 if c == "{" else -1
        elif c == "," and level == 0:
            options.append(expr[start:i])
            start = i + 1
        i += 1
    if options:
        options.append(expr[start:])
        return (_Choice(tuple(_parse(o, pattern, depth) for o in options)),)
    if _RANGE_LIKE.fullmatch(expr):
        raise BracePatternError(f"{{{expr}}} is not a range: both ends must be integers or both single "
                                "letters, and a step an integer", url=pattern)
    return ("{", *_parse(expr, pattern, depth), "}")


def _brace_count(parts: tuple[_Part, ...]) -> int:
    n = 1
    for part in parts:
        if isinstance(part, _Ints):
            n *= part.count
        elif isinstance(part, _Choice):
            n *= sum(_brace_count(o) for o in part.options)
    return n


def _brace_names(parts: tuple[_Part, ...]) -> Iterator[str]:
    def names(part: _Part) -> list[str]:
        if isinstance(part, str):
            return [part]
        if isinstance(part, _Ints):
            return part.names()
        return [name for option in part.options for name in _brace_names(option)]

    return ("".join(combo) for combo in product(*(names(p) for p in parts)))


def expand_braces(pattern: str, *, limit: int = MAX_BRACE_NAMES) -> list[str]:
    """The names a brace pattern stands for, in WebDataset's order: ``shards-{000..099}.tar``,
    ``s3://bucket/{train,val}/shard-{0..98..2}.tar`` (see above).

    Patterns joined by ``::`` (``a-{0..9}.tar::b-{0..9}.tar``, WebDataset's list of
    patterns) stand for each one's names in turn, where each names shards: a chained
    fsspec URL (``simplecache::s3://...``) begins with a protocol, which names none.

    A string without braces is one name, as it is. Refused with a `BracePatternError`
    naming the pattern: unbalanced braces, a range of mixed kinds, more than `limit`
    names (counted before any is made, so that a typo cannot hang or fill memory).
    """
    patterns = pattern.split("::")
    if len(patterns) < 2 or not all(names_shards(one) and not _chains(one) for one in patterns):
        patterns = [pattern]
    if "{" not in pattern and "}" not in pattern:
        return patterns
    parsed = [_parse(one, one) for one in patterns]
    if (n := sum(_brace_count(parts) for parts in parsed)) > limit:
        raise BracePatternError(f"expands to {n:,} names, more than the limit of {limit:,} (a typo in a range?)",
                                url=pattern)
    return [name for parts in parsed for name in _brace_names(parts)]


def _chains(part: str) -> bool:
    """Whether `part` of a ``::``-joined string is a segment of a chained fsspec URL, whose file
    system reads the segment after it: an archive's (``tar://member.tar::file:///x.tar``) or a
    cache wrapper's. Such a URL is one (refused where it is read: `urls.check_chain`)."""
    if "://" not in part:
        return False
    import fsspec
    from fsspec.archive import AbstractArchiveFileSystem
    from fsspec.implementations.cached import CachingFileSystem

    try:
        return issubclass(fsspec.get_filesystem_class(part.split("://", 1)[0]),
                          (AbstractArchiveFileSystem, CachingFileSystem))
    except (ImportError, ValueError):
        return False


def folder_named(source: str) -> str:
    """The folder a `source` that does not name shards (`names_shards`) names: its escaped
    braces (``data/\\{v1\\}``) unescaped, as in a pattern; braces standing for themselves kept."""
    return expand_braces(source)[0] if "{" in source or "}" in source else source


def names_shards(source: str) -> bool:
    """Whether `source` names shards (one shard's URL, or a brace pattern) rather than a dataset's folder.

    A folder whose name has braces that stand only for themselves (``data/{v1}``) is a folder;
    a malformed pattern names shards, so that expanding it explains what is wrong.
    """
    # A presigned or SAS-signed shard URL ends in its query string (``a.tar?X-Amz-Signature=...``).
    if split_query(source)[0].endswith(_SHARD_SUFFIXES):
        return True
    if "{" not in source and "}" not in source:
        return False
    try:
        return any(not isinstance(part, str) for part in _parse(source, source))
    except BracePatternError:
        return True
