"""The fused JPEG transforms: torchvision's crop distribution, right pixels, uint8 CHW out."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp

from shardstream.transforms import CenterCropJPEG, RandomResizedCropJPEG, crop_params


def torchvision_get_params(width, height, scale, ratio, rng: random.Random):
    """RandomResizedCrop.get_params as torchvision documents it, on Python's RNG (a reference)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def jpeg(array: np.ndarray, quality: int = 95) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG", quality=quality)
    return out.getvalue()


@pytest.mark.parametrize("size", [(447, 382), (500, 200), (120, 900)])
def test_crop_distribution_matches_torchvision(size):
    width, height = size
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    torch.manual_seed(0)
    ours = [crop_params(width, height, scale, ratio) for _ in range(3000)]
    rng = random.Random(1)
    ref = [torchvision_get_params(width, height, scale, ratio, rng) for _ in range(3000)]
    for stat in (lambda p: p[2] * p[3] / (width * height), lambda p: math.log(p[3] / p[2]),
                 lambda p: (p[1] + p[3] / 2) / width, lambda p: (p[0] + p[2] / 2) / height):
        assert ks_2samp([stat(p) for p in ours], [stat(p) for p in ref]).pvalue > 0.001
    for top, left, h, w in ours:
        assert 0 <= top and 0 <= left and top + h <= height and left + w <= width and h > 0 and w > 0


def test_output_is_uint8_chw_and_flips_half_the_time():
    image = np.zeros((120, 160, 3), dtype=np.uint8)
    image[:, :80] = (255, 0, 0)  # left red, right blue
    image[:, 80:] = (0, 0, 255)
    data = jpeg(image)
    crop = RandomResizedCropJPEG(32, scale=(1.0, 1.0), ratio=(160 / 120, 160 / 120))
    torch.manual_seed(0)
    flipped = 0
    for _ in range(200):
        out = crop(data)
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8 and out.is_contiguous()
        left_red = out[0, :, :8].float().mean() > 200 and out[2, :, :8].float().mean() < 60
        right_red = out[0, :, -8:].float().mean() > 200 and out[2, :, -8:].float().mean() < 60
        assert left_red != right_red  # the whole image, possibly mirrored
        flipped += right_red
    assert 70 < flipped < 130  # p = 0.5


def test_large_image_uses_dct_scaling_and_keeps_the_right_region():
    # A 1600x1200 photo-sized image cropped to a 4x smaller region: draft() decodes at a
    # reduced scale, and the box must be mapped into that scale correctly.
    image = np.zeros((1200, 1600, 3), dtype=np.uint8)
    image[:600, :800] = (255, 0, 0)
    image[:600, 800:] = (0, 255, 0)
    image[600:, :800] = (0, 0, 255)
    image[600:, 800:] = (255, 255, 255)
    data = jpeg(image)
    crop = RandomResizedCropJPEG(64, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), flip=False)
    out = crop(data).float()
    quadrant = lambda ys, xs: out[:, ys, xs].mean(dim=(1, 2))
    assert torch.allclose(quadrant(slice(4, 28), slice(4, 28)), torch.tensor([255.0, 0, 0]), atol=40)
    assert torch.allclose(quadrant(slice(4, 28), slice(36, 60)), torch.tensor([0.0, 255, 0]), atol=40)
    assert torch.allclose(quadrant(slice(36, 60), slice(4, 28)), torch.tensor([0.0, 0, 255]), atol=40)
    assert torch.allclose(quadrant(slice(36, 60), slice(36, 60)), torch.tensor([255.0, 255, 255]), atol=40)


def test_center_crop_takes_the_center():
    image = np.zeros((300, 400, 3), dtype=np.uint8)
    image[100:200, 150:250] = 255  # a white square in the middle, 1/3 of the height
    out = CenterCropJPEG(size=90, resize=100)(jpeg(image))
    assert out.shape == (3, 90, 90)
    # short side 300 -> 100, so the 100 px square becomes ~33 px, centred in the 90 px crop
    center = out[:, 35:55, 35:55].float().mean()
    corner = out[:, :20, :20].float().mean()
    assert center > 200 and corner < 30


def test_grey_and_png_inputs_become_rgb():
    grey = io.BytesIO()
    Image.fromarray(np.full((50, 60), 128, dtype=np.uint8)).save(grey, format="PNG")
    out = RandomResizedCropJPEG(16)(grey.getvalue())
    assert out.shape == (3, 16, 16)
    assert int(out.float().mean().round()) == 128
