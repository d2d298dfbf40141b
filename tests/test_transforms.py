"""The fused JPEG transforms: torchvision's crop distribution, right pixels, uint8 CHW out."""

from __future__ import annotations

import base64
import io
import itertools
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp

from shardstream.decode import REGION_DECODER, decode_rgb, decode_rgb_crop, jpeg_reduction
from shardstream.transforms import CenterCropJPEG, CropPlan, RandomResizedCropJPEG, crop_params, crop_resize


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


@pytest.mark.parametrize("at_least", [None, (467, 301), (300, 100), (200, 140), (100, 60), (117, 76), (1, 1)])
def test_simplejpeg_and_pillow_decode_the_same_pixels(at_least):
    """JPEGs are decoded by simplejpeg where it is installed, by Pillow otherwise: the same pixels at every
    scale (both are libjpeg-turbo, only power-of-two DCT reductions are used, and both choose them by
    Pillow's `draft` rule: (117, 76) of a 467 x 301 image was 1/4 for simplejpeg and 1/2 for Pillow), so
    augmentation does not depend on which one a worker has."""
    pytest.importorskip("simplejpeg")
    from shardstream.decode import decode_rgb

    for data in _jpeg_variants():
        fast, pillow = decode_rgb(data, at_least), decode_rgb(data, at_least, use_simplejpeg=False)
        assert fast.shape == pillow.shape and fast.shape[2] == 3 and fast.dtype == np.uint8
        assert np.array_equal(fast, pillow)


def test_an_mpo_is_reduced_and_decoded_as_a_jpeg_by_pillow():
    """Pillow opens a JPEG holding more pictures after the first (MPO: stereo, depth, cameras' previews) as
    format "MPO": it is drafted at the same reduction as the same picture saved as a plain JPEG, so an
    install with Pillow alone gives the pixels simplejpeg and the region decoder give (it was decoded at
    full size, every crop 12-27 levels off)."""
    from shardstream.decode import decode_rgb

    first = Image.open(io.BytesIO(_jpeg_variants()[0])).convert("RGB").resize((1200, 840), Image.BICUBIC)
    mpo, plain = io.BytesIO(), io.BytesIO()
    first.save(mpo, "MPO", save_all=True, append_images=[first.rotate(90)], quality=90)
    first.save(plain, "JPEG", quality=90)
    assert Image.open(io.BytesIO(mpo.getvalue())).format == "MPO"
    for at_least in ((300, 210), (600, 420), None):
        reduced = decode_rgb(mpo.getvalue(), at_least, use_simplejpeg=False)
        assert np.array_equal(reduced, decode_rgb(plain.getvalue(), at_least, use_simplejpeg=False)), at_least
    assert decode_rgb(mpo.getvalue(), (300, 210), use_simplejpeg=False).shape == (210, 300, 3)


def test_cmyk_jpeg_is_decoded_to_rgb():
    cmyk = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(cmyk, format="JPEG")  # red
    out = RandomResizedCropJPEG(16, flip=False)(cmyk.getvalue()).float()
    assert out.shape == (3, 16, 16)
    assert out[0].mean() > 200 and out[1].mean() < 60 and out[2].mean() < 60


