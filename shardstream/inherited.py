"""The caller's process-wide settings that a DataLoader worker started fresh must be sent.

A forked worker inherits its parent's memory, settings and all. One started by spawn or
forkserver (macOS and Windows by default, and where a user asks for it) is a fresh
interpreter that receives the dataset pickled, and in it:

* Pillow's pixel limit (`PIL.Image.MAX_IMAGE_PIXELS`) is Pillow's default: a limit raised
  for trusted large photos failed them in spawned workers alone;
* the warning filters are Python's defaults plus ``-W``/``PYTHONWARNINGS``: a warning the
  training script silenced (`warnings.filterwarnings("ignore", ...)`) printed once per
  worker, and one it made an error (``"error"``, to stop on a wrong setting) was printed
  and the epoch went on.

The dataset carries both in its pickled state while a worker is being started, and the
worker takes them on as it unpickles the dataset. Each filter travels pickled on its own:
one that does not pickle (a category class made inside a function), or does not unpickle
in the worker (a class made under ``if __name__ == "__main__":``, in a notebook), stays
behind, counted in one line of the worker's log, rather than fail the worker's start.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from typing import Any

from PIL import Image

__all__ = ["callers_settings", "take_on"]

log = logging.getLogger("shardstream")


def callers_settings() -> dict[str, Any]:
    """This process's pixel limit and warning filters (each pickled), for a worker being started."""
    sent, left = [], 0
    for entry in warnings.filters:
        try:
            sent.append(pickle.dumps(entry))
        except Exception:  # a local class, a pattern of an odd kind: not worth failing the start over
            left += 1
    return {"pixel_limit": Image.MAX_IMAGE_PIXELS, "warning_filters": sent, "filters_left": left}


def take_on(settings: dict[str, Any]) -> None:
    """Make `settings` (from `callers_settings` in the parent) this worker process's own."""
    Image.MAX_IMAGE_PIXELS = settings["pixel_limit"]
    filters = settings.get("warning_filters")
    if filters is None:
        return
    taken, left = [], settings.get("filters_left", 0)
    for entry in filters:
        try:
            taken.append(pickle.loads(entry))
        except Exception:  # its category is a class this process cannot import
            left += 1
    warnings.resetwarnings()  # no filters, and the modules' records of what was shown dropped
    warnings.filters.extend(taken)  # before any warning: the next one reads them afresh
    if left:  # logged, not warned: under the caller's "error" filter a warning here failed the worker's start
        log.warning("%d of the training process's warning filters could not be sent to this DataLoader worker "
                    "(they do not pickle, or name a class it cannot import); it warns without them", left)
