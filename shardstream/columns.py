"""The per-sample columns of a shard index: class labels and sampling weights.

Both come from a sample's fields at pack or index time (`cls`, `weight`), are kept in
the index as packed 32-bit arrays (FORMAT.md), and are read back checked, so that
class-weighted sampling (sampling.py) can draw without opening a shard.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import CorruptIndexError, ShardstreamError

__all__ = ["MAX_CLASS", "check_label", "class_of", "label_of", "sampling_weight_of", "weight_of", "check_weight",
           "label_column", "weight_column", "read_labels", "read_weights"]


# The largest class index (FORMAT.md). Labels are int32 in indexes, and a class table is
# made up to the largest: 2**24 (16.7 million) classes is past any dataset's, and keeps that
# table in memory (3e9 would be gigabytes before anything is read).
MAX_CLASS = (1 << 24) - 1


def label_of(cls: bytes) -> int:
    """A sample's class for the index: its `cls` field as an integer, -1 if it is not a
    non-negative one (an index's -1 is "no class")."""
    try:
        label = int(cls)
    except ValueError:
        return -1
    return label if label >= 0 else -1


def check_label(cls: bytes, *, url: str | None = None, key: str | None = None, offset: int | None = None) -> int:
    """`label_of`, refused above `MAX_CLASS` (a class table that large would take gigabytes):
    what a tar's labels may be where they are read for an index or a sampling. Errors name
    the shard (`url`), sample and offset where given."""
    label = label_of(cls)
    if label > MAX_CLASS:
        raise ShardstreamError(f"cls {label} is above the largest class index, {MAX_CLASS}", url=url, key=key,
                               offset=offset)
    return label


def class_of(cls: bytes, **where: Any) -> int:
    """`label_of` for a reader's count of a tar without an index: a class past `MAX_CLASS` is
    no class there (-1), as a non-integer one is. The sample is read as any other; only
    class-weighted sampling, which needs every sample's class, refuses it (`Source.labels`).
    Refused, one such label stopped the whole dataset while it was counted, even under
    `on_error="skip"`. (`where`: what `check_label` takes to name the sample, unused.)"""
    label = label_of(cls)
    return label if label <= MAX_CLASS else -1


def weight_of(weight: bytes) -> float:
    """A sample's sampling weight for the index: its `weight` field as a number, NaN if it is not one."""
    try:
        return float(weight)
    except ValueError:
        return math.nan


def sampling_weight_of(data: bytes, **where: Any) -> float:
    """`check_weight` for a reader's count of a tar without an index: a weight it refuses is no
    weight there (NaN), as `class_of` does for classes. The sample is read as any other; only
    sampling by weight, which needs every sample's, refuses it (`Source.weights`). Refused,
    one `weight` of -1 stopped the whole dataset while it was counted, even under skip."""
    try:
        return check_weight(data)
    except ShardstreamError:
        return math.nan


_MAX_WEIGHT = float(np.finfo(np.float32).max)  # the index keeps weights as float32


def _rounds_to_max(weight: float) -> bool:
    with np.errstate(over="ignore"):
        return float(np.float32(weight)) == _MAX_WEIGHT


def check_weight(data: bytes, *, url: str | None = None, key: str | None = None,
                 offset: int | None = None) -> float:
    """A `weight` field's value, refused unless it is a finite, non-negative number within
    float32's range: what an index may hold, so that every index written can be read.
    Errors name the shard (`url`), sample and offset where given."""
    try:
        weight = float(data)
    except ValueError:
        raise ShardstreamError(f"weight must be a number, not {data[:20]!r}", url=url, key=key,
                               offset=offset) from None
    # Within range where float32 holds it: the 3.4028235e38 that float32's largest prints as
    # lies a hair above it in float64, and rounds to it.
    if not (math.isfinite(weight) and 0 <= weight and (weight <= _MAX_WEIGHT or _rounds_to_max(weight))):
        raise ShardstreamError(f"weight must be finite and non-negative, at most float32's {_MAX_WEIGHT:.4g}, "
                               f"not {weight}", url=url, key=key,
                               offset=offset)
    return weight


def label_column(labels: list[int]) -> np.ndarray | None:
    """The index's `labels` (None when no sample has a class)."""
    return np.asarray(labels, dtype=np.int64) if any(x >= 0 for x in labels) else None


def weight_column(weights: list[float]) -> np.ndarray | None:
    """The index's `weights` (None when no sample has one)."""
    return None if all(math.isnan(w) for w in weights) else np.asarray(weights, dtype=np.float64)


def read_labels(data: Any, n: int, url: str) -> np.ndarray | None:
    """An index's stored `labels` (int32 bytes, or None), checked: `n` of them."""
    if data is None:
        return None
    if not isinstance(data, bytes) or len(data) != 4 * n:
        raise CorruptIndexError(f"labels must be {n} int32 values", url=url)
    labels = np.frombuffer(data, dtype="<i4").astype(np.int64)
    # As writers store them (-1: none): one of 2**31 - 1 made class-weighted sampling count
    # 2**31 classes (16 GiB) from an index that passed every other check.
    if labels.size and (labels.min() < -1 or labels.max() > MAX_CLASS):
        bad = int(labels[(labels < -1) | (labels > MAX_CLASS)][0])
        raise CorruptIndexError(f"labels are class indexes 0..{MAX_CLASS}, or -1 for none; not {bad}", url=url)
    return labels


def read_weights(data: Any, n: int, url: str) -> np.ndarray | None:
    """An index's stored `weights` (float32 bytes, NaN for none, or None), checked: `n` of them."""
    if data is None:
        return None
    if not isinstance(data, bytes) or len(data) != 4 * n:
        raise CorruptIndexError(f"weights must be {n} float32 values", url=url)
    weights = np.frombuffer(data, dtype="<f4").astype(np.float64)
    if np.any(weights < 0) or np.any(np.isinf(weights)):
        raise CorruptIndexError("weights must be finite and non-negative (NaN: no weight)", url=url)
    return weights
