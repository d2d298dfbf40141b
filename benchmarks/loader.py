#!/usr/bin/env python
"""Loader benchmark: shardstream vs WebDataset, from JPEG bytes to uint8 batches.

    python benchmarks/loader.py [--images 2000] [--repeats 3] [--only decode,loader,remote,resume,shrink]
                                [--shuffle-buffer 2048] [--max-side 320] [--data ~/.cache/shardstream-bench]
                                [--out results.json]

Sections (each figure is the median of --repeats timed runs; contenders of a section
take turns round by round, so slow drift of a noisy machine hits all of them alike;
ratios are between medians of the same run):

* decode: one process, shuffled, decode + RandomResizedCrop(224) + horizontal flip to
  a uint8 CHW tensor. shardstream: `StreamingDataset(..., shuffle=True,
  decode=RandomResizedCropJPEG(224), fields=("jpg", "cls"))` iterated in this process.
  WebDataset: `WebDataset(tars, shardshuffle=True).shuffle(1000).decode("pil")
  .to_tuple("jpg", "cls").map_tuple(PILRandomResizedCrop(224), int)`, the PIL transform
  written here as torchvision does it (same crop sampling, crop then bilinear resize,
  flip, then CHW). The "bare loop" is RandomResizedCropJPEG called on the JPEG bytes
  already in memory: what the loader costs on top of it is its overhead. Diagnostics:
  the same pipeline with `prefetch=0` (no reader thread), and with the region decoder off.
* loader: `torch.utils.data.DataLoader(ds, batch_size=None, num_workers=n)` for n in
  0, 1, 2 (fresh loader per run, persistent workers off) over the dataset batched by
  64 and over WebDataset's pipeline `.batched(64)`; images/s and time to first batch
  (from constructing the dataset to receiving batch 1). Also `shardstream.DataLoader`
  against the torch DataLoader over the same StreamingDataset (2 workers), and the
  dataset with `decode_threads=2` in the loop's own process (num_workers=0).
* remote: the packed folder served by `shardstream.testing.HTTPTestServer` with 50 ms
  per request, in a process of its own (as remote storage would be). Raw sample streaming (decode=None, fields=("__key__", "jpg"), shuffled)
  through a 1-worker DataLoader from local disk and over HTTP (default prefetch, and 0), the
  decode pipeline local vs HTTP (1 worker), and WebDataset's raw streaming of its plain
  tars, local and over the same server (its http:// URLs open through `curl`).
* resume: time to first batch through `shardstream.DataLoader` (1 worker, batch 64) at
  the start of the epoch and after `load_state_dict` of a state taken after 90% of the
  epoch's batches, local and over HTTP. The resumed first batch is checked to be
  bit-identical to the batch the uninterrupted epoch delivered at that point. What a
  resume owes is the interrupted run's shuffle buffer; on a few thousand images the
  default buffer (2,048) holds most of what is left, so `--shuffle-buffer 512` with
  `--images 4000` shows a dataset several times larger than its buffer, as real ones are.
* adopt (not in the default run): WebDataset's tars as they are (a brace pattern: every
  reader scans each plain tar before its ranged reads) against the same tars after
  `shardstream index` (hard links to them, plus the indexes and manifest it writes),
  raw samples (decode=None, shuffled) through a 2-worker DataLoader, from local disk and
  over the HTTP server (50 ms a request). The index itself is timed once.
* steady (not in the default run): what a training run of many epochs sees. Every
  contender is one persistent-worker DataLoader (`persistent_workers=True`), made and
  run through one untimed epoch before the timed rounds; each round then times one
  whole epoch (`set_epoch` first, for shardstream), so the workers' start is paid once,
  as in training, not once per figure. Decode pipelines (batch 64) with 1 and 2 workers,
  shardstream and WebDataset, plus `shardstream.DataLoader` with 2 workers and the
  2-worker shardstream pipeline with torch's own collate (fresh shared memory for every
  batch, where shardstream's reuses it: batchmemory.py), the 1- and 2-worker shardstream
  pipelines with `prefetch=0` (no reader thread in the workers); and raw
  streaming through one worker from local disk and over the 50 ms HTTP server (the
  remote section's pair). Use `--images 4000`, the issues' own set size.
* steadyraw (not in the default run): the steady section's raw pair alone (local and
  HTTP, issue #4's target), cheap enough for many rounds (`--repeats 21`).
* steadydecode (not in the default run): the steady section's decode contenders that
  issue #3's worker targets compare (shardstream with 1 and 2 workers, WebDataset with
  2), with shardstream's two again at `prefetch=0`, for many rounds (`--repeats 11`).
* epochstart (not in the default run): the wait at the start of each epoch of a
  persistent worker streaming raw samples over the 50 ms HTTP server, with the head
  start on the next epoch and without it (`HeadStart.begin` patched out in the workers
  of those loaders), without a cache and with one a third of the dataset's size.
* readahead (not in the default run): raw samples (decode=None, shuffled) read in this
  process, as fast as they come, from local shards and over HTTP servers 50 ms and
  150 ms away (processes of their own), with the read-ahead window growing while the
  reader waits (readahead.py, the default) and with it fixed at its start
  (`readahead.GROWTH` set to 1 for that contender's epochs). Each contender is one
  dataset whose every round is its next epoch (`set_epoch`), as a training run's are.
* shrink (not in the default run): what `pack --max-side` costs once and saves every
  epoch. Pack the image folder as is and with `max_side=--max-side` (2 workers, zstd,
  fresh output each round), then the decode section's one-process pipeline over each
  packed dataset, and WebDataset + PIL over its tars of the original files as the
  baseline. The shrunk images are other data (fewer pixels): the decode rates say what
  a user gains by choosing that, not how the loaders compare.

Data: the synthetic ImageNet-like folder of benchmarks/run.py (cached under --data as
images-N; reused when present), packed once with `shardstream.pack(zstd, 32MB shards)`
and written once as plain WebDataset tars (`webdataset.ShardWriter`, maxsize 32 MB,
same files, same bytes, shuffled file order), cached under <data>/loader-N/.

The process runs torch with --torch-threads intra-op threads (default 1, what
DataLoader workers use): on a busy 2-core machine two threads make a 64-image
torch.stack ~40x slower (OpenMP threads waiting on each other), which would swamp
the in-process (num_workers=0) figures for both contenders alike.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import contenders as c  # noqa: E402
import run as pack_bench  # noqa: E402  (ensure_images, dataset_stats, machine)

import shardstream as ss  # noqa: E402
from shardstream import decode as ss_decode  # noqa: E402
from shardstream.transforms import RandomResizedCropJPEG, crop_params  # noqa: E402
from shardstream.writer import parse_size  # noqa: E402

SECTIONS = ("decode", "loader", "remote", "resume", "shrink", "adopt", "steady", "steadyraw", "steadydecode",
            "epochstart", "readahead")
DEFAULT_SECTIONS = ("decode", "loader", "remote", "resume")
SHARD_SIZE = "32MB"
BATCH = 64
SIZE = 224
LATENCY_S = 0.05
RESUME_AT = 0.9
SHUFFLE_BUFFER = 2048  # StreamingDataset's default; --shuffle-buffer
MAX_SIDE = 320  # --max-side, for the shrink section

warnings.filterwarnings("ignore", message=r"set WebDataset\(shardshuffle")  # shardshuffle=True means 100
warnings.filterwarnings("ignore", message=r"The given NumPy array is not writable")


# -- the WebDataset side's transform ----------------------------------------------------


@dataclass(frozen=True)
class PILRandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size)`` + ``RandomHorizontalFlip()`` + ``PILToTensor``
    on a PIL image, with PIL, numpy and torch only.

    The box is sampled exactly as torchvision samples it (`crop_params` is a copy of
    ``RandomResizedCrop.get_params``, drawing from torch's generator); then, as
    torchvision's functional ``resized_crop`` on PIL images does, crop, and resize with
    PIL's (antialiased) bilinear filter; flip with probability 1/2; HWC -> contiguous
    CHW uint8 through numpy (``torch.permute(...).contiguous()`` would be the same
    result, but see the module notes on threads).
    """

    size: int = SIZE
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        top, left, h, w = crop_params(image.size[0], image.size[1], self.scale, self.ratio)
        image = image.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1).item() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))


