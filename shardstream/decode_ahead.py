"""Decoding images in threads, ahead of the consumer and in its order, as decoding inline would.

`StreamingDataset(decode_threads=N)` splits each sample's decoding in two:

* **the draws**, in the iterating thread and in sample order: every field but the
  images decoded (labels, JSON, ...), and for a fused transform (`RandomResizedCropJPEG`,
  `CenterCropJPEG`) each image's crop drawn from its JPEG header, from the crops'
  generator under the sample's seed;
* **the pixels**, in N threads: the decode, crop and resize (libjpeg-turbo, Pillow and
  torch, which release the GIL while they work), or the whole decode for ``"rgb8"`` and
  ``"pil"``.

The consumer takes the samples in order and runs the `transform` under the sample's
seed, so the samples are those of ``decode_threads=0``, bit for bit, and a resume stays
exact. A custom `decode` callable may draw random numbers in any order, so
it cannot be split: `DecodeAhead` refuses it.

Why threads: a DataLoader worker process pays for each batch it ships (a shared-memory
tensor, pickling, page faults), about 0.3-0.5 ms of CPU an image on this project's
2-core machine as measured before workers reused their batches' memory
(batchmemory.py); decode threads in the process that consumes pay none of it.
Measured on 2,000 ImageNet-sized JPEGs with `RandomResizedCropJPEG(224)` and batches
of 64 on 2 cores (BENCHMARKS.md): two decode threads in one process 926 img/s, a torch
DataLoader with 2 worker processes 863 (1.04x per round; 1.11x in a second run), first
batch 0.12 against 0.35 s; an ad hoc script before it, four alternating rounds without batching: one
thread 557-606 img/s, two decode threads 1,032-1,099, 2 worker processes 917-963.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .decode import Decoder
from .errors import ShardstreamError
from .fields import IMAGE_EXTENSIONS, field_extension
from .transforms import crop_resize, is_fused

if TYPE_CHECKING:
    import torch

__all__ = ["DecodeAhead"]


@dataclass(frozen=True)
class _Image:
    """An image field left for the pixel half: its bytes, and what decodes them."""

    ext: str
    data: bytes
    decode: str | Callable[[bytes], Any]  # a mode of `Decoder`, or the crop drawn for it


@dataclass(frozen=True)
class DecodeAhead:
    """The two halves of a `Decoder`'s work on a sample, for decoding in threads (module doc)."""

    images: str | Callable[[bytes], Any]  # the dataset's `decode`
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if self.images is None or (callable(self.images) and not is_fused(self.images)):
            raise ValueError(
                "decode_threads needs images to decode in the threads: decode='rgb8' or 'pil', or a fused transform "
                f"(RandomResizedCropJPEG, CenterCropJPEG, without a __call__ or plan of its own), not {self.images!r}; a "
                "custom decode callable may draw random numbers, which threads would reorder")

    def draw(self, sample: dict[str, Any], crops: torch.Generator | None = None
             ) -> tuple[dict[str, Any], dict[str, _Image]]:
        """Decode all but the images, and draw each image's crop (random: from `crops`, seeded
        for the sample).

        Returns the sample with the images still bytes, and the images left to decode. The
        fields are taken in the sample's order, as `Decoder` takes them: where a field fails,
        an image before it that fails too is the error raised, so a sample with two bad
        fields names the one that decoding inline names.
        """
        fields = Decoder(images=None, allow_pickle=self.allow_pickle)
        url, key = str(sample.get("__url__", "")), str(sample.get("__key__", ""))
        decoded: dict[str, Any] = {}
        images: dict[str, _Image] = {}
        for name, value in sample.items():
            if name.startswith("__") or not isinstance(value, (bytes, bytearray, memoryview)):
                decoded[name] = value
                continue
            ext, data = field_extension(name), bytes(value)
            try:
                if ext not in IMAGE_EXTENSIONS:
                    decoded[name] = fields.field(ext, data, url, key, name)
                    continue
                decoded[name] = data
                images[name] = self._left_to_decode(ext, data, url, key, name, crops)
            except ShardstreamError:
                self.pixels(decoded, images)  # an image before this field that fails raises first
                raise
        return decoded, images

    def _left_to_decode(self, ext: str, data: bytes, url: str, key: str, name: str,
                        crops: torch.Generator | None) -> _Image:
        if isinstance(self.images, str):
            return _Image(ext, data, self.images)
        # The crop, from the header; a header that cannot be read is the sample's DecodeError.
        plan = Decoder(images=self.images.plan).field(ext, data, url, key, name, crops)  # type: ignore[union-attr]
        return _Image(ext, data, functools.partial(crop_resize, plan=plan))

    def pixels(self, sample: dict[str, Any], images: dict[str, _Image]) -> dict[str, Any]:
        """The sample with its images decoded (thread-safe; draws nothing)."""
        url, key = str(sample.get("__url__", "")), str(sample.get("__key__", ""))
        out = dict(sample)
        for name, image in images.items():
            out[name] = Decoder(images=image.decode).field(image.ext, image.data, url, key, name)
        return out
