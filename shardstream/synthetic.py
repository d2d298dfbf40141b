"""Deterministic synthetic ImageFolder trees whose JPEGs resemble ImageNet photos.

The demo, tests and benchmarks need ``root/<class>/<image>.jpg`` folders
(torchvision ``ImageFolder`` layout) but cannot ship real data. Naive stand-ins
mislead benchmarks: flat colours compress to a few KB (I/O and decode look
free) and white noise compresses badly and decodes unlike photographs. These
images match ImageNet in file size (~110 KB), dimensions (~450x375) and
spatial statistics: 1/f^alpha ("pink") noise fields synthesised with an
inverse FFT, illumination gradients, hard-edged textured shapes, fine detail
and sensor grain, with class-dependent palettes so classes are distinguishable.

Everything is drawn from ``numpy.random.default_rng`` seeded per image and
Pillow's JPEG encoder runs with fixed options, so the same arguments give
identical bytes (for a given platform and numpy/Pillow/libjpeg build) however
many worker processes are used. Only numpy and Pillow are needed, never torch.
"""

from __future__ import annotations

import colorsys
import ctypes
import functools
import io
import os
import pathlib
import signal
import sys
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

from .framepool import pool_context

__all__ = ["synthetic_jpeg", "make_image_folder"]

# Fraction of images in a class that use the class palette; the rest get a
# random palette so that the classification task is learnable but not trivial.
_CLASS_PALETTE_PROB = 0.75
# Side of the cached noise tiles (see _tiles), then the mean amplitudes of the
# image components: luminance 1/f field and fine background detail (relative
# contrast), object texture (relative contrast), sensor grain and colour
# detail (0-255 levels). Together they set the JPEG size; tuned so that the
# default size range at quality 90 averages ~110 KB, like ImageNet.
_TILE = 1024
_LUM = 0.32
_DETAIL = 0.3
_TEXTURE = 0.65
_GRAIN = 4.0
_CHROMA = 8.0


def _fft_len(n: int) -> int:
    """Return an FFT-friendly length >= n (power of two, or a multiple of 64).

    Sides such as 451 = 11 * 41 make pocketfft much slower, so fields are made
    on a slightly larger periodic grid and cropped (hiding the wrap-around seam).
    """
    return 1 << max(n - 1, 1).bit_length() if n <= 64 else -(-n // 64) * 64


@functools.lru_cache(maxsize=16)
def _log_freq(h: int, w: int) -> np.ndarray:
    """Return log|f| on the rfft2 grid of an (h, w) field, DC set to 0 (cached: few sizes occur)."""
    fy = np.fft.fftfreq(h).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(w).astype(np.float32)[None, :]
    f2 = fy * fy + fx * fx
    f2[0, 0] = 1.0
    return 0.5 * np.log(f2)


def _pink_noise(rng: np.random.Generator, h: int, w: int, alphas: Sequence[float]) -> np.ndarray:
    """Return fields of shape (len(alphas), h, w) with power spectrum ~ 1/f^alpha.

    Random complex coefficients scaled by f^(-alpha/2) are inverted with one
    batched ``irfft2``. Uniform coefficients are several times cheaper to draw
    than Gaussian ones and the summed field is Gaussian anyway. Fields are
    normalised to zero mean and unit standard deviation.
    """
    hh, ww = _fft_len(h), _fft_len(w)
    logf = _log_freq(hh, ww)
    a = np.asarray(alphas, np.float32)[:, None, None]
    amp = np.exp(logf * (-0.5 * a))
    amp[:, 0, 0] = 0.0
    coef = rng.random((len(alphas),) + logf.shape + (2,), dtype=np.float32)
    coef -= np.float32(0.5)
    spec = coef.view(np.complex64)[..., 0]  # (real, imag) pairs -> complex, no copy
    spec *= amp
    fields = np.fft.irfft2(spec, s=(hh, ww))[:, :h, :w]
    # Statistics from a strided subsample: accurate enough, and much cheaper.
    step = 4 if min(h, w) >= 64 else 1
    sub = fields[:, ::step, ::step]
    # (numpy < 2 computes FFTs in float64; keep everything downstream float32.)
    fields = (fields - sub.mean(axis=(1, 2), keepdims=True)).astype(np.float32, copy=False)
    fields *= 1.0 / (sub.std(axis=(1, 2), keepdims=True) + np.float32(1e-6))
    return fields


@functools.lru_cache(maxsize=1)
def _tiles() -> np.ndarray:
    """Return cached (3, 1024, 1024) float32 noise tiles, built once per process.

    Tiles 0 and 1 are rough 1/f^alpha textures (alpha 1.0 and 1.5) for object
    surfaces and fine detail; tile 2 is white Gaussian sensor grain. Cropping
    them at random offsets is far cheaper than drawing fresh full-resolution
    noise per image; a fixed seed makes them identical in every process.
    """
    rng = np.random.default_rng(0x5EED)
    rough = _pink_noise(rng, _TILE, _TILE, [1.0, 1.5])
    grain = rng.standard_normal((1, _TILE, _TILE), dtype=np.float32)
    return np.concatenate([rough, grain]).astype(np.float32)


def _crop(rng: np.random.Generator, tile: np.ndarray, h: int, w: int) -> np.ndarray:
    """Return an (h, w) view of a tile at a random offset, flip and stride.

    A stride of 2 along one axis (half the time) stretches the texture like wood
    or fabric grain. No transposes: reading a transposed view is ~15x slower.
    Windows larger than the tile wrap around (slow path, huge images only).
    """
    sy, sx = ((1, 1), (1, 1), (1, 2), (2, 1))[int(rng.integers(4))]
    if rng.random() < 0.5:
        tile = tile[::-1]
    need_h, need_w = h * sy, w * sx
    if need_h > tile.shape[0] or need_w > tile.shape[1]:
        pad = ((0, max(0, need_h - tile.shape[0])), (0, max(0, need_w - tile.shape[1])))
        tile = np.pad(tile, pad, mode="wrap")
    y = int(rng.integers(tile.shape[0] - need_h + 1))
    x = int(rng.integers(tile.shape[1] - need_w + 1))
    return tile[y:y + need_h:sy, x:x + need_w:sx]


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    """Return an RGB colour on the 0-255 scale as float32 from hue/saturation/value."""
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), np.float32) * np.float32(255.0)


