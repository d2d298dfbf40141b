"""The command line's stdout and stderr, whose reader may go before the command is done.

`shardstream inspect DST | head`, `shardstream pack ... 2>&1 | head -c 20`, a `jq` that
fails on its arguments: the reader of a command's output goes, and its next write raises
BrokenPipeError. That must not stop the work the output tells of (the last part's merge,
a pack's manifest, bench's --json), so writes here note the reader gone, point the
stream at /dev/null (nothing more to tell, at exit either), and let the command finish;
`cli.main` then exits with 141, quietly, as `yes | head` does.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

__all__ = ["QuietStderr", "output_lost", "reader_gone", "say", "send_nowhere"]

_reader_gone = False  # stdout's reader went while the command ran
_lost: OSError | None = None  # what failed a write to stdout otherwise (a full disk)


# Errors of a write that say the output is gone, not the work: its reader (EPIPE), its terminal
# hung up (EIO), or the stream closed before the command began (`2>&-`: EBADF).
_GONE = (errno.EPIPE, errno.EIO, errno.EBADF)


def say(*parts: object) -> None:
    """Print to stdout, flushed, until its reader goes (a terminal hung up, a closed stream:
    the same, without the 141). A write that fails otherwise (stdout on a full disk) does
    not stop the work either: the command ends with status 1 after it (`output_lost`)."""
    global _reader_gone, _lost
    if _reader_gone or _lost is not None:
        return
    try:
        print(*parts, flush=True)
    except OSError as error:
        if error.errno in _GONE:
            _reader_gone = error.errno == errno.EPIPE
        else:
            _lost = error
        send_nowhere(sys.stdout)


def output_lost() -> OSError | None:
    """The error that failed a write to stdout other than its reader's going (`say`), if any."""
    return _lost


def reader_gone() -> bool:
    """Whether stdout's reader went while the command ran (`say`)."""
    return _reader_gone


class QuietStderr:
    """sys.stderr, as it is when written to, until a write to it fails (its reader gone, its
    disk full): progress bars, warnings and messages written to it then go nowhere, and the
    work they tell of goes on (a bar on a full disk stopped a pack before its first shard)."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text) if sys.stderr is not None else len(text)
        except OSError:
            send_nowhere(sys.stderr)
            return len(text)

    def flush(self) -> None:
        try:
            if sys.stderr is not None:
                sys.stderr.flush()
        except OSError:
            send_nowhere(sys.stderr)

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno: tqdm asks
        return getattr(sys.stderr, name)

    # tqdm.write clears the bars writing to the file it writes to, found by equality
    def __eq__(self, other: object) -> bool:
        return other is sys.stderr or isinstance(other, QuietStderr)

    def __hash__(self) -> int:
        return hash(sys.stderr)


def send_nowhere(stream: Any) -> None:
    """Point `stream` (sys.stdout, sys.stderr) at /dev/null: its reader has gone."""
    nowhere = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(nowhere, stream.fileno())
    finally:
        os.close(nowhere)
