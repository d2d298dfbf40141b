"""SeenKeys: a key written twice is refused at its write, across shards too, in about 12 bytes a key once its
shard is done."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream import ShardstreamError
from shardstream.seenkeys import SeenKeys


keys = st.sampled_from([f"k{i}" for i in range(12)])
shards_of_keys = st.lists(st.lists(keys, min_size=1, max_size=8), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(shards_of_keys, st.sampled_from(["python", "shared by all", "shared by some"]))
def test_a_key_is_refused_at_its_write_exactly_when_written_before(shards, hashing):
    """Every key written before is refused at its write, naming the finished shard that has it when
    one does, and no other is, whatever hashes the keys share: a hash shared by two keys is told
    apart by the finished shards' keys. A refused key is not counted (the writer goes on)."""
    hash_key = {"python": hash, "shared by all": lambda key: 7, "shared by some": lambda key: len(key) % 2}[hashing]
    done: list[tuple[str, list[str]]] = []
    seen = SeenKeys(lambda: iter(done), hash_key=hash_key)
    for number, shard in enumerate(shards):
        written: list[str] = []
        for key in shard:
            before = [name for name, keys in done if key in keys]
            if key in written or before:
                with pytest.raises(ShardstreamError, match="duplicate sample key") as caught:
                    seen.check_new(key)
                assert caught.value.key == key
                assert ("written before, to " + before[0] in str(caught.value)) if before else (
                    "written before" not in str(caught.value))
            else:
                seen.check_new(key)
                seen.add(key)
                written.append(key)
        seen.seal()
        done.append((f"shard-{number:06d}", written))


def test_finished_shards_keep_about_12_bytes_a_key():
    """Regression: a set of every key written took 117-120 bytes a key of a writer's peak memory (about
    47 GB at 400M samples). The keys are made before the count starts, and each shard's keys are made
    again for the writer (hashing new strings, as a writer does), so the count holds SeenKeys alone."""
    shards, per_shard = 100, 500  # 50k keys: the filter grows five times on the way
    written = [(f"shard-{shard:06d}", tuple(f"laion/{shard:05d}/{i:09d}" for i in range(per_shard)))
               for shard in range(shards)]
    seen = SeenKeys(lambda: iter(written))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for shard in range(shards):
            for i in range(per_shard):
                key = f"laion/{shard:05d}/{i:09d}"
                seen.check_new(key)
                seen.add(key)
            seen.seal()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 8 bytes a key in the runs, 4-8 in the filter
    assert held <= 16 * shards * per_shard, f"{held / (shards * per_shard):.1f} bytes a key"
    for shard in range(shards):  # what it keeps refuses a repeat from every shard, those sealed as the filter grew too
        with pytest.raises(ShardstreamError, match=f"written before, to shard-{shard:06d}"):
            seen.check_new(f"laion/{shard:05d}/{shard * 5:09d}")
    seen.check_new(f"laion/00003/{per_shard + 7:09d}")
