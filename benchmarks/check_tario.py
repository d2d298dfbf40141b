#!/usr/bin/env python
"""Check that tario's hand-built tar headers are byte-identical to tarfile's.

    python benchmarks/check_tario.py [--names 200000]

`shardstream.tario._header` builds plain ustar headers itself for short ASCII names and
falls back to `tarfile` otherwise. This compares the two over random and edge-case
names (lengths 0-130, every ASCII byte including NUL and controls, non-ASCII, slashes,
dots) and sizes (0, block edges, the ustar limit), and checks that the parser reads
back what was written. Exits non-zero on the first difference.
"""

from __future__ import annotations

import argparse
import random
import sys

from shardstream import tario


def names(count: int, rng: random.Random):
    yield from ["", "a", "a.jpg", "x" * 99, "x" * 100, "x" * 101, "d/" * 49 + "k.cls", "é.jpg", "k.\u00e9",
                "a\0b.jpg", "\x7f.txt", "key.jpg", "class_000/img_00000.jpg", "class_000/img_00000.cls",
                "a" * 100 + "é", "\U0001F600.png", "x" * 200]
    ascii_chars = [chr(i) for i in range(128)]
    common = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./"
    for i in range(count):
        n = rng.choice((rng.randrange(0, 131), rng.randrange(1, 40)))
        pool = (ascii_chars, common, common + "éü€\U0001F600")[i % 3]
        yield "".join(rng.choice(pool) for _ in range(n))


def sizes(rng: random.Random):
    fixed = [0, 1, 511, 512, 513, 1023, 1024, 110_000, 8**11 - 1, 8**11, 8**11 + 1, 2**33, 2**31]
    return fixed + [rng.randrange(0, 1 << 24) for _ in range(20)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--names", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    size_list = sizes(rng)
    checked = fast = 0
    for name in names(args.names, rng):
        for size in (rng.choice(size_list), size_list[checked % len(size_list)]):
            try:
                want = tario._tarfile_header(name, size)
            except (ValueError, UnicodeEncodeError) as e:
                want = type(e)
            try:
                got = tario._header(name, size)
            except (ValueError, UnicodeEncodeError) as e:
                got = type(e)
            if got != want:
                print(f"MISMATCH for name={name!r} size={size}:\n  tarfile {want!r}\n  tario   {got!r}")
                return 1
            checked += 1
            fast += len(name) <= 100 and name.isascii() and size < 8**11
    # Round trip through the parser for member() and member_parts().
    for name in ["a.jpg", "class_000/img_00001.jpg", "x" * 100, "é/ü.png", "y" * 150 + ".cls"]:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 2000)))
        blob = tario.member(name, data)
        assert blob == b"".join(tario.member_parts(name, data)), name
        members = list(tario.iter_members(blob, url="check"))
        assert [(n, blob[s:e]) for n, s, e in members] == [(name, data)], (name, members)
        assert tario.member_size(len(data), name) == len(blob)
    print(f"ok: {checked} headers identical to tarfile's ({fast} on the hand-built path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
