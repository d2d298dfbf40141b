"""Brace patterns (`shardstream.braces.expand_braces`): WebDataset's patterns, expanded as its
`braceexpand` dependency expands them, refused clearly when malformed, and read end to end."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from shardstream import ShardstreamError, StreamingDataset
from shardstream import BracePatternError
from shardstream.braces import expand_braces, names_shards
from shardstream.source import resolve_source

try:  # tests/ may or may not be a package
    from . import _data as D
except ImportError:
    import _data as D

# Patterns whose names must be braceexpand's, in its order.
SAME_AS_BRACEEXPAND = [
    "shard-{000000..000003}.tar",
    "{train,val}",
    "{train,val}-{0..2}.tar",
    "{1..3}{a,b}{x,y}",
    "a{b,c{d,e}f}g",
    "python{2.{5..7},3.{2,3}}",
    "{a,{b,c}}{1..2}",
    "{{a,b},{c,d}}",
    "{0..10..2}", "{0..10..-3}", "{10..0..3}", "{0..3..0}", "{5..-5..3}",
    "{9..0}", "{-2..2}", "{2..-1}", "{0..0}", "{7..7}",
    "{07..10}", "{1..010}", "{-05..5}", "{00..3}", "{-0..3}", "{0..-03}", "{1..100..33}",
    "{a..e}", "{e..a}", "{a..z..5}", "{Y..c}", "{c..Y}", "{A..A}", "{z..A..7}", "{A..z..-10}",
    "x\\{a,b\\}y", "{a\\,b,c}", "\\{0..2\\}", "{a,b}\\}", "a\\\\b{1,2}",
    "{}", "{a}", "x{a{1,2}}", "{,a}", "{a,}", "{,}", "{1.5..3}", "{..}", "{a..}", "{-..-}",
    "s3://bucket/a-{0..3}.tar",
    "https://host/d/{train,val}-{000..002}.tar?token=abc",
    "https://host/a-{0..1}.tar?sig=x{1,2}",
    "gs://b/{a..c}/{0..1}.tar",
    "pipe:curl -s http://h/a-{0..2}.tar",
    "no-braces-here.tar",
]


@pytest.mark.parametrize("pattern", SAME_AS_BRACEEXPAND)
def test_expand_braces_matches_braceexpand(pattern):
    braceexpand = pytest.importorskip("braceexpand")
    assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


@pytest.mark.parametrize(("pattern", "names"), [
    ("s-{0..2}.tar", ["s-0.tar", "s-1.tar", "s-2.tar"]),
    ("s-{000..002}.tar", ["s-000.tar", "s-001.tar", "s-002.tar"]),
    ("{train,val}-{0..1}", ["train-0", "train-1", "val-0", "val-1"]),  # the last brace varies fastest
    ("{0..9..4}", ["0", "4", "8"]),
    ("{3..1}", ["3", "2", "1"]),
    ("{08..10}", ["08", "09", "10"]),
    ("{8..010}", ["008", "009", "010"]),
    ("{a..c}{Y..Z}", ["aY", "aZ", "bY", "bZ", "cY", "cZ"]),
    ("v{1,2.{0,1}}", ["v1", "v2.0", "v2.1"]),
    (r"lit\{0..1\}-{0,1}", ["lit{0..1}-0", "lit{0..1}-1"]),
    ("s3://bucket/a-{0..1}.tar", ["s3://bucket/a-0.tar", "s3://bucket/a-1.tar"]),
    ("https://h/{a,b}.tar?token=t", ["https://h/a.tar?token=t", "https://h/b.tar?token=t"]),
    ("data/{v1}/s.tar", ["data/{v1}/s.tar"]),  # braces around neither a list nor a range stay
])
def test_expand_braces_examples(pattern, names):
    assert expand_braces(pattern) == names


def test_where_braceexpand_differs_on_purpose():
    # No braces: a URL as it is (braceexpand drops the backslashes of C:\data\shard.tar).
    assert expand_braces(r"C:\data\shard.tar") == [r"C:\data\shard.tar"]
    # An escaped backslash inside braces is one backslash (braceexpand 0.1.7 unescapes nested
    # text once per level, and loses it).
    assert expand_braces(r"{a\\b,c}") == ["a\\b", "c"]
    assert expand_braces(r"x\\{0,1}") == ["x\\0", "x\\1"]


# A small alphabet, so that random strings are often patterns: no backslash (see above).
_PIECES = ["{", "}", ",", "..", "a", "Z", "0", "1", "09", "-", "x", "."]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=14).map("".join))
def test_random_patterns_agree_with_braceexpand(pattern):
    braceexpand = pytest.importorskip("braceexpand")
    try:
        theirs: list[str] | None = list(braceexpand.braceexpand(pattern))
    except braceexpand.UnbalancedBracesError:
        theirs = None
    try:
        mine = expand_braces(pattern)
    except BracePatternError as e:  # where braceexpand fails too, or where it makes names of no shard
        assert theirs is None or "closes no" in e.detail or "is not a range" in e.detail, (pattern, theirs)
        return
    assert mine == theirs


@pytest.mark.parametrize(("pattern", "words"), [
    ("shard-{0..3.tar", "never closed"),
    ("shard-0..3}.tar", "closes no"),
    ("a}{b.tar", "closes no"),  # braceexpand: the name "a}{b.tar"
    ("{a,{b}.tar", "never closed"),
    ("s-{1..a}.tar", "{1..a} is not a range"),
    ("s-{a..1}.tar", "is not a range"),
    ("s-{a..c..x}.tar", "is not a range"),
    ("s-{aa..c}.tar", "is not a range"),
    ("s-{0..9999999}.tar", "expands to 10,000,000 names, more than the limit of 1,000,000"),
    ("s-{0..999999999999999999}.tar", "more than the limit"),  # counted, never made
    ("s" + "{a,b}" * 21 + ".tar", "expands to 2,097,152 names"),
    ("{" * 100 + "}" * 100, "nested more than"),
])
def test_malformed_patterns_are_refused(pattern, words):
    with pytest.raises(BracePatternError) as info:
        expand_braces(pattern)
    assert isinstance(info.value, ShardstreamError) and isinstance(info.value, ValueError)
    assert words in str(info.value)
    assert info.value.url == pattern and str(info.value).startswith(pattern + ": ")


def test_the_limit_is_an_argument_and_a_query_stays_out_of_the_message():
    assert len(expand_braces("s-{0..9}.tar", limit=10)) == 10
    with pytest.raises(BracePatternError, match="11 names, more than the limit of 10"):
        expand_braces("s-{0..10}.tar", limit=10)
    pattern = "https://h/s-{0..3.tar?token=secret"
    with pytest.raises(BracePatternError) as info:
        expand_braces(pattern)
    assert "secret" not in str(info.value) and info.value.url == pattern


@pytest.mark.parametrize(("source", "shards"), [
    ("data/ds", False),
    ("s3://bucket/ds", False),
    ("data/{v1}", False),  # braces that stand for themselves: a folder
    ("data/{a,b}", True),
    ("data/s-{0..3}", True),
    ("data/s-{0..3", True),  # malformed: expanding it says what is wrong
    ("data/s-0.tar", True),
    ("https://h/s-0.tar?X-Amz-Signature=abc", True),  # a presigned shard URL, as WebDataset takes it
    ("https://h/s-0.tar.gz?sv=1&sig=abc", True),
    ("https://h/ds?sig=abc", False),
])
def test_names_shards(source, shards):
    assert names_shards(source) is shards


def test_one_presigned_shard_url_is_a_shard_not_a_dataset_folder():
    """WebDataset("https://h/s-0.tar?X-Amz-Signature=...") reads the shard; so must we, not look
    for https://h/s-0.tar/manifest.msgpack (no request is made here)."""
    source = resolve_source("https://h/s-0.tar?X-Amz-Signature=abc")
    assert source.names() == ["s-0.tar"] and source.manifest is None
    assert source.shards[0].url == "https://h/s-0.tar?X-Amz-Signature=abc"


