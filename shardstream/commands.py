"""What each `shardstream` subcommand does, given its parsed arguments (cli.py parses them).

Each is a thin layer over a library function: it calls it, prints, and returns the
exit status. Library modules are imported inside each command, so that `shardstream
--help` and the commands that need no torch start quickly.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from .errors import ShardstreamError, shown_name
from .streams import QuietStderr, say

if TYPE_CHECKING:
    from .benchresult import BenchResult
    from .verify import Problem

__all__ = ["cmd_bench", "cmd_demo", "cmd_index", "cmd_inspect", "cmd_merge", "cmd_pack", "cmd_repack", "cmd_verify",
           "plot_file"]



def _count(n: int, noun: str) -> str:
    """`n` `noun`s in words: "1 shard", "2,048 shards"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"

def _storage_options(text: str | None) -> dict:
    """--storage-options (or SHARDSTREAM_STORAGE_OPTIONS, its default): a JSON object."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        # Not the text itself: it holds credentials, and errors go to logs.
        raise ShardstreamError(f"--storage-options (or SHARDSTREAM_STORAGE_OPTIONS) is not JSON: {e.msg} "
                               f"(line {e.lineno}, column {e.colno})") from None
    if not isinstance(options, dict):
        raise ShardstreamError("--storage-options (or SHARDSTREAM_STORAGE_OPTIONS) must be a JSON object "
                               f"({{\"key\": ...}}), not a {type(options).__name__}")
    return options


def cmd_pack(args: argparse.Namespace) -> int:
    from .pack import pack

    if args.executor == "ray":
        return _pack_with_ray(args)
    part = _part(args.part)  # the option combinations and the part's form: checked by the parser (cli.py)
    summary = pack(args.src, args.dst, workers=args.workers, part=part, progress=not args.quiet,
                   **_pack_options(args))
    say(summary)
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
        say(f"{parts - len(missing)} of {parts} parts done; the last part to finish merges")
        return 0
    try:
        manifest = merge(args.dst, storage_options=options, fsync=args.fsync)
    except ShardstreamError as e:
        print(f"shardstream: every part is done, but they do not merge: {e}", file=QuietStderr())
        return 1
    say(f"all {parts} parts done: merged {_count(manifest.samples, 'sample')} in "
        f"{_count(len(manifest.shards), 'shard')}")
    return 0


def _pack_options(args: argparse.Namespace) -> dict:
    """The options every part of a pack shares, from the command line."""
    return dict(shard_size=args.shard_size, max_samples=args.max_samples, compression=args.compression,
                level=args.level, seed=args.seed, shuffle=not args.no_shuffle, on_error=args.on_error,
                max_side=args.max_side, quality=args.quality,
                overwrite=args.overwrite, resume=args.resume, storage_options=_storage_options(args.storage_options),
                fsync=args.fsync)


def _pack_with_ray(args: argparse.Namespace) -> int:
    from .executors import pack_with_ray

    manifest, summaries = pack_with_ray(args.src, args.dst, parts=args.parts or 4, address=args.ray_address,
                                        cpus_per_part=args.workers or 1, progress=not args.quiet,
                                        **_pack_options(args))
    seconds = max(s.seconds for s in summaries)
    say(f"packed {_count(manifest.samples, 'sample')} into {_count(len(manifest.shards), 'shard')} as "
        f"{args.parts or 4} Ray tasks (slowest part {seconds:.1f} s); skipped {len(manifest.skipped)}, not images "
        f"{manifest.ignored}")
    return 0


def _part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    index, total = (int(x) for x in text.split("/"))  # its form checked by the parser (cli.py)
    return index, total


def cmd_merge(args: argparse.Namespace) -> int:
    from .parts import merge

    manifest = merge(args.dst, storage_options=_storage_options(args.storage_options), fsync=args.fsync)
    say(f"merged {manifest.options.get('parts')} parts: {_count(manifest.samples, 'sample')} in "
        f"{_count(len(manifest.shards), 'shard')}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .adopt import index_tars

    manifest = index_tars(args.source, workers=args.workers, overwrite=args.overwrite, progress=not args.quiet,
                          storage_options=_storage_options(args.storage_options), manifest=not args.no_manifest)
    say(f"indexed {_count(manifest.samples, 'sample')} in {_count(len(manifest.shards), 'shard')} "
          f"({manifest.shards.bytes.sum() / 1e6:,.1f} MB); fields {', '.join(manifest.shards.all_fields())}; "
          f"{len(manifest.classes)} classes" + ("; no manifest written: stream them by their pattern"
                                                 if args.no_manifest else ""))
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    from .adopt import repack_tars

    manifest = repack_tars(args.source, args.dst, shard_size=args.shard_size, compression=args.compression,
                           level=args.level, progress=not args.quiet, overwrite=args.overwrite,
                           class_names=args.class_names, prefix_keys=args.prefix_keys,
                           storage_options=_storage_options(args.storage_options))
    say(f"repacked {_count(manifest.samples, 'sample')} into {_count(len(manifest.shards), 'shard')} "
          f"({manifest.shards.bytes.sum() / 1e6:,.1f} MB)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .plan import INTERLEAVE_SHARDS
    from .verify import inspect_dataset

    info = inspect_dataset(args.dataset, storage_options=_storage_options(args.storage_options))
    if args.json:
        say(json.dumps(info, indent=2))
        return 0
    say(f"{info['url']}: {_count(info['samples'], 'sample')} in {_count(info['shards'], 'shard')} "
        f"({info['compression']}), {info['bytes'] / 1e6:,.1f} MB + {info['index_bytes'] / 1e3:,.1f} KB of index")
    say(f"tar bytes {info['tar_bytes'] / 1e6:,.1f} MB, compression ratio {info['compression_ratio']:.3f}")
    say(f"fields: {', '.join(info['fields'])}; written by {info['writer']} (format {info['format_version']})")
    if info["options"]:
        say("packed with: " + ", ".join(f"{name} {value}" for name, value in info["options"].items()))
    if info["classes"]:
        say(f"{len(info['classes'])} classes:")
        for name, count in info["classes"].items():
            say(f"  {shown_name(name)}: {count}")
    say(f"skipped at pack time: {len(info['skipped'])}, not images: {info['ignored']}")
    for item in info["skipped"]:
        say(f"  {shown_name(item['file'])}: {shown_name(item['reason'])}")
    if info["shuffle_block"]:
        order = ("all shards' in one seeded order" if info["shards"] <= INTERLEAVE_SHARDS
                 else "shard after shard, each shard's in a seeded order")
        say(f"shuffled epochs read {info['shuffle_blocks']:,} blocks of {info['shuffle_block']:,} samples or more, "
            f"{order}")
    else:
        say(f"shuffled epochs read each of the {_count(info['shards'], 'shard')} whole, in a seeded order")
    say(f"with several DataLoader workers, a shuffled epoch deals each worker runs of at least "
        f"{info['worker_run']:,} samples, rounded up to whole batches (so that a worker reads whole frames); "
        "an epoch's last round, and a rank's share smaller than a run a worker, are dealt in smaller ones")
    return 0


def _problem_lines(problems: list[Problem]) -> list[str]:
    """A line a problem, and one for a bad frame's samples, each named by `verify` with the
    frame's error (a line each repeated it 9 times over). A frame's error names its first
    and last samples: samples that share another message (the same decode error of images
    apart) keep a line each, since a range would take in the good ones between them."""
    runs: list[list[Problem]] = []
    for problem in problems:
        last = runs[-1][-1] if runs else None
        if last is not None and problem.key and last.key and (problem.shard, problem.message) == (last.shard,
                                                                                                  last.message):
            runs[-1].append(problem)
        else:
            runs.append([problem])
    lines = []
    for run in runs:
        first, end = run[0], run[-1]
        if len(run) > 1 and f"{first.key!r} to {end.key!r}" in first.message:
            lines.append(f"{first.shard} samples {first.key!r} to {end.key!r} ({len(run)}): {first.message}")
        else:
            lines += map(str, run)
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_dataset

    report = verify_dataset(
        args.dataset,
        decode_images=not args.no_decode,
        progress=not args.quiet,
        storage_options=_storage_options(args.storage_options),
        workers=args.workers,
    )
    for line in _problem_lines(report.problems):
        say(f"PROBLEM {line}")
    for warning in report.warnings:
        say(f"WARNING {warning}")
    count = len(report.problems)
    status = "ok" if report.ok else f"{count} problem{'' if count == 1 else 's'}"
    if report.warnings:
        status += f" ({len(report.warnings)} warning{'' if len(report.warnings) == 1 else 's'})"
    if report.parts is not None:
        numbers, total = report.parts
        missing = total - len(numbers)
        status += (f"; parts {', '.join(map(str, numbers))} of {total}, not merged"
                   + (f" ({missing} part{'s' if missing != 1 else ''} not finished)" if missing else
                      " (`shardstream merge` merges them)"))
    say(f"verified {_count(report.shards, 'shard')}, {_count(report.samples, 'sample')}, "
        f"{_count(report.images, 'image')} decoded: {status}")
    return 0 if report.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    failed = run_demo(images=args.images, classes=args.classes, workers=args.workers, keep=args.keep)
    for check in failed:
        print(f"shardstream demo: check failed: {check}", file=QuietStderr())
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench

    plot = plot_file(args.plot) if args.plot is not None else None
    for option, path in (("--json", args.json), ("--plot", plot)):
        if path is not None:
            _writable_file(path, option)
    if plot is not None:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            print(f"shardstream bench: --plot {plot}: matplotlib is not installed, so no curve will be drawn "
                  "(pip install 'shardstream[plot]')", file=QuietStderr())
            plot = None
        else:  # a type it cannot write failed once every row had run
            kinds = Figure().canvas.get_supported_filetypes()
            suffix = os.path.splitext(plot)[1].lstrip(".").lower()
            if suffix not in kinds:
                raise ShardstreamError(f"--plot {plot}: matplotlib writes {', '.join(sorted(kinds))}, by the "
                                       "file's suffix")
    # The options named as bench's arguments are; --cache-limit, where not given, is left to its default.
    options = {name: getattr(args, name) for name in (
        "workers", "batch_size", "transform", "seconds", "warmup", "device", "rounds", "decode_on_device",
        "decode_threads", "prefetch", "cache_dir", "image_field")
        + (("cache_limit",) if args.cache_limit is not None else ())}
    try:
        result = bench(args.dataset, progress=not args.quiet, storage_options=_storage_options(args.storage_options),
                       **options)
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM: what was measured is said, then main's exit status
        partial = getattr(stop, "result", None)
        if partial is not None and partial.rows:
            _say_bench(partial, args.json, None)
            if plot is not None:
                say(f"no curve drawn to {plot}: stopped before the end")
        else:
            say("nothing was measured before the stop" + (f": no {args.json} written" if args.json else ""))
        raise
    _say_bench(result, args.json, plot)
    return 0


def _say_bench(result: BenchResult, json_path: str | None, plot: str | None) -> None:
    """Print the result (partial: what was measured before a stop), and write its files."""
    from .benchresult import save_json

    say(str(result))
    if json_path:
        save_json(result, json_path)
        say(f"wrote {json_path}" + (" (partial)" if result.partial else ""))
    if plot is not None:
        result.plot(plot)
        say(f"wrote {plot}")


def plot_file(path: str) -> str:
    """The file `bench --plot PATH` writes: PATH, and ``.png`` after a name with no suffix (as
    matplotlib names it; "wrote curve" named a file that was not there, curve.png was)."""
    return path if os.path.splitext(path)[1] else path + ".png"


def _writable_file(path: str, option: str) -> None:
    """Fail now, not after the whole benchmark ran, if `path` cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ShardstreamError(f"{option} {path}: is a folder, not a file")
    if not os.path.isdir(folder):
        raise ShardstreamError(f"{option} {path}: there is no folder {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ShardstreamError(f"{option} {path}: not writable")
