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
worker takes them on as it unpickles the dataset. Filters that do not pickle (a category
class defined inside a function) stay behind, and are named in the worker's one warning.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

from PIL import Image

__all__ = ["callers_settings", "take_on"]


def callers_settings() -> dict[str, Any]:
    """This process's pixel limit and warning filters, for a worker being started."""
    sent, left = [], []
    for entry in warnings.filters:
        try:
            pickle.dumps(entry)
        except Exception:  # a local class, a pattern of an odd kind: not worth failing the start over
            left.append(entry)
        else:
            sent.append(entry)
    return {"pixel_limit": Image.MAX_IMAGE_PIXELS, "warning_filters": sent, "filters_left": len(left)}


def take_on(settings: dict[str, Any]) -> None:
    """Make `settings` (from `callers_settings` in the parent) this worker process's own."""
    Image.MAX_IMAGE_PIXELS = settings["pixel_limit"]
    filters = settings.get("warning_filters")
    if filters is None:
        return
    warnings.resetwarnings()  # no filters, and the modules' records of what was shown dropped
    warnings.filters.extend(filters)  # before any warning: the next one reads them afresh
    if settings.get("filters_left"):
        warnings.warn(f"{settings['filters_left']} of the training process's warning filters could not be sent to "
                      "this DataLoader worker (they do not pickle); it warns without them", stacklevel=2)