def test_crop_matches_pillow_crop_and_antialiased_resize():
    """The fused path gives what decoding, cropping and resizing with Pillow gives: up to resampling rounding
    at full scale (torch's antialiased bilinear kernel); where the crop allows a DCT reduction, Pillow's draft,
    a crop to the box's pixels and a resize of the box in them (a crop then a resize: nothing outside the box
    is read), exactly from a whole decode, and within one level from a region decode (the box's offset in the
    region changes the float rounding of the filter's coefficients)."""
    data = _jpeg_variants()[0]
    full = Image.open(io.BytesIO(data)).convert("RGB")
    reduced = 0
    for seed, size in itertools.product(range(12), (64, 224)):
        torch.manual_seed(seed)
        out = RandomResizedCropJPEG(size, flip=False)(data).permute(1, 2, 0).numpy().astype(int)
        torch.manual_seed(seed)
        top, left, h, w = crop_params(467, 301, (0.08, 1.0), (3 / 4, 4 / 3))
        image = Image.open(io.BytesIO(data))
        _, (_, _, right, bottom) = image.draft("RGB", (max(1, 467 * size // w), max(1, 301 * size // h)))
        sx, sy = right / 467, bottom / 301  # the full image's box in the decoded pixels: 1/k, not size over size
        box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        x0, y0 = math.floor(box[0]), math.floor(box[1])
        cropped = image.convert("RGB").crop((x0, y0, math.ceil(box[2]), math.ceil(box[3])))
        ref = np.asarray(cropped.resize((size, size), Image.Resampling.BILINEAR,
                                        box=(box[0] - x0, box[1] - y0, box[2] - x0, box[3] - y0)))
        if image.size == full.size:
            assert np.abs(out - ref).mean() < 0.5, (seed, size)
        else:
            reduced += 1
            assert np.abs(out - ref).max() <= (1 if REGION_DECODER else 0), (seed, size)
    assert 0 < reduced < 24  # both paths were taken


needs_region_decoder = pytest.mark.skipif(not REGION_DECODER, reason="the _jpegregion extension is not built")


def _region_variants() -> list[bytes]:
    """Every chroma subsampling libjpeg upsamples differently, progressive, grey, and odd sizes."""
    rng = np.random.default_rng(5)
    out = _jpeg_variants()
    for size, subsampling in (((333, 251), 1), ((97, 61), 2), ((1203, 857), 2)):  # 4:2:2, 4:2:0
        coarse = Image.fromarray((rng.random((9, 13, 3)) * 255).astype(np.uint8)).resize(size, Image.BICUBIC)
        buf = io.BytesIO()
        coarse.save(buf, format="JPEG", quality=85, subsampling=subsampling)
        out.append(buf.getvalue())
    # 4:4:0 and 4:1:1, which Pillow does not write; their upsampling took partial decodes the longest to get
    # right in libjpeg-turbo.
    import simplejpeg

    for size, subsampling in (((210, 157), "440"), ((301, 199), "411")):
        coarse = Image.fromarray((rng.random((9, 13, 3)) * 255).astype(np.uint8)).resize(size, Image.BICUBIC)
        out.append(simplejpeg.encode_jpeg(np.ascontiguousarray(np.asarray(coarse)), quality=85,
                                          colorsubsampling=subsampling))
    return out


@needs_region_decoder
@pytest.mark.parametrize("region", [True, False])
def test_a_reduced_random_crop_reads_nothing_outside_its_box(monkeypatch, region):
    """Regression: at a DCT reduction, the box resize read the margin decoded around the crop, so the output's
    edge rows and columns blended in what lies outside it (a crop then a resize, RandomResizedCrop's order,
    never sees it): the crop of exactly a white square on black came out with grey edges (195)."""
    import shardstream.decode as decode_module

    if not region:  # the whole image decoded (reduced), as where the region decoder is not built
        monkeypatch.setattr(decode_module, "_jpegregion", None)
    pixels = np.zeros((1600, 1600, 3), np.uint8)
    pixels[400:1200, 400:1200] = 255
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, "JPEG", quality=95, subsampling=0)
    plan = CropPlan((1600, 1600), (400, 400, 800, 800), (224, 224), False)
    out = crop_resize(encoded.getvalue(), plan)
    assert out.shape == (3, 224, 224) and int(out.min()) >= 250, int(out.min())


def test_region_decode_gives_the_pixels_of_the_whole_decode():
    """For random boxes at every DCT reduction, the region decoder's pixels are the whole decode's pixels at
    the same place, byte for byte (its first and last columns included, where fancy upsampling reads a
    neighbour), and the box lies where it says."""
    rng = random.Random(0)
    checked = set()
    for data in _region_variants():
        width, height = Image.open(io.BytesIO(data)).size
        for _ in range(12):
            top, left, h, w = crop_params(width, height, (0.02, 1.0), (1 / 3, 3), torch.Generator().manual_seed(rng.randrange(1 << 30)))
            k = rng.choice((1, 2, 4, 8))
            at_least = (max(1, -(-width // k)), max(1, -(-height // k)))
            crop = decode_rgb_crop(data, (width, height), (top, left, h, w), at_least, margin=rng.randrange(4))
            whole = decode_rgb(data, at_least)
            checked.add((whole.shape[0] != height, crop.reduced))
            sy = sx = 1 / jpeg_reduction((width, height), at_least)  # k x k full-size pixels a decoded one
            y0 = math.floor(top * sy) - math.floor(crop.box[0])
            x0 = math.floor(left * sx) - math.floor(crop.box[1])
            assert crop.box[2:] == pytest.approx((h * sy, w * sx))
            assert crop.pixels.shape[0] >= math.ceil(h * sy) - 1 and crop.pixels.shape[1] >= math.ceil(w * sx) - 1
            expect = whole[y0 : y0 + crop.pixels.shape[0], x0 : x0 + crop.pixels.shape[1]]
            assert np.array_equal(crop.pixels, expect), (len(data), (top, left, h, w), k)
            if not crop.reduced:
                assert crop.box[:2] == (0, 0) and crop.pixels.shape[:2] == (h, w)  # exactly the box, no margin
    assert checked == {(False, False), (True, True)}  # both scales, and the region knows which it is


@needs_region_decoder
def test_crop_resize_gives_the_same_tensor_with_and_without_the_region_decoder(monkeypatch):
    """Byte for byte where the box is whole pixels at full scale (RandomResizedCropJPEG's, mostly); within a
    level where it falls between pixels (CenterCropJPEG's box, a DCT reduction): Pillow's filter takes the box's
    offset from the region's origin there, not the image's, and its float rounding moves a level now and then."""
    import shardstream.decode as decode

    plans, datas = [], []
    for data, size in itertools.product(_region_variants(), (32, 224)):
        width, height = Image.open(io.BytesIO(data)).size
        for seed in range(6):
            torch.manual_seed(seed)
            plans.append(RandomResizedCropJPEG(size).plan(data))
            datas.append(data)
        plans.append(CenterCropJPEG(size, size + size // 7).plan(data))
        datas.append(data)
    region = [crop_resize(d, p) for d, p in zip(datas, plans)]
    monkeypatch.setattr(decode, "_jpegregion", None)
    whole = [crop_resize(d, p) for d, p in zip(datas, plans)]
    same = 0
    for a, b, plan in zip(region, whole, plans):
        assert a.shape == b.shape == (3, plan.size[1], plan.size[0]) and a.dtype == torch.uint8
        diff = (a.int() - b.int()).abs().max().item()
        assert diff <= 1, plan
        (_, _, h, w), exact = plan.box, all(float(v).is_integer() for v in plan.box) and not plan.resized_first
        if exact and w < 2 * plan.size[0] and h < 2 * plan.size[1]:  # no reduction can apply
            assert diff == 0, plan
            same += 1
    assert same > len(plans) // 3


@needs_region_decoder
def test_region_decoder_refuses_damage_and_the_whole_decode_takes_over():
    """A truncated JPEG warns in libjpeg, which the region decoder treats as an error (as simplejpeg's strict
    mode does): the crop then comes from the whole decode's path, which reports the damage as it always did;
    a CMYK JPEG it cannot convert is decoded whole, to RGB."""
    from shardstream import _jpegregion

    data = _jpeg_variants()[0]
    out = np.empty((10, 10, 3), np.uint8)
    with pytest.raises(ValueError, match="(?i)premature end|corrupt|data"):
        _jpegregion.decode_region(data[: len(data) // 2], out, 1, 250, 0, 10, 10)
    with pytest.raises(ValueError, match="outside"):
        _jpegregion.decode_region(data, out, 1, 295, 0, 10, 10)
    with pytest.raises(ValueError, match="needs 300"):
        _jpegregion.decode_region(data, np.empty(299, np.uint8), 1, 0, 0, 10, 10)
    with pytest.raises(ValueError, match="denom"):
        _jpegregion.decode_region(data, out, 3, 0, 0, 10, 10)
    plan = CropPlan((467, 301), (250, 0, 40, 40), (16, 16), False)
    with pytest.raises((OSError, ValueError)):
        crop_resize(data[: len(data) // 2], plan)
    cmyk = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(cmyk, format="JPEG")
    crop = decode_rgb_crop(cmyk.getvalue(), (40, 30), (5, 5, 20, 20), (40, 30))
    assert crop.pixels.shape == (30, 40, 3) and crop.pixels[..., 0].mean() > 200  # whole, red


@needs_region_decoder
def test_region_decoder_runs_in_threads_at_once():
    """It releases the GIL while it decodes: threads decoding together get what one thread gets."""
    from concurrent.futures import ThreadPoolExecutor

    data = _region_variants()[-1]  # 1203 x 857
    boxes = [(t, l, 300, 400) for t in range(0, 500, 50) for l in range(0, 800, 100)]
    one = [decode_rgb_crop(data, (1203, 857), b, (1203, 857)).pixels for b in boxes]
    with ThreadPoolExecutor(4) as pool:
        many = list(pool.map(lambda b: decode_rgb_crop(data, (1203, 857), b, (1203, 857)).pixels, boxes))
    assert all(np.array_equal(a, b) for a, b in zip(one, many))


def _claiming(data: bytes, width: int, height: int) -> bytes:
    """`data` with its frame header (SOF0) claiming another size."""
    at = data.index(b"\xff\xc0")
    return data[: at + 5] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + data[at + 9 :]


@pytest.mark.parametrize("decode", ["rgb8", RandomResizedCropJPEG(32), CenterCropJPEG(32, 40)], ids=str)
def test_a_jpeg_claiming_billions_of_pixels_is_refused_before_decoding(decode):
    """A few kilobytes of JPEG can claim 65,535 x 65,535 pixels (12.9 GB of RGB): past Pillow's bomb limit it is
    a DecodeError naming the sample, from the header alone, whichever decoder would run."""
    from shardstream import DecodeError
    from shardstream.decode import Decoder

    import tracemalloc

    bomb = _claiming(_jpeg_variants()[0], 60000, 60000)
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        with pytest.raises(DecodeError, match="decompression bomb") as info:
            Decoder(images=decode)({"__key__": "k1", "__url__": "s.tar", "jpg": bomb})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "k1" in str(info.value)
    assert peak < 50 << 20, f"{peak >> 20} MB allocated before refusing"
    # Within the limit the same header edit is only damage, which the decoders treat as they always did (Pillow
    # fills what is missing): not a bomb.
    try:
        Decoder(images=decode)({"__key__": "k1", "__url__": "s.tar", "jpg": _claiming(_jpeg_variants()[0], 900, 700)})
    except DecodeError as e:
        assert "bomb" not in str(e)


# JPEGs Pillow cannot write (cjpeg's -sample option, libjpeg-turbo 2.1): 4:4:1 (luma 1x4), which simplejpeg's
# header reader refuses with a KeyError, and 4:1:0 (luma 4x2), which the region decoder refuses at a reduction.
JPEG_441 = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoMDAsKCwsNDhIQDQ4RDgsLEBYQ"
    "ERMUFRUVDA8XGBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsNFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQU"
    "FBQUFBQUFBQUFBQUFBT/wAARCAAgABADARQAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6"
    "Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXG"
    "x8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPE"
    "xcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwD4E8I+FPufJ+leyeEfCn3Pkr2Twj4U+58n"
    "6V7J4R8Kfc+St+Q/N+H+Pfh98+P/AAj4U+58leyeEfCn3Pk/SvZPCPhT7nyV7J4R8Kfc+T9KOQ/pjh/j34ffP//Z"
)
JPEG_410 = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAUDBAQEAwUEBAQFBQUGBwwIBwcHBw8LCwkMEQ8SEhEPERETFhwXExQaFRERGCEY"
    "Gh0dHx8fExciJCIeJBweHx7/2wBDAQUFBQcGBw4ICA4eFBEUHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4e"
    "Hh4eHh4eHh4eHh4eHh7/wAARCAAwAEADAUIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6"
    "Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXG"
    "x8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPE"
    "xcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwD5KgsfatCCx9qv29h0+WtC3sP9mq1vY9OK"
    "0bex6cVpW9h0+WtG3sOny1406vtD18jzC1tTEt9P6fLWhb6f/s1oW+nf7NaFvp3+zUdvp/8As1pW+n9PlrRt9O6fLWlb6d0+"
    "WuSeF5z9iyPM7W1PK7ax9q07ax6cVp21h04rTtrDp8tZlrY9OK1bWx6cVqWth0+WtS1sOny1hg6vtD+Y8lzC1tTHttP6fLWn"
    "baf0+WtO207p8tadtp3T5ap2un9PlrUtdP6fLWpa6d0+WtS107p8tfU4PC85+tZLmdrani9rY9OK1rWx6fLWta2HT5a1rWw6"
    "cViWlj04rXtLHpxWvaWHT5a17Sw6fLXwuS1faWP5syjMLW1Mu10/p8tatrp/T5a0ktIoI/MlIVc4zimGSaX5YE8pfX+I/wCH"
    "+easWmn9PlrQaGO1i3uMk/dXuTVNbaW5k3ykn0HYfStO007p8terxTn08twscLhnarU69Yx7+r2Xz6pH67w7jFOSk9kf/9k="
)


# 40x16 JPEGs whose components are sampled differently from each other (Y, Cb, Cr as h x v: 1x1, 2x1, 4x1;
# 2x1, 4x1, 1x2; 4x1, 2x2, 1x2), from a libjpeg encoder that sets any factors (cjpeg's -sample sets them too).
JPEG_MIXED_112141 = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAQDAwMDAgQDAwMEBAQFBgoGBgUFBgwICQcKDgwPDg4MDQ0PERYTDxAVEQ0NExoT"
    "FRcYGRkZDxIbHRsYHRYYGRj/2wBDAQQEBAYFBgsGBgsYEA0QGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgY"
    "GBgYGBgYGBgYGBgYGBj/wAARCAAQACgDAREAAiEBA0EB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6"
    "Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXG"
    "x8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPE"
    "xcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwDdm+z2vgWLQ2uYzNp1vHfKCQC5eNk2j1+/"
    "n8K87i7DLKctnw/D3pNXbXmt7HJl9BUOFsNlcdeVvX1/r/hzp46wuC4zpqlCrGKT6tbdPP1tol6My4W8P1k9CFKnUUvR6rT7"
    "9F8te7PtZ8eVuGqDw/sXLm8r+S2ul+O1vX8Nw+V/2rmk80rStd3/AD+7y0ORtZBHZQxtG2VQKcD0GP7wr7/IqFfC4KEKceZe"
    "jf6MD73F+F2BzyTrPEpP1T08u33+mmoABt+IvB85+IJ1dbyQRrNEnlZOCqsE2n1HzA189l2VPNpyz2q7+0XJbtotf630IqZV"
    "/YeUY6cnfkg36b/8A/n3Kcvx3tUo1pXsvT0ST09dOtlpp/UnCGHqYPArGVZNpbN6t6f1rb1tY4OIfEChisTDC1aabuo/P8f0"
    "6b7n0Wb8ERzPJo4ii+S66dPPTpd9NNeiR6/L8A/tEzTx6p5SOdwQO2Fz2r3OBeNadfJMPVq0rtrsB+CT4XzLBTcY4h+l+z7X"
    "tvrr8rbgAH//2Q=="
)
JPEG_MIXED_214112 = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAQDAwMDAgQDAwMEBAQFBgoGBgUFBgwICQcKDgwPDg4MDQ0PERYTDxAVEQ0NExoT"
    "FRcYGRkZDxIbHRsYHRYYGRj/2wBDAQQEBAYFBgsGBgsYEA0QGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgY"
    "GBgYGBgYGBgYGBgYGBj/wAARCAAQACgDASEAAkEBAxIB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6"
    "Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXG"
    "x8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPE"
    "xcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwDfv7bWvBWiQaf4V0rzdRSTzZJRLgbSfQ9e"
    "hrIub7Vdb1dY7nQBp13qhEMuoCYP544G3b2rVYrCvThTDXqO+8vXv+bPHzfhjMs5w8v7UlabXw6fmvx+S9J4PyjGcKuUaGH5"
    "b9b3/r8/uO3jLBQwWFlmWYzv1ta3yv8A8Dy6GmNw0cHgMYqL5o46pe6+zeal8vhMeBqcp5JhsprvmlXc7N9OWLsdHF8GPHVp"
    "bpBa6as8CjCOHUcfjRWvAWb5NmOHdXD1OX+v69LAACn4IYHFyeI+t259d111PgllGa0f3Sqtpaf1qf/Z"
)
JPEG_MIXED_412212 = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAQDAwMDAgQDAwMEBAQFBgoGBgUFBgwICQcKDgwPDg4MDQ0PERYTDxAVEQ0NExoT"
    "FRcYGRkZDxIbHRsYHRYYGRj/2wBDAQQEBAYFBgsGBgsYEA0QGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgYGBgY"
    "GBgYGBgYGBgYGBgYGBj/wAARCAAQACgDAUEAAiIBAxIB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6"
    "Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWGh4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXG"
    "x8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYkNOEl8RcYGRomJygpKjU2Nzg5"
    "OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPE"
    "xcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwDrNM8E2HhOWS/vbAXAUcYcjB7c5/z+VY2o"
    "+JfiHZ6x5/h7Q/Ls93UzA459OfX+ftUeo63rPiFEm1rwKur+WPvC7EW33OOv9ffNUbD+0fFV0nh5Yv7Ni+59kBDqBkA9u/PI"
    "9M+tedxdhllOWz4fh70mrtrzW9jky+gqHC2GyuOvK3r6/wBf8Oe9l2VPNpyz2q7+0XJbtotf630IqZV/YeUY6cnfkg36b/8A"
    "ANMbho4PAYxUXzRx1S919m81L5fCY8DU5TyTDZTXfNKu52b6csXY6i1+B/jOwhK6bbJcRAY4YDufX/PNFFFfSZFQr4XBQhTj"
    "zL0b/Rgc/AvGtOvkmHq1aV212AU/BDA4uTxH1u3Pruuup8EsozWj+6VVtLT+tT//2Q=="
)


@needs_region_decoder
@pytest.mark.parametrize("data", [JPEG_MIXED_112141, JPEG_MIXED_214112, JPEG_MIXED_412212],
                         ids=["112141", "214112", "412212"])
def test_region_decoder_narrow_boxes_of_mixed_samplings_are_the_whole_decodes(data):
    """Regression: a box 1 to 3 columns wide was widened to 3 columns for the upsampling to see a neighbour,
    which is enough for 4:2:0 and 4:2:2 but not where a component is sampled 4 times across: 8 or 9 of the
    boxes of such an image were up to 36 levels off the whole decode. The span is at least two chroma
    columns' worth now."""
    from shardstream import _jpegregion

    whole = decode_rgb(data)
    height, width = whole.shape[:2]
    for box_width in (1, 2, 3, 4):
        for left in range(width - box_width + 1):
            out = np.empty((height, box_width, 3), np.uint8)
            _jpegregion.decode_region(data, out, 1, 0, left, height, box_width)
            assert np.array_equal(out, whole[:, left : left + box_width]), (box_width, left)


def test_a_subsampling_simplejpeg_does_not_know_is_decoded_by_pillow():
    """Regression: simplejpeg raised KeyError on a valid 4:4:1 JPEG, which escaped as neither a decoded image
    nor a DecodeError, so on_error="skip" could not skip it and the run died."""
    from shardstream.decode import Decoder, image_size

    assert image_size(JPEG_441) == (16, 32)
    pillow = np.asarray(Image.open(io.BytesIO(JPEG_441)).convert("RGB"))
    assert np.array_equal(decode_rgb(JPEG_441), pillow)
    out = Decoder(images="rgb8")({"__key__": "k", "__url__": "u", "jpg": JPEG_441})["jpg"]
    assert tuple(out.shape) in ((3, 32, 16), (32, 16, 3))
    assert RandomResizedCropJPEG(8)(JPEG_441).shape == (3, 8, 8)


@needs_region_decoder
def test_region_decoder_edge_columns_and_samplings_it_refuses():
    """Regressions: a one-column box at the first (or, width 2 mod 16, last) column of a 4:2:0 JPEG was up to
    16 levels off (a two-column span holds one chroma column); 4:1:0 at a DCT reduction was up to 71 levels off
    and is now refused, so the whole decode takes over with the right pixels."""
    from shardstream import _jpegregion

    rng = np.random.default_rng(1)
    for width in (20, 18):
        data = jpeg((rng.random((16, width, 3)) * 255).astype(np.uint8), quality=90)  # Pillow's default: 4:2:0
        whole = decode_rgb(data)
        for left in (0, width - 1):
            out = np.empty((16, 1, 3), np.uint8)
            _jpegregion.decode_region(data, out, 1, 0, left, 16, 1)
            assert np.array_equal(out, whole[:, left : left + 1]), (width, left)
    with pytest.raises(ValueError, match="not decoded by region"):
        _jpegregion.decode_region(JPEG_410, np.empty((10, 10, 3), np.uint8), 2, 3, 3, 10, 10)
    crop = decode_rgb_crop(JPEG_410, (64, 48), (6, 6, 20, 20), (32, 24))
    whole = decode_rgb(JPEG_410, (32, 24))
    assert crop.reduced and np.array_equal(crop.pixels, whole)


def test_center_crop_larger_than_the_resize_is_refused():
    """Regression: size > resize made a negative box, whose slice took the image's last rows (black where
    torchvision's CenterCrop would pad)."""
    with pytest.raises(ValueError, match="size <= resize"):
        CenterCropJPEG(size=288, resize=256)


def test_crop_params_match_torchvision_draw_for_draw_in_float32():
    """torchvision computes the aspect in float32 (torch.log, torch.exp); in float64 seed 26928 on a
    4032 x 3024 image gave a crop one pixel wider, at another place."""
    def torchvision_params(width, height, generator):  # torchvision's RandomResizedCrop.get_params
        area = height * width
        log_ratio = torch.log(torch.tensor((3 / 4, 4 / 3)))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(0.08, 1.0, generator=generator).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
                j = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
                return i, j, h, w
        raise AssertionError("no fallback expected for these sizes")

    for seed in [26928, *range(300)]:
        ours = crop_params(4032, 3024, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(seed))
        assert ours == torchvision_params(4032, 3024, torch.Generator().manual_seed(seed)), seed


def test_a_cut_jpeg_fails_whatever_the_crop():
    """A region decode stops after the crop's last row: a JPEG cut short below the crop decoded for some crops
    and failed for others, so whether a damaged sample was skipped depended on the epoch's draw."""
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8))
    data = io.BytesIO()
    image.resize((320, 240)).save(data, format="JPEG", quality=90)
    cut = data.getvalue()[: len(data.getvalue()) * 6 // 10]
    top = CropPlan((320, 240), (0, 0, 40, 40), (16, 16), False)  # well above the cut
    with pytest.raises((OSError, ValueError)):
        crop_resize(cut, top)
    assert tuple(crop_resize(data.getvalue(), top).shape) == (3, 16, 16)  # the whole file crops


def test_random_resized_crop_takes_torchvisions_sizes_and_refuses_others():
    """Regression: size=[224] (torchvision reads it as (224, 224)) failed every sample as image
    damage, an IndexError while planning each crop; under on_error="skip" each was skipped."""
    data = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 20, 30)).save(data, format="JPEG")
    for size, shape in ((16, (3, 16, 16)), ([16], (3, 16, 16)), ((16,), (3, 16, 16)), ((12, 20), (3, 12, 20)),
                        ([12, 20], (3, 12, 20))):
        assert tuple(RandomResizedCropJPEG(size)(data.getvalue()).shape) == shape, size
    for size in ((), (1, 2, 3), 0, (16, -1), "16", 16.0, True):
        with pytest.raises(ValueError, match="size is a side, or \\(height, width\\)"):
            RandomResizedCropJPEG(size)
    # numpy's integers are sides, as torchvision takes them; a bad scale or ratio is refused here, not as
    # each image's failure (a reversed range raised torch's RuntimeError, a negative scale a DecodeError).
    assert tuple(RandomResizedCropJPEG(np.int64(16))(data.getvalue()).shape) == (3, 16, 16)
    for bad in ({"scale": (1.0, 0.08)}, {"scale": (-1.0, 0.5)}, {"ratio": (4 / 3, 3 / 4)}, {"ratio": (0.0, 1.0)}):
        with pytest.raises(ValueError, match="is \\(min, max\\) with"):
            RandomResizedCropJPEG(16, **bad)
    with pytest.raises(ValueError, match="whole pixels"):
        CenterCropJPEG(224.0)  # failed each image in Pillow
    assert CenterCropJPEG(np.int64(16), np.int64(20)) == CenterCropJPEG(16, 20)


@pytest.mark.parametrize("where", ["two thirds in", "before the end"])
def test_a_marker_inside_the_image_data_fails_whatever_the_crop(where):
    """Regression: a JPEG with a stray segment (a DHT) inside its image data, its end marker
    still there, failed the crops whose rows reached the damage and decoded the others: whether
    the sample was skipped depended on the epoch's draw. With the segment just before the end,
    every crop decoded where the whole decode (rgb8, verify) failed."""
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 40, 3), dtype=np.uint8))
    data = io.BytesIO()
    image.resize((320, 240), Image.BICUBIC).save(data, format="JPEG", quality=90)
    good = data.getvalue()
    sos = good.index(b"\xff\xda")
    at = sos + (len(good) - sos) * 2 // 3 if where == "two thirds in" else len(good) - 2
    bad = good[:at] + b"\xff\xc4\x00\x05\x10\x01" + good[at:]
    for box in ((0, 0, 60, 80), (180, 0, 60, 80), (0, 0, 240, 320)):  # top, bottom, whole
        plan = CropPlan((320, 240), box, (32, 32), False)
        assert tuple(crop_resize(good, plan).shape) == (3, 32, 32)
        with pytest.raises((OSError, ValueError)):
            crop_resize(bad, plan)


