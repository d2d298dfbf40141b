"""The structure of a batch: tensors nested in mappings and sequences, and where it can go.

What the loader and the device-side transforms need to walk a batch without knowing
its layout: move every tensor, list them, count the samples, replace one field; and
the device a batch can actually be put on.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Callable, Iterator

import torch

__all__ = ["to_device", "tensors", "count_samples", "map_field", "usable_device"]


def usable_device(device: str | torch.device) -> torch.device:
    """`device`, or the CPU (with a warning) where it is CUDA and this machine has none, so
    that a script written for a GPU runs unchanged, if slowly, on a machine without one."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"device {str(device)!r} asked for, but CUDA is not available: batches stay on the CPU",
                      RuntimeWarning, stacklevel=3)
        return torch.device("cpu")
    return device


def _rebuilt(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """`batch` with `fn` applied to every value of it, its type kept where it can be (as
    torch's `pin_memory` walks a batch: mappings, named tuples, other sequences)."""
    if isinstance(batch, Mapping):
        if isinstance(batch, MutableMapping):  # keeps a subclass's other state (BatchEncoding's)
            out = copy.copy(batch)
            out.update({k: fn(v) for k, v in batch.items()})
            return out
        try:
            return type(batch)({k: fn(v) for k, v in batch.items()})  # type: ignore[call-arg]
        except TypeError:
            return {k: fn(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(fn(v) for v in batch))
    try:
        return type(batch)([fn(v) for v in batch])  # type: ignore[call-arg]
    except TypeError:  # a sequence that cannot be made from a list
        return [fn(v) for v in batch]


def _walked(batch: Any) -> bool:
    """Whether `batch` is a container whose values are walked (strings and bytes are values)."""
    return isinstance(batch, Mapping) or (isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)))


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor of a nested batch (mappings and sequences, their types kept) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if _walked(batch):
        return _rebuilt(batch, lambda v: to_device(v, device, non_blocking))
    return batch


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested batch (mappings and sequences), depth first."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from tensors(v)
    elif _walked(batch):
        for v in batch:
            yield from tensors(v)


def count_samples(batch: Any, by_first_field: bool = False) -> int:
    """Samples in a batch.

    `by_first_field`: the batch is what a collate of fields makes (`default_collate`,
    `pad_collate`: a tensor, or fields in a list, tuple or dict), counted by its first
    field where that is a tensor (its leading dimension), else by the first field that
    is (a first field of two views, ``((view1, view2), label)``, is a list of two batches:
    counted by its length it made 2 samples of 8), else by the first field's length (the
    keys' list, an EncodedBatch, a list of per-sample tensors). Otherwise
    (another collate) a list whose first item is not a tensor is a list of samples
    (``collate_fn=list``: torch's DataLoader turns each sample tuple into a list, so the
    structure alone cannot tell it from collated fields), and anything else counts by the
    leading dimension of its first tensor (1 if none).
    """
    if by_first_field:
        fields = [batch]
        if isinstance(batch, Mapping):
            fields = list(batch.values())
        elif isinstance(batch, (list, tuple)):
            fields = list(batch)
        for field in fields:
            if isinstance(field, torch.Tensor) and field.dim():
                return int(field.shape[0])
        first = fields[0] if fields else None
        if first is not None and not isinstance(first, torch.Tensor) and hasattr(first, "__len__"):
            return len(first)  # a list of keys, an EncodedBatch
    if isinstance(batch, list) and batch and not isinstance(batch[0], torch.Tensor):
        return len(batch)
    for t in tensors(batch):
        return int(t.shape[0]) if t.dim() else 1
    return len(batch) if isinstance(batch, list) else 1


def map_field(batch: Any, field: int | str, fn: Callable[[Any], Any]) -> Any:
    """`batch` with ``fn`` applied to one field: a key of a dict, an index of a tuple or list."""
    if isinstance(batch, Mapping) and field not in batch:
        # The default field 0 is a tuple batch's first (fields=(...)); a dict batch has names.
        raise ValueError(f"the batch has no field {field!r}: it holds {sorted(map(str, batch))}; name the image's "
                       "field (field=\"jpg\"), or give the dataset fields=(\"jpg\", \"cls\") for tuple batches")
    if isinstance(batch, Mapping):
        if isinstance(batch, MutableMapping):
            out = copy.copy(batch)
            out[field] = fn(batch[field])
            return out
        return {**batch, field: fn(batch[field])}
    items = list(batch)
    items[field] = fn(items[field])  # type: ignore[index]
    return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
