#!/usr/bin/env python
"""One-shot check of shardstream's host-to-device path on a CUDA machine (about 1-3 minutes).

    python tools/gpu_check.py [--images 160] [--batch-size 64] [--image-size 224] [--workers 4]
                              [--compute-ms 20] [--cpu] [--keep DIR]

It makes a small synthetic ImageNet-like dataset in a temporary folder
(`shardstream.synthetic.make_image_folder` + `shardstream.pack`), then:

(a) correctness: batches from ``shardstream.DataLoader(device="cuda")`` equal the CPU
    loader's batches (same dataset, seed and workers): uint8 images bit for bit, labels
    and keys, and after ``Normalize`` within 1e-6; the consumer runs a GPU kernel before
    reading each batch so the side-stream copies really run ahead, and the device batches
    are also kept to the end and compared then, so that a worker's reused batch memory
    (shardstream/batchmemory.py), released here by torch's pinning thread, would show if
    it were written again too early. The CPU side is checked too: ``device="cpu"`` equals the plain loader, ``Normalize`` matches the
    formula, every sample arrives exactly once, and decoding on the device side
    (``DecodeOnDevice("cpu")``) gives the workers' batches bit for bit;
(b) host-to-device bandwidth of a large pinned and a large pageable tensor (GB/s,
    timed with CUDA events);
(c) the loader's own H2D throughput: bytes/s of batches delivered on the GPU by a
    ``DataLoader(device="cuda")`` over a source that yields pre-made uint8 batches
    (so neither decoding nor reading limits it), as a fraction of pinned bandwidth;
(d) overlap: a matmul loop sized to ``--compute-ms`` per step consumes loader batches;
    the step time, data wait per step (``loader.stats.wait_s / steps``) and
    ``wait_fraction`` (near 0 when compute outlasts the data path), then the same with
    a ten times shorter step, where the data path shows;
(e) JPEG decode images/s: ``torchvision.io.decode_jpeg(device="cuda")`` (batched) against
    PIL and the fused crop on one CPU core; then the whole loader with the decode on the
    GPU (``DeferDecode`` in the workers, ``DecodeOnDevice("cuda")``) against decoding in
    the workers: images/s, and the pixel difference; "skipped" without torchvision.

Prints one table (check | value | ok). Exit status 1 if a correctness check fails, else
0; performance rows are marked "low" when under expectations but do not fail. Without
CUDA (or with --cpu) it says the GPU checks were skipped, runs the CPU-side checks and
exits 0.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

import shardstream
from shardstream import DataLoader, DecodeOnDevice, DeferDecode, Normalize, RandomResizedCropJPEG, StreamingDataset
from shardstream.device_jpeg import gpu_decoder_available
from shardstream.cli import _positive_int  # the command line's own check: a count of at least 1
from shardstream.synthetic import make_image_folder

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
NORMALIZE_TOL = 1e-6


# -- the table -----------------------------------------------------------------------------


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.failed = False

    def add(self, check: str, value: str, ok: str = "-") -> None:
        """ok: "ok", "FAIL" (a correctness failure), "low" (performance under expectations), "-", "skipped"."""
        if ok == "FAIL":
            self.failed = True
        self.rows.append((check, value, ok))
        print(f"  {check}: {value} [{ok}]", flush=True)

    def verdict(self, check: str, passed: bool, value: str) -> None:
        self.add(check, value, "ok" if passed else "FAIL")

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run one section; an exception becomes a FAIL row and the other sections still run."""
        print(f"{name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - report and carry on
            traceback.print_exc()
            self.add(name, f"ERROR {type(e).__name__}: {e}"[:200], "FAIL")
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)

    def table(self) -> str:
        head = ("check", "value", "ok")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(3)]
        line = "-+-".join("-" * w for w in widths)
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*head), line, *(fmt.format(*r) for r in self.rows)])


# -- data ------------------------------------------------------------------------------------