def test_a_dataset_folder_named_with_escaped_braces_is_opened(packed_plain, tmp_path):
    """Regression: README says `\\{` and `\\}` write plain braces, and they did in a pattern, but a dataset's
    folder written so (`data/\\{v1\\}`) was looked for with its backslashes: "no manifest"."""
    import shutil

    shutil.copytree(packed_plain, tmp_path / "{v1}")
    expected = sorted(s["__key__"] for s in StreamingDataset(packed_plain, decode=None))
    for written in (str(tmp_path / "\\{v1\\}"), str(tmp_path / "{v1}")):
        assert sorted(s["__key__"] for s in StreamingDataset(written, decode=None)) == expected, written


def test_a_dataset_folder_whose_name_holds_a_pattern_is_read_as_packed(packed_plain, tmp_path):
    """Regression: `pack` wrote to `run{1,2}/ds` as named (and inspect and verify read it so),
    where a dataset read it as a pattern of two shards, `run1/ds` and `run2/ds`: "file not
    found". Braces that expand to folders, not shards, where a dataset lies under the name
    as given, name that dataset."""
    import shutil

    shutil.copytree(packed_plain, tmp_path / "run{1,2}" / "ds")
    expected = sorted(s["__key__"] for s in StreamingDataset(packed_plain, decode=None))
    assert sorted(s["__key__"] for s in StreamingDataset(str(tmp_path / "run{1,2}" / "ds"), decode=None)) == expected
    with pytest.raises(ShardstreamError):  # no dataset under that name: a pattern, as before
        resolve_source(str(tmp_path / "run{3,4}" / "ds")).counts()


