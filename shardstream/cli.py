"""The `shardstream` command: pack, inspect, verify, demo.

Each subcommand is a thin layer over a library function; the CLI parses arguments,
prints, and turns a `ShardstreamError` into a one-line message and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .errors import ShardstreamError


def _storage_options(text: str | None) -> dict:
    return json.loads(text) if text else {}


def cmd_pack(args: argparse.Namespace) -> int:
    from .pack import pack

    summary = pack(
        args.src,
        args.dst,
        shard_size=args.shard_size,
        max_samples=args.max_samples,
        compression=args.compression,
        level=args.level,
        workers=args.workers,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        on_error=args.on_error,
        overwrite=args.overwrite,
        progress=not args.quiet,
        storage_options=_storage_options(args.storage_options),
    )
    print(summary)
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
    )
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    status = "ok" if report.ok else f"{len(report.problems)} problems"
    print(f"verified {report.shards} shards, {report.samples} samples, {report.images} images decoded: {status}")
    return 0 if report.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(images=args.images, classes=args.classes, workers=args.workers, keep=args.keep)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardstream", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="pack an image folder or file list into shards")
    p.add_argument("src", help="image folder (one subfolder per class) or a .txt/.csv list of path[,label]")
    p.add_argument("dst", help="output folder or fsspec URL (s3://bucket/prefix)")
    p.add_argument("--shard-size", default="256MB", help="uncompressed bytes per shard (default 256MB)")
    p.add_argument("--max-samples", type=int, default=None, help="at most this many samples per shard")
    p.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    p.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample order")
    p.add_argument("--no-shuffle", action="store_true", help="keep sorted order (class-sorted shards!)")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail", help="on a corrupt image")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_pack)

    p = sub.add_parser("inspect", help="what a packed dataset holds")
    p.add_argument("dataset")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("verify", help="check checksums, indexes and that every image decodes")
    p.add_argument("dataset")
    p.add_argument("--no-decode", action="store_true", help="skip decoding images")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("demo", help="make a small image folder, pack it, stream it, report speed")
    p.add_argument("--images", type=int, default=400)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--keep", default=None, help="keep the files in this folder")
    p.set_defaults(run=cmd_demo)

    for name in ("pack", "inspect", "verify"):
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
    except KeyboardInterrupt:
        print(f"shardstream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