def pil_decode(data: bytes) -> Image.Image:
    """What WebDataset's ``decode("pil")`` does with JPEG bytes."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


# -- data -------------------------------------------------------------------------------


@dataclass
class Data:
    n: int
    images: str  # the image folder
    ss_path: str  # shardstream dataset folder
    wds_files: list[str]  # WebDataset tars (local paths)
    root: str  # folder holding both, served over HTTP
    ss_shards: int = 0
    stats: dict = field(default_factory=dict)

    def wds_urls(self, base: str | None = None) -> list[str]:
        if base is None:
            return self.wds_files
        return [f"{base}/{os.path.relpath(p, self.root)}" for p in self.wds_files]

    def ss_url(self, base: str | None = None) -> str:
        return self.ss_path if base is None else f"{base}/{os.path.relpath(self.ss_path, self.root)}"


def ensure_data(data_dir: str, n: int) -> Data:
    images = pack_bench.ensure_images(data_dir, n, 2)
    stats = pack_bench.dataset_stats(images)
    if stats["images"] != n:
        raise SystemExit(f"{images} holds {stats['images']} images, expected {n}: remove it to regenerate")
    root = os.path.join(data_dir, f"loader-{n}")
    ss_path, wds_path = os.path.join(root, "ss-zstd-32MB"), os.path.join(root, "wds-32MB")
    marker = os.path.join(root, ".complete")
    if not os.path.exists(marker):
        c.reset(root)
        os.makedirs(root)
        print(f"packing {n} images: shardstream zstd {SHARD_SIZE} shards, WebDataset plain tars, "
              f"maxsize {SHARD_SIZE} (once; cached under {root}) ...", flush=True)
        t0 = time.perf_counter()
        summary = ss.pack(images, ss_path, compression="zstd", shard_size=SHARD_SIZE, workers=2, progress=False)
        assert summary.samples == n, summary
        write_wds(images, wds_path)
        with open(marker, "w") as f:
            json.dump({"images": n, "shard_size": SHARD_SIZE}, f)
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    wds_files = c.shard_files(wds_path, ".tar")
    if len(wds_files) < 2:
        raise SystemExit(f"{n} images make {len(wds_files)} WebDataset shard(s) of {SHARD_SIZE}: WebDataset with 2 "
                         "DataLoader workers needs 2 or more (use --images 600 or more)")
    source = ss.open_dataset(ss_path)
    assert int(source.counts().sum()) == n
    return Data(n, images, ss_path, wds_files, root, len(source.shards), stats)


def write_wds(src: str, dst: str) -> int:
    """The same files as plain WebDataset tars (bytes + class label), maxsize 32 MB.

    The file order is shuffled once with a fixed seed, as `shardstream.pack` does by
    default: class-sorted shards would make a 1000-sample shuffle buffer hold one class.
    """
    import webdataset as wds

    os.makedirs(dst, exist_ok=True)
    files = list(c.image_files(src))
    random.Random(0).shuffle(files)
    with wds.ShardWriter(os.path.join(dst, "shard-%06d.tar"), maxsize=parse_size(SHARD_SIZE), verbose=0) as sink:
        for path, key, label in files:
            with open(path, "rb") as f:
                sink.write({"__key__": key, "jpg": f.read(), "cls": label})
    return len(files)


def warm_files(paths: Iterable[str]) -> None:
    buf = bytearray(4 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# -- pipelines --------------------------------------------------------------------------


def ss_dataset(src: str, *, decode: Any = "crop", batch_size: int | None = None, prefetch: int | None = None,
               fields: tuple[str, ...] = ("jpg", "cls"), decode_threads: int = 0, collate_fn: Any = None) -> Any:
    return ss.StreamingDataset(src, shuffle=True, decode=RandomResizedCropJPEG(SIZE) if decode == "crop" else decode,
                               fields=fields, batch_size=batch_size, prefetch=prefetch, shuffle_buffer=SHUFFLE_BUFFER,
                               decode_threads=decode_threads, collate_fn=collate_fn)


def wds_pipeline(urls: list[str], *, decode: bool = True, batch_size: int | None = None) -> Any:
    import webdataset as wds

    pipeline = wds.WebDataset(urls, shardshuffle=True).shuffle(1000)
    if decode:
        pipeline = pipeline.decode("pil").to_tuple("jpg", "cls").map_tuple(PILRandomResizedCrop(SIZE), int)
    else:
        pipeline = pipeline.to_tuple("__key__", "jpg")
    return pipeline.batched(batch_size) if batch_size else pipeline


def without_region_decoder(run: Callable[[], dict]) -> Callable[[], dict]:
    """`run` with JPEG crops decoded whole, as where the _jpegregion extension is not built."""

    def whole() -> dict:
        saved, ss_decode._jpegregion = ss_decode._jpegregion, None
        try:
            return run()
        finally:
            ss_decode._jpegregion = saved

    return whole


def torch_loader(dataset: Any, workers: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=False)


def _count_item(item: Any) -> int:
    """Samples in an item: a (images, labels) batch, or one sample."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor) and item[0].dim() == 4:
        images, labels = item
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE), images.shape
        assert len(labels) == images.shape[0]
        return int(images.shape[0])
    return 1


def drain(make: Callable[[], Iterable[Any]]) -> dict:
    """Build the pipeline and run it to the end: samples, and seconds to the first item."""
    t0 = time.perf_counter()
    first = None
    n = 0
    for item in make():
        if first is None:
            first = time.perf_counter() - t0
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], torch.Tensor) and item[0].dim() == 3:
                assert item[0].dtype == torch.uint8 and item[0].shape == (3, SIZE, SIZE), item[0].shape
        n += _count_item(item)
    return {"samples": n, "first_s": first}


# -- timing -----------------------------------------------------------------------------


