"""Whether a file's bytes are an image `pack` can store: `check_image`, run on every image before it is packed.

`pack` stores JPEG, PNG and WebP byte for byte, so each file must be a whole, readable
image in one of these formats, or be skipped with a reason. A full decode would cost
more than the rest of packing, so the check is cheap: the format is told from the first
bytes (`sniff_image`), the header parsed, and only what is unusual goes to
Pillow. Apart from listing.py, which tells what a source holds from names alone and
reads no image, and from shrink.py, which changes the bytes of images checked here;
it runs in the pack workers (framebuild.py).
"""

from __future__ import annotations

import struct

from PIL import Image

from .decode import DAMAGED_IMAGE_ERRORS, is_jpeg, jpeg_ends, open_image
from .errors import PackError, reason

__all__ = ["check_image", "sniff_image"]


# The first bytes of image formats -> (field, format name). The formats pack stores have a
# field, for comparing with the one the name gives; the others are named only, for the
# message that refuses them. WebP (RIFF....WEBP) is tested apart.
_SIGNATURES: tuple[tuple[bytes, str | None, str], ...] = (
    (b"\xff\xd8\xff", "jpg", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "png", "PNG"),
    (b"GIF87a", None, "GIF"),
    (b"GIF89a", None, "GIF"),
    (b"BM", None, "BMP"),
    (b"II*\x00", None, "TIFF"),
    (b"MM\x00*", None, "TIFF"),
    (b"\x00\x00\x01\x00", None, "ICO"),
    (b"8BPS", None, "Photoshop"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", None, "JPEG 2000"),
    (b"\xff\x0a", None, "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", None, "JPEG XL"),
)
_ISO_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIF", b"heix": "HEIF", b"mif1": "HEIF", b"msf1": "HEIF"}


def sniff_image(data: bytes) -> tuple[str | None, str | None]:
    """(field, format name) of the image format `data` starts as, from its first bytes.

    The field is ``"jpg"``, ``"png"`` or ``"webp"`` for the formats `pack` stores, None
    for another format (named: ``"GIF"``, ``"BMP"``, ``"TIFF"``, ...); both are None for
    bytes that start as no image format known here. Whether the rest is a whole, readable
    image is `check_image`'s question.
    """
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp", "WebP"
    for magic, field, name in _SIGNATURES:
        if data.startswith(magic):
            return field, name
    if data[4:8] == b"ftyp" and data[8:12] in _ISO_BRANDS:
        return None, _ISO_BRANDS[data[8:12]]
    return None, None


# JPEG markers that start a frame libjpeg-turbo decodes (baseline, extended, progressive, and
# their arithmetic-coded kinds; not lossless, hierarchical or differential ones, which Pillow opens
# and no decoder here reads), the other segments a header holds before its scan, and those that
# stand alone. A marker outside them (JPG, JPGn, DHP, EXP) is unusual: Pillow decodes the file.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC9, 0xCA})
_HEADER = _SOF | {0xC4, 0xCC, 0xDB, 0xDD, 0xFE, *range(0xE0, 0xF0)}  # DHT, DAC, DQT, DRI, COM, APPn
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])


def _plain_jpeg(data: bytes) -> bool:
    """True if `data` is a JPEG whose header segments are whole, with a sane frame size, ending with EOI.

    The fast path of `check_image`, for the common case: walking the segment headers
    up to the start of scan costs about 10 µs, where `Image.open` costs 150-275 µs,
    a quarter of the whole per-image cost of packing (measured with cProfile on 110 KB
    JPEGs). It only ever says yes; anything unusual goes to Pillow, which then gives
    the error (or accepts what this walk is too strict for).
    """
    if not is_jpeg(data) or not jpeg_ends(data):
        return False
    pos, end, frame = 2, len(data), False
    defined: set[int] = set()  # quantisation tables defined
    wanted: list[int] = []  # the tables the frame's components name
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker not in _HEADER and marker != 0xDA:  # unusual, or SOI/EOI mid-header
            return False
        length = data[pos + 2] << 8 | data[pos + 3]
        if length < 2 or pos + 2 + length > end:
            return False
        if marker in _SOF:
            if frame or length < 8:
                return False
            bits, height, width, components = struct.unpack_from(">BHHB", data, pos + 4)
            if (bits != 8 or components not in (1, 3, 4) or length != 8 + 3 * components
                    or not 0 < width * height <= (Image.MAX_IMAGE_PIXELS or 1 << 62)):
                return False
            specs = [data[pos + 10 + 3 * c : pos + 13 + 3 * c] for c in range(components)]  # id, sampling, table
            if not all(1 <= h_v >> 4 <= 4 and 1 <= h_v & 0x0F <= 4 for _, h_v, _ in specs):
                return False
            wanted = [table for _, _, table in specs]
            frame = True
        elif marker == 0xDB:
            tables = _quantisation_tables(data, pos + 4, pos + 2 + length)
            if tables is None:
                return False
            defined |= tables
        elif marker == 0xC4 and not _whole_huffman_tables(data, pos + 4, pos + 2 + length):
            return False
        elif marker == 0xDA:  # start of scan: the header is over
            return frame and defined.issuperset(wanted)
        pos += 2 + length
    return False


