"""Encoding sample fields to bytes by their extension, as the WebDataset layout expects.

A field's extension says how its bytes are to be read: `cls` an ASCII integer, `txt`
UTF-8 text, `json` JSON, `msgpack`/`mp` msgpack, `npy` a NumPy array file, images
their original file bytes. Decoding lives in `decode.py`, on the reading side.
"""

from __future__ import annotations

import io
import json
import math
import tokenize
from typing import Any, Callable

import msgpack
import numpy as np

from .errors import ShardstreamError, reason
from .format import MAX_KEY_BYTES

__all__ = ["encode_field", "encode_sample", "field_extension", "unreadable", "IMAGE_EXTENSIONS"]

# Fields that hold an image file's bytes, read by the image decoders (decode.py).
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "gif", "tif", "tiff"})
# A sample's names beginning with "__" are the readers' (its key, WebDataset's shard URL and
# local path, and the dataset's mark of a repeat): `write` leaves these out of the shard, and
# refuses others (FORMAT.md).
READER_NAMES = frozenset({"__key__", "__url__", "__local_path__", "__pad__"})


def _encode_int(value: Any) -> bytes:
    # int() would truncate 3.7 to 3 and turn True into 1: an integer, or its text, only.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, str)):
        raise TypeError(f"an integer is needed, not {value!r}")
    return str(int(value)).encode("ascii")


def _encode_json(value: Any) -> bytes:
    # allow_nan=False: NaN and Infinity are not JSON, and other readers refuse them.
    _check_json_keys(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _check_json_keys(value: Any) -> None:
    """JSON's keys are strings: json.dumps turns 1 into "1" and True into "true", and the
    value would not read back as written (msgpack keeps them)."""
    if isinstance(value, dict):
        for name, part in value.items():
            if not isinstance(name, str):
                raise TypeError(f"a JSON object's keys are strings, not {name!r}: use str keys, or msgpack, "
                                "which keeps others")
            _check_json_keys(part)
    elif isinstance(value, (list, tuple)):
        for part in value:
            _check_json_keys(part)


def _encode_msgpack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _encode_npy(value: Any) -> bytes:
    if isinstance(value, np.ma.MaskedArray):  # np.save would store the data and drop the mask
        raise TypeError("npy stores no mask: pass array.filled(value), or the data and "
                        "np.ma.getmaskarray(array) as two fields")
    out = io.BytesIO()
    np.save(out, np.asarray(value), allow_pickle=False)
    return out.getvalue()


def _encode_float(value: Any) -> bytes:
    return repr(float(value)).encode("ascii")


def _encode_text(value: Any) -> bytes:
    # str() of None, an array or a dict would store a printout (an array's elided), not data.
    if not isinstance(value, str):
        raise TypeError(f"txt holds text: pass a str, not {type(value).__name__}")
    return value.encode("utf-8")


ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "cls": _encode_int,
    "cls2": _encode_int,
    "index": _encode_int,
    "json": _encode_json,
    "msgpack": _encode_msgpack,
    "mp": _encode_msgpack,
    "npy": _encode_npy,
    "txt": _encode_text,
    "weight": _encode_float,
}


# -- reading: what the stored bytes of a field are read as (decode.py applies these) --


def _int(data: bytes) -> int:
    return int(data)


def _float(data: bytes) -> float:
    return float(data)


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _json(data: bytes) -> Any:
    return json.loads(data)


def _msgpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)


def _npy(data: bytes) -> np.ndarray:
    # The .npy format only: np.load also opens bytes that begin as a zip does, as a lazy
    # NpzFile (not an array), and raises zipfile's own errors on damaged ones.
    array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    # In this machine's byte order, the same values: torch takes no other (a big-endian
    # array failed every collate, and torch.from_numpy).
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


FIELD_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "cls": _int,
    "cls2": _int,
    "index": _int,
    "txt": _text,
    "text": _text,
    "json": _json,
    "msgpack": _msgpack,
    "mp": _msgpack,
    "npy": _npy,
    "weight": _float,
}

# What the readers above raise on bytes they cannot read (numpy's header parser raises
# SyntaxError and tokenize's errors; MemoryError for a header that claims a huge array).
READ_ERRORS = (ValueError, TypeError, EOFError, SyntaxError, RecursionError, OverflowError, MemoryError,
               tokenize.TokenError, msgpack.UnpackException)


_WRITER_CHECKS = ("cls", "weight")  # the writer checks these itself, in its own words (their ranges too)


def _readable(field: str, data: bytes, key: str) -> bytes:
    """`data`, where every reader reads it as the field's extension says; else refused now,
    not stored for every read to fail (an npy of pickled objects, text that is no UTF-8,
    JSON or msgpack that does not parse: with the writer's own encoding, a tuple as a
    msgpack map's key, which reads back as an unhashable list)."""
    if field_extension(field) in _WRITER_CHECKS:
        return data
    why = unreadable(field, data)
    if why is not None:
        raise ShardstreamError(f"field {field!r}: {why}", key=key or None)
    return data