class Contender(pack_bench.Contender):
    """run.py's contender (median, rate), whose run returns a dict: samples, first-batch time, extras."""

    def __init__(self, name: str, run: Callable[[], dict], *, expect: int | None = None, note: str = ""):
        super().__init__(name, run, note=note)  # type: ignore[arg-type]
        self.expect = expect
        self.first: list[float] = []
        self.extra: list[dict] = []

    def once(self, record: bool = True) -> None:
        cpu0, t0 = pack_bench._cpu(), time.perf_counter()
        got = self.run_fn()
        wall, cpu = time.perf_counter() - t0, pack_bench._cpu() - cpu0
        self.samples = got.pop("samples")
        if self.expect is not None:
            assert self.samples == self.expect, f"{self.name}: {self.samples} samples, expected {self.expect}"
        first = got.pop("first_s", None)
        self.wall.append(wall)
        self.cpu.append(cpu)
        if first is not None:
            self.first.append(first)
        self.extra.append(got)

    @property
    def ttfb(self) -> float | None:
        return statistics.median(self.first) if self.first else None

    def row(self) -> dict:
        return {"contender": self.name, "note": self.note, "samples": self.samples, "runs_s": self.wall,
                "median_s": self.median, "images_per_s": self.rate, "cpu_s": self.cpu,
                "median_cpu_s": statistics.median(self.cpu), "first_batch_s": self.first,
                "median_first_batch_s": self.ttfb, "extra": self.extra}


def measure(section: str, group: list[Contender], repeats: int) -> None:
    for r in range(repeats):
        for con in group:
            con.once()
            ttfb = f"  first {con.first[-1]:.3f} s" if con.first else ""
            print(f"  [{section}] round {r + 1}/{repeats}  {con.name:<52} {con.wall[-1]:7.2f} s{ttfb}", flush=True)


def table(title: str, group: list[Contender], baseline: Contender | None, *, rate: bool = True) -> str:
    """A markdown table; `vs` is the rate against `baseline`, both medians of this run."""
    lines = [f"**{title}**", ""]
    head = ["contender", "median s"]
    if rate:
        head += ["img/s", f"vs {baseline.name}" if baseline else "vs"]
    head += ["first batch s (median)", "CPU s", "cores busy"]
    if rate and baseline:
        head.append("CPU/img vs baseline")
    head.append("runs (s)")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for g in group:
        cells = [g.name, f"{g.median:.2f}"]
        if rate:
            cells += [f"{g.rate:,.0f}", f"{g.rate / baseline.rate:.2f}x" if baseline else ""]
        cpu = statistics.median(g.cpu)
        # cores busy: CPU seconds over wall seconds, run by run (median); on an idle machine
        # ~1 for one process or one worker, up to 2 with two workers on two cores.
        busy = statistics.median(cc / w for cc, w in zip(g.cpu, g.wall))
        cells += [f"{g.ttfb:.3f}" if g.ttfb is not None else "-", f"{cpu:.1f}", f"{busy:.2f}"]
        if rate and baseline:  # baseline's CPU seconds per image over this one's: > 1 means less work
            base = statistics.median(baseline.cpu) / baseline.samples
            cells.append(f"{base / (cpu / g.samples):.2f}x" if cpu > 0 else "-")
        cells.append(", ".join(f"{w:.2f}" for w in g.wall))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print("\n" + text + "\n", flush=True)
    return text


# -- sections ---------------------------------------------------------------------------


def section_decode(d: Data, repeats: int, out: dict) -> None:
    # The bare loop's input: every sample's JPEG bytes and label, in memory, shuffled.
    held = [(jpg, int(cls)) for jpg, cls in ss_dataset(d.ss_path, decode=None)]
    crop = RandomResizedCropJPEG(SIZE)
    pil = PILRandomResizedCrop(SIZE)
    subset = held[: min(len(held), 256)]

    def bare() -> dict:
        n = 0
        for jpg, cls in held:
            crop(jpg)
            int(cls)
            n += 1
        return {"samples": n}

    def bare_pil() -> dict:
        for jpg, cls in subset:
            pil(pil_decode(jpg))
        return {"samples": len(subset)}

    group = [
        Contender("shardstream StreamingDataset (in-process)", lambda: drain(lambda: ss_dataset(d.ss_path)),
                  expect=d.n),
        Contender("WebDataset + PIL RandomResizedCrop", lambda: drain(lambda: wds_pipeline(d.wds_files)),
                  expect=d.n),
        Contender("bare loop: RandomResizedCropJPEG on bytes in memory", bare, expect=d.n),
        Contender(f"bare loop: PIL decode + crop on bytes in memory ({len(subset)} images)", bare_pil,
                  expect=len(subset), note="diagnostic: the WebDataset side's per-image work without a loader"),
    ]
    group.append(Contender("shardstream StreamingDataset (in-process), prefetch 0",
                           lambda: drain(lambda: ss_dataset(d.ss_path, prefetch=0)), expect=d.n,
                           note="diagnostic: no reader thread (the default local read-ahead is 2 pieces)"))
    if ss_decode.REGION_DECODER:
        group.append(Contender("shardstream StreamingDataset (in-process), whole-image decode",
                               without_region_decoder(lambda: drain(lambda: ss_dataset(d.ss_path))), expect=d.n,
                               note="diagnostic: the region decoder (_jpegregion) switched off"))
    measure("decode", group, repeats)
    ssc, wdsc, barec, pilc = group[:4]
    out["targets"]["decode: prefetch 0 vs the default, per round (informative)"] = _target(
        per_round(group[4], ssc), None, None, "x")
    if len(group) > 5:
        out["targets"]["decode: region decode vs whole-image decode, per round (informative)"] = _target(
            per_round(ssc, group[5]), None, None, "x")
    out["decode"] = {"rows": [g.row() for g in group],
                     "table": table(f"decode, one process, shuffled, {d.n} images, median of {repeats}", group, wdsc)}
    overhead = ssc.median / barec.median - 1
    cpu = {g.name: statistics.median(g.cpu) / g.samples for g in group}  # CPU seconds per image
    cpu_overhead = cpu[ssc.name] / cpu[barec.name] - 1
    wds_overhead = (wdsc.median / d.n) / (pilc.median / len(subset)) - 1
    wds_cpu_overhead = cpu[wdsc.name] / cpu[pilc.name] - 1
    out["targets"]["decode: one process >= 2x WebDataset"] = _target(ssc.rate / wdsc.rate, ">=", 2.0, "x")
    out["targets"]["decode: loader overhead < 10% of the bare loop"] = _target(overhead * 100, "<", 10.0, "%")
    out["targets"]["decode: one process vs WebDataset, median of per-round ratios (informative)"] = _target(
        per_round(ssc, wdsc), None, None, "x")
    out["targets"]["decode: loader overhead, median of per-round ratios (informative)"] = _target(
        (1 / per_round(ssc, barec) - 1) * 100, None, None, "%")
    out["targets"]["decode: loader overhead in CPU time (informative)"] = _target(cpu_overhead * 100, None, None, "%")
    out["decode"].update(overhead_pct=overhead * 100, cpu_overhead_pct=cpu_overhead * 100,
                         wds_loader_overhead_pct=wds_overhead * 100, wds_loader_cpu_overhead_pct=wds_cpu_overhead * 100,
                         cpu_ms_per_image={k: v * 1e3 for k, v in cpu.items()})
    print(f"loader overhead vs bare loop (wall, CPU): shardstream {overhead * 100:+.1f}%, {cpu_overhead * 100:+.1f}%; "
          f"WebDataset {wds_overhead * 100:+.1f}%, {wds_cpu_overhead * 100:+.1f}% (vs its PIL bare loop)\n", flush=True)


