"""A request's deadline over urllib3's connections: its headers and its body.

The timeouts bound each wait on a socket, not the request: a server that trickles a
byte within every read timeout would hold a reader forever. So each request also has a
deadline (`deadline_s`), past which it fails with `RequestDeadlineError` (transient,
so retried). The watchdog's thread (watchdog.py) ends a body read that outlives it by
shutting its socket: reading the body in steps and looking at the clock between them
would cost a copy of every byte (0.25-0.3 ms of CPU per MB more, measured on
loopback). The connection stays out of urllib3's pool until the watch is over, so that
the socket shut is never another request's. The headers are read inside urllib3 and
http.client: the connections of `watched` pools (http_ranges' own, and those of
s3_ranges' botocore clients) watch that read too, against the deadline `headers_due`
sets, and shut their socket past it.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from typing import Any, Callable, Iterator

from .errors import shown_url
from .perprocess import PerProcess
from .watchdog import Watchdog

__all__ = ["DEADLINE_BYTES_PER_READ", "BodyTooLongError", "RequestDeadlineError", "deadline_s", "headers_due",
           "read_body", "watched", "within"]


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


class BodyTooLongError(OSError):
    """A body longer than the request can take (`read_body`'s `most`): a server's fault, or
    a hostile one's, not retried."""

    status = 206  # what `retry.is_transient` reads: a status it does not retry


def read_body(response: Any, read: Callable[..., bytes], url: str, started: float, size: int | None,
              connect_s: float, read_s: float, most: int | None = None) -> bytes:
    """The body of urllib3's `response` through `read` (the response's own, or botocore's, which
    wraps it), within the deadline of a request that began at `started` and moves `size` bytes.

    Its headers are in by now (for `read_range`, within their own deadline; botocore's
    are bounded by their reads' timeouts only), and a deadline already past fails the
    request here. A body of unknown size (no Content-Length) is read a block at a time,
    each block within a deadline of its own. A body said or found to hold more than `most`
    bytes raises `BodyTooLongError`, its connection closed: an endless body, or a length of
    gigabytes, would fill memory (and the deadline grows with the length said).
    """
    if size is not None:
        if most is not None and size > most:
            raise _too_long(response, url, f"says it holds {size} bytes", most)
        return within(response, read, url, started, started + deadline_s(size, connect_s, read_s), size)
    blocks: list[bytes] = []
    held = 0
    deadline = started + deadline_s(DEADLINE_BYTES_PER_READ, connect_s, read_s)
    while block := within(response, functools.partial(read, DEADLINE_BYTES_PER_READ), url, started, deadline):
        blocks.append(block)
        held += len(block)
        if most is not None and held > most:
            raise _too_long(response, url, f"sent {held} bytes and more", most)
        started = time.monotonic()
        deadline = started + deadline_s(DEADLINE_BYTES_PER_READ, 0.0, read_s)
    return b"".join(blocks)


def _too_long(response: Any, url: str, said: str, most: int) -> BodyTooLongError:
    if response is not None:
        response.close()  # not drained: what is left of it may not end
    return BodyTooLongError(f"{shown_url(url)} {said} where the request takes {most} at most")


def within(response: Any, read: Callable[[], bytes], url: str, started: float, deadline: float,
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
