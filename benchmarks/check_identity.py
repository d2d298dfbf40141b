#!/usr/bin/env python
"""Check that optimisations leave the output bytes and the samples read back unchanged.

    # digests with the fast paths switched off (benchmarks/_reference.py) ...
    python benchmarks/check_identity.py --reference --write /tmp/before.json [--images DIR]
    # ... and with them on:
    python benchmarks/check_identity.py --compare /tmp/before.json [--images DIR]

(Old code can be checked the same way: PYTHONPATH=/tmp/old, from `git archive REV
shardstream | tar -x -C /tmp/old`, with --write.)

Packs a set of awkward inputs (long and non-ASCII names that need pax records, PNGs,
nested folders, a corrupt image skipped, several shards, both compressions, 1 and 2
workers) and writes the same samples with `ShardWriter`, then records the sha256 of
every output file. Every dataset is also read back three ways, by iteration, by
`reader[i]` and by random `read(a, b)` ranges, and compared with an independent
oracle: the shard decompressed whole and parsed by Python's `tarfile`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import sys
import tarfile
import tempfile

import numpy as np
import zstandard
from PIL import Image


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (17, 23, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _jpeg(seed: int) -> bytes:
    from shardstream.synthetic import synthetic_jpeg

    return synthetic_jpeg(seed, 60 + seed % 40, 50 + seed % 30)


def make_odd_folder(root: str) -> None:
    """Small ImageFolder with the names and formats that take the slow paths."""
    names = {
        "cats": ["a.jpg", "b.JPEG", "dotted.name.jpg", "x" * 120 + ".jpg", "ünïcødé.jpg", "sub/deeper/c.jpg",
                 "sp ace.png", "y" * 95 + ".png", "日本.png", "bad.jpg", "notes.txt"],
        "dogs": [f"img_{i:03d}.jpg" for i in range(40)] + ["z" * 99 + ".png"],
        "émigré": ["e1.jpg", "e2.png"],
    }
    seed = 0
    for cls, files in names.items():
        for name in files:
            path = os.path.join(root, cls, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            seed += 1
            if name == "bad.jpg":
                data = _jpeg(seed)[:300]  # truncated: skipped under on_error="skip"
            elif name.endswith(".txt"):
                data = b"not an image"
            elif name.lower().endswith(".png"):
                data = _png(seed)
            else:
                data = _jpeg(seed)
            with open(path, "wb") as f:
                f.write(data)


def oracle_samples(path: str) -> list[dict]:
    """Samples of a shard as Python's tarfile sees the whole (decompressed) stream."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    samples: list[dict] = []
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            slash = m.name.rfind("/")
            dot = m.name.find(".", slash + 1)
            key, field = m.name[:dot], m.name[dot + 1:]
            if not samples or samples[-1]["__key__"] != key:
                samples.append({"__key__": key})
            samples[-1][field] = tar.extractfile(m).read()
    return samples


def check_reads(dst: str, rng: random.Random) -> int:
    import shardstream

    n = 0
    for ref in shardstream.open_dataset(dst).shards:
        expect = oracle_samples(ref.url)
        for s in expect:
            s["__url__"] = ref.url
        reader = ref.reader()
        assert len(reader) == len(expect)
        got = list(reader)
        assert got == expect, f"iteration differs from tarfile for {ref.url}"
        assert all(type(v) is bytes for s in got for k, v in s.items() if not k.startswith("__"))
        for i in rng.sample(range(len(expect)), min(len(expect), 25)) + [0, len(expect) - 1, -1]:
            assert reader[i] == expect[i], f"reader[{i}] differs for {ref.url}"
        for _ in range(25):
            a = rng.randrange(len(expect))
            b = rng.randrange(a, len(expect) + 1)
            assert list(reader.read(a, b)) == expect[a:b], f"read({a}, {b}) differs for {ref.url}"
        # A plain .tar read without its index (as another tool's shard) gives the same samples.
        if ref.url.endswith(".tar"):
            stream = shardstream.StreamTarReader(ref.store, ref.name)
            assert list(stream) == expect
        n += len(expect)
    return n


def digest_folder(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def run(images: str | None, read: bool = True) -> dict[str, dict[str, str]]:
    import shardstream

    rng = random.Random(0)
    digests: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        odd = os.path.join(tmp, "odd")
        make_odd_folder(odd)
        cases = [("odd", odd, dict(shard_size="40KB", on_error="skip")),
                 ("odd-one-shard", odd, dict(on_error="skip", shuffle=False)),
                 ("odd-max-samples", odd, dict(max_samples=7, on_error="skip", seed=3))]
        if images:
            cases.append(("images", images, dict(shard_size="64MB")))
        for label, src, opts in cases:
            for compression in ("zstd", "none"):
                for workers in (1, 2):
                    dst = os.path.join(tmp, f"{label}-{compression}-{workers}")
                    shardstream.pack(src, dst, compression=compression, workers=workers, progress=False, **opts)
                    digest = digest_folder(dst)
                    name = f"pack {label} {compression}"
                    if name in digests:
                        assert digests[name] == digest, f"{name}: output depends on workers"
                    digests[name] = digest
                    if workers == 2:
                        checked = f"{check_reads(dst, rng)} samples read back identically" if read else "not read back"
                        print(f"{name}: {len(digest)} files, {checked}")
        # ShardWriter: mixed field types, awkward keys, several frames and shards.
        for compression in ("zstd", "none"):
            wrng = random.Random(1)  # its own generator: the output must not depend on --no-read
            dst = os.path.join(tmp, f"writer-{compression}")
            with shardstream.ShardWriter(dst, shard_size="300KB", compression=compression, frame_size=20_000) as w:
                for i in range(300):
                    key = ("k" * (i % 130 + 1)) + f"/s{i}" if i % 7 else f"ключ/{i}"
                    w.write({"__key__": key, "jpg": bytes(wrng.randrange(256) for _ in range(wrng.randrange(0, 3000))),
                             "cls": i % 5, "json": {"i": i}, "txt": "é" * (i % 9)})
            name = f"writer {compression}"
            digests[name] = digest_folder(dst)
            checked = f"{check_reads(dst, rng)} samples read back identically" if read else "not read back"
            print(f"{name}: {len(digests[name])} files, {checked}")
    return digests


def main() -> int:
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", help="write the digests to this JSON file")
    g.add_argument("--compare", help="compare the digests with this JSON file")
    p.add_argument("--images", help="also pack this image folder (e.g. the benchmark's cached images)")
    p.add_argument("--no-read", action="store_true", help="skip reading back")
    p.add_argument("--reference", action="store_true",
                   help="switch the fast paths off first (benchmarks/_reference.py): the digests to compare with")
    args = p.parse_args()
    import shardstream

    if args.reference:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _reference import use_reference_paths

        use_reference_paths()
    print(f"shardstream from {os.path.dirname(shardstream.__file__)}{' (reference paths)' if args.reference else ''}")
    digests = run(args.images, read=not args.no_read)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
        print(f"wrote {args.write}")
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    bad = [k for k in sorted(set(before) | set(digests)) if before.get(k) != digests.get(k)]
    for k in bad:
        print(f"DIFFERENT: {k}")
    print("identical output bytes" if not bad else f"{len(bad)} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