@pytest.mark.parametrize("name", ["data.tar", "data.tar.zst"])
def test_a_local_dataset_folder_named_like_a_shard_is_read_as_packed(packed_plain, tmp_path, name):
    """Regression: `pack` writes to a name as given, and `data.tar` was read as one shard:
    "could not open: IsADirectoryError" (and inspect, verify read it as the dataset)."""
    import shutil

    shutil.copytree(packed_plain, tmp_path / name)
    expected = sorted(s["__key__"] for s in StreamingDataset(packed_plain, decode=None))
    assert sorted(s["__key__"] for s in StreamingDataset(str(tmp_path / name), decode=None)) == expected


def test_a_local_dataset_folder_named_like_a_shard_is_read_as_packed_from_a_home_path(packed_plain, tmp_path,
                                                                                        monkeypatch):
    """Regression (found by review): the check that a folder holds a dataset did not expand `~`, so
    `~/data.tar` was read as one shard ("IsADirectoryError") where its full path read the dataset."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(packed_plain, tmp_path / "data.tar")
    expected = sorted(s["__key__"] for s in StreamingDataset(packed_plain, decode=None))
    assert sorted(s["__key__"] for s in StreamingDataset("~/data.tar", decode=None)) == expected


def test_a_remote_dataset_folder_named_like_a_shard_is_read_as_packed(packed_plain, tmp_path):
    """Regression: over HTTP or S3, `.../data.tar` (no trailing slash) naming a dataset's folder was read as one
    shard: "file not found". A single shard's URL is still that shard."""
    import shutil

    from shardstream import http_ranges
    from shardstream.testing import HTTPTestServer

    shutil.copytree(packed_plain, tmp_path / "data.tar")
    expected = sorted(s["__key__"] for s in StreamingDataset(packed_plain, decode=None))
    first = sorted(Path(packed_plain).glob("*.tar"))[0].name
    with HTTPTestServer(str(tmp_path)) as server:
        got = StreamingDataset(f"{server.url}/data.tar", decode=None)
        assert sorted(s["__key__"] for s in got) == expected
        one = resolve_source(f"{server.url}/data.tar/{first}")
        assert [ref.name for ref in one.shards] == [first]
        http_ranges._pool.get().clear()  # the server's keep-alive handlers end


def test_resolve_source_refuses_a_malformed_pattern(tmp_path):
    for pattern in (f"{tmp_path}/s-{{0..a}}", f"{tmp_path}/s-{{0..3.tar"):
        with pytest.raises(BracePatternError):
            resolve_source(pattern)


# -- end to end: a product pattern over real shards ------------------------------------------------