def _palette(rng: np.random.Generator, class_index: int | None) -> np.ndarray:
    """Return a (4, 3) float32 palette: two background colours and two accents.

    With ``class_index``, most images take hues from the class (golden-ratio
    spacing keeps classes apart) so classes are visually distinguishable; the
    rest get random hues so colour alone does not solve the task.
    """
    if class_index is not None and rng.random() < _CLASS_PALETTE_PROB:
        base = (class_index * 0.618034) % 1.0 + rng.normal(0.0, 0.03)
    else:
        base = rng.random()
    spread = rng.uniform(0.05, 0.25)
    return np.stack([
        _hsv(base, rng.uniform(0.2, 0.7), rng.uniform(0.35, 0.8)),
        _hsv(base + spread, rng.uniform(0.1, 0.6), rng.uniform(0.3, 0.9)),
        _hsv(base + 0.5 + rng.normal(0.0, 0.08), rng.uniform(0.3, 0.9), rng.uniform(0.3, 1.0)),
        _hsv(rng.random(), rng.uniform(0.0, 0.8), rng.uniform(0.1, 1.0)),
    ])


def _render(rng: np.random.Generator, width: int, height: int, class_index: int | None) -> np.ndarray:
    """Render one image as a (3, height, width) uint8 array (channel-first for speed)."""
    h, w = height, width
    pal = _palette(rng, class_index)
    tiles = _tiles()
    # Luminance at full resolution; the colour-mixing and detail-density fields
    # are smoother, so they are made at half resolution and upsampled by pixel
    # repetition (invisible for such fields; matches JPEG's 4:2:0 chroma grid).
    alpha = rng.uniform(1.6, 2.2)
    lum = _pink_noise(rng, h, w, [alpha])[0]
    low = _pink_noise(rng, (h + 1) // 2, (w + 1) // 2, [alpha + 0.4, alpha + 0.6, 2.0])
    # Background: blend two palette colours along a smooth field (t), add a
    # patchy accent colour, shade by the luminance field and by fine detail
    # whose strength varies over the image (smooth "sky" next to busy "foliage").
    np.clip(0.5 + 0.35 * low[0], 0.0, 1.0, out=low[0])  # t
    np.clip((low[1] - rng.uniform(0.3, 1.2)) * 1.5, 0.0, 0.7, out=low[1])  # accent
    np.clip(low[2] * 0.6 + 1.0, 0.1, 2.0, out=low[2])  # detail density
    t, accent, density = np.repeat(np.repeat(low, 2, axis=1), 2, axis=2)[:, :h, :w]
    img = pal[0][:, None, None] + (pal[1] - pal[0])[:, None, None] * t
    img += (pal[3] - pal[0])[:, None, None] * accent
    detail = _crop(rng, tiles[int(rng.integers(2))], h, w) * density
    shade = 1.0 + np.float32(_LUM * rng.uniform(0.7, 1.3)) * lum
    shade += np.float32(_DETAIL * rng.uniform(0.5, 1.5)) * detail
    img *= shade
    # Colour detail: independent rough textures on red and blue, as hue (not
    # only brightness) varies at fine scales in foliage, skin or fabric.
    for c in (0, 2):
        gain = np.float32(_CHROMA * rng.uniform(0.5, 1.5))
        img[c] += gain * _crop(rng, tiles[int(rng.integers(2))], h, w)

    # Hard-edged textured shapes (objects and occluders) of log-uniform size,
    # later ones on top; each has its own texture and a shading gradient.
    for k in range(int(rng.integers(3, 13))):
        r = np.exp(rng.uniform(np.log(0.03), np.log(0.35))) * min(w, h)
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        x0, y0 = max(int(cx - 1.5 * r), 0), max(int(cy - 1.5 * r), 0)
        x1, y1 = min(int(cx + 1.5 * r) + 1, w), min(int(cy + 1.5 * r) + 1, h)
        if x1 - x0 < 2 or y1 - y0 < 2:
            continue
        mask_img = Image.new("L", (x1 - x0, y1 - y0), 0)
        draw = ImageDraw.Draw(mask_img)
        cx, cy = cx - x0, cy - y0
        if rng.random() < 0.5:
            ry = r * rng.uniform(0.5, 1.4)
            draw.ellipse([cx - r, cy - ry, cx + r, cy + ry], fill=1)
        else:
            m = int(rng.integers(3, 8))
            ang = np.sort(rng.uniform(0, 2 * np.pi, m))
            rad = r * rng.uniform(0.6, 1.4, m)
            draw.polygon(list(zip(cx + rad * np.cos(ang), cy + rad * np.sin(ang))), fill=1)
        mask = np.asarray(mask_img).view(bool)  # 0/1 bytes: a free reinterpretation
        gain = np.float32(_TEXTURE * rng.uniform(0.4, 1.3))
        obj = gain * _crop(rng, tiles[int(rng.integers(2))], y1 - y0, x1 - x0)
        gy, gx = rng.uniform(-0.4, 0.4, 2) / r  # shading gradient across the object
        obj += (1.0 + gy * (np.arange(y1 - y0) - cy)).astype(np.float32)[:, None] \
            + (gx * (np.arange(x1 - x0) - cx)).astype(np.float32)[None, :]
        colour = pal[2 + k % 2] * np.float32(rng.uniform(0.6, 1.1))
        np.copyto(img[:, y0:y1, x0:x1], obj * colour[:, None, None], where=mask)

    # Illumination (linear gradient and vignette) and luminance sensor grain.
    theta, g, v = rng.uniform(0, 2 * np.pi), rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.25)
    ys, xs = np.linspace(-1.0, 1.0, h), np.linspace(-1.0, 1.0, w)
    light_y = (1.0 + g * np.sin(theta) * ys - v * ys * ys).astype(np.float32)
    light_x = (g * np.cos(theta) * xs - v * xs * xs).astype(np.float32)
    img *= light_y[:, None] + light_x[None, :]
    img += np.float32(_GRAIN * rng.uniform(0.5, 1.5)) * _crop(rng, tiles[2], h, w)
    np.clip(img, 0.0, 255.0, out=img)
    return img.astype(np.uint8)


