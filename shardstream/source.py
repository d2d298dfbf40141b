"""What a dataset source names: a packed dataset, a list of shard URLs, or a brace pattern.

`resolve_source` turns any of them into a `Source`: the shards in order, each with a
reader, and the per-shard sample counts the planner needs. A packed dataset gets its
counts from the manifest without opening a shard; tars written by other tools are
counted by one scan each (sequential reads of every shard once, done lazily).
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar, overload

import numpy as np

from .braces import COMPRESSED_TARS, expand_braces, folder_named, names_shards
from .columns import MAX_CLASS, class_of, label_column, sampling_weight_of, weight_column
from .errors import CorruptShardError, ManifestError, ShardstreamError, StorageError, shown_url
from .format import (INDEX_SUFFIX, MANIFEST_NAME, MAX_MANIFEST_BYTES, PART_MANIFEST, Manifest, ShardIndex,
                     ShardInfo)
from .iostats import counting_here
from .shardtable import ShardTable, checked_index
from .reader import ShardReader
from .tarstream import StreamTarReader
from .shardfile import FRAME_SIZE
from .sourcefile import image_field
from .retry import RetryPolicy
from .storage import Store
from .urls import expand_home, is_local, local_path, split_query, split_url

if TYPE_CHECKING:
    from .sampling import Mix

__all__ = ["ChainedShards", "ManifestShards", "Source", "ShardRef", "open_dataset", "resolve_source"]


T = TypeVar("T")

COUNT_THREADS = 8  # remote shards counted (without a manifest), or their indexes read for labels, at once


@dataclass(frozen=True)
class ShardRef:
    """One shard: where it is, and its manifest entry when there is a manifest."""

    store: Store
    name: str
    info: ShardInfo | None = None

    @property
    def url(self) -> str:
        return self.store.url(self.name)

    def reader(self) -> ShardReader | StreamTarReader:
        if self.info is not None:
            return ShardReader(self.store, self.name, self.info)
        if self.store.may_read(self.name + INDEX_SUFFIX):
            return ShardReader(self.store, self.name)
        return StreamTarReader(self.store, self.name)


class _MadeRefs(Sequence[ShardRef]):
    """Shard refs made when asked: at 400k shards, a ref per shard made up front would
    hold hundreds of MB in every process (shardtable.py). A slice gives a tuple."""

    __slots__ = ()

    def _ref(self, i: int) -> ShardRef:  # 0 <= i < len(self)
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> ShardRef: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[ShardRef]: ...

    def __getitem__(self, i: int | slice) -> ShardRef | Sequence[ShardRef]:
        if isinstance(i, slice):
            return tuple(self._ref(j) for j in range(*i.indices(len(self))))
        return self._ref(checked_index(i, len(self)))


class ManifestShards(_MadeRefs):
    """The shards of one manifest."""

    __slots__ = ("store", "table")

    def __init__(self, store: Store, table: ShardTable) -> None:
        self.store, self.table = store, table

    def __len__(self) -> int:
        return len(self.table)

    def _ref(self, i: int) -> ShardRef:
        info = self.table[i]
        return ShardRef(self.store, info.name, info)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ManifestShards):
            return NotImplemented
        return self.store == other.store and self.table == other.table

    __hash__ = None  # type: ignore[assignment]


class ChainedShards(_MadeRefs):
    """The shards of several sources (a mix), one source's after another, without copying them."""

    __slots__ = ("parts", "_ends")

    def __init__(self, parts: Sequence[Sequence[ShardRef]]) -> None:
        self.parts = tuple(parts)
        self._ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _ref(self, i: int) -> ShardRef:
        part = int(np.searchsorted(self._ends, i, side="right"))
        return self.parts[part][i - (int(self._ends[part - 1]) if part else 0)]


KEYS = b"keys\0"  # what `Source.contents` made of keys begins with


def _keys_digest(keys: Sequence[str]) -> bytes:
    digest = hashlib.sha256()
    for key in keys:
        digest.update(key.encode("utf-8", "surrogateescape") + b"\0")
    return digest.digest()


