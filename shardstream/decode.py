"""Decoding sample fields by extension: a plain registry of functions.

`Decoder(images=...)` turns ``{"jpg": bytes, "cls": b"3"}`` into
``{"jpg": <image>, "cls": 3}``. Images decode to PIL images (``"pil"``), to uint8
torch tensors in CHW layout (``"rgb8"``, the torchvision convention, so that
``torchvision.transforms.v2`` takes them as they are), stay bytes (``None``), or go
through a callable from bytes (a fused decode-and-crop, for example).

Pickle is never unpickled unless the caller opts in (``allow_pickle=True``): a shard
on shared storage must not be able to run code in a training job. Every failure
becomes a `DecodeError` naming the shard and the sample.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

import numpy as np
from PIL import Image

from .errors import DecodeError, reason
from .fields import FIELD_DECODERS, IMAGE_EXTENSIONS, READ_ERRORS, field_extension

if TYPE_CHECKING:
    import torch

try:
    import simplejpeg
except ImportError:  # optional (the `fast` extra): Pillow decodes instead
    simplejpeg = None

try:
    from . import _jpegregion
except ImportError:  # the C extension was not built (no libjpeg-turbo headers or compiler at install)
    _jpegregion = None

#: Whether JPEG crops are decoded region only (the `_jpegregion` extension is built).
REGION_DECODER = _jpegregion is not None

__all__ = ["Decoder", "DecodedCrop", "decode_image", "decode_rgb", "decode_rgb_crop", "image_formats_hint",
           "image_size", "is_jpeg", "jpeg_crop_decoder", "jpeg_damage", "jpeg_ends", "narrowed_grey", "open_image",
           "IMAGE_EXTENSIONS", "IMAGE_MODES", "JPEG_FORMATS", "PIL_FORMATS", "REGION_DECODER"]

IMAGE_MODES = (None, "pil", "rgb8")
PICKLE_EXTENSIONS = frozenset({"pyd", "pickle", "pkl", "pth"})
# The Pillow formats of IMAGE_EXTENSIONS (its JPEG plugin opens MPO files too).
# Pillow recognises a file by its bytes, not its name, and would open anything it knows:
# an EPS stored as a `jpg` field would run Ghostscript on a shard's PostScript.
PIL_FORMATS = ("JPEG", "PNG", "WEBP", "PPM", "BMP", "GIF", "TIFF")
# What Pillow names a JPEG it opened: an MPO (a camera JPEG holding more pictures after the
# first: stereo, depth, a large preview) is a JPEG to libjpeg, reduced and decoded alike.
JPEG_FORMATS = ("JPEG", "MPO")
# What Pillow raises on damaged image bytes. Mostly OSError, but its parsers raise others on
# some damage: IndexError from PNG's `verify` on a file with no image-data (IDAT) chunk.
DAMAGED_IMAGE_ERRORS = (OSError, SyntaxError, ValueError, IndexError, Image.DecompressionBombError)


def image_formats_hint(fields: Iterable[str]) -> str:
    """Advice where `fields` (fields asked and found, or one sample's and another's) name images
    of several formats: `pack` stores each image under its own format's field, so a folder of
    JPEGs and PNGs gives samples of `jpg` and samples of `png`. "" where they do not."""
    images = set(fields) & IMAGE_EXTENSIONS
    if len(images) < 2:
        return ""
    packed = ["jpg", "png", "webp"]  # what pack stores (sourcefile.IMAGE_FIELDS)
    field = ";".join(packed + sorted(images - set(packed)))
    return f" (pack stores an image under its format's field: fields=({field!r}, ...) takes whichever a sample has)"


def open_image(data: bytes) -> Image.Image:
    """`data` opened by Pillow, in one of `PIL_FORMATS` only (else PIL.UnidentifiedImageError)."""
    image = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    if image.format in JPEG_FORMATS:
        # Pillow feeds libjpeg 64 KB at a time, and libjpeg's arithmetic decoder cannot resume
        # mid-stream: a valid arithmetic-coded JPEG over 64 KB failed as "broken data stream".
        # The bytes are in memory already; one block costs nothing more.
        image.decodermaxblock = max(image.decodermaxblock, len(data))
    return image


def decode_image(data: bytes, mode: str | None, *, url: str = "", key: str = "", name: str = "") -> Any:
    """Decode image bytes: ``"pil"`` gives an RGB PIL image, ``"rgb8"`` a uint8 CHW tensor.
    An error names the sample's `url`, `key` and field `name` where given."""
    if mode is None:
        return data
    try:
        if mode == "pil":
            return _pil_rgb(data)
        return hwc_to_chw_tensor(decode_rgb(data))
    except DAMAGED_IMAGE_ERRORS as e:
        field = f" field {name!r}" if name else ""
        raise DecodeError(f"cannot decode image{field}: {reason(e)}", url=url or None, key=key or None) from e


