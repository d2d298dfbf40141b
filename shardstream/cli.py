"""The `shardstream` command: pack, merge, index, repack, inspect, verify, demo, bench.

This module parses the arguments and runs the subcommand (commands.py, each a thin
layer over a library function), and turns a `ShardstreamError`, or an `OSError` on a
path it was given (a file where a folder should be, a folder that cannot be made),
into a one-line message and exit status 1.

SIGTERM stops a command as Ctrl-C does (`Terminated`, a KeyboardInterrupt): schedulers
(SLURM, Kubernetes, spot instances) stop jobs with it, and Python's default for it ends
the process on the spot, without the cleanup an interrupt runs: a pack's worker
processes were left to notice on their own, its partial shard stayed in the scratch
folder, and the exit said nothing. The status is 128 + the signal's number, as a shell
reports a command a signal ended: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from .commands import (cmd_bench, cmd_demo, cmd_index, cmd_inspect, cmd_merge, cmd_pack, cmd_repack,
                       cmd_verify, plot_file)
from .bench import IMAGE_FIELD, ROUND_SECONDS, ROUNDS, SECONDS
from .errors import ShardstreamError, notes_in_short
from .parts import MAX_PARTS
from .shared import SLOTS
from .streams import QuietStderr, output_lost, reader_gone, send_nowhere
from .writer import MAX_COUNT


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _count(text: str) -> int:
    return _int_at_least(text, 0, "a non-negative integer")


def _seed(text: str) -> int:
    return _int_in(text, 0, (1 << 64) - 1, "a non-negative integer below 2**64")


def _int_at_least(text: str, least: int, what: str) -> int:
    """An integer of `least` or more, and below 2**63 (manifests and journals hold them as int64)."""
    value = _int_in(text, least, None, what)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected {what} below 2**63, got {text!r}")
    return value


def _level(text: str) -> int:
    """A zstd level the writer takes (checked here, as the writer checks it)."""
    from .writer import check_compression

    try:
        level = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    try:
        check_compression("zstd", level)
    except ShardstreamError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return level


def _quality(text: str) -> int:
    return _int_in(text, 1, 100)


def _int_in(text: str, least: int, most: int | None, what: str | None = None) -> int:
    """An integer from `least` to `most` (None: no bound), or a usage error saying it expected `what`."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"expected {what or f'an integer {least}..{most}'}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _seconds_at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def _size(text: str) -> str:
    """A size such as 256MB (checked here, passed on as written)."""
    from .writer import parse_size

    try:
        size = parse_size(text)
    except ShardstreamError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"a shard size must be at least one byte, not {text!r}")
    return text


def _byte_size(text: str) -> str:
    """A count of bytes such as 50GB (checked here, passed on as written)."""
    from .writer import parse_size

    try:
        parse_size(text)
    except ShardstreamError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _part_spec(text: str) -> str:
    """I/N with 0 <= I < N (checked here, passed on as written)."""
    index, _, total = text.partition("/")
    try:
        i, n = int(index), int(total)
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n <= MAX_PARTS:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N <= {MAX_PARTS} (e.g. 0/4), got {text!r}")
    return text


