"""The fused JPEG transforms: torchvision's crop distribution, right pixels, uint8 CHW out."""

from __future__ import annotations

import io
import itertools
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


def _jpeg_variants() -> list[bytes]:
    rng = np.random.default_rng(3)
    # Photo-like: smooth shapes (low-resolution noise, upsampled) plus a little grain.
    coarse = Image.fromarray((rng.random((24, 36, 3)) * 255).astype(np.uint8)).resize((467, 301), Image.BICUBIC)
    photo = np.clip(np.asarray(coarse, dtype=np.int16) + rng.integers(-6, 7, (301, 467, 3)), 0, 255).astype(np.uint8)
    out = []
    for kwargs in ({"quality": 90}, {"quality": 75, "progressive": True}, {"quality": 95, "subsampling": 0}):
        buf = io.BytesIO()
        Image.fromarray(photo).save(buf, format="JPEG", **kwargs)
        out.append(buf.getvalue())
    grey = io.BytesIO()
    Image.fromarray(photo[:, :, 0]).save(grey, format="JPEG", quality=90)
    return out + [grey.getvalue()]


@pytest.mark.parametrize("at_least", [None, (467, 301), (300, 100), (200, 140), (100, 60), (1, 1)])
def test_simplejpeg_and_pillow_decode_the_same_pixels(at_least):
    """JPEGs are decoded by simplejpeg where it is installed, by Pillow otherwise: the same pixels at every
    scale (both are libjpeg-turbo, and only power-of-two DCT reductions are used), so augmentation does not
    depend on which one a worker has."""
    pytest.importorskip("simplejpeg")
    from shardstream.decode import decode_rgb

    for data in _jpeg_variants():
        fast, pillow = decode_rgb(data, at_least), decode_rgb(data, at_least, use_simplejpeg=False)
        assert fast.shape == pillow.shape and fast.shape[2] == 3 and fast.dtype == np.uint8
        assert np.array_equal(fast, pillow)


def test_cmyk_jpeg_is_decoded_to_rgb():
    cmyk = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(cmyk, format="JPEG")  # red
    out = RandomResizedCropJPEG(16, flip=False)(cmyk.getvalue()).float()
    assert out.shape == (3, 16, 16)
    assert out[0].mean() > 200 and out[1].mean() < 60 and out[2].mean() < 60


def test_crop_matches_pillow_crop_and_antialiased_resize():
    """The fused path gives what decoding, cropping and resizing with Pillow gives: up to resampling rounding
    at full scale (torch's antialiased bilinear kernel), exactly where the crop allows a DCT reduction (Pillow's
    draft and resize with the same box)."""
    data = _jpeg_variants()[0]
    full = Image.open(io.BytesIO(data)).convert("RGB")
    reduced = 0
    for seed, size in itertools.product(range(12), (64, 224)):
        torch.manual_seed(seed)
        out = RandomResizedCropJPEG(size, flip=False)(data).permute(1, 2, 0).numpy().astype(int)
        torch.manual_seed(seed)
        top, left, h, w = crop_params(467, 301, (0.08, 1.0), (3 / 4, 4 / 3))
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (max(1, 467 * size // w), max(1, 301 * size // h)))
        sx, sy = image.size[0] / 467, image.size[1] / 301
        box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        ref = np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=box))
        if image.size == full.size:
            assert np.abs(out - ref).mean() < 0.5, (seed, size)
        else:
            reduced += 1
            assert np.array_equal(out, ref), (seed, size)
    assert 0 < reduced < 24  # both paths were taken
