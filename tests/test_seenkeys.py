"""SeenKeys: a key written twice is refused, across shards too, in 8 bytes a key once its shard is done."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream import ShardstreamError
from shardstream.seenkeys import SeenKeys


def write_as_a_writer_does(seen: SeenKeys, shards: list[list[list[str]]], done: list[tuple[str, list[str]]]) -> None:
    """Feed `shards` (each a list of frames, each a list of keys) through `seen` in the writer's order:
    every key checked and added at its write, each frame checked at its end, each shard sealed."""
    for number, frames in enumerate(shards):
        written: list[str] = []
        for frame in frames:
            for key in frame:
                seen.check_new(key)
                seen.add(key)
            seen.check_finished(frame)
            written += frame
        seen.seal()
        done.append((f"shard-{number:06d}", written))


keys = st.sampled_from([f"k{i}" for i in range(12)])
layouts = st.lists(st.lists(st.lists(keys, min_size=1, max_size=4), min_size=1, max_size=3), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(layouts, st.sampled_from(["python", "shared by all", "shared by some"]))
def test_a_key_is_refused_exactly_when_written_before(shards, hashing):
    """Refused iff it repeats, whatever the shard and frame it repeats in, and whatever hashes the keys
    share: a hash shared by two keys is told apart by the finished shards' keys."""
    hash_key = {"python": hash, "shared by all": lambda key: 7, "shared by some": lambda key: len(key) % 2}[hashing]
    done: list[tuple[str, list[str]]] = []
    seen = SeenKeys(lambda: iter(done), hash_key=hash_key)
    refused = first_refusal(shards)
    if refused is None:
        write_as_a_writer_does(seen, shards, done)
        return
    with pytest.raises(ShardstreamError, match="duplicate sample key") as caught:
        write_as_a_writer_does(seen, shards, done)
    assert caught.value.key == refused
    if "written before" in str(caught.value):
        shard = str(caught.value).rsplit("to ", 1)[1]
        assert refused in dict(done)[shard], "the shard named holds the key"


def first_refusal(shards: list[list[list[str]]]) -> str | None:
    """The key refused first, with every key kept as it is: a repeat within its shard at its write,
    else the first key of a frame that a finished shard holds, at the frame's end."""
    finished: set[str] = set()
    for frames in shards:
        shard: set[str] = set()
        for frame in frames:
            for key in frame:
                if key in shard:
                    return key
                shard.add(key)
            for key in frame:
                if key in finished:
                    return key
        finished |= shard
    return None


def test_finished_shards_keep_8_bytes_a_key():
    """Regression: a set of every key written took about 107 bytes a key (43 GB at 400M samples)."""

    def shard_keys(shard):
        return [f"laion/{shard:05d}/{i:09d}" for i in range(1000)]

    seen = SeenKeys(lambda: ((f"shard-{shard:06d}", shard_keys(shard)) for shard in range(200)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for shard in range(200):
            for key in shard_keys(shard):
                seen.check_new(key)
                seen.add(key)
            seen.seal()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 12 * 200_000, f"{held / 200_000:.1f} bytes a key"
    with pytest.raises(ShardstreamError, match="written before, to shard-000003"):
        seen.check_finished(["new", "laion/00003/000000007"])  # what it keeps still refuses a repeat
    seen.check_finished(["new", "laion/00003/000001007"])
