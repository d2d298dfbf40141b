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

import logging
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Callable, Container, Iterator

import numpy as np

from .errors import CorruptShardError, shown_url

log = logging.getLogger("shardstream")
_unended_said: set[str] = set()  # the tars this process said end without their end-of-archive blocks

BLOCK = 512
END_OF_ARCHIVE = bytes(2 * BLOCK)
MAX_MEMBER_SIZE = 1 << 31  # 2 GiB: no single field of a training sample is larger

_REGULAR = (b"0", b"\0", b"7")
_SPARSE = b"S"  # GNU tar --sparse (old GNU format); pax sparse files carry GNU.sparse.* records instead
_NAME_RECORDS = (b"x", b"g", b"L")  # pax (per member, global) and GNU long-name records
# The most a member's pax or long-name record may hold, read into memory to name it: a key is
# 1 MiB at most (FORMAT.md), and a pax record may carry a few others (times, owners, xattrs).
MAX_NAME_RECORD = 1 << 22
_SKIP_CHUNK = 1 << 20


def padded(size: int) -> int:
    """`size` rounded up to whole tar blocks."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def member_size(data_size: int, name: str) -> int:
    """Bytes a member takes in the archive (header, data and padding)."""
    header = BLOCK if _plain_ustar(name, data_size) else len(_tarfile_header(name, data_size))
    return header + padded(data_size)


# The ustar header that `tarfile` writes for the members below, split around its only
# variable fields (name, size, checksum). `_header` builds it directly for short ASCII
# names, the common case, at a few percent of tarfile's cost; anything else goes through
# tarfile. benchmarks/check_tario.py checks the two byte for byte over many names.
_MODE_IDS = b"0000644\0" + b"0000000\0" + b"0000000\0"  # mode, uid, gid
_MTIME = b"00000000000\0"
_TAIL = b"0" + bytes(100) + b"ustar\x0000" + bytes(32 + 32 + 8 + 8 + 155 + 12)  # type .. padding
_CHECKSUM_BASE = sum(_MODE_IDS) + sum(_MTIME) + 8 * ord(" ") + sum(_TAIL)
_MAX_USTAR_SIZE = 8**11  # sizes from here on need a pax record


def _plain_ustar(name: str, size: int) -> bool:
    """Whether the member's header is one ustar block (no pax record before it)."""
    return len(name) <= 100 and name.isascii() and 0 <= size < _MAX_USTAR_SIZE and type(size) is int


def _header(name: str, size: int) -> bytes:
    if _plain_ustar(name, size):
        raw = name.encode("ascii")
        size_field = b"%011o\0" % size
        checksum = _CHECKSUM_BASE + sum(raw) + sum(size_field)
        return b"".join(
            (raw, bytes(100 - len(raw)), _MODE_IDS, size_field, _MTIME, b"%06o\0 " % checksum, _TAIL)
        )
    return _tarfile_header(name, size)


def _tarfile_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0  # fixed, so that packing is byte-reproducible
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def member(name: str, data: bytes) -> bytes:
    """One tar member: header, data, zero padding to the block size."""
    return b"".join(member_parts(name, data))


def member_parts(name: str, data: bytes) -> tuple[bytes, bytes, bytes]:
    """`member` as (header, data, padding), for callers that join many members at once."""
    pad = -len(data) % BLOCK
    return _header(name, len(data)), data, _ZEROS[:pad] if pad else b""


_ZEROS = bytes(BLOCK)


