"""Progress bars without tqdm's monitor thread, on a stderr whose reader may go.

tqdm starts a background thread per process to watch for stalled bars. A thread
alive in the parent makes a later `fork` unsafe (pack and the DataLoader fork worker
processes), and it outlives the bar; our bars refresh on update, which is enough.

A bar shows work; it must not end it. `shardstream pack ... 2>&1 | head` closes the
bar's pipe, and tqdm lets a write's BrokenPipeError through (it quiets EIO only): the
pack stopped midway, its manifest unwritten.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm import tqdm

__all__ = ["progress_bar", "send_nowhere"]


class _Bar(tqdm):  # type: ignore[misc,type-arg]
    monitor_interval = 0


class _Stderr:
    """sys.stderr, as it is when written to, whose reader's going ends what is written to it:
    stderr then points nowhere (nothing more to tell, at exit either)."""

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


def send_nowhere(stream: Any) -> None:
    """Point `stream` (sys.stdout, sys.stderr) at /dev/null: its reader has gone."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def progress_bar(**options: Any) -> tqdm:  # type: ignore[type-arg]
    """A tqdm bar (same options) that starts no monitor thread, and writes to stderr
    until its reader goes (then to nowhere)."""
    return _Bar(**{"file": _Stderr(), **options})
