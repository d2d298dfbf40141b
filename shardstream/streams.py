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

__all__ = ["QuietStderr", "reader_gone", "say", "send_nowhere"]

_reader_gone = False  # stdout's reader went while the command ran


# Errors of a write that say the output is gone, not the work: its reader (EPIPE), its terminal
# hung up (EIO), or the stream closed before the command began (`2>&-`: EBADF).
_GONE = (errno.EPIPE, errno.EIO, errno.EBADF)


def say(*parts: object) -> None:
    """Print to stdout, flushed, until its reader goes (a terminal hung up, a closed stream:
    the same, without the 141)."""
    global _reader_gone
    if _reader_gone:
        return
    try:
        print(*parts, flush=True)
    except OSError as error:
        if error.errno not in _GONE:
            raise
        _reader_gone = error.errno == errno.EPIPE
        send_nowhere(sys.stdout)


def reader_gone() -> bool:
    """Whether stdout's reader went while the command ran (`say`)."""
    return _reader_gone


class QuietStderr:
    """sys.stderr, as it is when written to, until its reader goes: progress bars, warnings
    and messages written to it then go nowhere, and the work they tell of goes on."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text) if sys.stderr is not None else len(text)
        except OSError as error:
            if error.errno not in _GONE:
                raise
            send_nowhere(sys.stderr)
            return len(text)

    def flush(self) -> None:
        try:
            if sys.stderr is not None:
                sys.stderr.flush()
        except OSError as error:
            if error.errno not in _GONE:
                raise
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
