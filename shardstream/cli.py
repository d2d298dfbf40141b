"""The `shardstream` command: pack, inspect, verify, demo.

Each subcommand is a thin layer over a library function; the CLI parses arguments,
prints, and turns a `ShardstreamError`, or an `OSError` on a path it was given (a
file where a folder should be, a folder that cannot be made), into a one-line message
and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .errors import ShardstreamError


def _storage_options(text: str | None) -> dict:
    """--storage-options (or SHARDSTREAM_STORAGE_OPTIONS, its default): a JSON object."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShardstreamError(f"--storage-options (or SHARDSTREAM_STORAGE_OPTIONS) is not JSON: {e}: {text!r}") from None
    if not isinstance(options, dict):
        raise ShardstreamError(f"--storage-options (or SHARDSTREAM_STORAGE_OPTIONS) must be a JSON object, not {text!r}")
    return options


def cmd_pack(args: argparse.Namespace) -> int:
    from .pack import pack

    if args.executor == "ray":
        return _pack_with_ray(args)
    part = _part(args.part)
    summary = pack(args.src, args.dst, workers=args.workers, part=part, progress=not args.quiet,
                   **_pack_options(args))
    print(summary)
    if part is not None and not args.no_merge:
        return _merge_if_complete(args, part[1])
    return 0


def _merge_if_complete(args: argparse.Namespace, parts: int) -> int:
    """After a part: if every part is done, merge, so that the last part to finish makes the
    dataset and no separate merge step is needed (`shardstream merge` stays, to check or redo)."""
    from .parts import merge, missing_parts

    options = _storage_options(args.storage_options)
    missing = missing_parts(args.dst, parts, storage_options=options)
    if missing:
        print(f"{parts - len(missing)} of {parts} parts done; the last part to finish merges")
        return 0
    try:
        manifest = merge(args.dst, storage_options=options)
    except ShardstreamError as e:
        print(f"shardstream: every part is done, but they do not merge: {e}", file=sys.stderr)
        return 1
    print(f"all {parts} parts done: merged {manifest.samples:,} samples in {len(manifest.shards)} shards")
    return 0


def _pack_options(args: argparse.Namespace) -> dict:
    """The options every part of a pack shares, from the command line."""
    return dict(shard_size=args.shard_size, max_samples=args.max_samples, compression=args.compression,
                level=args.level, seed=args.seed, shuffle=not args.no_shuffle, on_error=args.on_error,
                max_side=args.max_side, quality=args.quality,
                overwrite=args.overwrite, resume=args.resume, storage_options=_storage_options(args.storage_options))


def _pack_with_ray(args: argparse.Namespace) -> int:
    from .executors import pack_with_ray

    if args.part is not None:
        raise ShardstreamError("--executor ray runs all parts itself; leave out --part")
    manifest, summaries = pack_with_ray(args.src, args.dst, parts=args.parts, address=args.ray_address,
                                        cpus_per_part=args.workers or 1, progress=not args.quiet,
                                        **_pack_options(args))
    seconds = max(s.seconds for s in summaries)
    print(f"packed {manifest.samples:,} samples into {len(manifest.shards)} shards as {args.parts} Ray tasks "
          f"(slowest part {seconds:.1f} s); skipped {len(manifest.skipped)}, not images {manifest.ignored}")
    return 0


def _part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        index, total = (int(x) for x in text.split("/"))
    except ValueError:
        raise ShardstreamError(f"--part takes I/N (e.g. 0/4), not {text!r}") from None
    return index, total