def write_tar(path: Path, keys: list[str]) -> None:
    """A plain tar (no index, no manifest) with one ``.cls`` member per sample."""
    with tarfile.open(path, "w") as tar:
        for key in keys:
            data = b"0"
            info = tarfile.TarInfo(f"{key}.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def split_shards(tmp_path) -> tuple[str, list[str]]:
    """train/ and val/, 4 shards each of 3, 5, 2, 7 samples; the pattern picks shards 0 and 2 of
    each by a list and a stepped range. Returns the pattern and its keys, in pattern order."""
    sizes = [3, 5, 2, 7]
    picked = []
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        for shard, size in enumerate(sizes):
            keys = [f"{split}_{shard}_{i:02d}" for i in range(size)]
            write_tar(tmp_path / split / f"shard-{shard:02d}.tar", keys)
            if shard % 2 == 0:
                picked.extend(keys)
    return f"{tmp_path}/{{train,val}}/shard-{{00..03..2}}.tar", picked


def keys_of(ds: StreamingDataset) -> list[str]:
    return [item[0] for item in ds]


def test_a_product_pattern_reads_every_sample_once(split_shards):
    pattern, picked = split_shards
    source = resolve_source(pattern)
    assert [ref.url.split("/")[-2:] for ref in source.shards] == [
        ["train", "shard-00.tar"], ["train", "shard-02.tar"], ["val", "shard-00.tar"], ["val", "shard-02.tar"]]
    assert list(source.counts()) == [3, 2, 3, 2]
    # In order, unshuffled: the shards in the pattern's order.
    ds = StreamingDataset(pattern, decode=None, fields=("__key__",))
    assert keys_of(ds) == picked
    # Shuffled over two ranks: every sample once (10 samples, no padding).
    got = []
    for rank in range(2):
        got += keys_of(StreamingDataset(pattern, decode=None, fields=("__key__",), shuffle=True, seed=3,
                                        rank=rank, world_size=2))
    assert sorted(got) == sorted(picked)
    # In DataLoader workers, which get the pattern, not its names.
    loader = DataLoader(StreamingDataset(pattern, decode=None, fields=("__key__",)), batch_size=None, num_workers=2)
    assert sorted(item[0] for item in loader) == sorted(picked)


def test_patterns_joined_by_double_colons_are_webdatasets_list_of_patterns(split_shards):
    """Found by a WebDataset migrant's walk: WebDataset splits a source on ``::`` into patterns
    (`expand_urls`); shardstream expanded the braces across it ("a-0.tar::b-8.tar: file not
    found"). Each pattern is expanded in turn, as WebDataset's; a chained fsspec URL, whose
    first part is a protocol, stays one URL."""
    from webdataset.shardlists import expand_urls

    pattern, picked = split_shards
    train, val = pattern.replace("{train,val}", "train"), pattern.replace("{train,val}", "val")
    joined = f"{val}::{train}"
    assert expand_braces(joined) == expand_urls(joined) and len(expand_braces(joined)) == 4
    assert keys_of(StreamingDataset(joined, decode=None, fields=("__key__",))) == picked[5:] + picked[:5]
    assert expand_braces("simplecache::s3://b/s-{0..1}.tar") == ["simplecache::s3://b/s-0.tar",
                                                                  "simplecache::s3://b/s-1.tar"]
    assert expand_braces("a.tar::b.tar") == ["a.tar", "b.tar"]
    # An archive's chain is one URL (found by review: split, its outer tar read as a shard), refused as before.
    assert expand_braces("tar://member.tar::file:///d/outer.tar") == ["tar://member.tar::file:///d/outer.tar"]
    with pytest.raises(ShardstreamError, match="a chained URL is read through fsspec's cache wrappers only"):
        StreamingDataset("tar://inner.tar::file:///d/outer.tar", decode=None).resolve()
    with pytest.raises(BracePatternError, match="expands to 4 names, more than the limit of 3"):
        expand_braces("a-{0..1}.tar::b-{0..1}.tar", limit=3)


def test_counting_indexed_shards_without_a_manifest_holds_one_index_at_a_time(tmp_path, monkeypatch):
    """Shards named by URL (no manifest) are counted from their indexes. The count kept every shard's
    reader until the last was counted, so every index at once, every key of the dataset: 100 MB at 1M
    samples, in every process that counts. It holds the one being read; the counts are the same."""
    from shardstream import ShardWriter, open_dataset

    with ShardWriter(str(tmp_path), max_samples=2, compression="none") as writer:
        for i in range(59):
            writer.write({"__key__": f"s{i:03d}", "cls": 0})
    urls = [str(tmp_path / name) for name in open_dataset(str(tmp_path)).names()]
    held = D.watch_held_indexes(monkeypatch)
    source = resolve_source(urls)
    assert list(source.counts()) == [2] * 29 + [1]
    assert held() == (30, 1)  # every index read, one at a time


def test_a_shard_given_as_a_dataset_says_how_to_read_it(packed_plain, tmp_path):
    """A shard file where a dataset folder belongs (`inspect x.tar`) said "could not look up the size:
    NotADirectoryError"; a folder of plain tars said "not a packed dataset" without saying how to make one."""
    import shutil

    from shardstream import ManifestError, open_dataset

    shard = Path(packed_plain) / open_dataset(packed_plain).shards[0].name
    with pytest.raises(ManifestError, match="a file, not a dataset folder: a shard is read with StreamingDataset"):
        open_dataset(str(shard))
    (tmp_path / "tars").mkdir()
    shutil.copy(shard, tmp_path / "tars")
    with pytest.raises(ManifestError, match="`shardstream index` writes one"):
        open_dataset(str(tmp_path / "tars"))
    assert len(list(StreamingDataset([str(shard)], decode=None))) == len(open_dataset(packed_plain).shards[0].reader())


def test_a_compressed_tar_that_holds_fewer_samples_than_counted_is_a_corrupt_shard(tmp_path):
    """Regression: a compressed tar read front to back that ended before the samples asked for
    (replaced between the counting pass and the read) raised a bare IndexError, outside the
    ShardstreamError contract; it is a CorruptShardError naming the file now."""
    import gzip

    from shardstream import CorruptShardError
    from shardstream.storage import Store
    from shardstream.tarstream import StreamTarReader

    write_tar(tmp_path / "s.tar", ["a", "b", "c"])
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress((tmp_path / "s.tar").read_bytes()))
    reader = StreamTarReader(Store(str(tmp_path)), "s.tar.gz")
    assert [s["__key__"] for s in reader.read(1, 3)] == ["b", "c"]
    with pytest.raises(CorruptShardError, match="fewer than were counted") as info:
        list(reader.read(0, 5))
    assert info.value.url.endswith("s.tar.gz")