def make_dataset(root: Path, images: int, workers: int) -> tuple[str, list[Path]]:
    src, dst = root / "images", root / "shards"
    classes = 4
    per_class = [images // classes + (1 if c < images % classes else 0) for c in range(classes)]
    files = make_image_folder(src, num_classes=classes, images_per_class=per_class, seed=0, workers=workers)
    shardstream.pack(str(src), str(dst), shard_size="2MB", workers=workers, progress=False, overwrite=True)
    return str(dst), files


def streaming(data: str, image_size: int, defer: bool = False) -> StreamingDataset:
    """The training pipeline; `defer=True` ships the JPEG bytes for `DecodeOnDevice` to decode."""
    crop = RandomResizedCropJPEG(image_size)
    return StreamingDataset(data, shuffle=True, seed=0, decode=DeferDecode(crop) if defer else crop,
                            fields=("jpg", "cls", "__key__"))


class PremadeBatches(StreamingDataset):
    """An in-memory source: `batches` copies of one pre-made uint8 batch, split over the workers.

    It yields as fast as the worker-to-main-process handover allows, so a loader over it
    measures the rest of the path: pinning and the copy to the device.
    """

    def __init__(self, batches: int, batch_size: int, image_size: int) -> None:
        super().__init__("memory://premade", decode=None)  # never resolved: __iter__ and __len__ are ours
        self.batches = batches
        self.images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8)
        self.labels = torch.randint(0, 1000, (batch_size,), dtype=torch.int64)

    def __len__(self) -> int:
        return self.batches

    def counts(self) -> np.ndarray:
        # shardstream.DataLoader counts before starting workers; there is no manifest to read.
        return np.array([self.batches])

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for _ in range(worker, self.batches, workers):
            yield self.images, self.labels

    @property
    def batch_bytes(self) -> int:
        return self.images.nbytes + self.labels.nbytes


def reference_normalize(images: torch.Tensor) -> torch.Tensor:
    """(x / 255 - mean) / std in float64: the formula, computed independently of Normalize."""
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, -1, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, -1, 1, 1)
    return (images.double() / 255 - mean) / std


# -- (a) correctness -------------------------------------------------------------------------------


def check_cpu_side(report: Report, data: str, keys: list[str], args: argparse.Namespace) -> list[Any]:
    """device="cpu" against the plain loader; Normalize against the formula; exactly once. Returns the plain batches."""
    plain = list(DataLoader(streaming(data, args.image_size), batch_size=args.batch_size, num_workers=args.workers))
    on_cpu = list(DataLoader(streaming(data, args.image_size), batch_size=args.batch_size, num_workers=args.workers,
                             device="cpu"))
    same = len(plain) == len(on_cpu) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(plain, on_cpu))
    report.verdict("(a) cpu: device='cpu' batches == plain batches (uint8)", same, f"{len(plain)} batches")

    seen = [k for batch in plain for k in batch[2]]
    report.verdict("(a) cpu: every sample exactly once", sorted(seen) == sorted(keys),
                   f"{len(seen)} samples, {len(set(seen))} distinct of {len(keys)}")

    normalized = list(DataLoader(streaming(data, args.image_size), batch_size=args.batch_size,
                                 num_workers=args.workers, device="cpu", transform_on_device=Normalize(field=0)))
    err = max(float((n[0].double() - reference_normalize(p[0])).abs().max()) for n, p in zip(normalized, plain))
    dtype_ok = all(n[0].dtype == torch.float32 for n in normalized)
    report.verdict("(a) cpu: Normalize(device='cpu') vs (x/255-mean)/std", err <= NORMALIZE_TOL and dtype_ok,
                   f"max |diff| {err:.2e} (tol {NORMALIZE_TOL:g})")

    deferred = list(DataLoader(streaming(data, args.image_size, defer=True), batch_size=args.batch_size,
                               num_workers=args.workers, device="cpu", transform_on_device=DecodeOnDevice("cpu")))
    same = len(deferred) == len(plain) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(deferred, plain))
    report.verdict("(a) cpu: decode on the device side (DecodeOnDevice('cpu')) == decode in workers", same,
                   f"{len(deferred)} batches")
    return plain


def busy(a: torch.Tensor, n: int) -> torch.Tensor:
    """Queue `n` matmuls on the current stream (a kernel of known duration, see calibrate)."""
    out = torch.empty_like(a)
    for _ in range(n):
        torch.mm(a, a, out=out)
    return out