def cmd_merge(args: argparse.Namespace) -> int:
    from .parts import merge

    manifest = merge(args.dst, storage_options=_storage_options(args.storage_options))
    print(f"merged {manifest.options.get('parts')} parts: {manifest.samples:,} samples in {len(manifest.shards)} shards")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .adopt import index_tars

    manifest = index_tars(args.source, workers=args.workers, overwrite=args.overwrite, progress=not args.quiet,
                          storage_options=_storage_options(args.storage_options))
    fields = sorted({f for s in manifest.shards for f in s.fields})
    print(f"indexed {manifest.samples:,} samples in {len(manifest.shards)} shards "
          f"({sum(s.bytes for s in manifest.shards) / 1e6:,.1f} MB); fields {', '.join(fields)}; "
          f"{len(manifest.classes)} classes")
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    from .adopt import repack_tars

    manifest = repack_tars(args.source, args.dst, shard_size=args.shard_size, compression=args.compression,
                           level=args.level, progress=not args.quiet,
                           storage_options=_storage_options(args.storage_options))
    print(f"repacked {manifest.samples:,} samples into {len(manifest.shards)} shards "
          f"({sum(s.bytes for s in manifest.shards) / 1e6:,.1f} MB)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .verify import inspect_dataset

    info = inspect_dataset(args.dataset, storage_options=_storage_options(args.storage_options))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['url']}: {info['samples']:,} samples in {info['shards']} shards ({info['compression']}), "
          f"{info['bytes'] / 1e6:,.1f} MB + {info['index_bytes'] / 1e3:,.1f} KB of index")
    print(f"tar bytes {info['tar_bytes'] / 1e6:,.1f} MB, compression ratio {info['compression_ratio']:.3f}")
    print(f"fields: {', '.join(info['fields'])}; written by {info['writer']} (format {info['format_version']})")
    if info["classes"]:
        print(f"{len(info['classes'])} classes:")
        for name, count in info["classes"].items():
            print(f"  {name}: {count}")
    print(f"skipped at pack time: {len(info['skipped'])}, not images: {info['ignored']}")
    for item in info["skipped"]:
        print(f"  {item['file']}: {item['reason']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_dataset

    report = verify_dataset(
        args.dataset,
        decode_images=not args.no_decode,
        progress=not args.quiet,
        storage_options=_storage_options(args.storage_options),
        workers=args.workers,
    )
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    status = "ok" if report.ok else f"{len(report.problems)} problems"
    print(f"verified {report.shards} shards, {report.samples} samples, {report.images} images decoded: {status}")
    return 0 if report.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    failed = run_demo(images=args.images, classes=args.classes, workers=args.workers, keep=args.keep)
    for check in failed:
        print(f"shardstream demo: check failed: {check}", file=sys.stderr)
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench
    from .benchresult import save_json

    plot = args.plot
    for option, path in (("--json", args.json), ("--plot", plot)):
        if path is not None:
            _writable_file(path, option)
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"shardstream bench: --plot {plot}: matplotlib is not installed, so no curve will be drawn "
                  "(pip install 'shardstream[plot]')", file=sys.stderr)
            plot = None
    result = bench(
        args.dataset,
        workers=args.workers,
        batch_size=args.batch_size,
        transform=args.transform,
        seconds=args.seconds,
        warmup=args.warmup,
        device=args.device,
        decode_on_device=args.decode_on_device,
        decode_threads=args.decode_threads,
        progress=not args.quiet,
        storage_options=_storage_options(args.storage_options),
    )
    print(result.table())
    if 0 in args.workers:
        print("num_workers=0 ran in this process with torch.set_num_threads(1), as DataLoader workers run")
    print(f"knee: num_workers={result.knee}" + (f" (with {result.decode_threads} decode threads per process)"
                                                 if result.decode_threads else ""))
    if args.json:
        save_json(result, args.json)
        print(f"wrote {args.json}")
    if plot is not None:
        result.plot(plot)
        print(f"wrote {plot}")
    return 0


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _count(text: str) -> int:
    return _int_at_least(text, 0, "a non-negative integer")


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _writable_file(path: str, option: str) -> None:
    """Fail now, not after the whole benchmark ran, if `path` cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ShardstreamError(f"{option} {path}: is a folder, not a file")
    if not os.path.isdir(folder):
        raise ShardstreamError(f"{option} {path}: there is no folder {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ShardstreamError(f"{option} {path}: not writable")


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 0 for n in counts):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, like 0,1,2,4,8; got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    from .shardfile import IMAGE_LEVEL, MIN_LEVEL
    from .shrink import DEFAULT_QUALITY

    parser = argparse.ArgumentParser(prog="shardstream", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="pack an image folder or file list into shards")
    p.add_argument("src", help="image folder (one subfolder per class) or a .txt/.csv list of path[,label]")
    p.add_argument("dst", help="output folder or fsspec URL (s3://bucket/prefix)")
    p.add_argument("--shard-size", default="256MB", help="uncompressed bytes per shard (default 256MB)")
    p.add_argument("--max-samples", type=_positive_int, default=None, help="at most this many samples per shard")
    p.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    p.add_argument("--level", type=int, default=IMAGE_LEVEL,
                   help=f"zstd level, {MIN_LEVEL}..22 (default {IMAGE_LEVEL}, a fast level: image files do not "
                   "shrink, and higher levels cost twice the time and more for a fraction of a percent)")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel workers: threads for large images, processes for small ones (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample order")
    p.add_argument("--no-shuffle", action="store_true", help="keep sorted order (class-sorted shards!)")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail", help="on a corrupt image")
    p.add_argument("--max-side", type=int, default=None, metavar="PX",
                   help="shrink images whose longer side exceeds PX to PX, encoded again (JPEG and WebP at "
                   "--quality, PNG losslessly); smaller images keep their bytes (default: keep every file's bytes)")
    p.add_argument("--quality", type=int, default=DEFAULT_QUALITY,
                   help=f"with --max-side: JPEG/WebP quality of shrunk images (default {DEFAULT_QUALITY})")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    p.add_argument("--resume", action="store_true", help="continue an interrupted pack from its last complete shard")
    p.add_argument("--part", default=None, metavar="I/N",
                   help="pack only part I of N; the last part to finish merges (or: shardstream merge DST)")
    p.add_argument("--no-merge", action="store_true", help="with --part: do not merge, even as the last part")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="ray: run --parts parts as Ray tasks on the cluster ray.init() finds, then merge")
    p.add_argument("--parts", type=_positive_int, default=4, help="with --executor ray: how many parts (default 4)")
    p.add_argument("--ray-address", default=None, help="with --executor ray: the cluster (default: RAY_ADDRESS or local)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_pack)

    p = sub.add_parser("merge", help="join the parts of a multi-machine pack into one dataset")
    p.add_argument("dst")
    p.set_defaults(run=cmd_merge)

    p = sub.add_parser("index", help="make WebDataset .tar shards a dataset in place: an index each, a manifest")
    p.add_argument("source", help="folder or URL prefix of .tar shards, a brace pattern, or one shard's URL")
    p.add_argument("--workers", type=_positive_int, default=8, help="shards read at once (default 8)")
    p.add_argument("--overwrite", action="store_true", help="replace a manifest already there")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_index)

    p = sub.add_parser("repack", help="rewrite other tools' tars (.tar, .tar.gz, .tar.zst) as a shardstream dataset")
    p.add_argument("source", help="folder or URL prefix of tars, a brace pattern, or one shard's URL")
    p.add_argument("dst", help="output folder or fsspec URL")
    p.add_argument("--shard-size", default="256MB", help="uncompressed bytes per shard (default 256MB)")
    p.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    p.add_argument("--level", type=int, default=IMAGE_LEVEL, help=f"zstd level (default {IMAGE_LEVEL})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_repack)

    p = sub.add_parser("inspect", help="what a packed dataset holds")
    p.add_argument("dataset")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("verify", help="check checksums, indexes and that every image decodes")
    p.add_argument("dataset")
    p.add_argument("--no-decode", action="store_true", help="skip decoding images")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="shards checked at once, in threads (default: one per core; at least 4 for remote storage)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("demo", help="make a small image folder, pack it, stream it, report speed")
    p.add_argument("--images", type=_positive_int, default=400)
    p.add_argument("--classes", type=_positive_int, default=4)
    p.add_argument("--workers", type=_count, default=2, help="DataLoader workers")
    p.add_argument("--keep", default=None, help="keep the files in this folder")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("bench", help="measure loader throughput per num_workers and find the knee")
    p.add_argument("dataset", help="packed dataset (folder or fsspec URL), brace pattern or shard URL")
    p.add_argument("--workers", type=_worker_counts, default=[0, 1, 2, 4, 8],
                   help="num_workers values to try, comma-separated (default 0,1,2,4,8); 0 iterates in this "
                   "process with torch.set_num_threads(1), as DataLoader workers do")
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument("--transform", choices=("train", "val", "none"), default="train",
                   help="train: RandomResizedCropJPEG(224); val: CenterCropJPEG(224); none: raw bytes")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per worker count (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds discarded first (default 1)")
    p.add_argument("--device", default="cpu", help="where batches go: cpu or cuda (default cpu)")
    p.add_argument("--decode-on-device", action="store_true",
                   help="workers ship JPEG bytes, the device decodes (nvJPEG on cuda; see README)")
    p.add_argument("--decode-threads", type=_count, default=0, metavar="N",
                   help="decode in N threads in each process that iterates (default 0: in the iterating thread)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the curve here (needs matplotlib)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--storage-options", default=os.environ.get("SHARDSTREAM_STORAGE_OPTIONS"),
                   help="fsspec options as JSON")
    p.set_defaults(run=cmd_bench)

    for name in ("pack", "merge", "index", "repack", "inspect", "verify"):
        sub.choices[name].add_argument(
            "--storage-options", default=os.environ.get("SHARDSTREAM_STORAGE_OPTIONS"),
            help="fsspec options as JSON, e.g. '{\"endpoint_url\": \"http://127.0.0.1:9000\"}'",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ShardstreamError as e:
        print(f"shardstream {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file or folder the command was given: missing, not a folder, not writable
        where = f"{e.filename}: " if e.filename is not None else ""
        print(f"shardstream {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardstream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