def section_shrink(d: Data, repeats: int, out: dict) -> None:
    shrunk_path, plain_path = (os.path.join(d.root, f"shrink-{name}") for name in (f"max{MAX_SIDE}", "plain"))

    def pack(dst: str, **options: Any) -> Callable[[], dict]:
        def run() -> dict:
            c.reset(dst)
            summary = ss.pack(d.images, dst, shard_size=SHARD_SIZE, workers=2, progress=False, **options)
            os.sync()
            return {"samples": summary.samples, "bytes_out": summary.bytes_out}
        return run

    packing = [Contender("pack as is (2 workers)", pack(plain_path), expect=d.n),
               Contender(f"pack --max-side {MAX_SIDE} (2 workers)", pack(shrunk_path, max_side=MAX_SIDE), expect=d.n)]
    measure("shrink", packing, repeats)
    warm_files(path for folder in (plain_path, shrunk_path) for path in c.shard_files(folder, ".tar.zst"))
    decoding = [Contender("decode: shardstream, packed as is", lambda: drain(lambda: ss_dataset(plain_path)),
                          expect=d.n),
                Contender(f"decode: shardstream, packed with --max-side {MAX_SIDE}",
                          lambda: drain(lambda: ss_dataset(shrunk_path)), expect=d.n),
                Contender("decode: WebDataset + PIL, original files", lambda: drain(lambda: wds_pipeline(d.wds_files)),
                          expect=d.n)]
    measure("shrink", decoding, repeats)
    plain, shrunk, wds = decoding
    sizes = {g.name: g.extra[-1]["bytes_out"] for g in packing}
    out["shrink"] = {"max_side": MAX_SIDE, "bytes_out": sizes,
                     "rows": [g.row() for g in packing + decoding],
                     "pack_table": table(f"pack, {d.n} images, median of {repeats}", packing, packing[0]),
                     "decode_table": table(f"decode, one process, shuffled, {d.n} images, median of {repeats}",
                                           decoding, wds)}
    out["targets"][f"shrink: decode rate with --max-side {MAX_SIDE} over as packed, per round (informative)"] = \
        _target(per_round(shrunk, plain), None, None, "x")
    print("bytes out: " + ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in sizes.items()), flush=True)


