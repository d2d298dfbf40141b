"""Collating samples into batches, in the workers.

`default_collate` is torch's, extended through torch's own hook (`collate_fn_map`):
tensors are stacked (in a DataLoader worker, into shared memory reused from batch to
batch: batchmemory.py), numbers become tensors, tuples and dicts are collated field by
field, and `EncodedImage`s (JPEGs left for the device to decode) are packed into one
`EncodedBatch`. `pad_collate` is for variable-length sequences.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .batchmemory import collate_tensors, one_batch, pooled_tensor
from .decode import image_formats_hint
from .device_jpeg import EncodedImage, collate_encoded
from .errors import CollateError, ShardstreamError, reason

__all__ = ["collated", "default_collate", "dicts_unlike_the_first", "is_own_collate", "pad_collate", "unlike_the_first"]

def _collate_ints(batch: Sequence[Any], **_: Any) -> torch.Tensor:
    """torch's collate of a batch whose first number is an int: `torch.tensor(batch)`,
    float32 by torch's default dtype where floats follow (JSON numbers: a timestamp
    1700000000, then 1700000000.123 came back 1700000000.0), where a float first gives
    float64. Here float64 either way."""
    if any(isinstance(number, float) for number in batch):
        return torch.tensor(batch, dtype=torch.float64)
    return torch.tensor(batch)


_COLLATE_FN_MAP = {
    **default_collate_fn_map,
    int: _collate_ints,
    torch.Tensor: collate_tensors,
    EncodedImage: lambda batch, **_: collate_encoded(batch),
}


def default_collate(batch: Sequence[Any]) -> Any:
    """torch's `default_collate`, which also packs `EncodedImage`s into an `EncodedBatch`.

    Dicts, the samples' own (no `fields`) or within them (a JSON field, in a tuple or a
    list), must have the same keys across the batch: torch's collate takes the first's,
    and a key the first lacked vanished from the whole batch, silently."""
    unlike = dicts_unlike_the_first(batch)
    if unlike is not None:
        position, how = unlike
        raise _collate_error(batch, position, how, lambda _: (None, None))
    with one_batch():  # a field that fails gives back the slots of the fields stacked before it
        return collate(batch, collate_fn_map=_COLLATE_FN_MAP)


Where = Callable[[int], "tuple[str | None, str | None]"]  # a batch position -> (shard URL, sample key)


def collated(collate_fn: Callable[[list[Any]], Any], batch: list[Any], where: Where,
             names: Sequence[str] | None = None) -> Any:
    """`collate_fn(batch)`; where it fails, a CollateError naming the first sample unlike the
    batch's first (by `where`, or the sample's own `__key__`) and how it differs (`names`
    names the parts of tuple items), not torch's "stack expects each tensor to be equal
    size ... at entry 1"."""
    try:
        return collate_fn(batch)
    except CollateError as error:
        # default_collate knows no sample of tuple items: the dict unlike the first is named here.
        unlike = dicts_unlike_the_first(batch, names) if error.key is None else None
        if unlike is None:
            raise
        raise _collate_error(batch, *unlike, where) from None
    except ShardstreamError:
        raise
    except Exception as error:
        # pad_collate's sequences differ in length by design: their other dimensions are compared.
        unlike = unlike_the_first(batch, names=names, padded=_underlying(collate_fn) is pad_collate)
        position, how = unlike if unlike is not None else (0, "")
        if not is_own_collate(collate_fn) and how:
            # Code of the user's own may fail for any reason: the difference is told, not blamed.
            name = getattr(collate_fn, "__qualname__", None) or type(collate_fn).__name__
            how = f"differs from the first, which may be why {name} failed: it {how}"
        raise _collate_error(batch, position, how, where, error) from error


def _collate_error(batch: Sequence[Any], position: int, how: str, where: Where,
                   error: BaseException | None = None) -> CollateError:
    item = batch[position]
    url, key = where(position)
    if isinstance(item, Mapping):  # a sample dict names itself
        url, key = item.get("__url__", url), item.get("__key__", key)
    said = f"could not collate a batch of {len(batch)}"
    if how:
        said += f": sample {position} of the batch {how}"
    if error is not None:
        said += f" ({type(error).__name__}: {reason(error)})"
    return CollateError(said, url=url if isinstance(url, str) else None, key=key if isinstance(key, str) else None)


def is_own_collate(collate_fn: Any) -> bool:
    """Whether `collate_fn` is `default_collate` or `pad_collate`, a `functools.partial` of
    one included (``partial(pad_collate, padding_value=-1)``): they draw nothing, and make
    batches of fields."""
    return _underlying(collate_fn) in (default_collate, pad_collate)


