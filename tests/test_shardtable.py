"""The manifest's shard list held as columns (shardstream/shardtable.py), and the sources
that hand out one `ShardRef` per shard only when asked (source.py)."""

from __future__ import annotations

import hashlib
import pickle
import tracemalloc
from pathlib import Path

import msgpack
import pytest

from shardstream import Mix, StreamingDataset, open_dataset
from shardstream.errors import ManifestError
from shardstream.format import MANIFEST_NAME, Manifest, ShardInfo
from shardstream.shardtable import ShardTable, TextColumn
from shardstream.source import resolve_source


def _infos(n: int, *, prefix: str = "shard") -> list[ShardInfo]:
    return [ShardInfo(name=f"{prefix}-{i:06d}.tar.zst", samples=3 + i % 5, bytes=4096 + 7 * i, raw_bytes=10240 + 9 * i,
                      sha256=hashlib.sha256(f"{prefix}{i}".encode()).hexdigest(), index=f"{prefix}-{i:06d}.tar.zst.idx",
                      index_bytes=100 + i, index_sha256=hashlib.sha256(f"i{prefix}{i}".encode()).hexdigest(),
                      fields=("cls", "jpg") if i % 3 else ("cls", "jpg", "json"))
            for i in range(n)]


def test_table_gives_back_every_entry():
    infos = _infos(11)
    table = ShardTable.of(infos)
    assert len(table) == 11
    assert list(table) == infos
    assert [table[i] for i in range(11)] == infos
    assert table[-1] == infos[-1] and table[-11] == infos[0]
    with pytest.raises(IndexError):
        table[11]
    with pytest.raises(IndexError):
        table[-12]
    assert list(table[2:9:3]) == infos[2:9:3]
    assert table.samples.tolist() == [s.samples for s in infos]
    assert table.bytes.tolist() == [s.bytes for s in infos]
    assert list(table.names) == [s.name for s in infos]
    assert table.fields() == [s.fields for s in infos]
    assert set(table.field_sets) == {("cls", "jpg"), ("cls", "jpg", "json")}  # each distinct list once


def test_table_columns_cannot_be_changed_in_place():
    table = ShardTable.of(_infos(3))
    with pytest.raises(ValueError):
        table.samples[0] = 99


def test_table_equality_sees_every_column():
    infos = _infos(4)
    table = ShardTable.of(infos)
    assert table == ShardTable.of(infos)
    for change in ({"name": "other.tar.zst"}, {"samples": 99}, {"bytes": 1}, {"raw_bytes": 1},
                   {"sha256": "f" * 64}, {"index": "other.idx"}, {"index_bytes": 1}, {"index_sha256": "e" * 64},
                   {"fields": ("txt",)}):
        changed = list(infos)
        changed[2] = ShardInfo(**{**infos[2].__dict__, **change})
        assert ShardTable.of(changed) != table, change


def test_table_concat_equals_one_table_of_all():
    a, b = _infos(5, prefix="a"), _infos(7, prefix="b")
    joined = ShardTable.concat([ShardTable.of(a), ShardTable.of([]), ShardTable.of(b)])
    assert joined == ShardTable.of(a + b)
    assert list(joined) == a + b


def test_table_pickles():
    table = ShardTable.of(_infos(9))
    assert pickle.loads(pickle.dumps(table)) == table
    assert list(pickle.loads(pickle.dumps(table))) == list(table)


def test_text_column_holds_any_text():
    values = ["a", "", "ünïcödé-shard.tar", "x" * 300, "日本語.tar.zst"]
    column = TextColumn(values)
    assert list(column) == values and [column[i] for i in range(len(values))] == values
    assert column[-1] == values[-1] and list(column[1:4]) == values[1:4]
    assert column == TextColumn(values) and column != TextColumn(values[:-1])


def test_table_refuses_a_checksum_that_is_not_hex():
    infos = _infos(3)
    for bad in ("z" * 64, "ab" * 31, "ab" * 33, " " * 64, ""):
        broken = [infos[0], ShardInfo(**{**infos[1].__dict__, "sha256": bad}), infos[2]]
        with pytest.raises(ValueError, match="SHA-256"):
            ShardTable.of(broken)


def test_manifest_keeps_a_table_whatever_it_was_given():
    infos = _infos(6)
    as_tuple = Manifest(shards=tuple(infos), compression="zstd")
    as_table = Manifest(shards=ShardTable.of(infos), compression="zstd")
    assert isinstance(as_tuple.shards, ShardTable)
    assert as_tuple == as_table
    assert as_tuple.samples == sum(s.samples for s in infos)
    assert as_tuple.counts.tolist() == [s.samples for s in infos]
    back = Manifest.from_bytes(as_tuple.to_bytes(), "m")
    assert back == as_tuple and list(back.shards) == infos


# -- a damaged shard list is named, entry by entry -------------------------------------------------------


def _manifest_with(entries: list, samples: int | None = None) -> bytes:
    body = msgpack.unpackb(Manifest(shards=tuple(_infos(3)), compression="zstd").to_bytes(), raw=False)
    body["shards"] = entries
    if samples is not None:
        body["samples"] = samples
    return msgpack.packb(body, use_bin_type=True)


def _entries() -> list[dict]:
    return msgpack.unpackb(Manifest(shards=tuple(_infos(3)), compression="zstd").to_bytes(), raw=False)["shards"]


