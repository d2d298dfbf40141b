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

import operator
import struct
from typing import NamedTuple

from PIL import Image

from .decode import DAMAGED_IMAGE_ERRORS, JPEG_FORMATS, is_jpeg, jpeg_ends, open_image, pixel_limit
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
_PARSED = _SOF | {0xC4, 0xDB, 0xDA}  # DHT, DQT, SOS


def _plain_jpeg(data: bytes) -> bool:
    """True if `data` is a JPEG whose header segments are whole, with a sane frame size and
    a first scan the decoders read, ending with EOI.

    The fast path of `check_image`, for the common case: walking the segment headers
    up to the start of scan costs about 10 µs, where `Image.open` costs 150-275 µs,
    a quarter of the whole per-image cost of packing (measured with cProfile on 110 KB
    JPEGs). It only ever says yes; anything unusual goes to Pillow, which then gives
    the error (or accepts what this walk is too strict for).
    """
    if not is_jpeg(data) or not jpeg_ends(data):
        return False
    pos, end = 2, len(data)
    frame: _Frame | None = None
    quantisation: set[int] = set()  # the ids of the tables defined so far
    huffman: set[tuple[int, int]] = set()  # (class, id)
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
        # The segments parsed are small (tables, the frame, the scan); APPn (EXIF, ICC: up to
        # 64 KB each) is passed over uncopied.
        body = data[pos + 4 : pos + 2 + length] if marker in _PARSED else b""
        if marker in _SOF:
            if frame is not None:
                return False
            frame = _frame(marker, body)
            if frame is None:
                return False
        elif marker == 0xDB:
            tables = _quantisation_tables(body)
            if tables is None:
                return False
            quantisation |= tables
        elif marker == 0xC4:
            codes = _huffman_tables(body)
            if codes is None:
                return False
            huffman |= codes
        elif marker == 0xDA:  # start of scan: the header is over
            return frame is not None and quantisation.issuperset(frame.tables) and _scan_readable(body, frame, huffman)
        pos += 2 + length
    return False


class _Frame(NamedTuple):
    """A start-of-frame segment: its marker (the kind of frame) and, per component, its id,
    horizontal and vertical sampling factors and quantisation table."""

    marker: int
    ids: bytes
    horizontal: list[int]
    vertical: list[int]
    tables: bytes

    @property
    def progressive(self) -> bool:
        return self.marker in (0xC2, 0xCA)

    @property
    def arithmetic(self) -> bool:
        return self.marker in (0xC9, 0xCA)


# Written as loops over byte slices, not generator expressions: the walk runs once an image
# packed, and these took 6 of its 24 us (a generator is set up per test).
def _frame(marker: int, body: bytes) -> _Frame | None:
    """The frame a start-of-frame segment's body describes, if the decoders read it: 8 bits,
    1, 3 or 4 components of distinct ids, a size within Pillow's pixel limit, sampling
    factors 1 to 4 that divide the largest (libjpeg refuses fractional ratios)."""
    if len(body) < 6:
        return None
    bits, height, width, count = struct.unpack_from(">BHHB", body)
    if (bits != 8 or count not in (1, 3, 4) or len(body) != 6 + 3 * count
            or not 0 < width * height <= (pixel_limit() or 1 << 62)):
        return None
    ids, sampling = body[6::3], body[7::3]
    horizontal, vertical = [x >> 4 for x in sampling], [x & 0x0F for x in sampling]
    h_max, v_max = max(horizontal), max(vertical)
    if len(set(ids)) != count or min(horizontal) < 1 or min(vertical) < 1 or h_max > 4 or v_max > 4:
        return None
    for h, v in zip(horizontal, vertical):
        if h_max % h or v_max % v:
            return None
    return _Frame(marker, ids, horizontal, vertical, body[8::3])


def _scan_readable(body: bytes, frame: _Frame, huffman: set[tuple[int, int]]) -> bool:
    """Whether the first scan's header (its SOS segment's body) is one the decoders read in
    `frame`: its components the frame's, at most 10 blocks an interleaved MCU, the spectral
    selection and approximation a sequential or progressive scan may have, and the Huffman
    tables it uses defined (libjpeg: "Huffman table 0x.. was not defined"). Damage here was
    accepted, and every decoder then refused the image (RELIABILITY 248)."""
    count = body[0] if body else 0
    if not 1 <= count <= len(frame.ids) or len(body) != 4 + 2 * count:
        return False
    selectors, tables = body[1 : 1 + 2 * count : 2], body[2 : 2 + 2 * count : 2]
    if len(set(selectors)) != count:
        return False
    blocks = 0
    for selector in selectors:
        component = frame.ids.find(selector)
        if component < 0:
            return False
        blocks += frame.horizontal[component] * frame.vertical[component]
    if count > 1 and blocks > 10:
        return False
    first, last, high, low = body[-3], body[-2], body[-1] >> 4, body[-1] & 0x0F
    if frame.progressive:
        if not (first <= last <= 63 and (first == 0) == (last == 0) and (first == 0 or count == 1)
                and low <= 13 and (high == 0 or low == high - 1)):
            return False
    elif (first, last, high, low) != (0, 63, 0, 0):
        return False
    for table in tables:
        if frame.arithmetic:  # conditioning tables (DAC) are optional: defaults stand in
            if table >> 4 > 3 or table & 0x0F > 3:
                return False
            continue
        if (not frame.progressive or (first == 0 and high == 0)) and (0, table >> 4) not in huffman:
            return False  # a DC table (a progressive DC refinement scan reads raw bits)
        if (not frame.progressive or last > 0) and (1, table & 0x0F) not in huffman:
            return False  # an AC table
    return True