@dataclass(frozen=True)
class Source:
    """An ordered list of shards, and the manifest if the source has one.

    A mix of several sources (`parts`) lists all their shards in order.
    """

    url: str
    shards: Sequence[ShardRef]  # a tuple, or made on demand from a manifest (ManifestShards)
    manifest: Manifest | None = None
    parts: tuple["Source", ...] = ()
    # Indexes of plain tars that `counts()` found by reading them through, by shard
    # number: readers made later, also in DataLoader workers (forked from this process,
    # or sent this Source), use them instead of reading each tar through again.
    scanned: dict[int, ShardIndex] = field(default_factory=dict, compare=False, repr=False)
    # The labels and weights of compressed tars, which have no index, by shard number: read
    # as `counts()` reads them through, for sampling by weight.
    read_columns: dict[int, "tuple[np.ndarray | None, np.ndarray | None]"] = field(
        default_factory=dict, compare=False, repr=False)
    # A digest of the keys of each tar `counts()` read through, by shard number: what tells a
    # resume state's dataset from another of the same shard names and counts (`contents`).
    read_keys: dict[int, bytes] = field(default_factory=dict, compare=False, repr=False)
    # Shards found to have no index file, by shard number: a shard read in several openings
    # (a weighted epoch's walks, stream.py) was probed for one again at each.
    unindexed: set[int] = field(default_factory=set, compare=False, repr=False)

    def reader(self, shard: int) -> ShardReader | StreamTarReader:
        """A reader of shard number `shard` (its place in `shards`)."""
        for part in self.parts:
            if shard < len(part.shards):
                return part.reader(shard)
            shard -= len(part.shards)
        ref, index = self.shards[shard], self.scanned.get(shard)
        if index is not None:
            return ShardReader(ref.store, ref.name, index=index)
        if shard in self.unindexed:
            return StreamTarReader(ref.store, ref.name)
        reader = ref.reader()
        if isinstance(reader, StreamTarReader):
            self.unindexed.add(shard)
        return reader

    @property
    def indexed(self) -> bool:
        """True when every shard can be read by sample ranges (sample-granular splitting)."""
        if self.parts:
            return all(p.indexed for p in self.parts)
        return self.manifest is not None

    @property
    def cacheable(self) -> bool:
        """True when a shard cache can keep this source's remote shards: each remote part has
        a manifest, whose checksums verify each copy (local shards are read in place)."""
        if self.parts:
            return all(p.cacheable for p in self.parts)
        return self.manifest is not None or self.local

    @property
    def local(self) -> bool:
        """True when every shard is on a local file system (no request latency to hide)."""
        if self.parts:
            return all(p.local for p in self.parts)
        if isinstance(self.shards, ManifestShards):  # one store: no need to make a ref per shard
            return self.shards.store.local
        return all(ref.store.local for ref in self.shards)

    def names(self) -> list[str]:
        """Every shard's file name, in order."""
        if self.parts:
            return [name for p in self.parts for name in p.names()]
        if isinstance(self.shards, ManifestShards):
            return list(self.shards.table.names)
        return [ref.name for ref in self.shards]

    def checksums(self) -> bytes | None:
        """Every shard's SHA-256 from the manifests, in order; None where a shard has none
        (a plain tar listed without a manifest)."""
        if self.parts:
            digests = [p.checksums() for p in self.parts]
            return None if any(d is None for d in digests) else b"".join(digests)  # type: ignore[arg-type]
        if isinstance(self.shards, ManifestShards):
            return self.shards.table.sha256_bytes()
        if any(ref.info is None for ref in self.shards):
            return None
        return b"".join(bytes.fromhex(ref.info.sha256) for ref in self.shards)  # type: ignore[union-attr]

    def fields(self) -> set[str] | None:
        """The fields that some shard holds, by the manifests; None where a shard has no manifest."""
        manifests = self._manifests()
        if manifests is None:
            return None
        return {name for m in manifests for name in m.shards.all_fields()}

    def classes(self) -> tuple[str, ...]:
        """The names of the labels, by the manifests (`Manifest.classes`); () where a part has no
        manifest, or no class table, or the parts of a mix name their labels differently."""
        tables = {m.classes for m in self._manifests() or ()}
        return tables.pop() if len(tables) == 1 else ()

    def classes_apart(self) -> str | None:
        """Where the parts of a mix give one label to different classes (each `cls` is a number in
        its own source's table, and the mix yields them as they are), what each names; else None.
        Tables of which one begins the other (a source with some of the classes) agree."""
        tables = [(p.url, p.manifest.classes) for p in self.parts if p.manifest is not None and p.manifest.classes]
        if not any(a[: len(b)] != b[: len(a)] for _, a in tables for _, b in tables):
            return None
        return "; ".join(f"{shown_url(url)}: {len(classes)} ({', '.join(classes[:3])}"
                         f"{', ...' if len(classes) > 3 else ''})" for url, classes in tables)

    def _manifests(self) -> list[Manifest] | None:
        """The manifests of this source (one per part), or None if any part has none."""
        manifests = [p.manifest for p in self.parts] if self.parts else [self.manifest]
        return None if any(m is None for m in manifests) else manifests  # type: ignore[return-value]

    def mean_sample_bytes(self) -> int:
        """Stored bytes per sample (from the manifest; a typical image otherwise)."""
        manifests = self._manifests()
        if not manifests or not sum(m.samples for m in manifests):
            return 128 << 10
        stored = sum(int(m.shards.bytes.sum()) for m in manifests)
        return max(1, stored // sum(m.samples for m in manifests))

    def least_sample_bytes(self) -> int:
        """Stored bytes per sample of the shard whose samples are stored in the fewest (from
        the manifest; 0 without one): a shard of well-compressed samples beside others holds
        more of them in a byte range than the dataset's mean says."""
        manifests = self._manifests()
        if not manifests:
            return 0
        stored = np.concatenate([m.shards.bytes for m in manifests]).astype(np.int64)
        counts = np.concatenate([m.counts for m in manifests]).astype(np.int64)
        held = counts > 0
        return int((stored[held] // counts[held]).min()) if held.any() else 0

    def samples_per_frame(self) -> int:
        """About how many samples one zstd frame holds (for plain tar shards, one frame's
        worth of bytes): neighbours that one read of a frame brings in anyway."""
        manifests = self._manifests()
        if not manifests or not sum(m.samples for m in manifests):
            return 8
        samples = sum(m.samples for m in manifests)
        raw = sum(int(m.shards.raw_bytes.sum()) for m in manifests)
        frame = max(int(m.options.get("frame_size") or FRAME_SIZE) for m in manifests)
        return max(1, min(1024, round(frame * samples / max(raw, 1))))

    def counts(self) -> np.ndarray:
        """Samples per shard."""
        if self.parts:
            return np.concatenate([p.counts() for p in self.parts])
        if self.manifest is not None:
            return self.manifest.counts
        counted = self._over_shards(self._count_shard, "shardstream-count")
        scanned = [ref for ref, (read_through, _, _, _) in zip(self.shards, counted)
                   if read_through and ref.name.endswith(".tar") and not ref.store.local]
        if scanned:
            warnings.warn(f"{scanned[0].url} and {len(scanned) - 1} more remote shards have no index: each is "
                          "read through to count and index its samples before the first one is read, in every "
                          "process that counts them; `shardstream index` writes the indexes once",
                          stacklevel=3)
        for i, (_, index, _, keys) in enumerate(counted):
            if isinstance(index, ShardIndex):
                self.scanned[i] = index
            elif index is not None:
                self.read_columns[i] = index
            if keys is not None:
                self.read_keys[i] = keys
        return np.array([n for _, _, n, _ in counted], dtype=np.int64)

    def _count_shard(self, shard: int) -> tuple[bool, Any, int, bytes | None]:
        """Whether shard number `shard` had to be read through (a tar without an index), the
        index that made (a compressed tar's labels and weights; None if none), its samples,
        and a digest of their keys where it was read through (None otherwise).

        Not its reader: readers kept until every shard was counted held every index read at
        once, every key of the dataset (about 100 bytes a sample, 10 GB at 100M samples,
        in every process that counts), where the counts need one index at a time."""
        try:
            return self._count_read(shard)
        except CorruptShardError as e:
            # Met before any sample is read, where `on_error` does not reach: said, as WebDataset
            # users expect its handlers' skip past damage.
            raise CorruptShardError(f"{e.detail} (met counting the samples of a shard without an index, before "
                                    "any is read: on_error cannot skip part of it; remove or repair the shard)",
                                    url=e.url, key=e.key, offset=e.offset) from e

    def _count_read(self, shard: int) -> tuple[bool, Any, int, bytes | None]:
        reader = self.reader(shard)
        if isinstance(reader, StreamTarReader) and reader.index is None:  # compressed: read through
            labels, weights, keys = [], [], []
            for sample in reader:
                keys.append(sample["__key__"])
                labels.append(class_of(sample["cls"]) if "cls" in sample else -1)
                weights.append(sampling_weight_of(sample["weight"]) if "weight" in sample else math.nan)
            return True, (label_column(labels), weight_column(weights)), len(labels), _keys_digest(keys)
        samples = len(reader)
        if isinstance(reader, StreamTarReader):
            return True, reader.index, samples, _keys_digest(reader.index.keys)  # type: ignore[union-attr]
        return False, None, samples, None

    def contents(self) -> bytes | None:
        """What identifies the samples in each place besides the shards' names and counts:
        every shard's SHA-256 from the manifests (`checksums`); without a manifest, the keys
        of the tars `counts()` read through (a WebDataset writer run again with another seed
        makes the same names and counts, and other samples in each place); None where
        neither is known."""
        checksums = self.checksums()
        if checksums is not None:
            return checksums
        read = self._read_keys()
        return KEYS + b"".join(i.to_bytes(8, "little") + digest for i, digest in read) if read else None

    def keys_read(self) -> bytes | None:
        """What `contents` gave when every tar was read through to count it, whatever the tars
        are now: each tar's keys' digest, from its index where it has one (a read a shard, a
        few at once; a compressed tar without one is read through), and nothing of the shards
        of a dataset `pack` or `ShardWriter` made (never read through). A state taken of tars
        before `shardstream index` ran over them then still finds its dataset. None where
        there are no tars."""
        digests = self._keys_digests()
        if not any(digest is not None for digest in digests):
            return None
        return KEYS + b"".join(i.to_bytes(8, "little") + digest for i, digest in enumerate(digests)
                               if digest is not None)

    def _keys_digests(self) -> list[bytes | None]:
        if self.parts:
            return [digest for part in self.parts for digest in part._keys_digests()]
        if self.manifest is not None and not self.manifest.options.get("indexed_in_place"):
            return [None] * len(self.shards)

        def digest(i: int) -> bytes:
            if i in self.read_keys:
                return self.read_keys[i]
            reader = self.reader(i)
            index = reader.index
            return _keys_digest(index.keys if index is not None else [sample["__key__"] for sample in reader])

        return list(self._over_shards(digest, "shardstream-keys"))

    def _read_keys(self) -> list[tuple[int, bytes]]:
        if not self.parts:
            return sorted(self.read_keys.items())
        out, first = [], 0
        for part in self.parts:
            out += [(first + i, digest) for i, digest in part._read_keys()]
            first += len(part.shards)
        return out

    def labels(self) -> np.ndarray:
        """Every sample's class index, in shard order, from the shard indexes (one read each)."""
        labels = self._per_sample("labels", "class weights need per-sample labels: this shard's index has none (no "
                                  "sample has a cls field holding an integer class index; `shardstream repack "
                                  "--class-names` numbers class names)", np.int64)
        unlabelled = np.flatnonzero(labels < 0)
        if len(unlabelled):
            url, key = self.where(int(unlabelled[0]))
            raise ShardstreamError(f"{len(unlabelled)} samples have no class (a cls field holding an integer from 0 "
                                   f"to {MAX_CLASS}); class weights need one on every sample", url=url, key=key)
        return labels

    def weights(self) -> np.ndarray:
        """Every sample's `weight` field, in shard order, from the shard indexes (one read each)."""
        weights = self._per_sample("weights", "sample weights need a weight field on every sample: this shard's "
                                   "index records none", np.float64)
        missing = np.flatnonzero(np.isnan(weights))
        if len(missing):
            url, key = self.where(int(missing[0]))
            raise ShardstreamError(f"{len(missing)} samples have no weight (a weight field holding a finite, "
                                   "non-negative number); every sample needs one",
                                   url=url, key=key)
        return weights

    def where(self, sample: int) -> tuple[str, str | None]:
        """The shard URL and key of sample number `sample` (in shard order), for an error to name."""
        shard = int(np.searchsorted(np.cumsum(self.counts()), sample, side="right"))
        first = int(self.counts()[:shard].sum())
        index = getattr(self.reader(shard), "index", None)
        return self.shards[shard].url, index.keys[sample - first] if index is not None else None

    def _per_sample(self, table: str, missing: str, dtype: type) -> np.ndarray:
        """One column of every shard's index, in shard order. Remote indexes are read several
        at once: one after another, 10k shards on S3 were 10k round trips in a row before
        the first sample of a class-weighted epoch."""
        def column(shard: int) -> np.ndarray:
            if shard in self.read_columns:  # a compressed tar's, read as it was counted
                values = self.read_columns[shard][("labels", "weights").index(table)]
            else:
                index = getattr(self.reader(shard), "index", None)
                values = getattr(index, table) if index is not None else None
            if values is None:
                raise ShardstreamError(missing, url=self.shards[shard].url)
            return values

        out = self._over_shards(column, "shardstream-index")
        return np.concatenate(out) if out else np.zeros(0, dtype=dtype)

    def _over_shards(self, work: Callable[[int], T], name: str) -> list[T]:
        """`work(shard)` for every shard number, in order. Remote shards are worked on
        several at once, since each costs round trips (a look for its index, a read);
        the first error is raised, and the work not yet begun is dropped."""
        shards = range(len(self.shards))
        if len(shards) < 2 or self.local:
            return [work(shard) for shard in shards]
        pool = ThreadPoolExecutor(min(COUNT_THREADS, len(shards)), thread_name_prefix=name, initializer=counting_here())
        try:
            return list(pool.map(work, shards))
        finally:
            pool.shutdown(cancel_futures=True)


def open_dataset(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None) -> Source:
    """Open a packed dataset (a folder or URL prefix holding ``manifest.msgpack``).

    `retry` bounds the retries of transient storage errors (default `RetryPolicy()`).
    """
    store = Store(os.fspath(url), storage_options or {}, retry or RetryPolicy())
    manifest_url = store.url(MANIFEST_NAME)
    if store.local and os.path.isfile(local_path(store.root)):
        if os.path.basename(store.root.rstrip("/")) == MANIFEST_NAME:
            raise ManifestError("a dataset's manifest: the dataset is the folder that holds it", url=store.root)
        raise ManifestError("a file, not a dataset folder: a shard is read with StreamingDataset([path]), and "
                            "`shardstream index` makes a folder of plain .tar shards a dataset", url=store.root)
    try:
        # Read, not exists(): a transient error must be retried, not taken for "absent".
        # Bounded, so that a hostile 100 GB "manifest" is refused, not loaded: locally by
        # its size, remotely by reading at most one byte past the limit (no extra request).
        if store.local and store.size(MANIFEST_NAME) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"larger than the limit of {MAX_MANIFEST_BYTES} bytes", url=manifest_url)
        data = store.read(MANIFEST_NAME) if store.local else store.read(MANIFEST_NAME, 0, MAX_MANIFEST_BYTES + 1)
    except StorageError as e:
        if e.detail != "file not found":
            raise
        raise ManifestError(f"no manifest: not a packed dataset ({_found_instead(store)})", url=manifest_url) from e
    manifest = Manifest.from_bytes(data, manifest_url)
    return Source(os.fspath(url), ManifestShards(store, manifest.shards), manifest)


_NO_MANIFEST = "or packing has not finished; for a folder of plain .tar shards, `shardstream index` writes one"
_PACK_FIRST = ("images, not shards: `shardstream pack` packs a folder of class folders of images (or a file "
               "list of them) into a dataset")


def _found_instead(store: Store) -> str:
    """What a location without a manifest holds, for its error: nothing (a path mistyped), an
    image folder not packed yet, datasets in its folders, or the general causes. Locally a
    look at a few entries; remotely one lookup of the prefix (a listing would cost a request
    per thousand objects: a prefix of a million raw images took 2,000); over HTTP nothing,
    where a missing listing says nothing of what is there."""
    # A folder named `photos.tar` is a folder; a local manifest file is refused before the read.
    folder = local_path(store.root) if store.local else None
    pattern = any(c in store.root for c in "{*?[")
    if names_shards(store.root) and (folder is None or pattern or os.path.isfile(folder)):
        # Only commands that take a dataset's folder (inspect, verify) come here with shards' names.
        return ("it names shards, not a dataset's folder: name the folder (`shardstream index` makes a folder of "
                "plain .tar shards a dataset)")
    if folder is not None:
        return _found_in_folder(folder)
    if store.root.rstrip("/").rsplit("/", 1)[-1] == MANIFEST_NAME:
        return "the location names a manifest: the dataset is the folder that holds it"
    if store.root.startswith(("http://", "https://")):
        return _NO_MANIFEST
    try:
        if store.exists(""):
            return f"{_NO_MANIFEST}; a folder of images is packed by `shardstream pack` first"
        bucket = _bucket_of(store.root)
        if bucket is not None and (bucket == store.root.rstrip("/") or not Store(bucket, store.options).exists("")):
            return f"no bucket {bucket}, or no access to it"
    except ShardstreamError:
        return _NO_MANIFEST
    return "nothing is there: no object has this prefix"


def _bucket_of(url: str) -> str | None:
    """The bucket (or container) of an object store's `url` (``s3://b`` of ``s3://b/x/y``),
    where its first name is one (not ``memory://``, nor a chain of protocols)."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2") or "::" in url:
        return None
    name = rest.split("/", 1)[0]
    return f"{scheme}://{name}" if name else None


_LOOK_AT = 10_000  # a folder's entries looked at, at most (each subfolder's: `_LOOK_INSIDE`)
_LOOK_INSIDE = 64


def _found_in_folder(root: str) -> str:
    if not os.path.isdir(root):
        return "no such folder"
    with os.scandir(root) as entries:
        seen = [(entry.name, entry.is_dir()) for _, entry in zip(range(_LOOK_AT), entries)]
    if not seen:
        return "an empty folder"
    files = [name for name, is_dir in seen if not is_dir]
    folders = sorted(name for name, is_dir in seen if is_dir and not name.startswith("."))
    if any(PART_MANIFEST.fullmatch(name) for name in files):
        return "parts of a pack, not merged yet: `shardstream merge` merges them once every part is there"
    datasets = [name for name in folders if os.path.isfile(os.path.join(root, name, MANIFEST_NAME))]
    if datasets:
        return f"datasets in its folders ({', '.join(datasets[:3])}{', ...' if len(datasets) > 3 else ''}): " \
            "name one of them"
    if any(image_field(name) for name in files) or any(_holds_images(os.path.join(root, name), 0) for name in
                                                       folders[:3]):
        return _PACK_FIRST
    splits = [name for name in folders[:3] if _holds_images(os.path.join(root, name), 1)]
    if splits:  # train/ and val/, each of class folders
        return f"image folders in its folders ({', '.join(splits)}): `shardstream pack` packs each into a dataset"
    compressed = sorted(name for name in files if name.lower().endswith(COMPRESSED_TARS))
    # Not a pack's own shards (indexed: packing not finished, or its manifest lost).
    if compressed and not any(name.lower().endswith((".tar", INDEX_SUFFIX)) for name in files):
        # `index` leaves them out (no ranged reads into a compressed tar): say what does apply.
        return (f"compressed tars ({compressed[0]}{', ...' if len(compressed) > 1 else ''}): stream them by a brace "
                "pattern or a list of their paths, or `shardstream repack` them into a dataset")
    return _NO_MANIFEST


def _holds_images(folder: str, depth: int) -> bool:
    """Whether `folder`, or (`depth` levels down) its first few subfolders, hold image files."""
    with os.scandir(folder) as entries:
        seen = [(entry.name, entry.is_dir()) for _, entry in zip(range(_LOOK_INSIDE), entries)]
    return any(image_field(name) for name, is_dir in seen if not is_dir) or depth > 0 and any(
        _holds_images(os.path.join(folder, name), depth - 1) for name in sorted(n for n, d in seen if d)[:3])


def _names_a_dataset_folder(url: str, options: dict[str, Any]) -> bool:
    """Whether the remote URL of one shard (`s3://b/data.tar`) names a dataset's folder
    instead: `pack` writes to a name as given. One request, one try, once a process; a URL
    with a query string (a presigned one signs its object alone) is a shard, and so is one
    the request fails for (its read then says why)."""
    if is_local(url) or split_query(url)[1]:
        return False
    try:
        return Store(url, options, RetryPolicy(attempts=1)).exists(MANIFEST_NAME)
    except ShardstreamError:
        return False


def _options_of(source: str | Sequence[str], options: dict[str, Any]) -> dict[str, Any]:
    """A Mix's source's storage options: where `options` are given by protocol, as fsspec takes
    a chained URL's (``{"s3": {...}, "http": {...}}``), its protocol's (by any of its file
    system's names: `http` for `https://`, `gcs` for `gs://`); else `options` whole. One
    set of options for every source could not mix S3 with HTTP (s3fs's `endpoint_url` went
    to aiohttp, which refused it)."""
    import fsspec

    url = source if isinstance(source, str) else (source[0] if source else "")
    known = set(fsspec.available_protocols()) | set(fsspec.registry)
    by_protocol = bool(options) and all(isinstance(value, Mapping) for value in options.values()) and set(
        options) <= known
    if not by_protocol or "::" in url:
        return options
    for name in _protocol_names(fsspec.core.split_protocol(url)[0] or "file"):
        if name in options:
            return dict(options[name])
    return {}


def _protocol_names(protocol: str) -> tuple[str, ...]:
    """Every name fsspec knows `protocol`'s file system by: those its table of implementations
    gives the same class (the class's own `protocol` lists `https` beside `http` only from
    fsspec 2025.10), and the class's own (file systems registered at run time)."""
    import fsspec
    from fsspec.registry import known_implementations

    path = known_implementations.get(protocol, {}).get("class")
    aliases = [name for name, spec in known_implementations.items() if path is not None and spec.get("class") == path]
    try:
        own = fsspec.get_filesystem_class(protocol).protocol
    except (ImportError, ValueError):  # its package not installed: reading it says so
        own = ()
    return tuple(dict.fromkeys((protocol, *aliases, *([own] if isinstance(own, str) else own))))


def resolve_source(source: "str | Sequence[str] | Mix", *, storage_options: dict[str, Any] | None = None,
                   retry: RetryPolicy | None = None) -> Source:
    """A `Source` from a dataset location, a brace pattern, a list of shard URLs, or a `Mix` of those."""
    from .sampling import Mix, source_urls

    options = storage_options or {}
    retry = retry or RetryPolicy()
    if isinstance(source, Mix):
        parts = tuple(resolve_source(s, storage_options=_options_of(s, options) if own is None else own, retry=retry)
                      for s, own in zip(source.sources, source.storage_options))
        return Source("mix", ChainedShards([p.shards for p in parts]), None, parts)
    source = source_urls(source)  # a pathlib.Path is a location too
    piped = next((url for url in ([source] if isinstance(source, str) else source)
                  if isinstance(url, str) and url.startswith("pipe:")), None)
    if piped is not None:
        # WebDataset's: a shell command whose output is the shard. Taken for a file name, it was "file not found".
        raise ShardstreamError("a pipe: URL is WebDataset's shell command, which shardstream does not run: name the "
                               "shard's file or fsspec URL (s3://, https://) itself; .tar.zst, .tar.gz and plain tars "
                               "are read as they are", url=piped)
    if isinstance(source, str):
        # A local folder holding a dataset is that dataset, whatever its name says (`pack`
        # writes to a name as given: `data.tar` was read as one shard, "is a directory").
        local_dataset = is_local(source) and os.path.isfile(os.path.join(local_path(expand_home(source)),
                                                                          MANIFEST_NAME))
        if not names_shards(source) or local_dataset:
            return open_dataset(folder_named(source) if not local_dataset else source, storage_options=options,
                                retry=retry)
        urls = expand_braces(source)
        if urls == [source] and _names_a_dataset_folder(source, options):
            return open_dataset(source, storage_options=options, retry=retry)
        if not any(names_shards(url) for url in urls) and Store(source, options, retry).exists(MANIFEST_NAME):
            # Braces that expand to folders, not shards, where a dataset's folder is named so,
            # braces and all (`pack` writes to the name as given): that dataset.
            return open_dataset(source, storage_options=options, retry=retry)
    else:
        urls = list(source)
    if not urls:
        raise ShardstreamError("no shards given")
    refs = []
    stores: dict[str, Store] = {}
    for url in urls:
        parent, name = split_url(url)
        store = stores.setdefault(parent, Store(parent, options, retry))
        refs.append(ShardRef(store, name))
    return Source(source if isinstance(source, str) else urls[0], tuple(refs))
