"""Shrinking images at pack time: `pack(max_side=...)`, as FFCV's `max_resolution`.

Decoding costs about in proportion to pixels, and a model trained on 224 px crops
gains little from the 12 megapixels a camera wrote: datasets are often stored with a
bounded resolution, once, at pack time, rather than decoded at full size every epoch.

An image whose longer side is at most `max_side` keeps its original bytes. A larger
one is decoded, shrunk as Pillow's `Image.thumbnail` does it (bicubic, antialiased;
a JPEG decoded at a DCT reduction of no less than twice the target), keeping its
aspect ratio, and encoded again: JPEG and lossy WebP at `quality`, PNG and lossless WebP
losslessly. `pack`
asks for the format of the image's field, the one its file name gives: its own
format, unless the name lies, and then a PNG named .jpg is shrunk into a JPEG, whose
field then says what its bytes are. Bound for another format than its own, an image
is first converted as Pillow converts it, which is what shardstream's decoders see
(they convert to RGB): for JPEG, alpha is dropped (RGBA and a palette with
transparency become RGB, LA becomes L) and 16-bit grey becomes 8-bit (clipped at
255); for PNG and WebP, a CMYK JPEG becomes RGB. The ICC profile is kept where the
colour space stays (not from CMYK, nor from grey to RGB); other metadata (EXIF,
including its orientation tag, which shardstream's decoders and torchvision's
ignore) is dropped. Pixels are not rotated. An animated image (WebP, APNG) keeps its
original bytes whatever its size: a shrunk copy would hold its first frame only, and
`pack` counts it as kept whole.

The output is a pure function of the input bytes, `max_side`, `quality` and the
Pillow build (its libjpeg-turbo, zlib and libwebp), so a rerun on the same
installation writes the same bytes. Cost, measured on 200 of the benchmark's
ImageNet-sized JPEGs (about 480x370 to 320 px, one core): decode 1.4 ms, bicubic resize
2.4 ms (Lanczos 3.3, bilinear 1.7), encode 0.5 ms; a pack that shrinks most images
runs several times slower than one that copies bytes, once per dataset.
"""

from __future__ import annotations

import io

from PIL import Image

from .decode import DAMAGED_IMAGE_ERRORS, image_size, narrowed_grey, open_image
from .errors import PackError

__all__ = ["shrink_image", "shrink_or_keep", "shrunk_size", "DEFAULT_QUALITY", "KEPT_ANIMATED", "KEPT_PICTURES"]

DEFAULT_QUALITY = 90  # FFCV's default too: visually lossless for training, about half the bytes of 95

# Formats `pack` accepts, and how each is written again.
_SAVE_OPTIONS = {"JPEG": ("quality",), "WEBP": ("quality",), "PNG": ()}

# The modes each format writes, for an image shrunk into another format than its own.
_WRITES = {"JPEG": ("L", "RGB"), "PNG": ("1", "L", "LA", "I;16", "RGB", "RGBA"), "WEBP": ("RGB", "RGBA")}
_GREY = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "F"})
_ALPHA = frozenset({"LA", "La", "PA", "RGBA", "RGBa"})
_DEEP_GREY = frozenset({"I;16", "I;16B", "I;16L"})  # 16-bit PNGs

KEPT_ANIMATED = "animated"  # why `shrink_or_keep` keeps a larger image's bytes
KEPT_PICTURES = "several pictures (MPO)"


def shrunk_size(size: tuple[int, int], max_side: int) -> tuple[int, int]:
    """(width, height) of an image of `size` after shrinking to `max_side` (unchanged if it fits)."""
    width, height = size
    longer = max(width, height)
    if longer <= max_side:
        return size
    return max(1, round(width * max_side / longer)), max(1, round(height * max_side / longer))


def shrink_image(data: bytes, max_side: int, quality: int = DEFAULT_QUALITY, *, path: str = "",
                 as_format: str | None = None) -> bytes:
    """`data` itself when its longer side is at most `max_side` or it is animated, else the
    image shrunk and encoded again, in `as_format` (``"JPEG"``, ``"PNG"`` or ``"WEBP"``)
    or by default its own format.

    Raises PackError naming `path` for an image Pillow cannot shrink or write back.
    """
    return shrink_or_keep(data, max_side, quality, path=path, as_format=as_format)[0]