def _check_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that go with others, given without them: a usage error (exit 2), as argparse's own.
    Ignored, they made a pack the user did not ask for."""
    if args.command == "bench":
        if args.decode_on_device and args.transform == "none":
            parser.error("--decode-on-device needs a transform to defer: --transform train or val")
        if args.decode_threads and (args.transform == "none" or args.decode_on_device):
            parser.error("--decode-threads decodes images here: it goes with --transform train or val, "
                         "without --decode-on-device")
        if args.cache_limit is not None and args.cache_dir is None:
            parser.error("--cache-limit goes with --cache-dir")
        if args.json is not None and args.plot is not None and \
                os.path.abspath(args.json) == os.path.abspath(plot_file(args.plot)):
            parser.error(f"--json and --plot name the same file ({args.json}): one would replace the other")
    if args.command == "demo" and args.keep is not None and "://" in args.keep:
        parser.error(f"--keep takes a local folder, not a URL ({args.keep})")
    if args.command == "demo" and args.images < args.classes:
        parser.error(f"--images ({args.images}) must be at least --classes ({args.classes}): an image a class")
    if args.command != "pack":
        return
    if args.executor == "ray" and args.part is not None:
        parser.error("--executor ray runs all parts itself; leave out --part")
    if args.executor != "ray" and (args.parts is not None or args.ray_address is not None):
        parser.error("--parts and --ray-address go with --executor ray (for one part: --part I/N)")
    if args.no_merge and args.part is None:
        parser.error("--no-merge goes with --part I/N")
    from .shardfile import IMAGE_LEVEL
    from .shrink import DEFAULT_QUALITY

    if args.max_side is None and args.quality != DEFAULT_QUALITY:
        parser.error("--quality goes with --max-side (only images shrunk are encoded again)")
    if args.compression == "none" and args.level != IMAGE_LEVEL:
        parser.error("--level goes with --compression zstd (uncompressed shards have no level)")


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(not 0 <= n <= SLOTS for n in counts):
        raise argparse.ArgumentTypeError(f"expected comma-separated counts from 0 to {SLOTS}, like 0,1,2,4,8; got {text!r}")
    if len(set(counts)) < len(counts):
        raise argparse.ArgumentTypeError(f"each worker count once (the knee takes one rate for each); got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    from .shardfile import IMAGE_LEVEL, MIN_LEVEL
    from .shrink import DEFAULT_QUALITY

    parser = argparse.ArgumentParser(prog="shardstream", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="pack an image folder or file list into shards")
    p.add_argument("src", help="image folder (one subfolder per class) or a .txt/.csv list of path[,label]")
    p.add_argument("dst", help="output folder or fsspec URL (s3://bucket/prefix)")
    p.add_argument("--shard-size", type=_size, default="256MB", help="uncompressed bytes per shard (default 256MB)")
    p.add_argument("--max-samples", type=_positive_int, default=None, help="at most this many samples per shard")
    p.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    p.add_argument("--level", type=_level, default=IMAGE_LEVEL,
                   help=f"zstd level, {MIN_LEVEL}..22 (default {IMAGE_LEVEL}, a fast level: image files do not "
                   "shrink, and higher levels cost twice the time and more for a fraction of a percent)")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="parallel workers: threads for large images, processes for small ones (default: the "
                        "CPUs this process may use: its affinity, its cgroup's CPU quota)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the sample order")
    p.add_argument("--no-shuffle", action="store_true", help="keep sorted order (class-sorted shards!)")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail", help="on a corrupt image")
    p.add_argument("--max-side", type=_positive_int, default=None, metavar="PX",
                   help="shrink images whose longer side exceeds PX to PX, encoded again (JPEG and WebP at "
                   "--quality, PNG losslessly); smaller images keep their bytes (default: keep every file's bytes)")
    p.add_argument("--quality", type=_quality, default=DEFAULT_QUALITY,
                   help=f"with --max-side: JPEG/WebP quality of shrunk images (default {DEFAULT_QUALITY})")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    p.add_argument("--resume", action="store_true", help="continue an interrupted pack from its last complete shard")
    p.add_argument("--part", type=_part_spec, default=None, metavar="I/N",
                   help="pack only part I of N; the last part to finish merges (or: shardstream merge DST)")
    p.add_argument("--no-merge", action="store_true", help="with --part: do not merge, even as the last part")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="ray: run --parts parts as Ray tasks on the cluster ray.init() finds, then merge")
    p.add_argument("--parts", type=_positive_int, default=None, help="with --executor ray: how many parts (default 4)")
    p.add_argument("--ray-address", default=None, help="with --executor ray: the cluster (default: RAY_ADDRESS or local)")
    p.add_argument("--fsync", action="store_true",
                   help="wait until each file is on the disk before the one that names it is written: a power "
                   "loss cannot leave a manifest that lists a lost shard (local DST; slower, by the disk's speed)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_pack)

    p = sub.add_parser("merge", help="join the parts of a multi-machine pack into one dataset")
    p.add_argument("dst")
    p.add_argument("--fsync", action="store_true", help="the manifest is on the disk when merge ends (local DST)")
    p.set_defaults(run=cmd_merge)

    p = sub.add_parser("index", help="make WebDataset .tar shards a dataset in place: an index each, a manifest")
    p.add_argument("source", help="folder or URL prefix of .tar shards, a brace pattern, or one shard's URL")
    p.add_argument("--workers", type=_positive_int, default=8, help="shards read at once (default 8)")
    p.add_argument("--overwrite", action="store_true", help="replace a manifest already there")
    p.add_argument("--no-manifest", action="store_true",
                   help="write the indexes only (stream the shards by their brace pattern): for a second set of "
                   "shards in a folder that has its dataset")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_index)

    p = sub.add_parser("repack", help="rewrite other tools' tars (.tar, .tar.gz, .tar.zst, .tar.bz2, .tar.xz) as a shardstream dataset")
    p.add_argument("source", help="folder or URL prefix of tars, a brace pattern, or one shard's URL")
    p.add_argument("dst", help="output folder or fsspec URL")
    p.add_argument("--shard-size", type=_size, default="256MB", help="uncompressed bytes per shard (default 256MB)")
    p.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    p.add_argument("--level", type=_level, default=IMAGE_LEVEL, help=f"zstd level (default {IMAGE_LEVEL})")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    p.add_argument("--class-names", action="store_true",
                   help="cls holds class names (\"bird\"): number them in sorted order (reads the tars twice)")
    p.add_argument("--prefix-keys", action="store_true",
                   help="make each key <tar name>/<key>, where tars repeat each other's keys")
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
    p.add_argument("--images", type=_positive_int, default=400, help="images to make (default 400)")
    p.add_argument("--classes", type=_positive_int, default=4, help="class folders to make them in (default 4)")
    p.add_argument("--workers", type=_count, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--keep", default=None, help="keep the files in this folder")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("bench", help="measure loader throughput per num_workers and find the knee")
    p.add_argument("dataset", help="packed dataset (folder or fsspec URL), brace pattern or shard URL")
    p.add_argument("--workers", type=_worker_counts, default=[0, 1, 2, 4, 8],
                   help="num_workers values to try, comma-separated (default 0,1,2,4,8); 0 iterates in this "
                   "process with torch.set_num_threads(1), as DataLoader workers do")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="samples a batch (default 64)")
    p.add_argument("--transform", choices=("train", "val", "none"), default="train",
                   help="train: RandomResizedCropJPEG(224); val: CenterCropJPEG(224); none: raw bytes")
    p.add_argument("--rounds", type=_positive_int, default=ROUNDS, metavar="N",
                   help=f"measure every worker count N times, the order reversed every other round; the knee is "
                   f"found from each count's median (default {ROUNDS})")
    p.add_argument("--seconds", type=_positive_float, default=None,
                   help=f"measured seconds per worker count and round (default {SECONDS:g} with --rounds 1, "
                   f"{ROUND_SECONDS:g} with more: {ROUNDS} rounds of 5 counts, with their warm-ups, about a minute)")
    p.add_argument("--warmup", type=_seconds_at_least_zero, default=1.0, help="seconds discarded first (default 1)")
    p.add_argument("--device", default="cpu", help="where batches go: cpu or cuda (default cpu)")
    p.add_argument("--decode-on-device", action="store_true",
                   help="workers ship JPEG bytes, the device decodes (nvJPEG on cuda; see README)")
    p.add_argument("--decode-threads", type=_count, default=0, metavar="N",
                   help="decode in N threads in each process that iterates (default 0: in the iterating thread)")
    p.add_argument("--prefetch", type=_count, default=None, metavar="N",
                   help="pieces each reader reads ahead (StreamingDataset's prefetch; default: 2 local, 6 remote)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="keep remote shards in this local folder (StreamingDataset's cache_dir): the first "
                   "measurement fills it")
    p.add_argument("--cache-limit", type=_byte_size, default=None, metavar="SIZE",
                   help="most bytes the cache keeps, e.g. 50GB (the default)")
    p.add_argument("--image-field", default=IMAGE_FIELD, metavar="FIELD",
                   help=f"the image's field, alternatives joined by ';' (default {IMAGE_FIELD})")
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
    for command in sub.choices.values():  # a usage error after parsing shows its command's usage
        command.set_defaults(command_parser=command)
    return parser


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """The library's warnings (tars left out by `index`, ...) as one line each, not Python's
    `file:line: UserWarning:` and the source line that raised them."""
    import warnings

    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        said = str(message).removeprefix("shardstream: ")  # named in a program's log, here by the line's start
        print(f"shardstream {command}: warning: {said}", file=QuietStderr())

    before = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where it is, as Ctrl-C raises KeyboardInterrupt:
    whatever cleans up after an interrupt cleans up after it."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While the command runs, SIGTERM raises `Terminated`; a second SIGTERM ends the process
    at once (the cleanup may be what hangs, and an interrupted pack is safe to kill). SIGINT
    raises KeyboardInterrupt, as Python's own handler does; both are remembered (`_SIGNALS`).

    Only from the main thread, where Python runs signal handlers; the handler before is
    put back after (a test may call `main` in its process). A child forked meanwhile (a
    `multiprocessing.Pool` worker, a DataLoader worker before its own setup) gets SIGTERM's
    default back as it starts (`_default_sigterm_in_child`): its parent stops it with
    SIGTERM (`Pool.terminate`, at the pool's end), and it must die of it, quietly. A Python
    handler could not promise that: one that arrives just before the child blocks in a
    lock is run only when the lock is taken, and a pool worker waits on one the pool's
    terminate holds: `demo` hung so, twice in about 140 runs under load (RELIABILITY 247)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_terminated)
    before_int = signal.signal(signal.SIGINT, _raise_interrupted)
    hook = sys.unraisablehook

    def quiet_about_signals(unraisable: Any) -> None:
        # A KeyboardInterrupt (or Terminated) dropped in a weakref callback or a __del__ (`_SIGNALS`)
        # is raised again, as a Ctrl-C: dropped, the command ran on to its end (a pack Ctrl-C'd
        # with 118 of 120 shards to go wrote its manifest), and `main` then said it was
        # interrupted. From a thread of its own, a moment later: raised here, in the hook, it would
        # be dropped again (so is threading's start, which waits for the thread). It is said once,
        # by `main` (Python's "Exception ignored in ..." is not printed).
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _thread.start_new_thread(_interrupt_main_soon, ())
        else:
            hook(unraisable)

    sys.unraisablehook = quiet_about_signals
    _RUNNING[0] += 1
    try:
        yield
    finally:
        _RUNNING[0] -= 1
        try:
            sys.unraisablehook = hook
        finally:  # an interrupt raised again (above) can come as the first line here runs
            signal.signal(signal.SIGTERM, before)
            signal.signal(signal.SIGINT, before_int)


def _raise_terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _SIGNALS.append(signum)
    raise Terminated()


def _interrupt_main_soon() -> None:
    time.sleep(0.001)  # the hook that started this has returned
    if _RUNNING[0]:  # not once the command has returned: the caller's own handler would take it
        _thread.interrupt_main(signal.SIGINT)


def _raise_interrupted(signum: int, frame: Any) -> None:
    """Python's own Ctrl-C, remembered (`_SIGNALS`)."""
    _SIGNALS.append(signum)
    raise KeyboardInterrupt()


