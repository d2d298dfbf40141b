"""Fused image transforms: JPEG bytes straight to the uint8 CHW tensor a model trains on.

`RandomResizedCropJPEG` does what ``RandomResizedCrop(size) + RandomHorizontalFlip()``
on a decoded image does, with the same distribution of crops as torchvision (the same
`scale`/`ratio` sampling, ten tries, then the central fallback), but in fewer steps:

* the image size comes from the JPEG header, before anything is decoded;
* only the part of the JPEG that holds the crop is decoded, where the `_jpegregion`
  extension is built (libjpeg-turbo's partial decoding: the rows above the crop are
  only entropy-decoded, the rows below not at all; `decode.decode_rgb_crop`);
* DCT-domain downscaling when the crop is at least twice the output size, so large
  photos are decoded at a fraction of their resolution;
* the crop is resized channels-last in one antialiased bilinear pass
  (`torch.nn.functional.interpolate`, as torchvision's tensor transforms do; its
  vectorised uint8 kernel needs the channels-last layout, which a region decode gives
  as it is); after a DCT reduction the box falls between pixels, and Pillow's resize
  takes it exactly;
* the output (224 x 224, small) is mirrored and laid out CHW afterwards.

JPEGs are decoded by the region decoder, else by simplejpeg (libjpeg-turbo) where it
is installed (the `fast` extra), else, and for every other format, by Pillow
(`decode.decode_rgb`); all give the same pixels for the same scale (all are
libjpeg-turbo; a DCT-reduced crop resized from a region may differ by one level, the
float rounding of the box's offset in Pillow's filter). Measured on 400 ImageNet-sized
JPEGs of the benchmark set (one core): simplejpeg's whole decode 1.29-1.47 ms; a
region decode of torchvision's crops about 20% less than a whole decode by the same
library; the crop's resize with the flip and layout 0.27 ms from a channels-last copy
(Pillow's resize alone 1.0 ms); the whole transform in BENCHMARKS.md.

Randomness comes from the torch generator passed in, which the dataset makes for its
iteration and seeds per sample from (seed, epoch, sample), so augmentation is
reproducible and resumption exact; called without one (as a torchvision transform is),
a crop draws from torch's global generator. Output is uint8: normalisation belongs on
the GPU (`shardstream.loader.Normalize`).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .arguments import flag
from .decode import decode_rgb_crop, image_size

__all__ = ["RandomResizedCropJPEG", "CenterCropJPEG", "CropPlan", "crop_params", "crop_resize"]


def crop_params(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                rand: torch.Generator | None = None) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop, exactly as torchvision's RandomResizedCrop."""
    area = height * width
    # In float32, as torchvision's `torch.log(torch.tensor(ratio))` and `torch.exp`: float64
    # here gave another crop for 1 seed in 60,000 (a width one pixel off, then other draws).
    log_ratio = _log_ratio(ratio[0], ratio[1])
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=rand).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=rand)).item()
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


@functools.lru_cache(maxsize=16)
def _log_ratio(low: float, high: float) -> tuple[float, float]:
    return tuple(torch.log(torch.tensor((low, high))).tolist())  # type: ignore[return-value]


class CropPlan(NamedTuple):
    """What a fused transform does to one image, drawn before anything is decoded."""

    full: tuple[int, int]  # the image's (width, height)
    # The crop: top, left, height, width, in full-size pixels; whole pixels for random crops,
    # fractional where the crop is of a resized image (CenterCropJPEG), mapped back.
    box: tuple[float, float, float, float]
    size: tuple[int, int]  # the output's (width, height)
    flip: bool  # mirrored left to right
    # The resampling filter reads the image around the box, as a resize of the whole image
    # then a crop does (CenterCropJPEG); else only the box, as a crop then a resize does
    # (RandomResizedCrop's order).
    resized_first: bool = False