def _quantisation_tables(data: bytes, start: int, end: int) -> set[int] | None:
    """The ids of the tables a DQT segment's body defines, if it is whole tables (64 entries
    of 1 or 2 bytes each, ids 0 to 3); else None."""
    ids = set()
    while start < end:
        precision, table = data[start] >> 4, data[start] & 0x0F
        if precision > 1 or table > 3:
            return None
        ids.add(table)
        start += 1 + 64 * (1 + precision)
    return ids if start == end else None


def _whole_huffman_tables(data: bytes, start: int, end: int) -> bool:
    """A DHT segment's body is whole Huffman tables: a class and id, 16 code counts, and as
    many symbols as they add up to (at most 256). A count off by one bit here was accepted,
    and every decoder then refused the image."""
    while start < end:
        if data[start] >> 4 > 1 or data[start] & 0x0F > 3 or start + 17 > end:
            return False
        counts = data[start + 1 : start + 17]
        symbols = sum(counts)
        if symbols > 256 or start + 17 + symbols > end or not _prefix_code(counts):
            return False
        if data[start] >> 4 == 0 and max(data[start + 17 : start + 17 + symbols], default=0) > 15:
            return False  # a DC table's symbols are bit counts, 0 to 15 (libjpeg's check)
        start += 17 + symbols
    return start == end


def _prefix_code(counts: bytes) -> bool:
    """Whether codes of these counts, by length 1 to 16, fit the code space (libjpeg refuses
    a table whose codes run out of it: "bad Huffman table")."""
    code = 0
    for length, count in enumerate(counts, 1):
        code += count
        if code >= 1 << length:  # the all-ones code of a length is reserved
            return False
        code <<= 1
    return True


def check_image(data: bytes, path: str) -> str:
    """The field of `data`'s true format (``"jpg"``, ``"png"`` or ``"webp"``), whatever
    the name of its file says (`pack` stores it under its name's field all the same, and
    reports a difference); raise PackError unless it is a readable, complete image in
    one of these formats.

    Cheap by design (a full decode would cost more than the rest of packing): the format
    is told from the first bytes, the header is parsed, PNG chunk checksums verified, and
    a JPEG whose header is unusual, or that does not end with its end-of-image marker, is
    fully decoded (to tell truncation from trailing bytes, and a header no decoder reads).
    `verify` does the full decode of every image.
    """
    kind, name = sniff_image(data)
    if kind is None:
        if name is None:
            raise PackError("not a readable image: unknown or damaged format", url=path)
        # Pillow would read a GIF or a BMP, but the fields pack writes hold JPEG, PNG and WebP only.
        raise PackError(f"a {name} image: pack stores JPEG, PNG and WebP only", url=path)
    if kind == "jpg" and _plain_jpeg(data):
        return kind
    try:
        with open_image(data) as image:
            _within_bomb_limit(image.size)
            if image.format == "JPEG":
                # Decoded: a JPEG comes here only where its header walk (`_plain_jpeg`) found it
                # unusual or damaged (a frame kind, marker or table no decoder here reads), or
                # it does not end with its end marker (truncated, or bytes after it); Pillow
                # opens such files and every decoder then refused them.
                image.load()
            elif image.format == "PNG":
                image.verify()
            else:
                image.load()
    except Image.UnidentifiedImageError as e:
        raise PackError("not a readable image: unknown or damaged format", url=path) from e
    except (*DAMAGED_IMAGE_ERRORS, Image.DecompressionBombWarning) as e:
        # The reason goes into the manifest, which must be reproducible.
        raise PackError(f"not a readable image: {reason(e)}", url=path) from e
    return kind


def _within_bomb_limit(size: tuple[int, int]) -> None:
    # What Pillow warns about (DecompressionBombWarning) as an error, in Pillow's words,
    # without changing the warning filters, which threads share (`pack` turns the
    # warning itself into an error for its whole run, see `pack._bomb_warnings_raise`).
    pixels, limit = size[0] * size[1], Image.MAX_IMAGE_PIXELS
    if limit is not None and pixels > limit:
        raise Image.DecompressionBombWarning(
            f"Image size ({pixels} pixels) exceeds limit of {limit} pixels, could be decompression bomb DOS attack.")