def test_pillow_opens_only_the_image_formats_a_field_may_hold():
    """Pillow tells formats by their bytes: an EPS stored as a `jpg` field would run Ghostscript on a shard's
    PostScript. It is not an image here, whichever decoder meets it, and no program is run."""
    import subprocess
    from unittest import mock

    from PIL import EpsImagePlugin

    from shardstream.decode import Decoder
    from shardstream.errors import DecodeError

    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\nnewpath 0 0 moveto 32 0 lineto fill\nshowpage\n%%EOF\n"
    ran = []
    with mock.patch.object(EpsImagePlugin, "gs_binary", "gs"), \
            mock.patch.object(subprocess, "check_call", lambda *a, **k: ran.append(a)):
        for mode in ("rgb8", "pil", RandomResizedCropJPEG(16)):
            with pytest.raises(DecodeError, match="cannot identify image file"):
                Decoder(mode)({"__key__": "k", "__url__": "shard.tar", "jpg": eps})
    assert not ran


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_sixteen_bit_grey_is_scaled_not_clipped(mode):
    """Pillow's convert("RGB") clips 16-bit grey at 255: depth maps, medical and satellite images came out white."""
    values = (np.arange(16 * 64, dtype=np.uint32).reshape(16, 64) * 64)
    data = io.BytesIO()
    image = Image.fromarray(values.astype(np.uint16)) if mode == "I;16" else Image.fromarray(values.astype(np.int32))
    image.save(data, format="PNG" if mode == "I;16" else "TIFF")
    pixels = decode_rgb(data.getvalue())
    assert np.array_equal(pixels[..., 0], (values >> 8).astype(np.uint8))
    assert np.array_equal(pixels[..., 0], pixels[..., 2])


