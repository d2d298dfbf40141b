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

The timeouts bound each wait on the socket, so a server that trickles a byte now and
then would hold a reader forever; each request also has a deadline (`deadline_s`),
past which it fails with `RequestDeadlineError` (retried). A thread of this process
(`Watchdog`) ends a body read that outlives it by shutting its socket: reading the
body in steps and looking at the clock between them would cost a copy of every byte
(0.25-0.3 ms of CPU per MB more, measured on loopback). The connection stays out of
urllib3's pool until the watch is over, so that the socket shut is never another
request's. The headers are read inside urllib3 and http.client: the connections of
this module's pools (and of `s3_ranges`' botocore clients) watch that read too
(`watched`, `headers_due`), against the request's deadline for a response without a
body (`deadline_s(0, ...)`), and shut their socket past it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator, Mapping

from .errors import shown_url
from .watchdog import Watchdog


__all__ = ["HTTPStatusError", "PerProcess", "RequestDeadlineError", "available", "deadline_s", "headers_due",
           "range_header", "read_body", "read_range", "watched"]


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

    manager = urllib3.PoolManager(maxsize=32, retries=False)
    manager.pool_classes_by_scheme = {"http": watched(urllib3.HTTPConnectionPool),
                                      "https": watched(urllib3.HTTPSConnectionPool)}
    return manager


# When the headers of the request this thread is making are due (`headers_due` sets it), and
# whether the watchdog had to shut its socket for them.
_headers = threading.local()


@functools.cache
def watched(pool_class: type) -> type:
    """urllib3's `pool_class` (or a subclass, as botocore's) whose connections read a
    response's headers by the time `headers_due` sets: a server that trickles a header
    byte within every read timeout would hold them forever."""

    class Connection(pool_class.ConnectionCls):  # type: ignore[name-defined,misc]
        def getresponse(self, *args: Any, **kwargs: Any) -> Any:
            due = getattr(_headers, "due", None)
            if due is None:
                return super().getresponse(*args, **kwargs)
            with _watchdog.get().watch(due - time.monotonic(), functools.partial(_shut, self)) as watch:
                try:
                    return super().getresponse(*args, **kwargs)
                finally:
                    _headers.late = watch.fired

    return type(f"Watched{pool_class.__name__}", (pool_class,), {"ConnectionCls": Connection})


def _shut(connection: Any) -> None:
    """End a read of `connection`'s socket blocked in another thread (it reads an end of
    stream, as if the server had closed): the socket is shut down for reading."""
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)


_pool = PerProcess(_pool_manager)

MAX_REDIRECTS = 5  # as browsers and fsspec's aiohttp (10) do, a bound on redirect loops


# How long a request may take in all: the connect timeout, one read timeout for its first
# byte, and one more for every DEADLINE_BYTES_PER_READ it moves (the timeouts of 10 s and
# 20 s give an 8 MB range 190 s: about 45 KB/s at the least). The body's part is counted
# in its share of the time (`Watchdog`): a worker's 6 reads at once need those 45 KB/s
# together, not each, and 8 workers 350 KB/s (2.8 Mbit/s). A slow link is left alone; a
# server that trickles a byte within every read timeout is not.
DEADLINE_BYTES_PER_READ = 1 << 20


def deadline_s(size: int, connect_s: float, read_s: float) -> float:
    """Seconds a request moving `size` bytes may take in all, with these timeouts (its body's
    in its share of the time, `Watchdog`)."""
    return connect_s + read_s * (1 + size / DEADLINE_BYTES_PER_READ)


class RequestDeadlineError(TimeoutError):
    """A request outlived its deadline (`deadline_s`): transient, so retried."""


_watchdog = PerProcess(Watchdog)


def _stop(response: Any) -> None:
    """End a read of urllib3's `response` blocked in another thread (it fails, as if the
    connection had dropped): its socket is shut down for reading."""
    try:
        response.shutdown()  # urllib3 2.3 and later
        return
    except (AttributeError, ValueError, RuntimeError, OSError):
        pass
    _shut(getattr(response, "connection", None))


def read_body(response: Any, read: Callable[..., bytes], url: str, started: float, size: int | None,
              connect_s: float, read_s: float) -> bytes:
    """The body of urllib3's `response` through `read` (the response's own, or botocore's, which
    wraps it), within the deadline of a request that began at `started` and moves `size` bytes.

    Its headers are in by now (for `read_range`, within their own deadline; botocore's
    are bounded by their reads' timeouts only), and a deadline already past fails the
    request here. A body of unknown size (no Content-Length) is read a block at a time,
    each block within a deadline of its own.
    """
    if size is not None:
        return _within(response, read, url, started, started + deadline_s(size, connect_s, read_s), size)
    blocks: list[bytes] = []
    deadline = started + deadline_s(DEADLINE_BYTES_PER_READ, connect_s, read_s)
    while block := _within(response, functools.partial(read, DEADLINE_BYTES_PER_READ), url, started, deadline):
        blocks.append(block)
        started = time.monotonic()
        deadline = started + deadline_s(DEADLINE_BYTES_PER_READ, 0.0, read_s)
    return b"".join(blocks)


