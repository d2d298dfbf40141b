"""Ranged reads over HTTP(S) through urllib3: the reads that stream shards from http(s):// sources.

fsspec's HTTP filesystem (aiohttp, driven by an event loop in its own thread) still
does everything else over HTTP: sizes, listings, sequential opens, and the reads of a
store given options other than ``headers``. The reads that stream samples come here
because they are the hot path and measurement says so: 8 MB ranges from a server 50 ms
away, 6 at a time, cost 1.2-1.8 ms of CPU per MB through fsspec and aiohttp (most of
it in the event loop's thread) against 0.4-0.6 ms through urllib3 in the threads that
ask (BENCHMARKS.md). In a DataLoader worker that CPU and the GIL are what the worker
needs for its samples.

Errors are raised for `RetryPolicy` to classify: a 404 as FileNotFoundError, 401/403
as PermissionError, other statuses as `HTTPStatusError` (5xx, 408 and 429 retried),
and urllib3's own errors (dropped connections, timeouts, a body cut short) as they
are (retried). urllib3 does not retry by itself here: every retry is counted.
"""

from __future__ import annotations

import os
import threading
from typing import Mapping

try:
    import urllib3
except ImportError:  # then fsspec reads HTTP too
    urllib3 = None  # type: ignore[assignment]

__all__ = ["HTTPStatusError", "available", "read_range"]

_pool: list = [None]  # this process's urllib3.PoolManager, made on first use
_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child opens its own connections, never its parent's; a thread of the
    parent may have held the lock at the fork, so the child gets a new one too."""
    global _lock
    _lock = threading.Lock()
    _pool[0] = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class HTTPStatusError(OSError):
    """A response with an error status, carried as `status` (as aiohttp's errors do)."""

    def __init__(self, status: int, url: str):
        super().__init__(f"HTTP {status} for {url}")
        self.status = status


def available() -> bool:
    """Whether urllib3 is installed (it comes with botocore, requests and most environments)."""
    return urllib3 is not None


def _manager() -> "urllib3.PoolManager":
    with _lock:
        if _pool[0] is None:
            _pool[0] = urllib3.PoolManager(maxsize=32, retries=False)
        return _pool[0]


def read_range(url: str, start: int | None, end: int | None, *, headers: Mapping[str, str] = {},
               connect_s: float = 10.0, read_s: float = 20.0) -> bytes:
    """Bytes [start, end) of `url` (to its end when `end` is None; the whole file when both are None).

    Like fsspec's `cat_file`, a range that runs past the end of the file gives the bytes
    up to the end.
    """
    request_headers = dict(headers)
    if start is not None or end is not None:
        request_headers["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
    response = _manager().request("GET", url, headers=request_headers, preload_content=False,
                                  timeout=urllib3.Timeout(connect=connect_s, read=read_s))
    try:
        if response.status == 404:
            raise FileNotFoundError(url)
        if response.status in (401, 403):
            raise PermissionError(f"HTTP {response.status} for {url}")
        if response.status == 416:  # the range starts at or past the end
            return b""
        if response.status >= 400:
            raise HTTPStatusError(response.status, url)
        data = response.read()
    finally:
        response.drain_conn()  # an error's body too: the connection goes back to the pool clean
        response.release_conn()
    if response.status == 200 and (start or end is not None):  # a server that ignores ranges sends it all
        data = data[start or 0 : end]
    return data