def section_adopt(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    from shardstream.adopt import index_tars

    indexed = os.path.join(d.root, "wds-indexed")
    c.reset(indexed)
    os.makedirs(indexed)
    for path in d.wds_files:  # the same files: index_tars never writes to a shard
        os.link(path, os.path.join(indexed, os.path.basename(path)))
    t0 = time.perf_counter()
    manifest = index_tars(indexed)
    index_s = time.perf_counter() - t0
    assert manifest.samples == d.n
    pattern = "/shard-{000000..%06d}.tar" % (len(d.wds_files) - 1)
    names = [os.path.basename(p) for p in d.wds_files]
    assert names == ["shard-%06d.tar" % i for i in range(len(names))], names
    raw = dict(decode=None, fields=("__key__", "jpg"), shuffle=True)
    tars = os.path.dirname(d.wds_files[0])

    def http(path: str) -> str:
        return f"{server.url}/{os.path.relpath(path, d.root)}"

    def over(src: str, remote: bool) -> Callable[[], dict]:
        return lambda: _run_remote(lambda: ss.StreamingDataset(src, **raw), server if remote else None, workers=2)

    group = [Contender("raw: WebDataset tars as they are, local", over(tars + pattern, False), expect=d.n),
             Contender("raw: the tars indexed in place, local", over(indexed, False), expect=d.n),
             Contender("raw: WebDataset tars as they are, HTTP 50 ms", over(http(tars) + pattern, True), expect=d.n),
             Contender("raw: the tars indexed in place, HTTP 50 ms", over(http(indexed), True), expect=d.n)]
    measure("adopt", group, repeats)
    local_plain, local_indexed, http_plain, http_indexed = group
    out["adopt"] = {"index_s": index_s, "rows": [g.row() for g in group],
                    "table": table(f"raw samples, 2 DataLoader workers, {d.n} images, median of {repeats}", group,
                                   local_plain)}
    out["targets"]["adopt: indexed over tars as they are, local, per round (informative)"] = _target(
        per_round(local_indexed, local_plain), None, None, "x")
    out["targets"]["adopt: indexed over tars as they are, HTTP, per round (informative)"] = _target(
        per_round(http_indexed, http_plain), None, None, "x")
    print(f"shardstream index of {len(d.wds_files)} tars ({d.n} samples): {index_s:.2f} s", flush=True)


def section_loader(d: Data, repeats: int, out: dict) -> None:
    group: list[Contender] = []
    for n in (0, 1, 2):
        group.append(Contender(f"shardstream, torch DataLoader, {n} workers",
                               lambda n=n: drain(lambda: torch_loader(ss_dataset(d.ss_path, batch_size=BATCH), n)),
                               expect=d.n))
        group.append(Contender(f"WebDataset .batched(64), torch DataLoader, {n} workers",
                               lambda n=n: drain(lambda: torch_loader(wds_pipeline(d.wds_files, batch_size=BATCH), n)),
                               expect=d.n))
    group.append(Contender("shardstream.DataLoader, 2 workers",
                           lambda: drain(lambda: ss.DataLoader(ss_dataset(d.ss_path), batch_size=BATCH, num_workers=2,
                                                               persistent_workers=False)),
                           expect=d.n))
    group.append(Contender("shardstream, torch DataLoader, 0 workers, 2 decode threads",
                           lambda: drain(lambda: torch_loader(ss_dataset(d.ss_path, batch_size=BATCH, decode_threads=2),
                                                              0)),
                           expect=d.n, note="decode_threads=2: two cores in one process"))
    measure("loader", group, repeats)
    by = {g.name: g for g in group}
    s = [by[f"shardstream, torch DataLoader, {n} workers"] for n in (0, 1, 2)]
    w = [by[f"WebDataset .batched(64), torch DataLoader, {n} workers"] for n in (0, 1, 2)]
    wrapper = by["shardstream.DataLoader, 2 workers"]
    text = table(f"DataLoader, batch 64, {d.n} images, median of {repeats}", group, w[2])
    ratios = ["| workers | shardstream img/s | WebDataset img/s | shardstream / WebDataset | shardstream first batch s "
              "| WebDataset first batch s |", "|---|---|---|---|---|---|"]
    for n in (0, 1, 2):
        ratios.append(f"| {n} | {s[n].rate:,.0f} | {w[n].rate:,.0f} | {s[n].rate / w[n].rate:.2f}x | "
                      f"{s[n].ttfb:.3f} | {w[n].ttfb:.3f} |")
    ratios_text = "\n".join(ratios)
    print(ratios_text + "\n")
    overhead = wrapper.median / s[2].median - 1
    print(f"shardstream.DataLoader vs torch DataLoader (2 workers): {overhead * 100:+.1f}% time\n", flush=True)
    out["loader"] = {"rows": [g.row() for g in group], "table": text, "by_workers": ratios_text,
                     "wrapper_overhead_pct": overhead * 100}
    t = out["targets"]
    t["loader: 2 workers >= 1.9x its own 1-worker rate"] = _target(s[2].rate / s[1].rate, ">=", 1.9, "x")
    t["loader: 2 workers >= 2x WebDataset's 2-worker rate"] = _target(s[2].rate / w[2].rate, ">=", 2.0, "x")
    t["loader: 2 workers vs 1 worker, median of per-round ratios (informative)"] = _target(
        per_round(s[2], s[1]), None, None, "x")
    t["loader: 2 workers vs WebDataset's 2, median of per-round ratios (informative)"] = _target(
        per_round(s[2], w[2]), None, None, "x")
    for n in (0, 1, 2):
        t[f"loader: time to first batch no worse than WebDataset ({n} workers)"] = _target(
            s[n].ttfb / w[n].ttfb, "<=", 1.0, "x (shardstream / WebDataset)")
    t["loader: shardstream.DataLoader wrapper overhead (informative)"] = _target(overhead * 100, None, None, "%")
    threaded = by["shardstream, torch DataLoader, 0 workers, 2 decode threads"]
    t["loader: 2 decode threads in one process vs 2 worker processes, per round (informative)"] = _target(
        per_round(threaded, s[2]), None, None, "x")
    t["loader: 2 decode threads in one process vs WebDataset's 2 workers, per round (informative)"] = _target(
        per_round(threaded, w[2]), None, None, "x")


class ServerProcess:
    """`HTTPTestServer` in a process of its own, as remote storage is: serving does not
    then compete for this process's GIL with the loop that receives the batches."""

    def __init__(self, root: str, latency_s: float):
        code = (f"import sys\nfrom shardstream.testing import HTTPTestServer\n"
                f"server = HTTPTestServer({root!r}, latency_s={latency_s!r})\nprint(server.url, flush=True)\n"
                f"for _ in sys.stdin:\n    print(server.faults.requests, flush=True)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.url = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        if not self.url.startswith("http://"):
            raise RuntimeError("the HTTP test server did not start")

    @property
    def requests(self) -> int:
        """Requests answered so far."""
        self.proc.stdin.write("\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)


class Requests:
    """Requests the test server answered during one run."""

    def __init__(self, server: ServerProcess | None):
        self.server = server
        self.start = server.requests if server else 0

    def done(self) -> int:
        return self.server.requests - self.start if self.server else 0


def _run_remote(make_ds: Callable[[], Any], server: ServerProcess | None, workers: int = 1) -> dict:
    counter = Requests(server)
    holder: dict = {}

    def make() -> Any:
        holder["ds"] = make_ds()
        return torch_loader(holder["ds"], workers)

    got = drain(make)
    got["requests"] = counter.done()
    ds = holder["ds"]
    if isinstance(ds, ss.StreamingDataset):
        got["io"] = ds.io_stats()
    return got


def section_remote(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    base = server.url
    raw = dict(decode=None, fields=("__key__", "jpg"))
    group = [
        Contender("raw: shardstream local, default prefetch (2)",
                  lambda: _run_remote(lambda: ss_dataset(d.ss_url(), **raw), None), expect=d.n),
        Contender("raw: shardstream HTTP 50 ms, default prefetch (6)",
                  lambda: _run_remote(lambda: ss_dataset(d.ss_url(base), **raw), server), expect=d.n),
        Contender("raw: shardstream HTTP 50 ms, prefetch 0",
                  lambda: _run_remote(lambda: ss_dataset(d.ss_url(base), prefetch=0, **raw), server), expect=d.n),
        Contender("raw: WebDataset local",
                  lambda: _run_remote(lambda: wds_pipeline(d.wds_urls(), decode=False), None), expect=d.n),
        Contender("raw: WebDataset HTTP 50 ms (curl)",
                  lambda: _run_remote(lambda: wds_pipeline(d.wds_urls(base), decode=False), server), expect=d.n),
        Contender("decode: shardstream local",
                  lambda: _run_remote(lambda: ss_dataset(d.ss_url(), batch_size=BATCH), None), expect=d.n),
        Contender("decode: shardstream HTTP 50 ms",
                  lambda: _run_remote(lambda: ss_dataset(d.ss_url(base), batch_size=BATCH), server), expect=d.n),
    ]
    measure("remote", group, repeats)
    by = {g.name: g for g in group}
    local = by["raw: shardstream local, default prefetch (2)"]
    text = table(f"remote: DataLoader, 1 worker, {d.n} samples, HTTP server with {LATENCY_S * 1000:.0f} ms per "
                 f"request, median of {repeats}", group, local)
    pairs = [("raw: shardstream HTTP 50 ms, default prefetch (6)", "raw: shardstream local, default prefetch (2)"),
             ("raw: shardstream HTTP 50 ms, prefetch 0", "raw: shardstream local, default prefetch (2)"),
             ("raw: WebDataset HTTP 50 ms (curl)", "raw: WebDataset local"),
             ("decode: shardstream HTTP 50 ms", "decode: shardstream local"),
             ("raw: shardstream HTTP 50 ms, default prefetch (6)", "raw: WebDataset HTTP 50 ms (curl)")]
    lines = ["| comparison | ratio of rates | requests per epoch (remote) |", "|---|---|---|"]
    for a, b in pairs:
        reqs = statistics.median(e["requests"] for e in by[a].extra)
        lines.append(f"| {a} / {b} | {by[a].rate / by[b].rate:.2f}x | {reqs:.0f} |")
    ratio_text = "\n".join(lines)
    print(ratio_text + "\n", flush=True)
    out["remote"] = {"rows": [g.row() for g in group], "table": text, "ratios": ratio_text}
    remote = by["raw: shardstream HTTP 50 ms, default prefetch (6)"]
    out["targets"]["remote: raw streaming over HTTP >= 90% of local"] = _target(
        remote.rate / local.rate * 100, ">=", 90.0, "%")
    out["targets"]["remote: raw over HTTP vs local, median of per-round ratios (informative)"] = _target(
        per_round(remote, local) * 100, None, None, "%")
    out["targets"]["remote: raw over HTTP vs local after the first item, per round (informative)"] = _target(
        statistics.median(_steady(remote, i) / _steady(local, i) for i in range(len(local.wall))) * 100,
        None, None, "%")


class LiveWorkersContender(Contender):
    """A contender whose CPU seconds count its live worker processes too: persistent
    workers are not reaped between rounds, so `getrusage(RUSAGE_CHILDREN)` misses them."""

    def __init__(self, *args: Any, skip_pid: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.skip_pid = skip_pid  # the HTTP server's process: not the loader's work

    def once(self, record: bool = True) -> None:
        live0 = self._live()
        super().once(record)
        self.cpu[-1] += self._live() - live0

    def _live(self) -> float:
        import psutil

        total = 0.0
        for child in psutil.Process().children(recursive=True):
            if child.pid != self.skip_pid:
                try:
                    times = child.cpu_times()
                except psutil.Error:
                    continue
                total += times.user + times.system
        return total


class Epochs:
    """One persistent-worker DataLoader whose every call runs one more whole epoch."""

    def __init__(self, make_ds: Callable[[], Any], workers: int, *, wrapper: bool = False):
        self.ds = make_ds()
        if wrapper:
            self.loader = ss.DataLoader(self.ds, batch_size=BATCH, num_workers=workers, persistent_workers=True)
        else:
            self.loader = torch.utils.data.DataLoader(self.ds, batch_size=None, num_workers=workers,
                                                      persistent_workers=workers > 0)
        self.epoch = 0
        self()  # the untimed epoch that starts the workers

    def __call__(self) -> dict:
        if hasattr(self.ds, "set_epoch"):
            self.ds.set_epoch(self.epoch)
        self.epoch += 1
        return drain(lambda: self.loader)


SS_1, SS_2 = "shardstream, torch DataLoader, 1 worker", "shardstream, torch DataLoader, 2 workers"
SS_1_P0, SS_2_P0 = SS_1 + ", prefetch 0", SS_2 + ", prefetch 0"
WDS_2 = "WebDataset .batched(64), torch DataLoader, 2 workers"


def _steady_makers(d: Data, server: ServerProcess) -> dict[str, Callable[[], Epochs]]:
    """The steady section's contenders, each a persistent-worker loader made on call."""
    raw = dict(decode=None, fields=("__key__", "jpg"))
    return {
        SS_1: lambda: Epochs(lambda: ss_dataset(d.ss_path, batch_size=BATCH), 1),
        SS_2: lambda: Epochs(lambda: ss_dataset(d.ss_path, batch_size=BATCH), 2),
        SS_1_P0: lambda: Epochs(lambda: ss_dataset(d.ss_path, batch_size=BATCH, prefetch=0), 1),
        SS_2_P0: lambda: Epochs(lambda: ss_dataset(d.ss_path, batch_size=BATCH, prefetch=0), 2),
        "shardstream.DataLoader, 2 workers": lambda: Epochs(lambda: ss_dataset(d.ss_path), 2, wrapper=True),
        "shardstream, torch DataLoader, 2 workers, torch's collate": lambda: Epochs(
            lambda: ss_dataset(d.ss_path, batch_size=BATCH, collate_fn=torch.utils.data.default_collate), 2),
        "WebDataset .batched(64), torch DataLoader, 1 worker": lambda: Epochs(
            lambda: wds_pipeline(d.wds_files, batch_size=BATCH), 1),
        WDS_2: lambda: Epochs(lambda: wds_pipeline(d.wds_files, batch_size=BATCH), 2),
        "raw: shardstream local, 1 worker": lambda: Epochs(lambda: ss_dataset(d.ss_url(), **raw), 1),
        "raw: shardstream HTTP 50 ms, 1 worker": lambda: Epochs(lambda: ss_dataset(d.ss_url(server.url), **raw), 1),
    }


def _run_steady(section: str, makers: dict[str, Callable[[], Epochs]], d: Data, repeats: int,
                server: ServerProcess) -> dict[str, Contender]:
    """Start each contender's workers (one untimed epoch), then time `repeats` rounds."""
    group: list[Contender] = []
    for name, make in makers.items():
        print(f"  [{section}] starting {name} (one untimed epoch)", flush=True)
        group.append(LiveWorkersContender(name, make(), expect=d.n, skip_pid=server.proc.pid))
    try:
        measure(section, group, repeats)
    finally:
        for g in group:
            g.run_fn.loader = None  # the workers go now, not at exit
    return {g.name: g for g in group}


def _raw_targets(section: str, by: dict[str, Contender], t: dict) -> None:
    local, remote = by["raw: shardstream local, 1 worker"], by["raw: shardstream HTTP 50 ms, 1 worker"]
    t[f"{section}: raw streaming over HTTP >= 90% of local"] = _target(remote.rate / local.rate * 100, ">=", 90.0, "%")
    t[f"{section}: raw over HTTP vs local, median of per-round ratios (informative)"] = _target(
        per_round(remote, local) * 100, None, None, "%")


def section_steady(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    by = _run_steady("steady", _steady_makers(d, server), d, repeats, server)
    group = list(by.values())
    out["steady"] = {"rows": [g.row() for g in group],
                     "table": table(f"steady: persistent workers, one whole epoch per round after an untimed one, "
                                    f"{d.n} images, median of {repeats}", group, by[WDS_2])}
    t = out["targets"]
    _decode_targets("steady", by, t)
    fresh = by["shardstream, torch DataLoader, 2 workers, torch's collate"]
    t["steady: 2 workers, batch memory reused vs torch's collate, median of per-round ratios (informative)"] = \
        _target(per_round(by[SS_2], fresh), None, None, "x")
    _raw_targets("steady", by, t)


def section_steadydecode(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    """The steady section's decode contenders that issue #3's targets compare, alone, so
    that many rounds fit: shardstream with 1 and 2 workers (and both at prefetch 0: is the
    reader thread worth its place?), WebDataset with 2."""
    chosen = (SS_1, SS_2, WDS_2, SS_1_P0, SS_2_P0)
    makers = {name: make for name, make in _steady_makers(d, server).items() if name in chosen}
    by = _run_steady("steadydecode", makers, d, repeats, server)
    group = list(by.values())
    out["steadydecode"] = {"rows": [g.row() for g in group],
                           "table": table(f"steadydecode: persistent workers, {d.n} images, median of {repeats}",
                                          group, by[WDS_2])}
    _decode_targets("steadydecode", by, out["targets"])


def _decode_targets(section: str, by: dict[str, Contender], t: dict) -> None:
    s1, s2, w2 = by[SS_1], by[SS_2], by[WDS_2]
    t[f"{section}: 2 workers >= 1.9x its own 1-worker rate"] = _target(s2.rate / s1.rate, ">=", 1.9, "x")
    t[f"{section}: 2 workers vs 1 worker, median of per-round ratios (informative)"] = _target(
        per_round(s2, s1), None, None, "x")
    t[f"{section}: 2 workers >= 2x WebDataset's 2-worker rate"] = _target(s2.rate / w2.rate, ">=", 2.0, "x")
    t[f"{section}: 2 workers vs WebDataset's 2, median of per-round ratios (informative)"] = _target(
        per_round(s2, w2), None, None, "x")
    if SS_2_P0 in by:
        for n, default, none in ((1, s1, by[SS_1_P0]), (2, s2, by[SS_2_P0])):
            t[f"{section}: {n} worker(s), prefetch 0 vs the default, per round (informative)"] = _target(
                per_round(none, default), None, None, "x")


def section_steadyraw(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    """The steady section's raw pair alone (issue #4's target), so that many rounds fit."""
    makers = {name: make for name, make in _steady_makers(d, server).items() if name.startswith("raw: ")}
    by = _run_steady("steadyraw", makers, d, repeats, server)
    group = list(by.values())
    out["steadyraw"] = {"rows": [g.row() for g in group],
                        "table": table(f"steadyraw: raw samples, persistent 1-worker loaders, {d.n} images, "
                                       f"median of {repeats}", group, by["raw: shardstream local, 1 worker"])}
    _raw_targets("steadyraw", by, out["targets"])


def section_epochstart(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    """The wait at the start of each epoch of a persistent worker over HTTP (50 ms a request),
    with the head start on the next epoch (headstart.py) and without it: raw samples through
    one worker, without a cache and with a cache a third of the dataset's size. A loader's
    worker is forked when it is made (the untimed epoch), so the loaders made while
    `HeadStart.begin` is patched to do nothing keep that in their workers for good; the
    others run the library as it is. The first timed round is each worker's second epoch,
    when no head start has been read yet: the table's first-item column counts the later
    rounds only."""
    import shardstream.headstart as headstart

    raw = dict(decode=None, fields=("__key__", "jpg"))
    shard_bytes = max(os.path.getsize(os.path.join(d.ss_path, f)) for f in os.listdir(d.ss_path) if f.endswith(".zst"))
    total = sum(os.path.getsize(os.path.join(d.ss_path, f)) for f in os.listdir(d.ss_path))
    limit = max(total // 3, 2 * shard_bytes + (1 << 20))
    caches = tempfile.mkdtemp(prefix="shardstream-epochstart-")

    def remote(cache: str | None) -> Callable[[], Any]:
        options = dict(cache_dir=os.path.join(caches, cache), cache_limit=limit) if cache else {}
        return lambda: ss.StreamingDataset(d.ss_url(server.url), shuffle=True, shuffle_buffer=SHUFFLE_BUFFER,
                                           **raw, **options)

    original = headstart.HeadStart.begin
    group: list[Contender] = []
    try:
        for on in (False, True):
            headstart.HeadStart.begin = original if on else (lambda self, *args, **kwargs: None)  # type: ignore
            for cache in (None, "on" if on else "off"):
                name = f"HTTP 50 ms, {'cache 1/3 of the data' if cache else 'no cache'}, head start {'on' if on else 'off'}"
                print(f"  [epochstart] starting {name} (one untimed epoch)", flush=True)
                group.append(LiveWorkersContender(name, Epochs(remote(cache), 1), expect=d.n, skip_pid=server.proc.pid))
    finally:
        headstart.HeadStart.begin = original  # type: ignore[method-assign]
    try:
        measure("epochstart", group, repeats)
    finally:
        for g in group:
            g.run_fn.loader = None  # the workers go now, not at exit
        shutil.rmtree(caches, ignore_errors=True)
    lines = ["| contender | median epoch s | first item, rounds 2 on (median) | first item, rounds 2 on (range) |",
             "|---|---|---|---|"]
    for g in group:
        later = g.first[1:] or g.first
        lines.append(f"| {g.name} | {g.median:.2f} | {statistics.median(later):.3f} s | "
                     f"{min(later):.3f}-{max(later):.3f} s |")
    text = f"**epochstart: persistent 1-worker loaders, raw samples, {d.n} images, cache limit {limit / 1e6:.0f} MB, " \
           f"{repeats} rounds**\n\n" + "\n".join(lines)
    print("\n" + text + "\n", flush=True)
    out["epochstart"] = {"rows": [g.row() for g in group], "table": text, "cache_limit": limit}


def section_readahead(d: Data, repeats: int, out: dict) -> None:
    """Raw samples in this process, the read-ahead window growing (the default) or fixed at
    its start, over HTTP 50 ms and 150 ms away; local shards for scale."""
    from shardstream import readahead

    servers = {latency: ServerProcess(d.root, latency) for latency in (LATENCY_S, 0.15)}
    raw = dict(decode=None, fields=("__key__", "jpg"))

    def epochs(url: str, growth: int) -> Callable[[], dict]:
        dataset, epoch = ss_dataset(url, **raw), iter(range(1 << 30))

        def run() -> dict:
            dataset.set_epoch(next(epoch))
            saved, readahead.GROWTH = readahead.GROWTH, growth
            try:
                return drain(lambda: dataset)
            finally:
                readahead.GROWTH = saved
        return run

    group = [Contender("raw in-process: local", epochs(d.ss_url(), readahead.GROWTH), expect=d.n)]
    for latency, server in servers.items():
        for growth, how in ((1, "window fixed"), (readahead.GROWTH, "window growing (default)")):
            group.append(Contender(f"raw in-process: HTTP {latency * 1000:.0f} ms, {how}",
                                   epochs(d.ss_url(server.url), growth), expect=d.n))
    try:
        measure("readahead", group, repeats)
    finally:
        for server in servers.values():
            server.close()
    text = table(f"readahead: raw samples in one process, {d.n} images, median of {repeats}", group, group[0])
    out["readahead"] = {"rows": [g.row() for g in group], "table": text}
    for k in (1, 3):
        fixed, growing = group[k], group[k + 1]
        out["targets"][f"readahead: {growing.name} vs fixed, per round (informative)"] = _target(
            per_round(growing, fixed), None, None, "x")


def _steady(con: Contender, i: int) -> float:
    """Run i's rate after its first item: an epoch of a few seconds, less the start that a long one hides."""
    return (con.samples - 1) / (con.wall[i] - con.first[i])


def _resume_reference(src: str) -> tuple[dict, Any, int, int]:
    """Run the epoch (shardstream.DataLoader, 1 worker, batch 64) to 90%: the state, and the next batch."""
    loader = ss.DataLoader(ss_dataset(src), batch_size=BATCH, num_workers=1, persistent_workers=False)
    total = len(loader)
    k = int(round(RESUME_AT * total))
    state, reference = None, None
    for i, batch in enumerate(loader):
        if i == k - 1:
            state = loader.state_dict()
        if i == k:
            reference = batch
            break
    assert state is not None and reference is not None and state["current"]["delivered"] == k, state
    return state, reference, k, total


def _first_batch(src: str, state: dict | None, reference: Any, server: ServerProcess | None) -> dict:
    counter = Requests(server)
    t0 = time.perf_counter()
    loader = ss.DataLoader(ss_dataset(src), batch_size=BATCH, num_workers=1, persistent_workers=False)
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    batch = next(batches)
    first = time.perf_counter() - t0
    requests = counter.done()
    batches.close()  # stops the worker
    exact = None
    if reference is not None:
        exact = bool(torch.equal(batch[0], reference[0]) and torch.equal(batch[1], reference[1]))
        assert exact, "the resumed first batch differs from the uninterrupted epoch's batch"
    return {"samples": int(batch[0].shape[0]), "first_s": first, "requests_to_first_batch": requests, "exact": exact}


def section_resume(d: Data, repeats: int, out: dict, server: ServerProcess) -> None:
    t0 = time.perf_counter()
    state, reference, k, total = _resume_reference(d.ss_path)
    print(f"  [resume] state taken after {k} of {total} batches (untimed, {time.perf_counter() - t0:.1f} s): "
          f"{len(json.dumps(state))} bytes of JSON", flush=True)
    local, remote = d.ss_url(), d.ss_url(server.url)
    group = [
        Contender("local: epoch start", lambda: _first_batch(local, None, None, None)),
        Contender(f"local: resumed at {k}/{total} batches", lambda: _first_batch(local, state, reference, None)),
        Contender("HTTP 50 ms: epoch start", lambda: _first_batch(remote, None, None, server)),
        Contender(f"HTTP 50 ms: resumed at {k}/{total} batches",
                  lambda: _first_batch(remote, state, reference, server)),
    ]
    measure("resume", group, repeats)
    text = table(f"resume: time to first batch, shardstream.DataLoader, 1 worker, batch 64, {d.n} images, "
                 f"median of {repeats}", group, None, rate=False)
    lines = ["| where | epoch start s | resumed s | resumed / start | requests to first batch (start, resumed) |",
             "|---|---|---|---|---|"]
    for where, (a, b) in (("local", group[:2]), ("HTTP 50 ms", group[2:])):
        reqs = "-"
        if where != "local":
            reqs = ", ".join(f"{statistics.median(e['requests_to_first_batch'] for e in g.extra):.0f}" for g in (a, b))
        lines.append(f"| {where} | {a.ttfb:.3f} | {b.ttfb:.3f} | {b.ttfb / a.ttfb:.2f}x | {reqs} |")
        out["targets"][f"resume: TTFB at 90% within 1.5x of epoch start ({where})"] = _target(
            b.ttfb / a.ttfb, "<=", 1.5, "x")
    ratio_text = "\n".join(lines)
    print(ratio_text + "\n", flush=True)
    out["resume"] = {"rows": [g.row() for g in group], "table": text, "ratios": ratio_text, "state": state,
                     "resumed_at_batch": k, "batches": total, "bit_exact": True}


def per_round(a: Contender, b: Contender) -> float:
    """Median over rounds of a's rate over b's rate, each round's pair measured minutes apart at
    most: steadier than the ratio of the medians when the machine drifts during a run."""
    return statistics.median((a.samples / wa) / (b.samples / wb) for wa, wb in zip(a.wall, b.wall))


def _target(value: float, op: str | None, want: float | None, unit: str) -> dict:
    met = None
    if op == ">=":
        met = value >= want
    elif op == "<=":
        met = value <= want
    elif op == "<":
        met = value < want
    return {"value": value, "op": op, "want": want, "unit": unit, "met": met}


# -- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global SHUFFLE_BUFFER, MAX_SIDE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="images in the synthetic folder (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per contender (median reported)")
    p.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                   help="comma-separated sections: " + ", ".join(SECTIONS) + " (default: " + ", ".join(DEFAULT_SECTIONS)
                   + ")")
    p.add_argument("--data", default="~/.cache/shardstream-bench", help="cache folder for images and shards")
    p.add_argument("--out", default=None, help="JSON results file (default: <data>/loader-results-<images>.json)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads in this process")
    p.add_argument("--shuffle-buffer", type=int, default=SHUFFLE_BUFFER, help="shardstream's shuffle buffer")
    p.add_argument("--max-side", type=int, default=MAX_SIDE, help="the shrink section's pack --max-side")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if not sections or not set(sections) <= set(SECTIONS):
        p.error(f"--only takes some of {', '.join(SECTIONS)}")
    if args.repeats < 3:
        print("note: fewer than 3 repeats; medians of so few runs are fragile", file=sys.stderr)
    if args.images % 10:
        p.error("--images must be a multiple of 10 (the folder has 10 classes of equal size)")
    if args.images < 600:  # checked again once packed (ensure_data): the shards' count depends on the images' sizes
        p.error("need --images 600 or more: WebDataset's 2 DataLoader workers need 2 shards of 32 MB")
    torch.set_num_threads(args.torch_threads)
    SHUFFLE_BUFFER = args.shuffle_buffer
    MAX_SIDE = args.max_side

    start = time.perf_counter()
    data_dir = os.path.expanduser(args.data)
    os.makedirs(data_dir, exist_ok=True)
    info = pack_bench.machine()
    info["torch_threads"] = torch.get_num_threads()
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, torch {info['versions']['torch']}, "
          f"webdataset {info['versions']['webdataset']}, shardstream {info['versions']['shardstream']} "
          f"({info['git_commit']}), load average {os.getloadavg()[0]:.1f}")
    d = ensure_data(data_dir, args.images)
    print(f"images: {d.n} files, {d.stats['bytes'] / 1e6:,.1f} MB, mean {d.stats['mean_bytes'] / 1e3:.1f} KB; "
          f"shardstream {d.ss_shards} shards, WebDataset {len(d.wds_files)} shards ({d.root})")
    # Every run reads warm files: the shards are read once here, untimed.
    warm_files(sorted(os.path.join(d.ss_path, f) for f in os.listdir(d.ss_path)) + d.wds_files)
    results: dict = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "machine": info,
        "dataset": {**d.stats, "ss_shards": d.ss_shards, "wds_shards": len(d.wds_files), "root": d.root},
        "repeats": args.repeats,
        "shuffle_buffer": SHUFFLE_BUFFER,
        "targets": {},
        "load_average": {},
    }
    served = {"remote", "resume", "adopt", "steady", "steadyraw", "steadydecode", "epochstart"}
    server = ServerProcess(d.root, LATENCY_S) if served & set(sections) else None
    try:
        for name in sections:
            print(f"\n== {name} (load average {os.getloadavg()[0]:.1f})", flush=True)
            t0 = time.perf_counter()
            la0 = os.getloadavg()[0]
            if name == "decode":
                section_decode(d, args.repeats, results)
            elif name == "loader":
                section_loader(d, args.repeats, results)
            elif name == "remote":
                section_remote(d, args.repeats, results, server)
            elif name == "resume":
                section_resume(d, args.repeats, results, server)
            elif name == "shrink":
                section_shrink(d, args.repeats, results)
            elif name == "adopt":
                section_adopt(d, args.repeats, results, server)
            elif name == "steady":
                section_steady(d, args.repeats, results, server)
            elif name == "steadyraw":
                section_steadyraw(d, args.repeats, results, server)
            elif name == "steadydecode":
                section_steadydecode(d, args.repeats, results, server)
            elif name == "epochstart":
                section_epochstart(d, args.repeats, results, server)
            elif name == "readahead":
                section_readahead(d, args.repeats, results)
            results["load_average"][name] = {"start": la0, "end": os.getloadavg()[0],
                                             "section_s": time.perf_counter() - t0}
    finally:
        if server is not None:
            server.close()

    print("targets:")
    for label, t in results["targets"].items():
        verdict = "informative" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        want = f" (want {t['op']} {t['want']:g})" if t["op"] else ""
        print(f"  {label}: {t['value']:.2f} {t['unit']}{want} -> {verdict}")
    results["total_s"] = time.perf_counter() - start
    out = pack_bench.write_results(args.out or os.path.join(data_dir, f"loader-results-{d.n}.json"), results)
    print(f"\nwrote {out} ({results['total_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