_SOI = b"\xff\xd8"  # a JPEG's first bytes


def is_jpeg(data: bytes | memoryview) -> bool:
    """Whether `data` starts as a JPEG does (its start-of-image marker)."""
    return bytes(data[:2]) == _SOI


def jpeg_ends(data: bytes) -> bool:
    """Whether a JPEG's last bytes hold its end-of-image marker (a few bytes of padding or
    trailer may follow it): a file cut short has none."""
    return b"\xff\xd9" in data[-64:]


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of the image in `data`, from its header.

    An image of more pixels than Pillow's decompression-bomb limit raises
    `PIL.Image.DecompressionBombError`, whichever library reads the header, as Pillow
    does when it opens one: a few kilobytes of JPEG can claim 65,535 x 65,535 pixels.
    """
    if simplejpeg is not None and is_jpeg(data):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except Exception:  # ValueError, and KeyError for a subsampling it does not know (4:4:1)
            pass  # Pillow reads it, or raises its own error
        else:
            return _within_pixel_limit(width, height)
    return open_image(data).size


def pixel_limit() -> int | None:
    """The most pixels an image may have: Pillow's error threshold, twice its
    `PIL.Image.MAX_IMAGE_PIXELS` (89.5 MP by default, so 179 MP), None where that is None.
    The readers decode up to it, and `pack` packs up to it (what it packs can be read: a
    108 MP phone photo too, over Pillow's warning threshold)."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else 2 * limit


def _within_pixel_limit(width: int, height: int) -> tuple[int, int]:
    limit = pixel_limit()
    if limit is not None and width * height > limit:
        raise Image.DecompressionBombError(
            f"image of {width * height} pixels ({width}x{height}) exceeds the limit of {limit} pixels, "
            f"could be a decompression bomb (PIL.Image.MAX_IMAGE_PIXELS sets the limit)")
    return width, height


def decode_rgb(data: bytes, at_least: tuple[int, int] | None = None, *, use_simplejpeg: bool = True) -> np.ndarray:
    """The image in `data` as an RGB uint8 (height, width, 3) array.

    JPEGs are decoded by simplejpeg where it is installed (the `fast` extra),
    otherwise, and for every other format, by Pillow; both give the same pixels (both
    are libjpeg-turbo). With `at_least` (width, height), a JPEG is decoded at the
    smallest DCT reduction (1/2, 1/4 or 1/8, as Pillow's `draft`) that keeps it at
    least that large; other formats at full size. `use_simplejpeg=False` decodes with
    Pillow even where simplejpeg is installed.
    """
    if use_simplejpeg and simplejpeg is not None and is_jpeg(data):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            _within_pixel_limit(width, height)
            if at_least is None:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
            k = jpeg_reduction((width, height), at_least)
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-width // k),
                                          min_height=-(-height // k))
        except Exception:  # ValueError, and KeyError for a subsampling it does not know (4:4:1)
            pass  # arithmetic coding, damage: Pillow decodes it or raises the error (CMYK simplejpeg
            # converts itself, up to 2 levels off Pillow's conversion)
    return np.array(_pil_rgb(data, at_least))


def jpeg_crop_decoder() -> str:
    """Which library decodes JPEG crops in this process, in words (for reports)."""
    if _jpegregion is not None:
        return "libjpeg-turbo, region only (shardstream._jpegregion)"
    if simplejpeg is not None:
        return "simplejpeg, whole images (the _jpegregion extension is not built)"
    return "Pillow, whole images (neither _jpegregion nor simplejpeg is available)"


def jpeg_reduction(size: tuple[int, int], at_least: tuple[int, int]) -> int:
    """The DCT reduction (8, 4, 2, else 1) Pillow's `draft` chooses for an image of `size`
    asked to be at least `at_least`: the largest k with k <= width // at_least width and
    k <= height // at_least height. Every decoder here uses this rule, so an install with
    Pillow alone decodes at the same scale, and gives the same pixels, as one with
    simplejpeg or the region decoder.

    Powers of two only: libjpeg-turbo also scales by 3/8, 5/8, ..., which was slower
    than no scaling at all here (28.6 vs 24.3 ms for a 1600x1200 JPEG at 5/8), and
    Pillow's `draft` would give other pixels.
    """
    scale = min(size[0] // max(1, at_least[0]), size[1] // max(1, at_least[1]))
    return next((k for k in (8, 4, 2) if k <= scale), 1)


class DecodedCrop(NamedTuple):
    """Decoded pixels holding a crop's box, and where the box lies in them."""

    pixels: np.ndarray  # RGB uint8, (height, width, 3)
    box: tuple[float, float, float, float]  # top, left, height, width, in `pixels`' coordinates
    reduced: bool  # decoded at a DCT reduction: the box's edges may fall between pixels


def decode_rgb_crop(data: bytes, size: tuple[int, int], box: tuple[float, float, float, float],
                    at_least: tuple[int, int], margin: int = 0, *, around: bool = False) -> DecodedCrop:
    """The part of the image in `data` (of `size`, width by height) that holds `box`.

    `box` is (top, left, height, width) in full-size pixels; the image is decoded at
    the smallest DCT reduction that keeps it at least `at_least`, as `decode_rgb`
    decodes it. A JPEG is decoded region only where the `_jpegregion` extension is
    built: the rows above the box are only entropy-decoded, the rows below not at all,
    the columns beside it not transformed; the pixels are those of the whole decode.
    At a reduction, `margin` decoded pixels around the box are kept as well (a resampling
    filter reads beyond a box whose edges fall between pixels); at full scale only with
    `around` (a fractional box, or a filter that reads around the box as a resize of the
    whole image does). Other formats, and JPEGs the extension refuses (CMYK, damage), are
    decoded whole.
    """
    # Region only where the file is whole: a region decode stops after the crop's last row,
    # so a file cut short below the crop would decode for some crops and fail for others.
    if _jpegregion is not None and is_jpeg(data) and jpeg_ends(data):
        k = jpeg_reduction(size, at_least)
        scaled = (-(-size[0] // k), -(-size[1] // k))  # libjpeg rounds a reduction's size up
        try:
            return _decode_region(data, size, scaled, box, k, margin if k > 1 or around else 0)
        except ValueError:
            pass  # decoded whole below, by simplejpeg or Pillow, which raise what they raise
    pixels = decode_rgb(data, at_least)
    reduced = pixels.shape[:2] != (size[1], size[0])
    s = 1 / jpeg_reduction(size, at_least) if reduced else 1.0  # see _decode_region
    top, left, height, width = box
    return DecodedCrop(pixels, (top * s, left * s, height * s, width * s), reduced)


def _decode_region(data: bytes, size: tuple[int, int], scaled: tuple[int, int], box: tuple[float, float, float, float],
                   k: int, margin: int) -> DecodedCrop:
    # A reduction by k makes each decoded pixel of k x k full-size ones, from the image's
    # top left: full-size x is x / k decoded, whatever the size (the last decoded pixel
    # runs past the image's edge where k does not divide it, as Pillow's `draft` box says).
    # Scaled by decoded size over full size instead, a box drifted towards the bottom
    # right, by up to k - 1 full-size pixels.
    top, left, height, width = (v / k for v in box)
    y0, x0 = max(0, math.floor(top) - margin), max(0, math.floor(left) - margin)
    y1 = min(scaled[1], math.ceil(top + height) + margin)
    x1 = min(scaled[0], math.ceil(left + width) + margin)
    pixels = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
    _jpegregion.decode_region(data, pixels, k, y0, x0, y1 - y0, x1 - x0)
    return DecodedCrop(pixels, (top - y0, left - x0, height, width), k > 1)


# libjpeg's warnings that mean data is missing (libjpeg-turbo's jerror.h): the decoder fills
# what is lost with grey or smears it. "N extraneous bytes before marker" is not one (the
# image is whole; ImageNet has such files).
_JPEG_DAMAGE = ("Corrupt JPEG data: premature end", "Corrupt JPEG data: bad", "Corrupt JPEG data: found marker",
                "Premature end of JPEG file")


def jpeg_damage(data: bytes) -> str | None:
    """libjpeg's word on data missing from a JPEG that still decodes, or None: a JPEG whose data
    is whole, another format, or no strict decoder here (simplejpeg, the `fast` extra). The
    decoders, as Pillow's and torchvision's do, decode such images, damage and all."""
    if simplejpeg is None or not is_jpeg(data):
        return None
    try:
        simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
    except Exception as error:  # noqa: BLE001 - damage is told by libjpeg's message; anything else is not ours
        message = str(error)
        return message if message.startswith(_JPEG_DAMAGE) else None
    return None


def narrowed_grey(image: Image.Image) -> Image.Image:
    """A 16-bit grey image (I;16 or I: PNG depth maps, medical and satellite images) as 8-bit
    grey, its top 8 bits: Pillow's own convert clips at 255 rather than scaling, nearly all white.
    Mode I holds 32-bit signed values: where they leave 0..65535 there is no 16-bit reading
    (shifted as one, a 32-bit TIFF came out all white), and no 8-bit one to assume."""
    values = np.asarray(image)
    if values.size and (int(values.min()) < 0 or int(values.max()) > 0xFFFF):
        raise ValueError(f"a 32-bit integer image (values {int(values.min())}..{int(values.max())}) has no 8-bit "
                         "reading; decode it with a callable (decode=...)")
    scaled = np.right_shift(values.astype(np.uint32), 8).astype(np.uint8)
    return Image.fromarray(scaled, "L")


def _pil_rgb(data: bytes, at_least: tuple[int, int] | None = None) -> Image.Image:
    image = open_image(data)
    if image.format in JPEG_FORMATS:
        image.draft("RGB", at_least or image.size)  # decode straight to RGB, reduced where allowed
    if image.mode.startswith("I"):
        return narrowed_grey(image).convert("RGB")
    if image.mode == "F":
        raise ValueError("a floating-point image has no 8-bit reading; decode it with a callable (decode=...)")
    return image.convert("RGB")


def hwc_to_chw_tensor(array: np.ndarray) -> Any:
    """A contiguous uint8 CHW torch tensor from an HWC array."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


def _pickle(data: bytes) -> Any:
    return pickle.loads(data)


# What the field parsers (fields.py's, and pickle) raise on hostile bytes.
_FIELD_ERRORS = (*READ_ERRORS, pickle.UnpicklingError)



@dataclass(frozen=True)
class Decoder:
    """Decode every field of a sample by its extension (the part after the last dot).

    Fields with no decoder stay bytes. Picklable, so it can cross into workers.
    """

    images: str | Callable[[bytes], Any] | None = "rgb8"
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if not callable(self.images) and self.images not in IMAGE_MODES:
            raise ValueError(f"decode (a Decoder's images) must be one of {IMAGE_MODES} or a callable (a transform "
                             f"such as RandomResizedCropJPEG), not {self.images!r}")

    def __call__(self, sample: dict[str, Any], crops: torch.Generator | None = None) -> dict[str, Any]:
        """`sample` decoded; a fused crop (`images` a `RandomResizedCropJPEG`) draws from
        `crops` where given."""
        url, key = str(sample.get("__url__", "")), str(sample.get("__key__", ""))
        out: dict[str, Any] = {}
        for name, value in sample.items():
            if name.startswith("__") or not isinstance(value, (bytes, bytearray, memoryview)):
                out[name] = value
                continue
            out[name] = self.field(field_extension(name), bytes(value), url, key, name, crops)
        return out

    def field(self, ext: str, data: bytes, url: str, key: str, name: str,
              crops: torch.Generator | None = None) -> Any:
        if ext in IMAGE_EXTENSIONS:
            if not callable(self.images):
                return decode_image(data, self.images, url=url, key=key, name=name)
            try:
                return self.images(data) if crops is None else self.images(data, crops)  # type: ignore[call-arg]
            except DecodeError:
                raise
            except DAMAGED_IMAGE_ERRORS as e:
                raise DecodeError(f"cannot decode image field {name!r}: {reason(e)}", url=url or None,
                                  key=key or None) from e
        if ext in PICKLE_EXTENSIONS:
            if not self.allow_pickle:
                raise DecodeError(
                    f"field {name!r} is a pickle; unpickling runs code, pass allow_pickle=True only for trusted data",
                    url=url or None,
                    key=key or None,
                )
            decoder: Callable[[bytes], Any] | None = _pickle
        else:
            decoder = FIELD_DECODERS.get(ext)
        if decoder is None:
            return data
        try:
            return decoder(data)
        except _FIELD_ERRORS as e:
            raise DecodeError(f"cannot decode field {name!r}: {reason(e)}", url=url or None, key=key or None) from e
