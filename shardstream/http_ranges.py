"""Ranged reads over HTTP(S) through urllib3: the reads that stream shards from http(s):// sources.

fsspec's HTTP filesystem (aiohttp, driven by an event loop in its own thread) still
does everything else over HTTP: sizes, listings, and the reads of a
store given options other than ``headers``. The reads that stream samples come here
because they are the hot path and measurement says so: 8 MB ranges from a server 50 ms
away, 6 at a time, cost 1.2-1.8 ms of CPU per MB through fsspec and aiohttp (most of
it in the event loop's thread) against 0.4-0.6 ms through urllib3 in the threads that
ask (BENCHMARKS.md). In a DataLoader worker that CPU and the GIL are what the worker
needs for its samples.

Errors are raised for `RetryPolicy` to classify: a 404 as FileNotFoundError, 401/403
as PermissionError, other statuses as `HTTPStatusError` (5xx, 408 and 429 retried),
and urllib3's own errors (dropped connections, timeouts, a body cut short) as they
are (retried). urllib3 does not retry by itself here: every retry is counted. Redirects
are followed here (`read_range`), as fsspec's client follows them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import urllib.parse
from typing import Any, Callable, Mapping

from .errors import shown_url


__all__ = ["HTTPStatusError", "PerProcess", "available", "range_header", "read_range"]


class PerProcess:
    """A value made on first use in each process: a forked child makes its own (connections
    must not be shared with the parent), and gets a new lock (a parent's thread may have held
    the old one at the fork)."""

    _all: list["PerProcess"] = []

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self._lock = threading.Lock()
        self._value: Any = None
        PerProcess._all.append(self)

    def get(self) -> Any:
        with self._lock:
            if self._value is None:
                self._value = self.make()
            return self._value

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._value = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [holder._forget() for holder in PerProcess._all])

def _pool_manager() -> Any:
    import urllib3  # when first used, as botocore in s3_ranges

    return urllib3.PoolManager(maxsize=32, retries=False)


_pool = PerProcess(_pool_manager)

MAX_REDIRECTS = 5  # as browsers and fsspec's aiohttp (10) do, a bound on redirect loops


class HTTPStatusError(OSError):
    """A response with an error status, carried as `status` (as aiohttp's errors do), and
    its headers (`Retry-After` is what `RetryPolicy` reads)."""

    def __init__(self, status: int, url: str, headers: Mapping[str, str] | None = None):
        super().__init__(f"HTTP {status} for {shown_url(url)}")
        self.status = status
        self.headers = dict(headers or {})


@functools.cache
def available() -> bool:
    """Whether urllib3 is installed (it comes with botocore, requests and most environments)."""
    return importlib.util.find_spec("urllib3") is not None


def range_header(start: int | None, end: int | None) -> str:
    """The HTTP ``Range`` value for bytes [start, end) (to the end of the file when `end` is None)."""
    return f"bytes={start or 0}-{'' if end is None else end - 1}"


def read_range(url: str, start: int | None, end: int | None, *, headers: Mapping[str, str] = {},
               connect_s: float = 10.0, read_s: float = 20.0) -> bytes:
    """Bytes [start, end) of `url` (to its end when `end` is None; the whole file when both are None).

    Like fsspec's `cat_file`, a range that runs past the end of the file gives the bytes
    up to the end. Redirects (CDNs, presigned URLs) are followed, `MAX_REDIRECTS` at most,
    with the same range; any other 3xx is an error.
    """
    request_headers = dict(headers)
    if start is not None or end is not None:
        request_headers["Range"] = range_header(start, end)
    import urllib3

    timeout = urllib3.Timeout(connect=connect_s, read=read_s)
    for _ in range(MAX_REDIRECTS + 1):
        # Not urllib3's own redirects: those go through its Retry object, which is off
        # here so that every retry is `RetryPolicy`'s, and counted.
        response = _pool.get().request("GET", url, headers=request_headers, preload_content=False,
                                      redirect=False, timeout=timeout)
        location = response.get_redirect_location()
        if not location:
            break
        response.drain_conn()
        response.release_conn()
        url = urllib.parse.urljoin(url, location)
    try:
        if response.status == 404:
            raise FileNotFoundError(shown_url(url))
        if response.status in (401, 403):
            raise PermissionError(f"HTTP {response.status} for {shown_url(url)}")
        if response.status == 416:  # the range starts at or past the end
            return b""
        if response.status >= 300:  # errors, and redirects beyond MAX_REDIRECTS or without a Location
            raise HTTPStatusError(response.status, url, response.headers)
        data = response.read()
    finally:
        response.drain_conn()  # an error's body too: the connection goes back to the pool clean
        response.release_conn()
    if response.status == 200 and (start or end is not None):  # a server that ignores ranges sends it all
        data = data[start or 0 : end]
    return data
