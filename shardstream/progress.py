"""Progress bars without tqdm's monitor thread, on a stderr whose reader may go.

tqdm starts a background thread per process to watch for stalled bars. A thread
alive in the parent makes a later `fork` unsafe (pack and the DataLoader fork worker
processes), and it outlives the bar; our bars refresh on update, which is enough.

A bar shows work; it must not end it. `shardstream pack ... 2>&1 | head` closes the
bar's pipe, and tqdm lets a write's BrokenPipeError through (it quiets EIO only): the
pack stopped midway, its manifest unwritten. Bars write through `streams.QuietStderr`.
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from .streams import QuietStderr

__all__ = ["progress_bar"]


class _Bar(tqdm):  # type: ignore[misc,type-arg]
    monitor_interval = 0


def progress_bar(**options: Any) -> tqdm:  # type: ignore[type-arg]
    """A tqdm bar (same options) that starts no monitor thread, and writes to stderr
    until its reader goes (then to nowhere)."""
    return _Bar(**{"file": QuietStderr(), **options})