@pytest.mark.parametrize("key,value,message", [
    ("samples", True, r"shard entry 1\).*'samples' has the wrong type"),
    ("bytes", 2.5, r"shard entry 1\).*'bytes' has the wrong type"),
    ("name", 7, r"shard entry 1\).*'name' has the wrong type"),
    ("fields", "jpg", r"shard entry 1\).*'fields' has the wrong type"),
    ("name", "../up.tar.zst", r"shard entry 1\).*unsafe shard file name"),
    ("index", "a\0b.idx", r"shard entry 1\).*unsafe shard file name"),
    ("sha256", "not hex", "not a SHA-256 digest in hex: 'not hex'"),
    ("index_sha256", "A" * 63, "not a SHA-256 digest"),
    ("raw_bytes", 2 ** 64 - 1, "shard entry is invalid"),
    ("fields", ["jpg", 3], "fields must be strings"),
])
def test_a_damaged_entry_is_named(key, value, message):
    entries = _entries()
    entries[1][key] = value
    with pytest.raises(ManifestError, match=message):
        Manifest.from_bytes(_manifest_with(entries), "m.msgpack")


def test_a_missing_key_and_a_non_map_entry_are_named():
    entries = _entries()
    del entries[2]["index_bytes"]
    with pytest.raises(ManifestError, match=r"shard entry 2\).*missing field 'index_bytes'"):
        Manifest.from_bytes(_manifest_with(entries), "m.msgpack")
    entries = _entries()
    entries[0] = ["not", "a", "map"]
    with pytest.raises(ManifestError, match=r"shard entry 0\)"):
        Manifest.from_bytes(_manifest_with(entries), "m.msgpack")


def test_samples_beyond_what_the_bytes_hold_are_refused_without_overflow():
    entries = _entries()
    entries[0]["samples"] = 2 ** 62  # times 512 overflows 64 bits: must not wrap around and pass
    with pytest.raises(ManifestError, match="more samples than its bytes"):
        Manifest.from_bytes(_manifest_with(entries, samples=2 ** 62 + 7), "m.msgpack")


@pytest.mark.parametrize("change", [
    {"samples": 2 ** 40, "raw_bytes": 2 ** 49},  # its raw bytes raised to match
    {"samples": (1 << 26), "raw_bytes": 2 ** 40, "index_bytes": 1 << 28},  # past a shard's samples
    {"index_bytes": (256 << 20) + 1},  # past the index's limit
    {"samples": 1000, "raw_bytes": 2 ** 30},  # 1,000 samples in an index of 9,000 bytes
])
def test_counts_no_index_a_reader_reads_could_hold_are_refused(change):
    """Regression (found by a review of hostile datasets): an epoch is planned from the manifest's counts before
    a shard is opened, and an 853-byte shard said to hold 2**40 samples, its `raw_bytes` raised to match, was
    planned to a bare MemoryError (8 TiB); 300 million took 9 s and 2.2 GiB. A shard's count is bounded by
    what its index can hold: 2**26 - 1 samples, 256 MiB, 10 bytes a sample at the least."""
    entries = _entries()
    entries[1].update({"index_bytes": 9000, **change})
    with pytest.raises(ManifestError, match="more samples than an index a reader reads could hold"):
        Manifest.from_bytes(_manifest_with(entries, samples=sum(e["samples"] for e in entries)), "m.msgpack")


# -- sources make a ShardRef per shard only when asked -----------------------------------------------------


def test_source_of_a_manifest_hands_out_refs_equal_to_its_entries(packed):
    source = open_dataset(packed)
    infos = list(source.manifest.shards)
    assert len(source.shards) == len(infos) >= 2
    assert [ref.info for ref in source.shards] == infos
    assert source.shards[-1].name == infos[-1].name and source.shards[-1].store is source.shards[0].store
    assert [ref.name for ref in source.shards[1:]] == [s.name for s in infos[1:]]
    assert source.names() == [s.name for s in infos]
    assert source.local
    assert source.fields() == {f for s in infos for f in s.fields}
    assert pickle.loads(pickle.dumps(source)).shards == source.shards


def test_a_mix_chains_its_parts_shards(packed, packed_plain):
    mix = resolve_source(Mix([packed, packed_plain], weights=[1, 1]))
    parts = [open_dataset(packed), open_dataset(packed_plain)]
    expected = [ref for p in parts for ref in p.shards]
    assert len(mix.shards) == len(expected)
    assert [ref.url for ref in mix.shards] == [ref.url for ref in expected]
    assert mix.shards[-1].url == expected[-1].url and mix.shards[-len(expected)].url == expected[0].url
    with pytest.raises(IndexError):
        mix.shards[len(expected)]
    assert mix.names() == [ref.name for ref in expected]
    assert mix.local and mix.fields() == parts[0].fields() | parts[1].fields()
    assert [ref.url for ref in mix.shards[1:3]] == [ref.url for ref in expected[1:3]]


def _big_dataset(folder: Path, shards: int) -> None:
    manifest = Manifest(shards=tuple(_infos(shards)), compression="zstd")
    (folder / MANIFEST_NAME).write_bytes(manifest.to_bytes())


def test_a_dataset_of_many_shards_holds_columns_not_an_object_per_shard(tmp_path):
    # One Python object per shard held about 880 bytes each (350 MB at 400k shards) in every
    # process, and pickled into every spawned DataLoader worker at 280 bytes each.
    shards = 20_000
    _big_dataset(tmp_path, shards)
    tracemalloc.start()
    try:
        dataset = StreamingDataset(str(tmp_path), shuffle=True, rank=1, world_size=4)
        assert len(dataset) == -(-sum(s.samples for s in _infos(shards)) // 4)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 250 * shards, held
    assert len(pickle.dumps(dataset)) < 200 * shards
    assert dataset.resolve().shards[12_345].info == _infos(12_346)[-1]