def _encode(arr: np.ndarray, quality: int) -> bytes:
    """JPEG-encode a (3, h, w) uint8 array with fixed options (deterministic bytes)."""
    buf = io.BytesIO()
    rgb = Image.merge("RGB", [Image.fromarray(plane) for plane in arr])
    rgb.save(buf, format="JPEG", quality=quality, subsampling="4:2:0", optimize=False, progressive=False)
    return buf.getvalue()


def synthetic_jpeg(seed: int, width: int, height: int, quality: int = 90, *,
                   class_index: int | None = None) -> bytes:
    """Return the bytes of one deterministic, photograph-like JPEG.

    At about 450x375 px and ``quality=90`` files average roughly 110 KB, like
    ImageNet, so I/O and decode benchmarks see realistic costs. The same
    arguments give identical bytes (with the same numpy and Pillow builds:
    FFT rounding and libjpeg may differ between versions). ``class_index`` biases
    the colour palette towards a hue derived from the class so that images of
    one class look alike; ``None`` gives a random palette.
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    rng = np.random.default_rng(seed)
    return _encode(_render(rng, int(width), int(height), class_index), quality)


def _image_spec(seed: int, class_index: int, image_index: int,
                size_range: tuple[tuple[int, int], tuple[int, int]]) -> tuple[int, int, int]:
    """Return (image_seed, width, height) derived only from the image's identity.

    Deriving from (seed, class, image) rather than from a shared stream keeps
    the output independent of generation order and of the number of workers.
    """
    (w0, h0), (w1, h1) = size_range
    rng = np.random.default_rng(np.random.SeedSequence([seed, class_index, image_index]))
    width = int(rng.integers(min(w0, w1), max(w0, w1) + 1))
    height = int(rng.integers(min(h0, h1), max(h0, h1) + 1))
    return int(rng.integers(2**63)), width, height


def _write_one(job: tuple[str, int, int, int, int, int]) -> str:
    """Generate and write one image (top-level so that it pickles for Pool)."""
    path, image_seed, width, height, quality, class_index = job
    data = synthetic_jpeg(image_seed, width, height, quality, class_index=class_index)
    with open(path, "wb") as f:
        f.write(data)
    return path


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int | None) -> None:
    """Pool initializer: on Linux, the worker is killed when the process that started it ends;
    it ignores SIGINT, which its caller handles.

    A `Pool` worker waits on the task queue, whose write end its forked siblings hold
    too, so workers whose parent is killed outright (SIGKILL, the OOM killer, a test
    runner's timeout) would otherwise wait there forever. `parent`: the pid the worker's
    parent must have (the caller's, for a forked worker); None where the worker has
    another parent (forkserver's server), which is then the one it has now.
    """
    # Ctrl-C in a terminal reaches every process of the group: the caller handles it and ends
    # the pool; a worker raising KeyboardInterrupt too printed a traceback each (as pack's do not).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl in this libc: best effort
        return
    if os.getppid() != expected:  # the parent ended before the prctl took effect
        os._exit(1)


def make_image_folder(
    root: str | os.PathLike,
    *,
    num_classes: int = 10,
    images_per_class: int | Sequence[int] = 20,
    seed: int = 0,
    size_range: tuple[tuple[int, int], tuple[int, int]] = ((400, 350), (500, 375)),
    quality: int = 90,
    workers: int = 1,
) -> list[pathlib.Path]:
    """Write a synthetic ImageFolder tree under ``root``; return the written paths, sorted.

    Layout is ``root/class_000/img_00000.jpg``, zero padded so that sorted order
    is index order (ImageFolder labels classes by sorted name). ``images_per_class``
    is one count for every class or a per-class sequence such as ``[1000, 100, 10]``
    for imbalanced data; a sequence sets the number of classes itself (then
    ``num_classes`` must match it or be left at its default). Width and height
    are drawn uniformly, inclusive, from ``size_range = ((min_w, min_h), (max_w,
    max_h))``. Each image depends only on (seed, class, index), so the output is
    identical for any ``workers``; ``workers > 1`` renders in a process pool.
    """
    if np.ndim(images_per_class) == 0:
        counts = [int(images_per_class)] * max(num_classes, 0)  # type: ignore[arg-type]
    else:
        counts = [int(c) for c in images_per_class]  # type: ignore[union-attr]
        if num_classes not in (10, len(counts)):
            raise ValueError(f"images_per_class has {len(counts)} entries but num_classes={num_classes}")
    if num_classes < 0 or any(c < 0 for c in counts):
        raise ValueError("num_classes and images_per_class must be non-negative")
    root = pathlib.Path(root)
    cdigits = max(3, len(str(len(counts) - 1)))
    idigits = max(5, len(str(max(counts, default=1) - 1)))
    jobs = []
    for c, count in enumerate(counts):
        class_dir = root / f"class_{c:0{cdigits}d}"
        class_dir.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image_seed, width, height = _image_spec(seed, c, i, size_range)
            jobs.append((str(class_dir / f"img_{i:0{idigits}d}.jpg"), image_seed, width, height, quality, c))
    # Not forked from a process running threads (a test runner's, a training script's): a child
    # forked while another thread held a lock waits on it forever, and `demo` hung so in a test.
    context = pool_context() if workers > 1 and len(jobs) > 1 else None
    if context is not None:
        _tiles()  # build once here so that forked workers share it
        forked = context.get_start_method() == "fork"
        with context.Pool(min(workers, len(jobs)), initializer=_die_with,
                          initargs=(os.getpid() if forked else None,)) as pool:
            written = pool.map(_write_one, jobs, chunksize=max(1, len(jobs) // (workers * 8)))
    else:
        written = [_write_one(job) for job in jobs]
    return sorted(pathlib.Path(p) for p in written)
