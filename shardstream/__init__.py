"""shardstream: pack image folders into open, indexed tar/zstd shards and stream them
into PyTorch, exactly once per epoch, from local disk or any fsspec URL.

The format, the writer and `pack` import neither torch nor anything torch-shaped;
the dataset and the loader are imported on first use, so ``shardstream pack`` starts
fast and works where torch is absent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    BracePatternError,
    CollateError,
    CorruptIndexError,
    CorruptShardError,
    DecodeError,
    DuplicateKeyError,
    ManifestError,
    MissingFieldError,
    PackError,
    ShardstreamError,
    StorageError,
    WorkerDiedError,
)
from .format import Manifest, ShardInfo
from .pack import PackSummary, pack
from .policy import ErrorPolicy, TooManyErrors
from .reader import ShardReader
from .tarstream import StreamTarReader, open_shard
from .source import Source, open_dataset
from .retry import RetryPolicy
from .writer import ShardWriter
from . import rankcounts as _rankcounts  # noqa: F401  its fork hook, before any fork (rankcounts; imports no torch)

if TYPE_CHECKING:  # the lazy names' types, for type checkers and IDEs, which do not run `__getattr__`
    from .collate import default_collate as default_collate, pad_collate as pad_collate
    from .dataset import StreamingDataset as StreamingDataset
    from .device_jpeg import DecodeOnDevice as DecodeOnDevice, DeferDecode as DeferDecode
    from .loader import (DataLoader as DataLoader, LoaderStats as LoaderStats, Normalize as Normalize,
                         sigterm_held_for_new_workers as sigterm_held_for_new_workers,
                         worker_waits_for_its_parent_on_sigterm as worker_waits_for_its_parent_on_sigterm)
    from .sampling import Mix as Mix, Sampling as Sampling
    from .transforms import CenterCropJPEG as CenterCropJPEG, RandomResizedCropJPEG as RandomResizedCropJPEG
    from .world import World as World

# Public names that need torch, by the module that defines them.
_LAZY = {
    "StreamingDataset": "dataset",
    "DataLoader": "loader",
    "LoaderStats": "loader",
    "Normalize": "loader",
    "worker_waits_for_its_parent_on_sigterm": "loader",
    "sigterm_held_for_new_workers": "loader",
    "World": "world",
    "Sampling": "sampling",
    "Mix": "sampling",
    "pad_collate": "collate",
    "default_collate": "collate",
    "RandomResizedCropJPEG": "transforms",
    "CenterCropJPEG": "transforms",
    "DeferDecode": "device_jpeg",
    "DecodeOnDevice": "device_jpeg",
}

__all__ = [
    "__version__",
    "BracePatternError",
    "CollateError",
    "CorruptIndexError",
    "CorruptShardError",
    "DecodeError",
    "DuplicateKeyError",
    "ErrorPolicy",
    "Manifest",
    "ManifestError",
    "MissingFieldError",
    "PackError",
    "PackSummary",
    "RetryPolicy",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "ShardstreamError",
    "StorageError",
    "Source",
    "StreamTarReader",
    "WorkerDiedError",
    "TooManyErrors",
    "open_dataset",
    "open_shard",
    "pack",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'shardstream' has no attribute {name!r}")
