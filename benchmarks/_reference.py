"""Switch shardstream's fast paths off, to compare the library with its own reference paths.

The optimised hot paths each have a general counterpart that they must match exactly:

* `tario._header` builds short-ASCII-name headers by hand; `tario._tarfile_header` is
  what `tarfile` writes (and what `_header` falls back to).
* `shardfile.build_frame` joins (header, data, padding) parts once; the reference makes
  it join whole `tario.member()` blobs, as the first version did.
* `ShardReader._samples` parses the common layout with `tario.scan_sample` and checks
  plain-tar header checksums in one vectorised pass; with `scan_sample` returning None
  every sample goes through `_parse_sample` (`tario.iter_members`), the general parser.
* `pack` runs process workers in `_FramePool`; the reference is `multiprocessing.Pool.imap`
  (threads, for large images, are not switched).
* `ShardReader` cuts samples out of pieces in C (`_tarcut`: zstd frames decompressed
  into a reused buffer, fields copied straight out); the reference does it in Python
  (python-zstandard, then `_samples` as above).
* `ShardReader` reads local shards in pieces of `LOCAL_READ_BYTES` (2 MB); the
  reference reads them in `READ_BYTES` (8 MB) pieces, as remote ones are.

`use_reference_paths()` patches the imported modules in place, so a check script can
run once with it (`--reference`) and once without, over the same code base, and compare
output bytes, samples and exceptions, whatever else changes in the tree meanwhile.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator


def use_reference_paths() -> None:
    """Switch the fast paths off for the rest of the process."""
    _patch()


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    """Switch the fast paths off inside a `with` block (benchmarks: before vs after)."""
    saved = _patch()
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _patch() -> list[tuple[Any, str, Any]]:
    import shardstream  # noqa: F401 - loads the submodules patched below

    tario = sys.modules["shardstream.tario"]
    pack = sys.modules["shardstream.pack"]
    reader = sys.modules["shardstream.reader"]
    saved = [(m, n, getattr(m, n)) for m, n in ((tario, "_header"), (tario, "scan_sample"),
                                                (tario, "member_parts"), (pack, "process_results"),
                                                (reader, "LOCAL_READ_BYTES"), (reader, "_tarcut"))]

    reader.LOCAL_READ_BYTES = reader.READ_BYTES
    reader._tarcut = None

    tario._header = tario._tarfile_header
    tario.scan_sample = lambda buf, a, b, key: None
    # build_frame joins what member_parts returns: whole member blobs make it do what
    # the first version did (each member's data copied into its blob, then again).
    parts = tario.member_parts
    tario.member_parts = lambda name, data: (b"".join(parts(name, data)), b"", b"")

    def results(jobs: list[Any], workers: int, context: Any, *_: Any) -> Iterator[Any]:
        with context.Pool(workers) as pool:
            yield from pool.imap(pack.build_job, jobs, chunksize=1)

    pack.process_results = results
    return saved
