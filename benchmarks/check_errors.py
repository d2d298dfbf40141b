#!/usr/bin/env python
"""Check that the reader's fast paths raise exactly what the general parser raises.

    python benchmarks/check_errors.py --reference --write /tmp/errors-before.json
    python benchmarks/check_errors.py --compare /tmp/errors-before.json

Packs a small dataset (both compressions), then reads thousands of damaged copies of
its shards: bytes of tar headers changed (half of the time with the header checksum
made valid again, so that the damage reaches the later checks), member data changed,
and index entries shifted or renamed. zstd shards are damaged in their decompressed
tar stream and recompressed frame by frame, so the damage reaches the tar parser. For
every case it records what iteration, `reader[i]` and `reader.read(a, b)` give: the
samples yielded (digested) and the exception type and message. Run it with the fast
paths switched off (--reference, benchmarks/_reference.py) and on: the records must
be identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile

import numpy as np
import zstandard

TMP = ["/nonexistent"]  # the temporary folder, replaced by "<tmp>" in what is recorded

INTERESTING = [0, 0x20, 0x30, 0x37, 0x35, 0x78, 0x4C, 0x80, 0xFF, 0x2E, 0x2F, 0x41, 0xC3]


def outcome(fn) -> list:
    """[samples yielded, digest of them, exception type, message]."""
    h = hashlib.sha256()
    n = 0
    try:
        for sample in fn():
            items = ((k, v if isinstance(v, bytes) else str(v).replace(TMP[0], "<tmp>")) for k, v in sample.items())
            h.update(repr(sorted(items)).encode())
            n += 1
    except Exception as e:  # noqa: BLE001 - the point is to record whatever is raised
        return [n, h.hexdigest()[:16], type(e).__name__, str(e).replace(TMP[0], "<tmp>")]
    return [n, h.hexdigest()[:16], None, None]


def header_positions(raw: bytes, index) -> list[int]:
    """Offsets of every header block in a tar stream, from the index's sample offsets."""
    out = []
    offsets = index.sample_offsets.tolist()
    for a, b in zip(offsets, offsets[1:]):
        pos = a
        while pos < b:
            out.append(pos)
            try:
                size = int(raw[pos + 124 : pos + 136].rstrip(b"\0 ") or b"0", 8)
            except ValueError:
                break
            pos += 512 + (size + 511) // 512 * 512
    return out