def crop_resize(data: bytes, plan: CropPlan) -> torch.Tensor:
    """The crop `plan` describes of the image in `data`, resized, maybe mirrored: uint8 CHW."""
    (_, _, h, w), full, size = plan.box, plan.full, plan.size
    whole = all(float(v).is_integer() for v in plan.box) and not plan.resized_first
    # Decode at the smallest scale that keeps the crop at least the output size, and only
    # the part that holds the crop (where the region decoder is built). Around a reduced
    # box, keep what the bilinear filter reads: its support is the downscale factor.
    want = (max(1, full[0] * size[0] // max(w, 1)), max(1, full[1] * size[1] // max(h, 1)))
    margin = math.ceil(max(h / size[1], w / size[0])) + 1
    crop = decode_rgb_crop(data, full, plan.box, (min(want[0], full[0]), min(want[1], full[1])), margin,
                           around=not whole)
    if not crop.reduced and whole:
        # Full scale: torch's antialiased bilinear kernel (torchvision's tensor transforms
        # use it), on a channels-last copy of the crop, which its uint8 kernel vectorises
        # (a region decode already gives exactly the crop, channels-last: no copy then).
        y, x, h, w = (round(v) for v in (*crop.box[:2], h, w))
        region = torch.from_numpy(crop.pixels)[y : y + h, x : x + w].permute(2, 0, 1).unsqueeze(0)
        region = region.contiguous(memory_format=torch.channels_last)
        out = F.interpolate(region, size=(size[1], size[0]), mode="bilinear", antialias=True)[0]
    else:
        # DCT-reduced, or a crop of a resized image: the box falls between pixels, which
        # Pillow's resize takes exactly (a box resize there is the whole resize's pixels).
        y, x, bh, bw = crop.box
        pixels = crop.pixels
        if whole:
            # A crop then a resize (RandomResizedCrop's order): the filter reads the box's pixels
            # only. Given the margin around it, the edges blended in what lies outside the crop.
            top, left = math.floor(y), math.floor(x)
            pixels = pixels[top : math.ceil(y + bh), left : math.ceil(x + bw)]
            y, x = y - top, x - left
        resized = Image.fromarray(pixels).resize(size, Image.Resampling.BILINEAR, box=(x, y, x + bw, y + bh))
        out = torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1)
    if plan.flip:
        out = out.flip(-1)
    return out.contiguous()


def _pixels(side: object) -> int | None:
    """`side` as an int where it is an integer (numpy's too), else None; never a bool."""
    if isinstance(side, bool):
        return None
    try:
        return operator.index(side)  # type: ignore[arg-type]
    except TypeError:
        return None


@dataclass(frozen=True)
class RandomResizedCropJPEG:
    """JPEG (or any image) bytes -> random resized crop, random horizontal flip, uint8 CHW tensor."""

    size: int | tuple[int, int] = 224  # as torchvision's: an int, or (height, width), or [side]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True

    def __post_init__(self) -> None:
        # Checked here, not at each image: `[224]` failed every sample as image damage (an
        # IndexError in `plan`), and under on_error="skip" each was skipped as a bad sample.
        size = self.size
        sides = list(size) if isinstance(size, (tuple, list)) else [size]
        sides = [_pixels(side) for side in sides]
        if len(sides) not in (1, 2) or not all(side is not None and side > 0 for side in sides):
            raise ValueError(f"RandomResizedCropJPEG's size is a side, or (height, width), in pixels: not {size!r}")
        object.__setattr__(self, "size", sides[0] if len(sides) == 1 else tuple(sides))
        object.__setattr__(self, "flip", flag(self.flip, "flip"))  # "no" flipped half the crops
        # Likewise: a reversed range failed each image in torch, a negative scale as image damage.
        (low, high), (narrow, wide) = self.scale, self.ratio
        if not 0 <= low <= high:
            raise ValueError(f"RandomResizedCropJPEG's scale is (min, max) with 0 <= min <= max: not {self.scale!r}")
        if not 0 < narrow <= wide:
            raise ValueError(f"RandomResizedCropJPEG's ratio is (min, max) with 0 < min <= max: not {self.ratio!r}")

    def plan(self, data: bytes, generator: torch.Generator | None = None) -> CropPlan:
        """Draw this image's crop and flip from `generator` (torch's global one where None),
        reading only the header. A subclass's own `plan` is the user's code: the dataset
        calls it as `plan(data)`, with torch's global generator seeded per sample."""
        out = (self.size, self.size) if isinstance(self.size, int) else (self.size[1], self.size[0])
        full = image_size(data)
        box = crop_params(full[0], full[1], self.scale, self.ratio, generator)
        return CropPlan(full, box, out, self.flip and bool(torch.rand(1, generator=generator).item() < 0.5))

    def __call__(self, data: bytes, generator: torch.Generator | None = None) -> torch.Tensor:
        # A subclass's own `plan(data)` is the user's code: called as it was written.
        return crop_resize(data, self.plan(data) if generator is None else self.plan(data, generator))


@dataclass(frozen=True)
class CenterCropJPEG:
    """Validation transform: resize the short side to `resize`, center crop `size`; uint8 CHW tensor.

    torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` on a PIL image: its geometry,
    and its pixels within a level (a box resize of the crop's part of the image, its
    filter reading around the box as the whole resize does), except for images whose
    short side is at least twice `resize`, which are decoded at a DCT reduction first."""

    size: int = 224
    resize: int = 256

    def __post_init__(self) -> None:
        if _pixels(self.size) is None or _pixels(self.resize) is None:  # 224.0 failed each image in Pillow
            raise ValueError(f"CenterCropJPEG's size and resize are whole pixels: not {self.size!r}, {self.resize!r}")
        object.__setattr__(self, "size", _pixels(self.size))
        object.__setattr__(self, "resize", _pixels(self.resize))
        if not 0 < self.size <= self.resize:
            # torchvision's CenterCrop would pad a crop larger than the resized image.
            raise ValueError(f"CenterCropJPEG needs 0 < size <= resize, not size={self.size}, resize={self.resize}")

    def plan(self, data: bytes, generator: torch.Generator | None = None) -> CropPlan:
        """This image's central crop (`generator` is not drawn from: the signature is the
        random crop's), reading only the header: torchvision's geometry (the
        short side resized to `resize`, the long side to ``int(resize * long / short)``, the
        crop's offset rounded in resized pixels), mapped back to source pixels, so that
        resampling the box gives the pixels of Pillow's resize, then the crop."""
        width, height = full = image_size(data)
        short, long = sorted((width, height))
        resized_long = int(self.resize * long / short)
        new_w, new_h = (self.resize, resized_long) if width <= height else (resized_long, self.resize)
        top, left = int(round((new_h - self.size) / 2.0)), int(round((new_w - self.size) / 2.0))
        sx, sy = width / new_w, height / new_h
        box = (top * sy, left * sx, self.size * sy, self.size * sx)
        return CropPlan(full, box, (self.size, self.size), False, resized_first=True)

    def __call__(self, data: bytes, generator: torch.Generator | None = None) -> torch.Tensor:
        return crop_resize(data, self.plan(data))


def is_fused(images: object) -> bool:
    """Whether `images` crops as one of the fused transforms does (our plan drawn from the
    generator passed, then `crop_resize`): theirs, or a subclass's that keeps their
    `__call__` and `plan`. A subclass's own `__call__` or `plan` is the user's code, which a
    decode in threads (decode_ahead.py) would skip or reorder, and which draws from
    torch's global generator."""
    return type(images).__call__ in (RandomResizedCropJPEG.__call__, CenterCropJPEG.__call__) and plans_crops(images)


def plans_crops(planner: object) -> bool:
    """Whether `planner`'s `plan` is one of the fused transforms' own (drawing from the generator passed)."""
    return getattr(type(planner), "plan", None) in (RandomResizedCropJPEG.plan, CenterCropJPEG.plan)