@pytest.mark.parametrize("values", [np.array([[0, 1 << 20]]), np.array([[-5, 100]])], ids=["32-bit", "negative"])
def test_a_32_bit_integer_image_is_refused_naming_the_sample_not_made_white(values):
    """Regression: mode I was read as 16-bit whatever its values: a TIFF of 32-bit values came out all white
    (shifted by 8 and clipped), and negative ones wrapped round."""
    from shardstream.decode import Decoder
    from shardstream.errors import DecodeError

    data = io.BytesIO()
    Image.fromarray(values.astype(np.int32)).save(data, format="TIFF")
    with pytest.raises(DecodeError, match="32-bit integer image .* has no 8-bit reading") as raised:
        Decoder(images="rgb8")({"__key__": "deep", "tif": data.getvalue()})
    assert raised.value.key == "deep"


@pytest.mark.parametrize("size", [(500, 375), (333, 500), (300, 256), (640, 480), (512, 512), (1200, 900)])
def test_center_crop_is_resize_then_crop(size):
    """CenterCropJPEG(224, 256) gives the pixels of torchvision's Resize(256) + CenterCrop(224) on a PIL image
    (Pillow's resize of the whole image, then the crop), within a level of float rounding; an image at least twice
    the crop's size is decoded at a DCT reduction first (its speed), which is close, not the same."""
    width, height = size
    rng = np.random.default_rng(width)
    detail = Image.fromarray(rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)).resize(size)
    data = io.BytesIO()
    detail.save(data, format="JPEG", quality=95)
    short, long = sorted(size)
    new = (256, int(256 * long / short)) if width <= height else (int(256 * long / short), 256)
    top, left = int(round((new[1] - 224) / 2.0)), int(round((new[0] - 224) / 2.0))
    reference = Image.open(io.BytesIO(data.getvalue())).convert("RGB").resize(new, Image.Resampling.BILINEAR)
    expected = torch.from_numpy(np.asarray(reference.crop((left, top, left + 224, top + 224))).copy()).permute(2, 0, 1)
    got = CenterCropJPEG(224, resize=256)(data.getvalue())
    assert got.shape == expected.shape
    difference = (got.int() - expected.int()).abs()
    if min(size) * 224 / 256 < 2 * 224:  # no reduction: the crop's box is less than twice the output
        assert difference.max() <= 1
    else:
        assert difference.float().mean() < 4 and difference.max() < 64


