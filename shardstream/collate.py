"""Collating samples into batches, in the workers.

`default_collate` is torch's: tensors are stacked, numbers become tensors, tuples and
dicts are collated field by field. `pad_collate` is for variable-length sequences.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data import default_collate

__all__ = ["default_collate", "pad_collate"]


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
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=padding_value)
    labels = default_collate([item[1] for item in batch])
    return padded, lengths, labels
