"""Shard indexes: read, checked against the manifest, and kept for the next epoch.

A shard's index (FORMAT.md) says where each of its samples lies, so that a range of
samples costs one ranged read. `load_index` reads it and checks its checksum and sample
count against the manifest entry. A remote shard's checked index is kept in memory
(`INDEX_MEMO_BYTES` per process), so the next epoch's readers of that shard, in a
persistent worker or the main process, start without a round trip for it.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading

from .errors import CorruptIndexError
from .format import INDEX_SUFFIX, MAX_INDEX_BYTES, ShardIndex, ShardInfo
from .storage import Store

__all__ = ["load_index"]

# Serialised index bytes of remote shards kept per process across epochs (`load_index`):
# 16 MB holds the indexes of about 470,000 samples with ImageNet-like keys (34 bytes a
# sample serialised), some 45 MB in memory (measured: 2.8x the serialised size).
INDEX_MEMO_BYTES = 16 << 20


def load_index(store: Store, name: str, info: ShardInfo | None = None) -> ShardIndex:
    """Read a shard's index, checking its checksum against the manifest entry if given.

    A remote shard's index checked against its manifest entry is kept in memory
    (`INDEX_MEMO_BYTES` per process): the next epoch's readers of that shard, in a
    persistent worker or the main process, then start without a round trip for it.
    """
    index_name = info.index if info is not None else name + INDEX_SUFFIX
    url = store.url(index_name)
    key = (url, info.index_sha256) if info is not None and not store.local else None
    if key is not None and (known := _index_memo.get(key)) is not None:
        return known
    if store.local:
        # Its size first: a sparse file of gigabytes (a few bytes in an archive) was read whole
        # before the limit refused it, or failed as a bare MemoryError.
        _check_size(store.size(index_name), info, url)
        data = store.read(index_name)
    elif info is not None:
        # As a range of the manifest's length: a body cut short is then told by its Content-Range
        # and retried, where the whole file sent without a length ended where the connection did,
        # failed its checksum as a damaged index, and was not retried (nor, under
        # on_error="skip", remembered: fetched again a sample).
        data = store.read(index_name, 0, info.index_bytes, size=info.index_bytes)
    else:  # no more than a reader takes: one byte past it is refused (`ShardIndex.from_bytes`)
        data = store.read(index_name, 0, MAX_INDEX_BYTES + 1)
    if info is not None and hashlib.sha256(data).hexdigest() != info.index_sha256:
        raise CorruptIndexError("index checksum does not match the manifest", url=url)
    try:
        index = ShardIndex.from_bytes(data, url)
    except CorruptIndexError as e:
        if info is not None:
            raise
        # Beside a shard no manifest lists, the likelier story is another tool's file of the name.
        raise CorruptIndexError("not a shardstream index (another tool's?): remove it, or `shardstream index "
                                f"--overwrite` writes shardstream's ({e.detail.rstrip('.')})", url=url) from e
    if info is not None and len(index) != info.samples:
        raise CorruptIndexError(f"index lists {len(index)} samples, the manifest {info.samples}", url=url)
    if key is not None:
        _index_memo.put(key, index, len(data))
    return index


def _check_size(size: int, info: ShardInfo | None, url: str) -> None:
    if info is not None and size != info.index_bytes:
        raise CorruptIndexError(f"index is {size} bytes, where the manifest says {info.index_bytes}", url=url)
    if size > MAX_INDEX_BYTES:
        raise CorruptIndexError(f"index is {size} bytes, past the {MAX_INDEX_BYTES} a reader reads (FORMAT.md)",
                                url=url)


class _IndexMemo:
    """Checked indexes of remote shards, by URL and checksum, at most `limit` of their
    serialised bytes (about a third of what they take in memory); least recently used
    go first."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[tuple[str, str], tuple[ShardIndex, int]] = collections.OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[str, str]) -> ShardIndex | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: tuple[str, str], index: ShardIndex, size: int) -> None:
        if size > self.limit:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (index, size)
            self._bytes += size
            while self._bytes > self.limit:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork


_index_memo = _IndexMemo(INDEX_MEMO_BYTES)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_index_memo.after_fork)