_ARITHMETIC_ENCODER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <jpeglib.h>
/* arith W H in.rgb out.jpg: an RGB image as an arithmetic-coded JPEG (Pillow writes Huffman coding only) */
int main(int argc, char **argv) {
    int w = atoi(argv[1]), h = atoi(argv[2]);
    unsigned char *rgb = malloc((size_t)w * h * 3);
    FILE *in = fopen(argv[3], "rb");
    if (fread(rgb, 1, (size_t)w * h * 3, in) != (size_t)w * h * 3) return 2;
    struct jpeg_compress_struct c; struct jpeg_error_mgr e;
    c.err = jpeg_std_error(&e); jpeg_create_compress(&c);
    FILE *out = fopen(argv[4], "wb"); jpeg_stdio_dest(&c, out);
    c.image_width = w; c.image_height = h; c.input_components = 3; c.in_color_space = JCS_RGB;
    jpeg_set_defaults(&c); jpeg_set_quality(&c, 95, TRUE); c.arith_code = TRUE;
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < c.image_height) { JSAMPROW row = rgb + (size_t)c.next_scanline * w * 3; jpeg_write_scanlines(&c, &row, 1); }
    jpeg_finish_compress(&c); fclose(out); return 0;
}
"""


def test_an_arithmetic_coded_jpeg_over_64_kb_decodes_everywhere(tmp_path):
    """Regression: Pillow feeds libjpeg 64 KB at a time, which libjpeg's arithmetic decoder cannot resume, so a
    valid arithmetic-coded JPEG over 64 KB failed as "broken data stream" with decode="pil", in verify, and when
    pack shrank it, where the other decoders read it."""
    import shutil
    import subprocess

    from shardstream.decode import decode_image
    from shardstream.shrink import shrink_or_keep

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc and libjpeg's headers to write an arithmetic-coded JPEG")
    (tmp_path / "arith.c").write_text(_ARITHMETIC_ENCODER)
    built = subprocess.run(["gcc", "-O1", "-o", str(tmp_path / "arith"), str(tmp_path / "arith.c"), "-ljpeg"],
                           capture_output=True)
    if built.returncode != 0:
        pytest.skip(f"cannot build the encoder: {built.stderr.decode()[-200:]}")
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)  # noise: well over 64 KB at quality 95
    (tmp_path / "in.rgb").write_bytes(pixels.tobytes())
    subprocess.run([str(tmp_path / "arith"), "400", "300", str(tmp_path / "in.rgb"), str(tmp_path / "a.jpg")],
                   check=True)
    data = (tmp_path / "a.jpg").read_bytes()
    assert len(data) > 1 << 16 and b"\xff\xc9" in data  # SOF9: arithmetic coding
    reference = decode_rgb(data)  # the path that read it before (simplejpeg or libjpeg whole)
    assert np.array_equal(np.asarray(decode_image(data, "pil")), reference)
    shrunk, kept = shrink_or_keep(data, 200, 90, path="a.jpg", as_format="JPEG")
    assert kept is None and Image.open(io.BytesIO(shrunk)).size == (200, 150)
