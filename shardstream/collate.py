"""Collating samples into batches, in the workers.

`default_collate` is torch's, extended through torch's own hook (`collate_fn_map`):
tensors are stacked (in a DataLoader worker, into shared memory reused from batch to
batch: batchmemory.py), numbers become tensors, tuples and dicts are collated field by
field, and `EncodedImage`s (JPEGs left for the device to decode) are packed into one
`EncodedBatch`. `pad_collate` is for variable-length sequences.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .batchmemory import collate_tensors, one_batch, pooled_tensor
from .device_jpeg import EncodedImage, collate_encoded

__all__ = ["default_collate", "pad_collate"]

_COLLATE_FN_MAP = {
    **default_collate_fn_map,
    torch.Tensor: collate_tensors,
    EncodedImage: lambda batch, **_: collate_encoded(batch),
}


def default_collate(batch: Sequence[Any]) -> Any:
    """torch's `default_collate`, which also packs `EncodedImage`s into an `EncodedBatch`."""
    with one_batch():  # a field that fails gives back the slots of the fields stacked before it
        return collate(batch, collate_fn_map=_COLLATE_FN_MAP)


def pad_collate(batch: Sequence[Any], padding_value: float = 0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Collate ``(sequence, label)`` pairs of different lengths.

    Returns ``(padded, lengths, labels)``: `padded` is ``(batch, max_len, ...)`` with
    `padding_value` after each sequence's end, `lengths` the true lengths (int64), and
    the labels collated by `default_collate`. Sequences may be tensors or arrays whose
    first dimension is the length; anything after the first two tuple items is ignored.
    """
    if not batch:
        raise ValueError("pad_collate needs at least one sample")
    sequences = [torch.as_tensor(item[0]) for item in batch]
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    with one_batch():  # labels that fail to collate give the padded sequences' slot back
        padded = _pad(sequences, padding_value)
        labels = default_collate([item[1] for item in batch])
    return padded, lengths, labels


def _pad(sequences: list[torch.Tensor], padding_value: float) -> torch.Tensor:
    """`pad_sequence(batch_first=True)`; in a DataLoader worker, into reused shared memory."""
    first = sequences[0]
    shape = (len(sequences), max(len(s) for s in sequences), *first.shape[1:])
    uniform = all(s.shape[1:] == first.shape[1:] and s.dtype == first.dtype for s in sequences)
    if not uniform or (padded := pooled_tensor(shape, first.dtype)) is None:
        return torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=padding_value)
    padded.fill_(padding_value)
    for row, sequence in zip(padded, sequences):
        row[: len(sequence)] = sequence
    return padded
