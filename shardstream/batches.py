"""The structure of a batch: tensors nested in tuples, lists, named tuples and dicts.

What the loader and the device-side transforms need to walk a batch without knowing
its layout: move every tensor, list them, count the samples, replace one field.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

__all__ = ["to_device", "tensors", "count_samples", "map_field"]


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor of a nested batch (tuples, lists, dicts) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        moved = [to_device(v, device, non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested batch, depth first."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from tensors(v)


def count_samples(batch: Any) -> int:
    """Samples in a batch: a list of samples (what ``collate_fn=list`` makes) by its length,
    else the leading dimension of its first tensor (1 if none). A collated list of fields
    (torch's collate of tuples) holds tensors, and counts by them."""
    if isinstance(batch, list) and batch and not isinstance(batch[0], torch.Tensor):
        return len(batch)
    for t in tensors(batch):
        return int(t.shape[0]) if t.dim() else 1
    return len(batch) if isinstance(batch, list) else 1


def map_field(batch: Any, field: int | str, fn: Callable[[Any], Any]) -> Any:
    """`batch` with ``fn`` applied to one field: a key of a dict, an index of a tuple or list."""
    if isinstance(batch, dict):
        return {**batch, field: fn(batch[field])}
    items = list(batch)
    items[field] = fn(items[field])  # type: ignore[index]
    return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
