"""A manifest's list of shards, held as columns.

Every rank reads the manifest, and DataLoader workers started by spawn receive it
pickled. As one Python object per shard it cost, at 400k shards (a LAION-scale
dataset), 350 MB and 6 s in every process and 4.5 s to unpickle in every worker
(BENCHMARKS.md, "A manifest of 400k shards"). As columns (one array per number, one
byte string per text column, the distinct field lists once) it holds about 100 bytes per
shard, and pickles as a handful of buffers.

`ShardTable` is a sequence of `ShardInfo`: `table[i]` and iteration build the entry of
one shard when asked. Code that needs one number of every shard reads its column
(`table.samples`, `table.bytes`) instead of building 400k entries.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence, overload

import numpy as np

__all__ = ["ShardInfo", "ShardTable", "TextColumn", "checked_index"]

_HEX = re.compile("[0-9a-fA-F]*")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    name: str
    samples: int
    bytes: int
    raw_bytes: int  # the uncompressed tar stream
    sha256: str
    index: str
    index_bytes: int
    index_sha256: str
    fields: tuple[str, ...]


class TextColumn(Sequence[str]):
    """Strings in one UTF-8 byte string and their end offsets: 8 bytes per string
    beside its text, where a Python `str` costs about 50."""

    __slots__ = ("_data", "_ends")

    def __init__(self, values: Iterable[str]) -> None:
        encoded = [v.encode() for v in values]
        self._data = b"".join(encoded)
        self._ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> "TextColumn": ...

    def __getitem__(self, i: int | slice) -> "str | TextColumn":
        if isinstance(i, slice):
            return TextColumn(self[j] for j in range(*i.indices(len(self))))
        i = checked_index(i, len(self))
        start = int(self._ends[i - 1]) if i else 0
        return self._data[start : int(self._ends[i])].decode()

    def __len__(self) -> int:
        return len(self._ends)

    def __iter__(self) -> Iterator[str]:
        start = 0
        for end in self._ends.tolist():
            yield self._data[start:end].decode()
            start = end

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TextColumn):
            return NotImplemented
        return self._data == other._data and np.array_equal(self._ends, other._ends)

    __hash__ = None  # type: ignore[assignment]


class ShardTable(Sequence[ShardInfo]):
    """The shards of a manifest, in order, as columns.

    Numbers are read-only int64 arrays (`samples`, `bytes`, `raw_bytes`, `index_bytes`);
    checksums are kept as 32 raw bytes each and given back as lowercase hex.
    """

    __slots__ = ("names", "samples", "bytes", "raw_bytes", "_sha256", "indexes", "index_bytes", "_index_sha256",
                 "field_sets", "_field_set")

    def __init__(self, *, names: Iterable[str], samples: Sequence[int], bytes: Sequence[int],
                 raw_bytes: Sequence[int], sha256: Sequence[str], indexes: Iterable[str], index_bytes: Sequence[int],
                 index_sha256: Sequence[str], fields: Sequence[tuple[str, ...]]) -> None:
        self.names = TextColumn(names)
        self.samples = _numbers(samples)
        self.bytes = _numbers(bytes)
        self.raw_bytes = _numbers(raw_bytes)
        self._sha256 = _digests(sha256)
        self.indexes = TextColumn(indexes)
        self.index_bytes = _numbers(index_bytes)
        self._index_sha256 = _digests(index_sha256)
        # Shards of one dataset nearly always hold the same fields: each distinct list once.
        distinct: dict[tuple[str, ...], int] = {}
        codes = [distinct.setdefault(tuple(f), len(distinct)) for f in fields]
        self.field_sets: tuple[tuple[str, ...], ...] = tuple(distinct)
        self._field_set = np.asarray(codes, dtype=np.int32)
        n = len(self.names)
        lengths = {len(c) for c in (self.samples, self.bytes, self.raw_bytes, self._sha256, self.indexes,
                                    self.index_bytes, self._index_sha256, self._field_set)}
        if lengths != {n}:
            raise ValueError(f"shard columns differ in length: {sorted(lengths)}")

    @classmethod
    def of(cls, shards: Iterable[ShardInfo]) -> "ShardTable":
        """The table of these entries, in order."""
        shards = list(shards)
        return cls(names=[s.name for s in shards], samples=[s.samples for s in shards],
                   bytes=[s.bytes for s in shards], raw_bytes=[s.raw_bytes for s in shards],
                   sha256=[s.sha256 for s in shards], indexes=[s.index for s in shards],
                   index_bytes=[s.index_bytes for s in shards], index_sha256=[s.index_sha256 for s in shards],
                   fields=[s.fields for s in shards])

    @classmethod
    def concat(cls, tables: Sequence["ShardTable"]) -> "ShardTable":
        """The shards of `tables`, one table after another."""
        return cls(names=itertools.chain.from_iterable(t.names for t in tables),
                   samples=_joined(t.samples for t in tables), bytes=_joined(t.bytes for t in tables),
                   raw_bytes=_joined(t.raw_bytes for t in tables),
                   sha256=[h for t in tables for h in t.sha256_hex()],
                   indexes=itertools.chain.from_iterable(t.indexes for t in tables),
                   index_bytes=_joined(t.index_bytes for t in tables),
                   index_sha256=[h for t in tables for h in t.index_sha256_hex()],
                   fields=[t.field_sets[c] for t in tables for c in t._field_set.tolist()])

    def __len__(self) -> int:
        return len(self.samples)

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...
    @overload
    def __getitem__(self, i: slice) -> "ShardTable": ...

    def __getitem__(self, i: int | slice) -> "ShardInfo | ShardTable":
        if isinstance(i, slice):
            return ShardTable.of(self[j] for j in range(*i.indices(len(self))))
        i = checked_index(i, len(self))
        return ShardInfo(name=self.names[i], samples=int(self.samples[i]), bytes=int(self.bytes[i]),
                         raw_bytes=int(self.raw_bytes[i]), sha256=self._sha256[i].tobytes().hex(),
                         index=self.indexes[i], index_bytes=int(self.index_bytes[i]),
                         index_sha256=self._index_sha256[i].tobytes().hex(),
                         fields=self.field_sets[self._field_set[i]])

    def __iter__(self) -> Iterator[ShardInfo]:
        return (self[i] for i in range(len(self)))

    def sha256_bytes(self) -> bytes:
        """Every shard's SHA-256, 32 bytes each, in order."""
        return self._sha256.tobytes()

    def sha256_hex(self) -> list[str]:
        return [row.hex() for row in _rows(self._sha256)]

    def index_sha256_hex(self) -> list[str]:
        return [row.hex() for row in _rows(self._index_sha256)]

    def all_fields(self) -> list[str]:
        """The fields that some shard holds, sorted."""
        return sorted(set().union(*self.field_sets))

    def fields(self) -> list[tuple[str, ...]]:
        """Each shard's fields, in order."""
        return [self.field_sets[c] for c in self._field_set.tolist()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTable):
            return NotImplemented
        return (self.names == other.names and self.indexes == other.indexes and self.fields() == other.fields()
                and all(np.array_equal(getattr(self, c), getattr(other, c))
                        for c in ("samples", "bytes", "raw_bytes", "_sha256", "index_bytes", "_index_sha256")))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards, {int(self.samples.sum())} samples)"


def checked_index(i: int, n: int) -> int:
    """`i` as a position in a sequence of `n` (counting from the end where negative); IndexError outside."""
    i = i.__index__()
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"position {i} of {n}")
    return i


def _numbers(values: Sequence[int]) -> np.ndarray:
    column = np.asarray(values, dtype=np.int64).reshape(-1)
    column.flags.writeable = False  # shared by every reader of the manifest
    return column


def _joined(columns: Iterable[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.zeros(0, dtype=np.int64), *columns])


def _digests(hexes: Sequence[str]) -> np.ndarray:
    """SHA-256 digests given as hex, as rows of 32 bytes; ValueError names the first that is not one."""
    joined = "".join(hexes)
    if set(map(len, hexes)) <= {64} and _HEX.fullmatch(joined):
        return np.frombuffer(bytes.fromhex(joined), dtype=np.uint8).reshape(-1, 32)
    bad = next(h for h in hexes if len(h) != 64 or not _HEX.fullmatch(h))
    raise ValueError(f"not a SHA-256 digest in hex: {bad!r}")


def _rows(digests: np.ndarray) -> Iterator[bytes]:
    data = digests.tobytes()
    return (data[i : i + 32] for i in range(0, len(data), 32))