def unreadable(field: str, data: bytes, *, strict: bool = True) -> str | None:
    """Why the bytes `data` do not read as `field`'s extension says, or None (also where
    no reader of the extension is known: images, whose decoders are decode.py's). With
    `strict`, JSON with NaN or Infinity is refused: Python's reader (and shardstream's)
    takes it, but FORMAT.md and other readers do not. An `npy` is checked by its header
    and length, not read: no copy of a large array."""
    ext = field_extension(field)
    decoder = FIELD_DECODERS.get(ext)
    if decoder is None:
        return None
    try:
        if decoder is _json and strict:
            json.loads(data, parse_constant=_no_constant)
        elif decoder is _npy:
            _check_npy(data)
        else:
            decoder(data)
    except READ_ERRORS as e:
        return f"its bytes do not read back as {ext} ({reason(e)})"
    return None


def _check_npy(data: bytes) -> None:
    """Raise what `_npy` would on `data`, without making the array: a header numpy reads,
    no pickled objects, and the bytes the header's shape and dtype need."""
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):  # 3.0 (UTF-8 field names): numpy reads it, and no public header reader
        _npy(data)
        return
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(f)
    if dtype.hasobject:
        raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
    if any(n < 0 for n in shape):
        raise ValueError("negative dimensions are not allowed")
    needed = dtype.itemsize * math.prod(shape)  # Python's ints: numpy's int64 product wraps (2**32 x 2**32 is 0)
    if len(data) - f.tell() < needed:
        raise ValueError(f"EOF: reading array data, expected {needed} bytes got {len(data) - f.tell()}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def encode_field(field: str, value: Any, *, key: str = "", check_bytes: bool = True) -> bytes:
    """The bytes stored for `value` under the field name `field`.

    Bytes are stored as they are (images keep their original file bytes), where a reader
    reads them as the field's extension says (`check_bytes`; `repack` keeps another tool's
    as they came, as `index` does); other values are encoded by the field's last extension.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _readable(field, bytes(value), key) if check_bytes else bytes(value)
    ext = field_extension(field)
    encoder = ENCODERS.get(ext)
    if encoder is None:
        if isinstance(value, str) and ext in IMAGE_EXTENSIONS:  # a path passed for the file's bytes, most likely
            raise ShardstreamError(f"field {field!r}: an image field holds the file's bytes, not a str: pass "
                                   "open(path, 'rb').read()", key=key or None)
        if isinstance(value, str):  # WebDataset's convention for other extensions: UTF-8
            return value.encode("utf-8")
        raise ShardstreamError(
            f"field {field!r}: no encoding for {type(value).__name__} by this extension; pass bytes, or use "
            f"one of {sorted(ENCODERS)}",
            key=key or None,
        )
    try:
        data = encoder(value)
    # msgpack's ints past 64 bits; deep json; a tensor that requires grad (RuntimeError)
    except (TypeError, ValueError, OverflowError, RecursionError, RuntimeError) as e:
        raise ShardstreamError(f"field {field!r}: cannot encode {type(value).__name__}: {e}", key=key or None) from e
    return _readable(field, data, key) if encoder is _encode_msgpack else data


def field_extension(name: str) -> str:
    """The extension a field is encoded and decoded by: after its last dot, lower case
    (``left.jpg``: ``jpg``)."""
    return name.rsplit(".", 1)[-1].lower()


def encode_sample(sample: dict[str, Any], *, check_bytes: bool = True) -> tuple[str, list[tuple[str, bytes]]]:
    """Check a sample dict and encode it: (key, [(field, bytes), ...]) in sorted field order
    (`check_bytes`: see `encode_field`)."""
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ShardstreamError("a sample needs a non-empty string '__key__'")
    _check_key(key)
    fields = []
    for name in sorted(sample):
        if name in READER_NAMES:
            continue
        if name.startswith("__"):  # dropped, it was data lost; stored, readers refuse it (FORMAT.md)
            raise ShardstreamError(f"bad field name {name!r}: names beginning with '__' are the readers' "
                                   f"({', '.join(sorted(READER_NAMES))}), and no reader yields another: rename it",
                                   key=key)
        if not name or "/" in name or "\0" in name:  # a NUL would cut the tar member's name
            raise ShardstreamError(f"bad field name {name!r}", key=key)
        if name != name.lower():  # readers, WebDataset's and ours, lower-case it
            raise ShardstreamError(f"bad field name {name!r}: field names are lower case, as every reader of "
                                   "the tar format reads them", key=key)
        fields.append((name, encode_field(name, sample[name], key=key, check_bytes=check_bytes)))
    if not fields:
        raise ShardstreamError("a sample needs at least one field", key=key)
    return key, fields


def _check_key(key: str) -> None:
    # The key ends at the first dot of the last path component, so it cannot hold one;
    # absolute and parent paths would escape a folder when a shard is extracted, and empty
    # or "." parts name the same file as a key without them ("a//b", "./a/b": "a/b").
    parts = key.split("/")
    if "." in parts[-1] or any(part in ("", ".", "..") for part in parts) or "\0" in key:
        raise ShardstreamError(f"bad sample key {key!r}: a last part without dots, no absolute paths, "
                               "no empty, '.' or '..' parts")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no tar header or index could hold it
        raise ShardstreamError(f"bad sample key {key!r}: not encodable as UTF-8") from None
    if len(encoded) > MAX_KEY_BYTES:  # no reader would read the shard's index
        raise ShardstreamError(f"bad sample key {key[:40]!r}...: {len(encoded)} bytes, more than the {MAX_KEY_BYTES} "
                               "a key may take (FORMAT.md, limits)")