def _quantisation_tables(body: bytes) -> set[int] | None:
    """The ids of the tables a DQT segment's body defines, if it is whole tables (64 entries
    of 1 or 2 bytes each, ids 0 to 3); else None."""
    ids, at = set(), 0
    while at < len(body):
        precision, table = body[at] >> 4, body[at] & 0x0F
        if precision > 1 or table > 3:
            return None
        ids.add(table)
        at += 1 + 64 * (1 + precision)
    return ids if at == len(body) else None


def _huffman_tables(body: bytes) -> set[tuple[int, int]] | None:
    """The (class, id) of the tables a DHT segment's body defines, if it is whole Huffman
    tables: a class and id, 16 code counts, and as many symbols as they add up to (at most
    256); else None. A count off by one bit here was accepted, and every decoder then
    refused the image."""
    codes, at, end = set(), 0, len(body)
    while at < end:
        kind, table = body[at] >> 4, body[at] & 0x0F
        if kind > 1 or table > 3 or at + 17 > end:
            return None
        counts = body[at + 1 : at + 17]
        symbols = sum(counts)
        if symbols > 256 or at + 17 + symbols > end or not _prefix_code(counts):
            return None
        if kind == 0 and max(body[at + 17 : at + 17 + symbols], default=0) > 15:
            return None  # a DC table's symbols are bit counts, 0 to 15 (libjpeg's check)
        codes.add((kind, table))
        at += 17 + symbols
    return codes


def _prefix_code(counts: bytes) -> bool:
    """Whether codes of these counts, by length 1 to 16, fit the code space (libjpeg refuses
    a table whose codes run out of it: "bad Huffman table").

    libjpeg assigns the codes length by length and fails where a length's would reach its
    all-ones code, which is reserved: where the share of the code space the codes up to
    that length take, the sum of count x 2^-length, reaches 1. The share only grows, so the
    last length's tells (Kraft's sum, in 16ths of bits), in one C-level pass: a loop over
    the 16 lengths took 1.2 us a table, four tables an image."""
    return sum(map(operator.mul, counts, _CODE_SPACE)) < 1 << 16


_CODE_SPACE = tuple(1 << (16 - length) for length in range(1, 17))  # what a code of each length takes


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
        if not data:
            raise PackError("not a readable image: an empty file (0 bytes)", url=path)
        if name is None:
            raise PackError("not a readable image: unknown or damaged format", url=path)
        # Pillow would read a GIF or a BMP, but the fields pack writes hold JPEG, PNG and WebP only.
        raise PackError(f"a {name} image: pack stores JPEG, PNG and WebP only", url=path)
    if kind == "jpg" and _plain_jpeg(data):
        return kind
    try:
        with open_image(data) as image:
            if image.format in JPEG_FORMATS:
                # Decoded: a JPEG comes here only where its header walk (`_plain_jpeg`) found it
                # unusual or damaged (a frame kind, marker or table no decoder here reads), or
                # it does not end with its end marker (truncated, or bytes after it); Pillow
                # opens such files and every decoder then refused them.
                image.load()
            elif image.format == "PNG":
                if not image.tile:  # no IDAT: Pillow 11 on fails its verify with an IndexError, Pillow 10 a TypeError
                    raise PackError("not a readable image: no image data", url=path)
                image.verify()
            else:
                image.load()
    except Image.UnidentifiedImageError as e:
        raise PackError("not a readable image: unknown or damaged format", url=path) from e
    except Image.DecompressionBombError as e:  # Pillow's own, as it opens the file: the readers' limit too
        raise _too_large(reason(e), path) from e
    except DAMAGED_IMAGE_ERRORS as e:
        # The reason goes into the manifest, which must be reproducible.
        raise PackError(f"not a readable image: {reason(e)}", url=path) from e
    return kind


def _too_large(detail: str, path: str) -> PackError:
    return PackError(f"too large: {detail} (the limit is twice PIL.Image.MAX_IMAGE_PIXELS, a guard against "
                     "decompression bombs: raise it where the images are trusted)", url=path)