def _within(response: Any, read: Callable[[], bytes], url: str, started: float, deadline: float,
            size: int | None = None) -> bytes:
    """`read()`, ended by shutting down `response`'s socket if it runs past `deadline` (as
    `Watchdog` counts it); what it read is kept if all `size` bytes are in, though the
    deadline passed as they came."""
    left, cause = deadline - time.monotonic(), None
    if left > 0:  # else the headers came in too late
        with _kept_from_pool(response):
            with _watchdog.get().watch(left, functools.partial(_stop, response)) as watch:
                try:
                    data = read()
                except Exception as e:  # the failure of a read the watchdog ended is the deadline's
                    cause = e
            if watch.fired and response is not None:
                response.close()  # its socket is shut: no later request's to use
        if not watch.fired:
            if cause is not None:
                raise cause
            return data
        if cause is None and size is not None and len(data) == size:
            return data
    # Past it, a body without a length ends where the socket was shut: not whole.
    raise RequestDeadlineError(f"no whole response from {shown_url(url)} in {time.monotonic() - started:.3g} s "
                               f"(deadline {deadline - started:.3g} s)") from cause


@contextlib.contextmanager
def _kept_from_pool(response: Any) -> Iterator[None]:
    """Keep `response`'s connection out of urllib3's pool until the block is over, then put
    it back if its body is done. A read that ends the body puts it back (urllib3 does, in
    `read`), while the watchdog may still shut its socket: by then another request may
    have taken the connection, and its response would be cut short."""
    pool = getattr(response, "_pool", None)  # urllib3's private name, as botocore's `_raw_stream`
    if pool is None:
        yield
        return
    response._pool = None
    try:
        yield
    finally:
        response._pool = pool
        if response.closed:
            response.release_conn()


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
    with the same range; any other 3xx is an error. `connect_s` and `read_s` bound each
    wait on the socket, `deadline_s` of them the whole request, redirects and all.
    """
    request_headers = dict(headers)
    if start is not None or end is not None:
        request_headers["Range"] = range_header(start, end)
    import urllib3

    timeout = urllib3.Timeout(connect=connect_s, read=read_s)
    started = time.monotonic()
    for _ in range(MAX_REDIRECTS + 1):
        # Not urllib3's own redirects: those go through its Retry object, which is off
        # here so that every retry is `RetryPolicy`'s, and counted.
        response = _request(url, request_headers, timeout, started, started + deadline_s(0, connect_s, read_s))
        location = response.get_redirect_location()
        if not location:
            break
        _release(response, url, started, started + deadline_s(0, connect_s, read_s))
        url = urllib.parse.urljoin(url, location)
    size = _content_length(response)
    try:
        if response.status == 404:
            raise FileNotFoundError(shown_url(url))
        if response.status in (401, 403):
            raise PermissionError(f"HTTP {response.status} for {shown_url(url)}")
        if response.status == 416:  # the range starts at or past the end
            return b""
        if response.status >= 300:  # errors, and redirects beyond MAX_REDIRECTS or without a Location
            raise HTTPStatusError(response.status, url, response.headers)
        data = read_body(response, response.read, url, started, size, connect_s, read_s)
    finally:
        # An error's body too: the connection goes back to the pool clean.
        _release(response, url, started, started + deadline_s(size or 0, connect_s, read_s))
    if response.status == 200 and (start or end is not None):  # a server that ignores ranges sends it all
        data = data[start or 0 : end]
    return data


def _request(url: str, headers: Mapping[str, str], timeout: Any, started: float, due: float) -> Any:
    """urllib3's response to a GET of `url` (a request begun at `started`), its headers
    read by `due`; its body is read later."""
    with headers_due(url, started, due) as late:
        response = _pool.get().request("GET", url, headers=headers, preload_content=False, redirect=False,
                                       timeout=timeout)
        if late():
            response.close()
            response.release_conn()
    return response


@contextlib.contextmanager
def headers_due(url: str, started: float, due: float) -> Iterator[Callable[[], bool]]:
    """Responses read in this block, through connections of `watched` pools, have their
    headers in by `due` (for a request to `url` begun at `started`), or fail with
    `RequestDeadlineError`. Yields whether the deadline has passed on them: close a
    response it passed on before the block ends, since http.client takes a socket shut
    mid-header for the end of the headers, and what it made of them is not the server's."""
    _headers.due, _headers.late = due, False
    try:
        yield lambda: bool(_headers.late)
    except Exception as e:
        if _headers.late:  # the watchdog shut the socket: the failure is the deadline's
            raise _late_headers(url, started, due) from e
        raise
    finally:
        _headers.due = None
    if _headers.late:
        raise _late_headers(url, started, due)


def _late_headers(url: str, started: float, due: float) -> RequestDeadlineError:
    return RequestDeadlineError(f"no whole response headers from {shown_url(url)} in "
                                f"{time.monotonic() - started:.3g} s (deadline {due - started:.3g} s)")


def _content_length(response: Any) -> int | None:
    try:
        return int(response.headers["Content-Length"])
    except (KeyError, ValueError):
        return None


def _release(response: Any, url: str, started: float, deadline: float) -> None:
    """Give `response`'s connection back to the pool, with what is left of its body (an
    error's, a redirect's) read by `deadline`, or else closed: it must not answer the
    next request with this one's bytes."""
    if not response.closed:  # a body read to its end closes; then there is nothing to wait for
        try:
            _within(response, response.drain_conn, url, started, deadline)
        except RequestDeadlineError:
            response.close()
    response.release_conn()