def _underlying(collate_fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a `functools.partial` calls (``partial(pad_collate, padding_value=-1)``)."""
    while isinstance(collate_fn, functools.partial):
        collate_fn = collate_fn.func
    return collate_fn


def unlike_the_first(batch: Sequence[Any], *, names: Sequence[str] | None = None,
                     padded: bool = False) -> tuple[int, str] | None:
    """(the position of the first item of `batch` unlike its first item, how it differs),
    or None where all are alike: fields, parts, types, and the shapes and dtypes of
    tensors and arrays. `names` names the parts of tuple items (the dataset's `fields`).
    `padded`: items are `pad_collate`'s, whose sequences (the first part) may differ in
    length, and in dtype (promoted), not in their other dimensions."""
    first = batch[0]
    difference = _padded_difference if padded else functools.partial(_difference, path="")
    for position in range(1, len(batch)):
        how = difference(first, batch[position], names=names)
        if how is not None:
            return position, how
    return None


def _padded_difference(first: Any, item: Any, names: Sequence[str] | None = None) -> str | None:
    """`_difference` of two of `pad_collate`'s items (`unlike_the_first`): a sequence alone,
    or a tuple whose first part is the sequence."""
    if not isinstance(first, (tuple, list)):
        return _sequence_difference(first, item, "the sample")
    if isinstance(item, (tuple, list)) and first and item:
        how = _sequence_difference(first[0], item[0], f"field {_part_name('', 0, names)}")
        if how is not None:
            return how
        first, item = (None, *first[1:]), (None, *item[1:])  # the rest compared as default_collate's
    return _difference(first, item, "", names)


def _sequence_difference(first: Any, item: Any, name: str) -> str | None:
    if not (isinstance(first, (torch.Tensor, np.ndarray)) and isinstance(item, (torch.Tensor, np.ndarray))):
        return None
    if tuple(first.shape[1:]) == tuple(item.shape[1:]):
        return None
    return (f"has {name} of shape {tuple(item.shape)}, the batch's first {tuple(first.shape)}: sequences may "
            "differ in their length (the first dimension) only")


def _difference(first: Any, item: Any, path: str, names: Sequence[str] | None = None) -> str | None:
    where = f"field {path}" if path else "the sample"
    if isinstance(first, Mapping) and isinstance(item, Mapping):
        if first.keys() != item.keys():
            return _keys_differ(first, item, path)
        children = ((f"{path}.{key}" if path else str(key), first[key], item[key]) for key in first)
    elif type(first) is not type(item):
        return f"has {where} a {type(item).__name__}, where the batch's first has a {type(first).__name__}"
    elif isinstance(first, (tuple, list)):
        if len(first) != len(item):
            parts = f"{len(item)} parts" if not path else f"field {path} of {len(item)} items"
            return f"has {parts}, the batch's first {len(first)}"
        children = ((_part_name(path, i, names), a, b) for i, (a, b) in enumerate(zip(first, item)))
    elif isinstance(first, (torch.Tensor, np.ndarray)):
        if tuple(first.shape) != tuple(item.shape):
            return f"has {where} of shape {tuple(item.shape)}, the batch's first {tuple(first.shape)}"
        if first.dtype != item.dtype:
            return f"has {where} of dtype {item.dtype}, the batch's first {first.dtype}"
        return None
    else:
        return None
    for child_path, a, b in children:
        how = _difference(a, b, child_path)
        if how is not None:
            return how
    return None


def _keys_differ(first: Mapping, item: Mapping, path: str) -> str:
    missing, extra = sorted(map(str, first.keys() - item.keys())), sorted(map(str, item.keys() - first.keys()))
    told = (["no " + ", ".join(missing)] if missing else []) + ([", ".join(extra)] if extra else [])
    whose = f"the keys of field {path}" if path else "its fields"
    hint = "" if path else image_formats_hint([*missing, *extra])
    return f"has {' and '.join(told)} among {whose}, unlike the batch's first{hint}"


def _part_name(path: str, i: int, names: Sequence[str] | None) -> str:
    """Part `i` of a tuple or list at `path`: by `names` at the top (the dataset's `fields`)."""
    if names is not None and not path and i < len(names):
        return str(names[i])
    return f"{path}[{i}]" if path else str(i)


# -- dicts within samples: torch's collate takes the first's keys -------------------------------

_Tree = tuple  # ("map", {key: _Tree}) or ("seq", {index: _Tree}): where a sample holds dicts


def dicts_unlike_the_first(batch: Sequence[Any], names: Sequence[str] | None = None) -> tuple[int, str] | None:
    """(the position of the first item of `batch` whose dicts have other keys than the
    first item's, how), or None: the samples' own dicts and those within them (a JSON
    field, in a tuple or a list), where torch's collate takes the first's keys and drops a
    key the first lacked. Only the parts of the first item that hold dicts are compared
    (`_dicts_in`): a list of 2,048 numbers per sample cost 33x the collate, looked into."""
    if not batch:
        return None
    tree = _dicts_in(batch[0])
    if tree is None:
        return None
    for position in range(1, len(batch)):
        how = _dict_difference(tree, batch[0], batch[position], "", names)
        if how is not None:
            return position, how
    return None


def _dicts_in(item: Any) -> _Tree | None:
    """Where `item` holds dicts: a dict (its keys compared; its values that hold dicts looked
    into), a list or tuple's parts that hold them; None where it holds none."""
    if isinstance(item, Mapping):
        return ("map", {key: tree for key, value in item.items()
                        if isinstance(value, (dict, list, tuple)) and (tree := _dicts_in(value)) is not None})
    if isinstance(item, (list, tuple)):
        parts = {i: tree for i, part in enumerate(item)
                 if isinstance(part, (dict, list, tuple)) and (tree := _dicts_in(part)) is not None}
        return ("seq", parts) if parts else None
    return None


def _dict_difference(tree: _Tree, first: Any, item: Any, path: str, names: Sequence[str] | None = None) -> str | None:
    kind, parts = tree
    if kind == "map":
        if not isinstance(item, Mapping):
            return None  # another type: torch's collate names it
        if first.keys() != item.keys():
            return _keys_differ(first, item, path)
        name = lambda key: f"{path}.{key}" if path else str(key)  # noqa: E731
    else:
        if not isinstance(item, (list, tuple)):
            return None
        name = lambda i: _part_name(path, i, names)  # noqa: E731
    for key, subtree in parts.items():
        if kind == "seq" and key >= len(item):
            continue  # unequal lengths: torch's collate names them
        how = _dict_difference(subtree, first[key], item[key], name(key))
        if how is not None:
            return how
    return None


def pad_collate(batch: Sequence[Any], padding_value: float = 0) -> tuple[Any, ...]:
    """Collate samples whose sequences differ in length: ``(sequence, label, ...)`` tuples
    (``fields=("tokens.npy", "cls")``), or sequences alone.

    A sequence is a tensor or array whose first dimension is its length; its other
    dimensions must agree across the batch (``(T, 80)`` features: T varies). Returns
    ``(padded, lengths, *rest)``: `padded` is ``(batch, max_len, ...)`` with
    `padding_value` after each sequence's end, `lengths` the true lengths (int64;
    ``torch.arange(padded.shape[1]) < lengths[:, None]`` is the mask), and each further
    part of the tuples collated by `default_collate`: ``(padded, lengths, labels)`` for
    pairs, ``(padded, lengths)`` for sequences alone. One field is padded; a sample with
    two sequences of their own lengths needs a collate of its own, which may call this
    once for each.
    """
    if not batch:
        raise ValueError("pad_collate needs at least one sample")
    samples = [_as_parts(item) for item in batch]
    sequences = [torch.as_tensor(parts[0]) for parts in samples]
    # One dtype for all, as default_collate promotes: the first's cast 1.5 to 1 and 300 to 44.
    dtype = functools.reduce(torch.promote_types, (sequence.dtype for sequence in sequences))
    sequences = [sequence.to(dtype) for sequence in sequences]
    _check_padding(padding_value, dtype)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    with one_batch():  # the rest failing to collate gives the padded sequences' slot back
        padded = _pad(sequences, padding_value)
        # Every part after the sequence: anything after the label was dropped, keys and all.
        rest = default_collate([parts[1:] for parts in samples]) if len(samples[0]) > 1 else []
    return (padded, lengths, *rest)


def _as_parts(item: Any) -> tuple[Any, ...]:
    """`item` as pad_collate's parts: a tuple or list's own, or a sequence alone."""
    if isinstance(item, (tuple, list)) and item:
        return tuple(item)
    if isinstance(item, (torch.Tensor, np.ndarray)):
        return (item,)
    raise CollateError(f"pad_collate pads a sequence (a tensor or array), alone or first in a tuple (fields=(...)), "
                       f"not a {type(item).__name__}")


def _check_padding(padding_value: float, dtype: torch.dtype) -> None:
    """A `padding_value` the sequences' dtype cannot hold is refused: filled into shared
    memory in a worker, -1 became 255 in uint8, where the main process refused it."""
    if dtype.is_floating_point or dtype.is_complex:
        return
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not (float(padding_value).is_integer() and low <= padding_value <= high):
        raise CollateError(f"padding_value {padding_value!r} is no value of the sequences' dtype {dtype} "
                           f"(integers {low} to {high})")


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