def damage(raw: bytearray, headers: list[int], rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.85:
        h = rng.choice(headers)
        field = rng.choice([(0, 100), (100, 124), (124, 136), (148, 156), (156, 157), (257, 265), (345, 500), (0, 512)])
        for _ in range(rng.choice((1, 1, 2, 4))):
            pos = h + rng.randrange(*field)
            raw[pos] = rng.choice(INTERESTING) if rng.random() < 0.6 else rng.randrange(256)
        if rng.random() < 0.5:  # make the checksum valid again
            block = raw[h : h + 512]
            block[148:156] = b" " * 8
            raw[h + 148 : h + 156] = b"%06o\0 " % sum(block)
            return f"header@{h} fixed-checksum"
        return f"header@{h}"
    pos = rng.randrange(len(raw))
    raw[pos] ^= 0xFF
    return f"byte@{pos}"


def read_all(reader, rng: random.Random) -> dict:
    n = len(reader)
    picks = sorted({0, n - 1, *(rng.randrange(n) for _ in range(4))})
    a = rng.randrange(n)
    b = rng.randrange(a, n + 1)
    return {
        "iter": outcome(lambda: iter(reader)),
        "get": [outcome(lambda i=i: iter([reader[i]])) for i in picks],
        "range": [a, b, outcome(lambda: reader.read(a, b))],
    }


def run(cases: int, seed: int) -> dict:
    import shardstream
    from shardstream.format import ShardIndex
    from shardstream.reader import ShardReader
    from shardstream.storage import Store

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_identity import make_odd_folder

    rng = random.Random(seed)
    records: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        TMP[0] = tmp
        src = os.path.join(tmp, "src")
        make_odd_folder(src)
        for compression in ("none", "zstd"):
            dst = os.path.join(tmp, compression)
            shardstream.pack(src, dst, compression=compression, workers=1, progress=False, on_error="skip",
                             shard_size="200KB")
            store = Store(dst)
            ref = shardstream.open_dataset(dst).shards[0]
            index = ShardIndex.from_bytes(store.read(ref.info.index), "idx")
            data = store.read(ref.name)
            if compression == "zstd":
                dctx = zstandard.ZstdDecompressor()
                comp = index.frame_offsets.tolist() + [None]
                frames = [dctx.decompress(data[comp[f] : comp[f + 1]]) for f in range(len(comp) - 2)]
                raw = b"".join(frames)
            else:
                raw = data
            headers = header_positions(raw, index)
            cctx = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
            for case in range(cases):
                bad = bytearray(raw)
                what = damage(bad, headers, rng)
                new_index = index
                if rng.random() < 0.15:  # damage the index instead of (or as well as) the shard
                    offsets = index.sample_offsets.copy()
                    keys = list(index.keys)
                    i = rng.randrange(len(keys))
                    choice = rng.randrange(3)
                    if choice == 0 and 0 < i < len(keys):
                        offsets[i] += rng.choice((-512, 512, 1024))
                    elif choice == 1:
                        keys[i] = keys[i] + "x"
                    else:
                        keys[i], keys[-1] = keys[-1], keys[i]
                    if np.all(np.diff(offsets) > 0):
                        new_index = ShardIndex(tuple(keys), offsets, index.frame_offsets, index.frame_raw_offsets,
                                               index.compression)
                        what += f" index#{choice}@{i}"
                if compression == "zstd":
                    raw_offsets = index.frame_raw_offsets.tolist()
                    parts = [cctx.compress(bytes(bad[raw_offsets[f] : raw_offsets[f + 1]]))
                             for f in range(len(raw_offsets) - 1)]
                    file_offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
                    new_index = ShardIndex(new_index.keys, new_index.sample_offsets, file_offsets,
                                           index.frame_raw_offsets, "zstd")
                    body = b"".join(parts)
                else:
                    body = bytes(bad)
                name = f"case-{case}{'.tar.zst' if compression == 'zstd' else '.tar'}"
                with open(os.path.join(dst, name), "wb") as f:
                    f.write(body)
                reader = ShardReader(store, name, index=new_index)
                records[f"{compression} {case} {what}"] = read_all(reader, random.Random(case))
                os.remove(os.path.join(dst, name))
    return records


def main() -> int:
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write")
    g.add_argument("--compare")
    p.add_argument("--cases", type=int, default=1500, help="damaged shards per compression")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", action="store_true", help="switch the fast paths off first")
    args = p.parse_args()
    import shardstream

    if args.reference:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _reference import use_reference_paths

        use_reference_paths()
    print(f"shardstream from {os.path.dirname(shardstream.__file__)}{' (reference paths)' if args.reference else ''}")
    records = run(args.cases, args.seed)
    kinds: dict[str, int] = {}
    for r in records.values():
        k = r["iter"][2] or "ok"
        kinds[k] = kinds.get(k, 0) + 1
    print(f"{len(records)} damaged shards; iteration outcomes: {kinds}")
    if args.write:
        with open(args.write, "w") as f:
            json.dump(records, f, indent=0, sort_keys=True)
        print(f"wrote {args.write}")
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    bad = [k for k in sorted(set(before) | set(records)) if before.get(k) != records.get(k)]
    for k in bad[:20]:
        print(f"DIFFERENT: {k}\n  before {before.get(k)}\n  now    {records.get(k)}")
    print("identical outcomes" if not bad else f"{len(bad)} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
