#!/usr/bin/env python
"""shardstream beside LitData and MosaicML Streaming (and WebDataset), packing and raw reading.

    python benchmarks/peers.py [--images 4000] [--repeats 3] [--data ~/.cache/shardstream-bench]

LitData and MosaicML Streaming are not dependencies of shardstream, nor of its tests;
install them in a separate environment that sees the same torch, for example:

    python -m venv --system-site-packages /tmp/peers
    /tmp/peers/bin/pip install litdata mosaicml-streaming "torch==2.13.0" "numpy==$(python -c 'import numpy; print(numpy.__version__)')"
    /tmp/peers/bin/pip uninstall -y torchvision   # pulled in, and broken against torch 2.13
    /tmp/peers/bin/pip install -e .
    /tmp/peers/bin/python benchmarks/peers.py

`import streaming` (MosaicML) imports torchvision unconditionally, for classes this
benchmark does not use; a placeholder module stands in for it. Every contender packs
or reads the same synthetic image folder as benchmarks/run.py (made and cached there):

* pack: shardstream `pack(workers=2)` with zstd and without; WebDataset's ShardWriter
  (one process); MosaicML's `MDSWriter` without compression and with zstd (one
  process, as its API has it); LitData's `optimize(num_workers=2)` without compression.
* raw read (one process, no decode): each one's own output, front to back, taking the
  length of every sample's JPEG field. LitData hands out memoryviews of memory-mapped
  chunks, so its plain row reads nothing; a second row copies each field to `bytes`,
  which is what shardstream, WebDataset and MosaicML hand out.

Same method as run.py: warm files, one untimed warm-up round, contenders in turns,
medians; ratios against WebDataset in the same run. "CPU s" misses the work of
shardstream's pack workers here: they are children of the fork server, not of this
process.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.machinery
import multiprocessing
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders as c  # noqa: E402
from run import (Contender, dataset_stats, ensure_images, loadavg, machine, measure, table,  # noqa: E402
                 write_results)

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")


def _placeholder_torchvision() -> None:
    """`streaming` imports torchvision for its vision datasets only; none is used here."""
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # absent, or broken against this torch
        pass
    names = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")
    for name in names:
        module = sys.modules[name] = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers looks it up
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


# -- MosaicML Streaming -------------------------------------------------------------------


def pack_mosaic(src: str, dst: str, compression: str | None) -> int:
    _placeholder_torchvision()
    from streaming import MDSWriter

    n = 0
    with MDSWriter(out=dst, columns={"jpg": "bytes", "cls": "int"}, compression=compression,
                   size_limit=c.SHARD_BYTES) as writer:
        for path, _key, label in c.image_files(src):
            with open(path, "rb") as f:
                writer.write({"jpg": f.read(), "cls": label})
            n += 1
    return n


def read_mosaic(dst: str, cache: str) -> int:
    _placeholder_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    c.reset(cache)
    # `remote` + `local`: MosaicML decompresses zstd shards into `local`, not beside them.
    ds = StreamingDataset(remote=dst, local=cache, shuffle=False, batch_size=1)
    n, nbytes = 0, 0
    for sample in ds:
        nbytes += len(sample["jpg"])
        n += 1
    assert nbytes > 0
    return n


# -- LitData ------------------------------------------------------------------------------


def _litdata_sample(item: tuple[str, int]) -> dict:
    path, label = item
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": label}


def pack_litdata(src: str, dst: str, workers: int = 2) -> int:
    import litdata

    inputs = [(path, label) for path, _key, label in c.image_files(src)]
    litdata.optimize(fn=_litdata_sample, inputs=inputs, output_dir=dst, chunk_bytes="256MB",
                     num_workers=workers, mode="overwrite")
    return len(inputs)


def read_litdata(dst: str, cache: str, copy: bool = False) -> int:
    """LitData hands out fields as memoryviews of its memory-mapped chunks (nothing is
    read until touched); with `copy`, as bytes, which is what the others hand out."""
    import litdata

    c.reset(cache)
    ds = litdata.StreamingDataset(input_dir=dst, cache_dir=cache)
    n, nbytes = 0, 0
    for sample in ds:
        nbytes += len(bytes(sample["jpg"]) if copy else sample["jpg"])
        n += 1
    assert nbytes > 0
    return n


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", default="~/.cache/shardstream-bench")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # LitData and MosaicML start threads in this process, after which shardstream's pack
    # pool starts its workers from a fork server rather than by fork (forking a threaded
    # process can deadlock); preloaded, the fork server's workers start warm.
    multiprocessing.set_forkserver_preload(["shardstream.pack"])

    data = os.path.expanduser(args.data)
    info = machine()
    import importlib.metadata as md

    for pkg in ("litdata", "mosaicml-streaming"):
        try:
            info["versions"][pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            p.error(f"{pkg} is not installed: run this from an environment that has the peers (docstring)")
    print(f"machine: {info['cpu']}, {info['cores']} cores; litdata {info['versions']['litdata']}, "
          f"mosaicml-streaming {info['versions']['mosaicml-streaming']}, webdataset {info['versions']['webdataset']}")
    src = ensure_images(data, args.images, 2)
    stats = dataset_stats(src)
    n = stats["images"]
    work = os.path.join(data, f"peers-{n}")
    out = {name: os.path.join(work, name) for name in
           ("ss-zstd", "ss-tar", "wds", "mds", "mds-zstd", "litdata", "cache-mds", "cache-litdata")}

    def fresh(path: str):
        return lambda: (c.reset(path), os.sync())

    pack_group = [
        Contender("shardstream pack zstd (2 workers)", lambda: c.pack_shardstream(src, out["ss-zstd"], "zstd"),
                  prepare=fresh(out["ss-zstd"]), after=os.sync),
        Contender("shardstream pack none (2 workers)", lambda: c.pack_shardstream(src, out["ss-tar"], "none"),
                  prepare=fresh(out["ss-tar"]), after=os.sync),
        Contender("webdataset.ShardWriter (1 process)", lambda: c.pack_webdataset(src, out["wds"]),
                  prepare=fresh(out["wds"]), after=os.sync),
        Contender("MosaicML MDSWriter none (1 process)", lambda: pack_mosaic(src, out["mds"], None),
                  prepare=fresh(out["mds"]), after=os.sync),
        Contender("MosaicML MDSWriter zstd (1 process)", lambda: pack_mosaic(src, out["mds-zstd"], "zstd"),
                  prepare=fresh(out["mds-zstd"]), after=os.sync),
        Contender("LitData optimize none (2 workers)", lambda: pack_litdata(src, out["litdata"]),
                  prepare=fresh(out["litdata"]), after=os.sync),
    ]
    results: dict = {"date": datetime.date.today().isoformat(), "command": " ".join([sys.executable, *sys.argv]),
                     "machine": info, "dataset": stats, "repeats": args.repeats, "loadavg_before": loadavg()}
    measure("pack", pack_group, args.repeats)
    results["pack"] = table(f"pack, {n} images, img/s, median of {args.repeats}", pack_group,
                            "webdataset.ShardWriter (1 process)", "img/s", stats["bytes"])
    wds_urls = c.shard_files(out["wds"], ".tar")
    read_group = [
        Contender("shardstream .tar.zst", lambda: c.read_shardstream(out["ss-zstd"])),
        Contender("shardstream .tar", lambda: c.read_shardstream(out["ss-tar"])),
        Contender("webdataset.WebDataset (its .tar, no decode)", lambda: c.read_webdataset(wds_urls)),
        Contender("MosaicML StreamingDataset (uncompressed)", lambda: read_mosaic(out["mds"], out["cache-mds"])),
        Contender("MosaicML StreamingDataset (zstd)", lambda: read_mosaic(out["mds-zstd"], out["cache-mds"])),
        Contender("LitData StreamingDataset (uncompressed, memoryviews)",
                  lambda: read_litdata(out["litdata"], out["cache-litdata"])),
        Contender("LitData StreamingDataset (uncompressed, as bytes)",
                  lambda: read_litdata(out["litdata"], out["cache-litdata"], copy=True)),
    ]
    measure("read", read_group, args.repeats)
    results["read"] = table(f"raw read, one process, no decode, {n} samples, samples/s, median of {args.repeats}",
                            read_group, "webdataset.WebDataset (its .tar, no decode)", "samples/s", stats["bytes"])
    results["loadavg_after"] = loadavg()
    for g in pack_group + read_group:
        assert g.samples == n, f"{g.name} handled {g.samples} samples, expected {n}"
    path = write_results(args.out or os.path.join(data, f"peers-results-{n}.json"), results)
    print(f"load average before/after: {results['loadavg_before']} / {results['loadavg_after']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