def member_key(name: str) -> tuple[str, str] | None:
    """A member's (sample key, field), split at the first dot of its basename, the field
    lower case; None for a member that belongs to no sample: a basename without a dot
    or starting with one (``README``, ``.DS_Store``, macOS's ``._a.jpg``) and folders.
    WebDataset's rule (`base_plus_ext`, lower-cased suffixes), so that an indexed tar
    holds the samples WebDataset reads from it."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:  # no dot, or a leading one (a name ending in "/" has no dot after it)
        return None
    return name[:dot], name[dot + 1 :].lower()


@dataclass(frozen=True, slots=True)
class Header:
    name: str
    size: int
    kind: bytes  # the typeflag
    offset: int  # of the header block in the tar stream


def _high_bytes(block: bytes) -> int:
    """Bytes of 128 or more in a header outside its checksum field. Old Sun tar and others
    summed the bytes as signed: such a checksum is less by 256 for each (GNU tar and tarfile,
    and so WebDataset, take either sum)."""
    return sum(1 for b in block[:148] if b >= 128) + sum(1 for b in block[156:] if b >= 128)


def _number(field: bytes, what: str, url: str, offset: int) -> int:
    if field[:1] == b"\x80":  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise CorruptShardError(f"bad tar header: {what} field {field!r}", url=url, offset=offset) from None


def parse_header(block: bytes | memoryview, url: str, offset: int, verify: bool,
                 renamed: bool = False) -> Header | None:
    """Decode one 512-byte header block; None for an all-zero (end of archive) block.

    `renamed`: a pax or GNU long-name record before this header gives the member's name.
    """
    block = bytes(block)
    if len(block) < BLOCK:
        raise CorruptShardError("truncated tar header", url=url, offset=offset)
    if block[:1] == b"\0" and block == bytes(BLOCK):
        return None
    if verify:
        stored = _number(block[148:156], "checksum", url, offset)
        # The checksum is the byte sum of the header with its own field read as spaces.
        unsigned = sum(block[:148]) + 256 + sum(block[156:])
        if stored != unsigned and stored != unsigned - 256 * _high_bytes(block):
            raise CorruptShardError("bad tar header checksum", url=url, offset=offset)
    size = _number(block[124:136], "size", url, offset)
    if size < 0:
        raise CorruptShardError(f"bad tar header: negative size {size}", url=url, offset=offset)
    if size > MAX_MEMBER_SIZE:
        raise CorruptShardError(f"tar member of {size} bytes exceeds the limit", url=url, offset=offset)
    name = block[:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\0":  # POSIX ustar; GNU's magic ("ustar  ") keeps times there (tar -g)
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    kind = block[156:157]
    if renamed or kind in _NAME_RECORDS:
        # A name that is never used: GNU tar cuts a long name's ustar field mid-character.
        return Header(name.decode("utf-8", "replace"), size, kind, offset)
    # Bytes that are not UTF-8 are kept as surrogates (as tarfile does): a member that
    # belongs to no sample may have any name; one that does is refused (`_member_name`).
    return Header(name.decode("utf-8", "surrogateescape"), size, kind, offset)


def _member_name(name: str, kind: bytes, url: str, offset: int) -> str:
    """`name` of a member about to be yielded, or the error where a sample cannot be read from it."""
    if kind == _SPARSE:
        raise CorruptShardError(f"{name!r} is a sparse member (GNU tar --sparse), which is not supported: "
                                "make the tar without --sparse", url=url, offset=offset)
    if member_key(name) is not None:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise CorruptShardError(f"tar member name {name!r} is not UTF-8", url=url, offset=offset) from None
    return name


def _pax_path(data: bytes, url: str, offset: int) -> str | None:
    """The `path` record of a pax extended header, if any."""
    pos, path, sparse = 0, None, False
    try:
        while pos < len(data):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            if length <= 0:
                break
            record = data[space + 1 : pos + length - 1]
            keyword, _, value = record.partition(b"=")
            if keyword == b"path":
                path = value.decode("utf-8", "surrogateescape")  # hdrcharset=BINARY: see `_member_name`
            elif keyword.startswith(b"GNU.sparse."):
                sparse = True
            pos += length
    except ValueError:
        raise CorruptShardError("bad pax extended header", url=url, offset=offset) from None
    if sparse:  # the member's data is a sparse map and pieces, not the file's bytes
        raise CorruptShardError(f"{path or 'a member'!r} is a sparse file (GNU tar --sparse), which is not "
                                "supported: make the tar without --sparse", url=url, offset=offset)
    return path


def iter_members(
    buf: bytes, *, url: str, base: int = 0, verify: bool = True
) -> Iterator[tuple[str, int, int]]:
    """Yield (name, data start, data end) for each regular file in an in-memory tar stream.

    `buf` holds whole members (one sample's span); `base` is its offset in the full tar
    stream, so that error offsets point into the shard. A member that runs past the end
    of `buf`, or an all-zero block inside it (a lost header), is an error.
    """
    pos, end, long_name = 0, len(buf), None
    while pos + BLOCK <= end:
        at = pos
        header = parse_header(buf[at : at + BLOCK], url, base + at, verify, long_name is not None)
        if header is None:
            raise CorruptShardError("an all-zero (end-of-archive) block inside a sample", url=url, offset=base + at)
        start = at + BLOCK
        stop = start + header.size
        if stop > end:
            raise CorruptShardError("tar member runs past the end of its data", url=url, offset=base + at)
        pos = start + padded(header.size)
        if header.kind in (b"x", b"L"):
            data = bytes(buf[start:stop])  # buf may be a memoryview
            long_name = _pax_path(data, url, base + start) if header.kind == b"x" else _gnu_name(data)
            continue
        if header.kind in _REGULAR or header.kind == _SPARSE:
            yield _member_name(long_name or header.name, header.kind, url, base + at), start, stop
        long_name = None
    if pos != end:
        raise CorruptShardError("truncated tar stream", url=url, offset=base + pos)


def common_member(block: bytes, pos: int, key: str) -> tuple[str, int] | None:
    """(field, data size) of the header at ``block[pos : pos + 512]``, if it is a member of
    sample `key` in the common layout, else None.

    The common layout: a regular ustar member with a short name (no pax or long-name
    record, no name prefix) of the key the index expects. Anything else, including a
    header that would not parse, gives None, and the caller parses the sample with
    `iter_members`, which handles every layout and raises the precise error. Header
    checksums are not checked here (see `checksums_ok`).
    """
    if block[pos] == 0 or block[pos + 156] != 48 or block[pos + 345] != 0 or block[pos + 257 : pos + 262] != b"ustar":
        return None  # an end block, another member type, a name prefix, or not ustar
    field = block[pos + 124 : pos + 136]
    if field[0] == 0x80:
        return None
    text = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        size = int(text, 8) if text else 0
        nul = block.find(b"\0", pos, pos + 100)
        name = block[pos : nul if nul >= 0 else pos + 100].decode("utf-8")
    except ValueError:  # includes UnicodeDecodeError
        return None
    if size < 0 or size > MAX_MEMBER_SIZE:
        return None
    named = member_key(name)
    if named is None or named[0] != key or named[1] != name[len(key) + 1 :] or named[1].startswith("__"):
        return None  # no sample's, another's, a field to lower-case or refuse: `iter_members`' callers decide
    return named[1], size


def scan_sample(buf: bytes, a: int, b: int, key: str) -> list[tuple[str, int, int]] | None:
    """The fast path for one sample of an indexed shard: [(field, data start, data end)].

    `buf[a:b]` should hold the members of the sample `key`, all in the layout
    `common_member` accepts, and nothing else; otherwise None. Where it returns a list,
    `iter_members` would have given the same members.
    """
    end = min(b, len(buf))
    if a < 0 or a >= end:
        return None
    members = []
    pos = a
    while pos + BLOCK <= end:
        member = common_member(buf, pos, key)
        if member is None:
            return None
        field, size = member
        start = pos + BLOCK
        if start + size > end or any(field == seen for seen, _, _ in members):  # twice: the caller says so
            return None
        members.append((field, start, start + size))
        pos = start + padded(size)
    if pos != end or not members:
        return None
    return members


_SUM_WEIGHTS = 8 ** np.arange(5, -1, -1, dtype=np.int64)


def checksums_ok(buf: bytes, positions: list[int]) -> bool:
    """True if the header blocks at `positions` of `buf` all pass `parse_header`'s checksum test.

    One vectorised pass instead of two Python sums of 512 bytes per header. False
    means that at least one would fail: parse them one by one to raise the error.
    """
    if not positions:
        return True
    blocks = np.frombuffer(buf, dtype=np.uint8)[np.asarray(positions, dtype=np.intp)[:, None] + np.arange(BLOCK)]
    field = blocks[:, 148:156]
    computed = blocks.sum(axis=1, dtype=np.int64) - field.sum(axis=1, dtype=np.int64) + 256
    # tarfile's (and GNU tar's) layout: six octal digits, NUL, space.
    digits = field[:, :6].astype(np.int64) - 48
    good = ((digits >= 0) & (digits <= 7)).all(axis=1) & (field[:, 6] == 0) & (field[:, 7] == 32)
    good &= digits @ _SUM_WEIGHTS == computed
    for k in np.flatnonzero(~good).tolist():  # other layouts, and signed sums: as parse_header reads them
        try:
            stored = _number(field[k].tobytes(), "checksum", "", 0)
        except CorruptShardError:
            return False
        if stored != int(computed[k]) and stored != int(computed[k]) - 256 * _high_bytes(blocks[k].tobytes()):
            return False
    return True


def _gnu_name(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")  # see `_member_name`


# The first bytes of the compressed streams a tar is commonly kept in: a shard named
# ``.tar`` that starts with one was compressed and misnamed (``tar czf x.tar``).
_COMPRESSED_MAGIC = ((b"\x1f\x8b", "gzip", ".tar.gz"), (b"\x28\xb5\x2f\xfd", "zstd", ".tar.zst"),
                     (b"BZh", "bzip2", ".tar.bz2"), (b"\xfd7zXZ\x00", "xz", ".tar.xz"))


def _first_header(block: bytes, url: str, verify: bool) -> Header | None:
    """`parse_header` of a tar's first block, where a compressed stream read as a plain tar
    is said to be one, not reported as a bad checksum or a truncated header at byte 0.
    Only a block that is no header is looked at (a first member may be named ``BZh...``)."""
    try:
        return parse_header(block, url, 0, verify)
    except CorruptShardError:
        for magic, kind, suffix in _COMPRESSED_MAGIC:
            if block.startswith(magic):
                raise CorruptShardError(f"a {kind}-compressed stream, not a plain tar: name the shard {suffix} "
                                        "(the decompressor is chosen by the name)", url=url, offset=0) from None
        raise


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
            if not offset:  # a copy or upload cut before its first byte: a whole shard lost, silently
                raise CorruptShardError("empty file: no tar header (tar, tarfile and WebDataset refuse it too)",
                                        url=url, offset=0)
            # EOF without the end-of-archive blocks: accepted, as GNU tar and tarfile accept it; but
            # every writer ends with them, and a copy or upload cut at a member's boundary reads so.
            if url not in _unended_said:
                _unended_said.add(url)
                log.warning("%s ends at byte %d without the end-of-archive blocks tar writes: cut short at a "
                            "member's boundary? Its samples up to there are read; any after it are lost",
                            shown_url(url), offset)
            return
        header = parse_header(block, url, offset, verify, long_name is not None) if offset else \
            _first_header(block, url, verify)
        if header is None:
            return
        data = _member_data(read, header, url)
        pad = padded(header.size) - header.size
        if pad and len(read(pad)) < pad:
            raise CorruptShardError("truncated tar member padding", url=url, offset=offset)
        member_offset, offset = offset, offset + BLOCK + padded(header.size)
        if header.kind in (b"x", b"L"):
            long_name = _pax_path(data, url, member_offset) if header.kind == b"x" else _gnu_name(data)
            record_offset = member_offset if record_offset is None else record_offset
            continue
        if header.kind in _REGULAR or header.kind == _SPARSE:
            # A pax or long-name record belongs to the member it precedes: report its offset.
            at = member_offset if record_offset is None else record_offset
            yield _member_name(long_name or header.name, header.kind, url, at), data, at
        long_name, record_offset = None, None


def _member_data(read: Callable[[int], bytes], header: Header, url: str) -> bytes:
    """The data of the member `header` begins, read through `read`: a regular file's whole, a
    name record's (`MAX_NAME_RECORD` at most: a few kilobytes of zstd or gzip made one of
    2 GiB, held whole), nothing of the rest (folders, links, global pax records: skipped)."""
    if header.kind in (b"x", b"L") and header.size > MAX_NAME_RECORD:
        raise CorruptShardError(f"a {'pax' if header.kind == b'x' else 'long-name'} record of {header.size} bytes, "
                                f"past the {MAX_NAME_RECORD} a member's name takes", url=url, offset=header.offset)
    if header.kind in _REGULAR or header.kind in (_SPARSE, b"x", b"L"):
        data = read(header.size)
        if len(data) < header.size:
            raise CorruptShardError("truncated tar member", url=url, offset=header.offset)
        return data
    left = header.size
    while left:  # a chunk at a time: nothing of it is kept
        got = len(read(min(left, _SKIP_CHUNK)))
        if not got:
            raise CorruptShardError("truncated tar member", url=url, offset=header.offset)
        left -= got
    return b""


def members_apart(key: str, field: str, url: str, offset: int) -> CorruptShardError:
    """The error of a sample whose members are not adjacent in its tar: WebDataset reads it
    as two half samples, and an index must not hold a key twice. A dotted field (`001.jpg`
    of `a.001.jpg`) says where the key was cut, the likelier cause."""
    cut = (f"; a key ends at the name's first dot: {key}.{field} is field {field!r} of sample {key!r}, where "
           f"{key}_{field} would be a sample of its own") if "." in field else ""
    return CorruptShardError(f"sample {key!r} appears again after other samples (its members are not adjacent): "
                             f"make the tar with each sample's files together{cut}", url=url, key=key, offset=offset)


def check_new_field(field: str, present: Container[str], *, url: str, key: str, offset: int) -> None:
    """Refuse a member's field that its sample has already (`tar -rf` of a member again:
    which copy a reader keeps is anyone's guess), or one beginning with ``__``: those are
    the names readers give what is not a field (``__key__``, ``__url__``), and a member
    ``a.__key__`` would replace the sample's key with its bytes."""
    if field.startswith("__"):
        raise CorruptShardError(f"field {field!r}: names beginning with '__' are the reader's own ('__key__', "
                                "'__url__'), not a member's", url=url, key=key, offset=offset)
    if field in present:
        raise CorruptShardError(f"field {field!r} appears twice", url=url, key=key, offset=offset)


def group_samples(
    members: Iterator[tuple[str, bytes, int]], *, url: str
) -> Iterator[tuple[dict[str, object], int]]:
    """Group adjacent members with the same key into samples: ({'__key__': key, field: bytes}, offset).
    A key whose members are not adjacent is refused (`members_apart`), as an index of the tar refuses it."""
    sample: dict[str, object] | None = None
    sample_offset = 0
    earlier: set[str] = set()  # the keys of the samples so far
    for name, data, offset in members:
        named = member_key(name)
        if named is None:
            continue
        key, field = named
        if sample is not None and sample["__key__"] != key:
            yield sample, sample_offset
            sample = None
        if sample is None:
            if key in earlier:
                raise members_apart(key, field, url, offset)
            earlier.add(key)
            sample, sample_offset = {"__key__": key}, offset
        check_new_field(field, sample, url=url, key=key, offset=offset)
        sample[field] = data
    if sample is not None:
        yield sample, sample_offset
