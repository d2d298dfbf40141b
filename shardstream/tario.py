"""Tar in the WebDataset layout: writing members, and parsing them fast.

Writing goes through `tarfile.TarInfo.tobuf` (PAX format: plain ustar headers for short
names, a pax record only when a name needs it), with every header field fixed, so the
same sample always gives the same bytes.

Parsing is hand-written: the reader parses one header per field of every sample, and
`tarfile` costs tens of microseconds per member where slicing a 512-byte block costs
about one (see MEASURED figures in BENCHMARKS.md). Only what a dataset needs is
supported: regular files, pax and GNU long-name records; directories, links and other
member types are skipped, never followed or written.

A member `dir/key.field.ext` belongs to sample `dir/key` with field `field.ext`: the
key ends at the first dot of the last path component, as in WebDataset.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from .errors import CorruptShardError

BLOCK = 512
END_OF_ARCHIVE = bytes(2 * BLOCK)
MAX_MEMBER_SIZE = 1 << 31  # 2 GiB: no single field of a training sample is larger

_REGULAR = (b"0", b"\0", b"7")


def padded(size: int) -> int:
    """`size` rounded up to whole tar blocks."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def member_size(data_size: int, name: str) -> int:
    """Bytes a member takes in the archive (header, data and padding)."""
    return len(_header(name, data_size)) + padded(data_size)


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0  # fixed, so that packing is byte-reproducible
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def member(name: str, data: bytes) -> bytes:
    """One tar member: header, data, zero padding to the block size."""
    pad = padded(len(data)) - len(data)
    return b"".join((_header(name, len(data)), data, bytes(pad)))


def split_name(name: str) -> tuple[str, str]:
    """Split a member name into (sample key, field) at the first dot of the basename."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


@dataclass(frozen=True, slots=True)
class Header:
    name: str
    size: int
    kind: bytes  # the typeflag
    offset: int  # of the header block in the tar stream


def _number(field: bytes, url: str, offset: int) -> int:
    if field[:1] == b"\x80":  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise CorruptShardError(f"bad tar header: size field {field!r}", url=url, offset=offset) from None


def parse_header(block: bytes | memoryview, url: str, offset: int, verify: bool) -> Header | None:
    """Decode one 512-byte header block; None for an all-zero (end of archive) block."""
    block = bytes(block)
    if len(block) < BLOCK:
        raise CorruptShardError("truncated tar header", url=url, offset=offset)
    if block[:1] == b"\0" and block == bytes(BLOCK):
        return None
    if verify:
        stored = _number(block[148:156], url, offset)
        # The checksum is the byte sum of the header with its own field read as spaces.
        if stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise CorruptShardError("bad tar header checksum", url=url, offset=offset)
    size = _number(block[124:136], url, offset)
    if size > MAX_MEMBER_SIZE:
        raise CorruptShardError(f"tar member of {size} bytes exceeds the limit", url=url, offset=offset)
    name = block[:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptShardError("tar member name is not UTF-8", url=url, offset=offset) from None
    return Header(text, size, block[156:157], offset)


def _pax_path(data: bytes, url: str, offset: int) -> str | None:
    """The `path` record of a pax extended header, if any."""
    pos = 0
    try:
        while pos < len(data):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            if length <= 0:
                break
            record = data[space + 1 : pos + length - 1]
            keyword, _, value = record.partition(b"=")
            if keyword == b"path":
                return value.decode("utf-8")
            pos += length
    except (ValueError, UnicodeDecodeError):
        raise CorruptShardError("bad pax extended header", url=url, offset=offset) from None
    return None


def iter_members(
    buf: bytes, *, url: str, base: int = 0, verify: bool = True
) -> Iterator[tuple[str, int, int]]:
    """Yield (name, data start, data end) for each regular file in an in-memory tar stream.

    `buf` holds whole members; `base` is its offset in the full tar stream, so that
    error offsets point into the shard. Stops at the end-of-archive block or the end of
    `buf`; a member that runs past the end of `buf` is an error.
    """
    pos, end, long_name = 0, len(buf), None
    while pos + BLOCK <= end:
        header = parse_header(buf[pos : pos + BLOCK], url, base + pos, verify)
        if header is None:
            return
        start = pos + BLOCK
        stop = start + header.size
        if stop > end:
            raise CorruptShardError("tar member runs past the end of its data", url=url, offset=base + pos)
        pos = start + padded(header.size)
        if header.kind in (b"x", b"L"):
            data = buf[start:stop]
            long_name = _pax_path(data, url, base + start) if header.kind == b"x" else _gnu_name(data)
            continue
        if header.kind in _REGULAR:
            yield (long_name or header.name), start, stop
        long_name = None
    if pos != end:
        raise CorruptShardError("truncated tar stream", url=url, offset=base + pos)


def _gnu_name(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


def iter_stream_members(f: BinaryIO, *, url: str, verify: bool = True) -> Iterator[tuple[str, bytes, int]]:
    """Yield (name, data, offset of its first header) for each regular file of a tar read from `f`.

    For tars without an index (other tools' WebDataset shards, `.tar.gz`): one pass,
    constant memory beyond the current member.
    """
    offset, long_name, record_offset = 0, None, None
    read = f.read
    while True:
        block = read(BLOCK)
        if not block:
            return  # EOF without an end-of-archive block: accepted, as GNU tar does
        header = parse_header(block, url, offset, verify)
        if header is None:
            return
        data = read(header.size)
        if len(data) < header.size:
            raise CorruptShardError("truncated tar member", url=url, offset=offset)
        pad = padded(header.size) - header.size
        if pad and len(read(pad)) < pad:
            raise CorruptShardError("truncated tar member padding", url=url, offset=offset)
        member_offset, offset = offset, offset + BLOCK + padded(header.size)
        if header.kind in (b"x", b"L"):
            long_name = _pax_path(data, url, member_offset) if header.kind == b"x" else _gnu_name(data)
            record_offset = member_offset if record_offset is None else record_offset
            continue
        if header.kind in _REGULAR:
            # A pax or long-name record belongs to the member it precedes: report its offset.
            yield (long_name or header.name), data, member_offset if record_offset is None else record_offset
        long_name, record_offset = None, None


def group_samples(
    members: Iterator[tuple[str, bytes, int]], *, url: str
) -> Iterator[tuple[dict[str, object], int]]:
    """Group adjacent members with the same key into samples: ({'__key__': key, field: bytes}, offset)."""
    sample: dict[str, object] | None = None
    sample_offset = 0
    for name, data, offset in members:
        key, field = split_name(name)
        if sample is not None and sample["__key__"] != key:
            yield sample, sample_offset
            sample = None
        if sample is None:
            sample, sample_offset = {"__key__": key}, offset
        if field in sample:
            raise CorruptShardError(f"field {field!r} appears twice", url=url, key=key, offset=offset)
        sample[field] = data
    if sample is not None:
        yield sample, sample_offset