def shrink_or_keep(data: bytes, max_side: int, quality: int = DEFAULT_QUALITY, *, path: str = "",
                   as_format: str | None = None) -> tuple[bytes, str | None]:
    """`shrink_image`'s bytes, and why an image larger than `max_side` kept its own bytes
    (`KEPT_ANIMATED`, `KEPT_PICTURES`), or None when it fit or was shrunk: `pack` reports
    the images a dataset holds larger than asked for."""
    if as_format is not None and as_format not in _SAVE_OPTIONS:
        raise ValueError(f"as_format must be one of {sorted(_SAVE_OPTIONS)}, not {as_format!r}")
    try:
        if max(image_size(data)) <= max_side:  # the header alone: the common case decodes nothing
            return data, None
        with open_image(data) as image:
            fmt = image.format or ""
            if fmt == "MPO":  # a JPEG holding more pictures after the first (stereo, depth: cameras write them)
                if getattr(image, "n_frames", 1) > 1:  # shrinking would keep the first only
                    return data, KEPT_PICTURES
                fmt = "JPEG"
            if fmt not in _SAVE_OPTIONS:
                raise PackError(f"cannot shrink a {fmt or 'unknown'} image (JPEG, PNG and WebP only)", url=path)
            if getattr(image, "n_frames", 1) > 1:  # Pillow would resize (and save) the first frame only
                return data, KEPT_ANIMATED
            out_fmt = as_format or fmt
            target = shrunk_size(image.size, max_side)
            icc = image.info.get("icc_profile")
            box = None
            if fmt == "JPEG":  # decode at the largest DCT reduction that keeps twice the target
                drafted = image.draft(None, (2 * target[0], 2 * target[1]))
                box = drafted[1] if drafted else None
            elif image.mode in ("1", "P"):  # Pillow resizes these by nearest neighbour only
                image = image.convert("RGBA" if "transparency" in image.info else ("L" if image.mode == "1" else "RGB"))
            # A 16-bit grey PNG: mode I;16, or I before Pillow 10.3 (a PNG holds no 32-bit grey).
            deep = image.mode in _DEEP_GREY or (fmt == "PNG" and image.mode == "I")
            if deep and "I;16" not in _WRITES[out_fmt]:
                # Stored in 8 bits (a 16-bit PNG named .jpg): narrowed as the decoders read it,
                # not clipped to white by Pillow's convert.
                image, deep = narrowed_grey(image), False
            if deep:  # Pillow resizes 32-bit integer grey, not 16-bit: widen, and narrow again below
                image = image.convert("I")
            if out_fmt != fmt and image.mode not in _WRITES[out_fmt]:
                image, icc = _writable(image, out_fmt, icc)
            # What Image.thumbnail does, but to exactly the size `shrunk_size` promises.
            image = _resized(image, target, box)
            if deep and image.mode == "I":  # back to 16 bits, the overshoot of the bicubic clipped
                image = image.convert("I;16")
            out = io.BytesIO()
            if out_fmt == "WEBP" and (fmt == "PNG" or _lossless_webp(data)):
                # A lossless image stays lossless. `exact`: the colours under transparent pixels are
                # kept, as the decoders show them (they drop alpha), where libwebp would change them.
                extra = {"lossless": True, "exact": True}
            else:
                extra = {name: quality for name in _SAVE_OPTIONS[out_fmt]}
                if out_fmt == "WEBP":  # lossy too (found by a walk: 21 levels off under transparent pixels)
                    extra["exact"] = True
            image.save(out, out_fmt, icc_profile=icc, **extra)
            return out.getvalue(), None
    except PackError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's limit on pixels, which decoding would hold in memory
        raise PackError(f"too large to shrink safely: {e}", url=path) from e
    except DAMAGED_IMAGE_ERRORS as e:
        raise PackError(f"cannot shrink the image: {e}", url=path) from e


def _lossless_webp(data: bytes) -> bool:
    """Whether WebP `data`'s image is lossless (a `VP8L` chunk), from its RIFF chunks: the
    first image chunk found, past an extended header's (`VP8X`, `ICCP`, `ALPH`, ...)."""
    at = 12  # past "RIFF", the size, "WEBP"
    while at + 8 <= len(data):
        kind, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        if kind in (b"VP8L", b"VP8 "):
            return kind == b"VP8L"
        at += 8 + size + (size & 1)  # chunks are padded to even sizes
    return False


def _resized(image: Image.Image, size: tuple[int, int], box: tuple[int, int, int, int] | None) -> Image.Image:
    """`image` resized to `size` (bicubic, from `box`), with an alpha band resized apart.

    Pillow resizes RGBA and LA with their colours weighted by alpha, so a pixel wholly
    transparent comes out black; the decoders drop alpha and show the colour stored under
    it, as torchvision's loader does, so a shrunk image's transparent half turned from the
    white stored there to black. Resized apart, the colours are the image's own."""
    def resize(band: Image.Image) -> Image.Image:
        return band.resize(size, Image.Resampling.BICUBIC, box=box, reducing_gap=2.0)

    if image.mode not in ("RGBA", "LA"):
        return resize(image)
    colour, alpha = image.convert(image.mode[:-1]), image.getchannel("A")
    return Image.merge(image.mode, (*resize(colour).split(), resize(alpha)))


def _writable(image: Image.Image, fmt: str, icc: bytes | None) -> tuple[Image.Image, bytes | None]:
    """`image` converted to the first mode of grey or colour, with alpha or without, that
    `fmt` writes, as Pillow converts it (which is what shardstream's decoders see: they
    convert to RGB, dropping alpha), and the ICC profile where it still describes it."""
    grey, alpha = image.mode in _GREY, image.mode in _ALPHA
    wanted = (["LA"] if grey and alpha else []) + (["RGBA"] if alpha else []) + (["L"] if grey else []) + ["RGB"]
    mode = next(m for m in wanted if m in _WRITES[fmt])
    space_kept = image.mode != "CMYK" and (mode in _GREY) == grey
    return image.convert(mode), icc if space_kept else None