def check_gpu_side(report: Report, data: str, plain: list[Any], args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    a = torch.randn(1024, 1024, device=device) / 32
    normalize_cpu = Normalize(field=0)

    def compare(transform: Normalize | None, hold: bool) -> tuple[bool, float, int]:
        """Iterate a cuda loader, the consumer stream busy at every step. With `hold`, keep every
        device batch and compare only at the end (a buffer reused too early would show); else
        compare each batch as it comes."""
        loader = DataLoader(streaming(data, args.image_size), batch_size=args.batch_size, num_workers=args.workers,
                            device=device, transform_on_device=transform)
        ok, err, held = True, 0.0, []

        def check(i: int, images: torch.Tensor, labels: torch.Tensor, keys: list[str]) -> None:
            nonlocal ok, err
            ref_images, ref_labels, ref_keys = plain[i]
            ok &= images.device.type == "cuda" and labels.device.type == "cuda" and keys == ref_keys
            ok &= torch.equal(labels.cpu(), ref_labels)
            if transform is None:
                ok &= images.dtype == torch.uint8 and torch.equal(images.cpu(), ref_images)
            else:
                err = max(err, float((images.cpu() - normalize_cpu(ref_images)).abs().max()))
                err = max(err, float((images.cpu().double() - reference_normalize(ref_images)).abs().max()))

        n = 0
        arrived = []  # sums taken on the consumer stream the moment a batch arrives
        for i, (images, labels, keys) in enumerate(loader):
            # Read at once, before any other work: a batch handed over without the consumer
            # stream waiting for its copy (a missing event wait) would be read half-copied.
            arrived.append(images.reshape(len(images), -1).to(torch.int64).sum(1) if transform is None else None)
            busy(a, 20)  # the consumer stream is busy while the copy stream runs ahead
            if hold:
                held.append((images, labels, keys))
            else:
                check(i, images, labels, keys)
            n += 1
        torch.cuda.synchronize()
        for i, batch in enumerate(held):
            check(i, *batch)
        for i, sums in enumerate(arrived):
            if sums is not None:
                ok &= torch.equal(sums.cpu(), plain[i][0].reshape(len(plain[i][0]), -1).to(torch.int64).sum(1))
        return ok and n == len(plain) and loader.stats.batches == n, err, n

    def dropped_at_once() -> tuple[bool, int]:
        """Each batch read late (behind queued work) on the consumer stream and dropped at once,
        unsynchronised: its memory is freed to the allocator while the read is still queued,
        and would be the next copy's (and read half overwritten) but for `record_stream`."""
        loader = DataLoader(streaming(data, args.image_size), batch_size=args.batch_size, num_workers=args.workers,
                            device=device, prefetch_to_device=1)
        sums = []
        for images, _, _ in loader:
            busy(a, 20)  # queued first: the read below runs late
            sums.append(images.reshape(len(images), -1).to(torch.int64).sum(1))
            del images
        torch.cuda.synchronize()
        expected = [ref[0].reshape(len(ref[0]), -1).to(torch.int64).sum(1) for ref in plain]
        ok = len(sums) == len(plain) and all(torch.equal(got.cpu(), want) for got, want in zip(sums, expected))
        return ok, len(sums)

    ok, _, n = compare(None, hold=True)
    report.verdict("(a) cuda: device batches == cpu batches (uint8, labels, keys; also read on arrival)", ok,
                   f"{n} of {len(plain)} batches")
    ok, n = dropped_at_once()
    report.verdict("(a) cuda: batches read late and dropped unsynchronised stay whole (record_stream)", ok,
                   f"{n} of {len(plain)} batches")
    ok, err, n = compare(Normalize(field=0), hold=False)
    report.verdict("(a) cuda: Normalize on device vs cpu", ok and err <= NORMALIZE_TOL,
                   f"max |diff| {err:.2e} (tol {NORMALIZE_TOL:g}), {n} batches")


# -- (b) bandwidth ------------------------------------------------------------------------------------


def h2d_bandwidth(nbytes: int, pinned: bool, reps: int = 5) -> float:
    """GB/s (1e9 bytes/s) of host-to-device copies of one `nbytes` tensor, timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)  # touch every page first
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=pinned)
    end.record()
    end.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


# -- (c) loader H2D throughput ----------------------------------------------------------------------------


def loader_throughput(batches: int, batch_size: int, image_size: int, workers: int,
                      device: str = "cuda") -> tuple[float, int]:
    """GB/s of batches delivered on `device` (second, warm epoch of persistent workers) and batches counted."""
    source = PremadeBatches(batches, batch_size, image_size)
    loader = DataLoader(source, num_workers=workers, device=device, prefetch_factor=4)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in loader:  # warm-up epoch: starts the workers, fills the pinned-memory cache
        pass
    sync()
    t0 = time.perf_counter()
    n = 0
    for images, labels in loader:
        n += 1
    sync()
    elapsed = time.perf_counter() - t0
    return n * source.batch_bytes / elapsed / 1e9, n


# -- (d) overlap ------------------------------------------------------------------------------------------------


def calibrate(a: torch.Tensor, target_ms: float) -> tuple[int, float]:
    """Matmuls per step so that one step takes about `target_ms`; returns (count, measured ms)."""
    busy(a, 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    busy(a, 20)
    end.record()
    end.synchronize()
    per = start.elapsed_time(end) / 20
    n = max(1, round(target_ms / per))
    start.record()
    busy(a, n)
    end.record()
    end.synchronize()
    return n, start.elapsed_time(end)


def overlap(steps: int, batch_size: int, image_size: int, workers: int, compute_ms: float) -> dict[str, float]:
    a = torch.randn(2048, 2048, device="cuda") / 45
    n, kernel_ms = calibrate(a, compute_ms)
    source = PremadeBatches(steps, batch_size, image_size)
    loader = DataLoader(source, num_workers=workers, device="cuda", transform_on_device=Normalize(field=0))

    def epoch() -> float:
        t0 = time.perf_counter()
        for images, labels in loader:
            out = busy(a, n)
            out[0, 0] += images.mean() + labels[0]  # the step uses its batch
            torch.cuda.current_stream().synchronize()  # as a loop that reads its loss every step
        return time.perf_counter() - t0

    epoch()  # warm-up: workers started, caches filled
    wall = epoch()
    s = loader.stats
    return {"kernel_ms": kernel_ms, "step_ms": 1e3 * wall / max(s.batches, 1),
            "wait_ms": 1e3 * s.wait_s / max(s.batches, 1), "wait_fraction": s.wait_fraction, "steps": s.batches}


# -- (e) JPEG decode ------------------------------------------------------------------------------------------


def rate_of(fn: Callable[[bytes], Any], blobs: list[bytes], min_s: float = 1.0) -> float:
    """Images per second of `fn` over `blobs`, repeated for at least `min_s` seconds (one core)."""
    n, t0 = 0, time.perf_counter()
    while True:
        for b in blobs:
            fn(b)
        n += len(blobs)
        if time.perf_counter() - t0 >= min_s:
            return n / (time.perf_counter() - t0)


def cpu_decode(report: Report, blobs: list[bytes], min_s: float = 1.0) -> None:
    """Report the CPU decode rates the GPU decoder is to beat: Pillow alone, and the fused crop."""
    pil = rate_of(lambda b: np.asarray(Image.open(io.BytesIO(b)).convert("RGB")), blobs, min_s)
    report.add("(e) CPU JPEG decode (PIL, 1 core)", f"{pil:,.0f} images/s")
    crop = RandomResizedCropJPEG(224)
    fused = rate_of(crop, blobs, min_s)
    report.add("(e) CPU RandomResizedCropJPEG(224) (1 core)", f"{fused:,.0f} images/s")


def gpu_decode(report: Report, blobs: list[bytes]) -> None:
    if not gpu_decoder_available("cuda"):  # tries a tiny JPEG: torchvision may import without nvJPEG
        report.add("(e) GPU JPEG decode (torchvision.io.decode_jpeg)",
                   "skipped: torchvision's GPU decoder not available here", "skipped")
        return
    import torchvision
    from torchvision.io import decode_jpeg

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

    def decode_all() -> list[torch.Tensor]:
        try:
            return list(decode_jpeg(data, device="cuda"))  # batched (torchvision >= 0.19)
        except (TypeError, RuntimeError, ValueError):  # older torchvision: one image a call
            return [decode_jpeg(d, device="cuda") for d in data]

    out = decode_all()  # warm-up: nvjpeg handles
    torch.cuda.synchronize()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        decode_all()
        reps += 1
    torch.cuda.synchronize()
    rate = reps * len(data) / (time.perf_counter() - t0)
    report.add(f"(e) GPU JPEG decode, torchvision {torchvision.__version__}", f"{rate:,.0f} images/s "
               f"(batches of {len(data)})")
    diffs = [float((g.cpu().float() - torch.from_numpy(np.asarray(Image.open(io.BytesIO(b)).convert("RGB")))
                    .permute(2, 0, 1).float()).abs().mean()) for g, b in zip(out, blobs)]
    # nvjpeg and libjpeg differ in IDCT and chroma upsampling: close, not equal (not a shardstream check).
    report.add("(e) GPU decode vs PIL (mean |diff| < 2 levels)", f"worst image mean |diff| {max(diffs):.2f}",
               "ok" if max(diffs) < 2.0 else "low")


def loader_decode(report: Report, data: str, args: argparse.Namespace, batch_size: int) -> None:
    """The whole loader, decoding in the workers against decoding on the GPU (DecodeOnDevice):
    images/s delivered on the device, and how far the GPU's pixels are from the CPU's."""
    decode = DecodeOnDevice("cuda")
    if not decode.on_gpu:
        report.add("(e) loader with DecodeOnDevice('cuda')", "skipped: torchvision's GPU decoder not available", "skipped")
        return

    def second_epoch(defer: bool) -> tuple[float, list[Any]]:
        """The rate of a warm epoch (workers started, nvJPEG's handles made) and its batches."""
        loader = DataLoader(streaming(data, args.image_size, defer=defer), batch_size=batch_size,
                            num_workers=args.workers, device="cuda", transform_on_device=decode if defer else None)
        list(loader)
        batches = list(loader)  # the same epoch again: the same samples, in the same order
        torch.cuda.synchronize()
        return loader.stats.samples_per_s, batches

    cpu_rate, cpu_batches = second_epoch(False)
    gpu_rate, gpu_batches = second_epoch(True)
    diff = max(float((g[0].float() - c[0].float()).abs().mean()) for g, c in zip(gpu_batches, cpu_batches))
    same_keys = [g[2] for g in gpu_batches] == [c[2] for c in cpu_batches]
    report.add(f"(e) loader, decode in {args.workers} workers (CPU)", f"{cpu_rate:,.0f} images/s on the GPU")
    report.add(f"(e) loader, DecodeOnDevice('cuda'), {args.workers} workers", f"{gpu_rate:,.0f} images/s = "
               f"{gpu_rate / cpu_rate:.2f}x", "ok" if gpu_rate >= cpu_rate else "low")
    # nvJPEG's IDCT and upsampling and a float resize: close to the CPU pixels, not equal.
    report.verdict("(e) DecodeOnDevice('cuda') vs CPU decode: same samples, mean |diff| < 3 levels",
                   same_keys and diff < 3.0, f"worst batch mean |diff| {diff:.2f}")


# -- main ------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=_positive_int, default=None,
                   help="synthetic ImageNet-like JPEGs to make (default 160 with CUDA, 48 without)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="for (a) (default 16) and (c)/(d) (default 128)")
    p.add_argument("--image-size", type=_positive_int, default=224,
                   help="crop size of the decoded and in-memory images")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: min(4, cores))")
    p.add_argument("--compute-ms", type=float, default=20.0, help="(d) duration of the synthetic step")
    p.add_argument("--cpu", action="store_true", help="skip the GPU checks even when CUDA is available")
    p.add_argument("--keep", default=None, help="make the dataset in this folder and keep it (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    cores = os.cpu_count() or 1
    args.workers = args.workers if args.workers is not None else max(1, min(4, cores))
    images = args.images if args.images is not None else (160 if cuda else 48)
    big_batch = args.batch_size or 128
    args.batch_size = min(args.batch_size or 16, max(1, images // 4))
    report = Report()
    start = time.perf_counter()

    if cuda:
        props = torch.cuda.get_device_properties(0)
        print(f"CUDA: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
              f"shardstream {shardstream.__version__}; {cores} cores, {args.workers} workers", flush=True)
    else:
        why = "--cpu given" if args.cpu else "torch.cuda.is_available() is False"
        print(f"NO CUDA ({why}): the GPU checks (a: cuda side, b, c, d, e) are SKIPPED; "
              f"running the CPU-side correctness checks only. torch {torch.__version__}", flush=True)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shardstream-gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        with report.section("dataset"):
            t0 = time.perf_counter()
            data, files = make_dataset(root, images, workers=min(8, cores))
            source = shardstream.open_dataset(data)
            keys = [s["__key__"] for ref in source.shards for s in ref.reader()]
            report.add("dataset", f"{len(keys)} JPEGs (~{sum(f.stat().st_size for f in files) / len(files) / 1e3:.0f} KB),"
                       f" {len(source.shards)} shards, made in {time.perf_counter() - t0:.1f} s")

        plain: list[Any] = []
        with report.section("(a) cpu"):
            plain = check_cpu_side(report, data, keys, args)

        if not cuda:
            for name in ("(a) cuda: device batches == cpu batches", "(b) H2D bandwidth pinned / pageable",
                         "(c) loader H2D throughput", "(d) compute/data overlap", "(e) GPU JPEG decode"):
                report.add(name, "skipped: no CUDA", "skipped")
            with report.section("(c) cpu"):  # section (c)'s source and loader, through real workers
                _, n = loader_throughput(batches=8, batch_size=4, image_size=32, workers=args.workers, device="cpu")
                report.add(f"(c) cpu: premade batches through {args.workers} workers", f"{n} of 8 batches",
                           "ok" if n == 8 else "FAIL")
            with report.section("(e) cpu"):
                cpu_decode(report, [f.read_bytes() for f in files[:32]], min_s=0.5)
        else:
            with report.section("(a) cuda"):
                if plain:
                    check_gpu_side(report, data, plain, args)

            pinned = 0.0
            with report.section("(b) bandwidth"):
                nbytes = 512 * 2**20
                pinned = h2d_bandwidth(nbytes, pinned=True)
                pageable = h2d_bandwidth(nbytes, pinned=False)
                report.add("(b) H2D pinned (512 MiB, cuda events)", f"{pinned:.1f} GB/s",
                           "ok" if pinned >= 0.95 * pageable else "low")
                report.add("(b) H2D pageable (512 MiB, cuda events)",
                           f"{pageable:.1f} GB/s = {pageable / pinned:.0%} of pinned")

            with report.section("(c) loader throughput"):
                rate, n = loader_throughput(batches=160, batch_size=big_batch, image_size=args.image_size,
                                            workers=args.workers)
                frac = rate / pinned if pinned else float("nan")
                report.add(f"(c) loader H2D, {big_batch}x3x{args.image_size}^2 uint8 batches",
                           f"{rate:.2f} GB/s = {frac:.0%} of pinned ({n} batches, {args.workers} workers)",
                           "ok" if frac >= 0.1 else "low")

            with report.section("(d) overlap"):
                steps = max(20, min(100, int(2000 / args.compute_ms)))
                for compute_ms, expect_hidden in ((args.compute_ms, True), (args.compute_ms / 10, False)):
                    r = overlap(steps, big_batch, args.image_size, args.workers, compute_ms)
                    hidden = r["wait_fraction"] < 0.1
                    report.add(f"(d) step with {r['kernel_ms']:.1f} ms of compute",
                               f"step {r['step_ms']:.1f} ms, data wait {r['wait_ms']:.2f} ms/step, "
                               f"wait_fraction {r['wait_fraction']:.3f} ({int(r['steps'])} steps)",
                               ("ok" if hidden else "low") if expect_hidden else "-")

            with report.section("(e) decode"):
                blobs = [f.read_bytes() for f in files[:64]]
                cpu_decode(report, blobs)
                gpu_decode(report, blobs)
                loader_decode(report, data, args, args.batch_size)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print()
    print(report.table())
    verdict = "FAILED" if report.failed else "passed"
    print(f"\ncorrectness {verdict}; {time.perf_counter() - start:.0f} s"
          + ("" if cuda else "; GPU checks skipped (no CUDA)"), flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