# The SIGTERMs and SIGINTs a command was sent. Python runs a handler between any two bytecodes,
# also in a weakref callback or a __del__, where an exception raised is printed and dropped: the
# command then ran on to its end, exit status 0 (seen in clean-clone suites: a SIGTERM once, a
# Ctrl-C to a pack's process group once). `main` still says a signal ended it.
_SIGNALS: list[int] = []
# How many commands run under `_sigterm_interrupts` (`main` may be called in a command's caller's
# process, as tests do). Changed by `+=` on an item, which no pending signal interrupts (only calls
# and loops' jumps run handlers), so an interrupt raised again cannot skip it.
_RUNNING = [0]


def _default_sigterm_in_child() -> None:
    # signal.signal works here: in a forked child the forking thread is the main thread.
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is _raise_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_sigterm_in_child)


def _stopped(command: str, terminated: bool, resume: bool) -> int:
    """Say that `command` was stopped by a signal (SIGTERM where `terminated`, else SIGINT), and
    return its exit status (128 + its number)."""
    hint = "; --resume continues from the last complete shard" if resume else ""
    print(f"shardstream {command}: {'terminated (SIGTERM)' if terminated else 'interrupted'}{hint}", file=QuietStderr())
    return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_combinations(args.command_parser, args)
    resume = args.command == "pack" and args.executor == "local"
    signals = len(_SIGNALS)
    try:
        with _sigterm_interrupts(), _warnings_as_lines(args.command):
            status = int(args.run(args))
            if sys.stdout is not None:  # (None where the command was started with stdout closed: `>&-`)
                sys.stdout.flush()  # here, not at exit, where a reader gone is "Exception ignored" and status 120
        if len(_SIGNALS) > signals:  # an interrupt dropped where it was raised (see _SIGNALS)
            return _stopped(args.command, signal.SIGTERM in _SIGNALS[signals:], resume)
        if reader_gone():
            return 128 + signal.SIGPIPE
        if (lost := output_lost()) is not None:  # its work done, its output not (stdout on a full disk)
            print(f"shardstream {args.command}: error: could not write its output: {lost.strerror or lost}",
                  file=QuietStderr())
            return 1
        return status
    except ShardstreamError as e:
        notes = "".join(f"\n  {note}" for note in notes_in_short(e))  # what to do about it
        print(f"shardstream {args.command}: error: {e}{notes}", file=QuietStderr())
        return 1
    except BrokenPipeError:  # `shardstream inspect DST | head`: the reader has gone, as `yes | head` reads
        # Quiet, as Unix tools are; stdout points nowhere, so flushing at exit raises nothing more.
        send_nowhere(sys.stdout)
        return 128 + signal.SIGPIPE
    except OSError as e:  # a file or folder the command was given: missing, not a folder, not writable
        where = f"{e.filename}: " if e.filename is not None else ""
        print(f"shardstream {args.command}: error: {where}{e.strerror or e}", file=QuietStderr())
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Terminated`; or raised again as a Ctrl-C, dropped)
        return _stopped(args.command, isinstance(e, Terminated) or signal.SIGTERM in _SIGNALS[signals:], resume)


if __name__ == "__main__":
    sys.exit(main())
