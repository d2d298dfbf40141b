"""Fused image transforms: JPEG bytes straight to the uint8 CHW tensor a model trains on.

`RandomResizedCropJPEG` does what ``RandomResizedCrop(size) + RandomHorizontalFlip()``
on a decoded image does, with the same distribution of crops as torchvision (the same
`scale`/`ratio` sampling, ten tries, then the central fallback), but in fewer steps:

* DCT-domain downscaling (`PIL.Image.draft`) when the crop is at least twice the
  output size, so large photos are decoded at 1/2, 1/4 or 1/8 resolution;
* crop and resize in one antialiased resampling pass (`Image.resize(box=...)`), with
  no intermediate crop image;
* the flip and the CHW layout as one copy.

Randomness comes from torch's generator, which the dataset seeds per sample from
(seed, epoch, sample), so augmentation is reproducible and resumption exact. Output
is uint8: normalisation belongs on the GPU (`shardstream.loader.Normalize`).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

__all__ = ["RandomResizedCropJPEG", "CenterCropJPEG", "crop_params"]


def crop_params(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                rand: torch.Generator | None = None) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop, exactly as torchvision's RandomResizedCrop."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=rand).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=rand).item())
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=rand).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=rand).item())
            return top, left, h, w
    # Fallback: the central crop, with the ratio clamped into range.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _open(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def _crop_resize(image: Image.Image, box: tuple[int, int, int, int], size: tuple[int, int]) -> Image.Image:
    """Resize the region `box` (top, left, h, w) of `image` to `size` (w, h), using DCT scaling when it applies."""
    top, left, h, w = box
    full_w, full_h = image.size
    # Ask the JPEG decoder for the smallest scale that keeps the crop at least the
    # output size; draft() picks a power-of-two reduction and reports it.
    want = (max(1, full_w * size[0] // max(w, 1)), max(1, full_h * size[1] // max(h, 1)))
    if image.format == "JPEG":
        image.draft("RGB", want)
    sx, sy = image.size[0] / full_w, image.size[1] / full_h
    region = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image.resize(size, Image.Resampling.BILINEAR, box=region)


def _to_chw(image: Image.Image, flip: bool) -> torch.Tensor:
    array = np.asarray(image)
    if flip:
        array = array[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


@dataclass(frozen=True)
class RandomResizedCropJPEG:
    """JPEG (or any image) bytes -> random resized crop, random horizontal flip, uint8 CHW tensor."""

    size: int | tuple[int, int] = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True

    def __call__(self, data: bytes) -> torch.Tensor:
        out = (self.size, self.size) if isinstance(self.size, int) else (self.size[1], self.size[0])
        image = _open(data)
        box = crop_params(image.size[0], image.size[1], self.scale, self.ratio)
        flip = self.flip and bool(torch.rand(1).item() < 0.5)
        return _to_chw(_crop_resize(image, box, out), flip)


@dataclass(frozen=True)
class CenterCropJPEG:
    """Validation transform: resize the short side to `resize`, center crop `size`; uint8 CHW tensor."""

    size: int = 224
    resize: int = 256

    def __call__(self, data: bytes) -> torch.Tensor:
        image = _open(data)
        width, height = image.size
        # The crop of the resized image, mapped back to source pixels.
        factor = min(width, height) / self.resize
        w = h = self.size * factor
        left, top = (width - w) / 2, (height - h) / 2
        box = (int(round(top)), int(round(left)), max(1, int(round(h))), max(1, int(round(w))))
        return _to_chw(_crop_resize(image, box, (self.size, self.size)), False)
