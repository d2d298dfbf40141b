"""Progress bars without tqdm's monitor thread.

tqdm starts a background thread per process to watch for stalled bars. A thread
alive in the parent makes a later `fork` unsafe (pack and the DataLoader fork worker
processes), and it outlives the bar; our bars refresh on update, which is enough.
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

__all__ = ["progress_bar"]


class _Bar(tqdm):  # type: ignore[misc,type-arg]
    monitor_interval = 0


def progress_bar(**options: Any) -> tqdm:  # type: ignore[type-arg]
    """A tqdm bar (same options) that starts no monitor thread."""
    return _Bar(**options)
