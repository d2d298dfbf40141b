"""The command line's stdout and stderr, whose reader may go before the command is done.

`shardstream inspect DST | head`, `shardstream pack ... 2>&1 | head -c 20`, a `jq` that
fails on its arguments: the reader of a command's output goes, and its next write raises
BrokenPipeError. That must not stop the work the output tells of (the last part's merge,
a pack's manifest, bench's --json), so writes here note the reader gone, point the
stream at /dev/null (nothing more to tell, at exit either), and let the command finish;
`cli.main` then exits with 141, quietly, as `yes | head` does.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["QuietStderr", "reader_gone", "say", "send_nowhere"]

_reader_gone = False  # stdout's reader went while the command ran


def say(*parts: object) -> None:
    """Print to stdout, flushed, until its reader goes."""
    global _reader_gone
    if _reader_gone:
        return
    try:
        print(*parts, flush=True)
    except BrokenPipeError:
        _reader_gone = True
        send_nowhere(sys.stdout)


def reader_gone() -> bool:
    """Whether stdout's reader went while the command ran (`say`)."""
    return _reader_gone


class QuietStderr:
    """sys.stderr, as it is when written to, until its reader goes: progress bars, warnings
    and messages written to it then go nowhere, and the work they tell of goes on."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except BrokenPipeError:
            send_nowhere(sys.stderr)
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except BrokenPipeError:
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
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
