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

Each request has a deadline besides its timeouts (deadlines.py): past it, it fails with
`RequestDeadlineError` (retried), its headers' read and its body's alike.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import email.utils
import functools
import importlib.util
import re
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .deadlines import RequestDeadlineError, deadline_s, headers_due, read_body, watched, within
from .errors import shown_url
from .perprocess import PerProcess

__all__ = ["HTTPStatusError", "RequestDeadlineError", "available", "fetch_range", "most_bytes", "range_header",
           "read_range"]


def _pool_manager() -> Any:
    import urllib3  # when first used, as botocore in s3_ranges

    manager = urllib3.PoolManager(maxsize=32, retries=False)
    manager.pool_classes_by_scheme = {"http": watched(urllib3.HTTPConnectionPool),
                                      "https": watched(urllib3.HTTPSConnectionPool)}
    return manager


_pool = PerProcess(_pool_manager)


# A server that ignores Range sends the whole file (200) for every piece of it asked for:
# kept, the pieces after the first ask only whether it changed (a 304, no body), where each
# fetched the whole file again (a shard of 20 MB in 8 MB pieces crossed the wire 5 times;
# 256 MB, 32 times).
WHOLE_FILES_BYTES = 512 << 20  # at most this much kept a process, or the one file last sent
# The most a whole file sent for a range, its length said, may hold where its size is unknown
# (no manifest): the range's bound (`most_bytes`) refused any shard larger than a piece. A
# body of no length said keeps that bound (it may not end).
WHOLE_FILE_MOST = 4 << 30

# A file as asked for: its URL and the request's headers (another token may be sent another file).
_Asked = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class _Kept:
    """A whole file a server sent for a range, and the headers that ask it whether the file
    changed since (`If-None-Match`, `If-Modified-Since`)."""

    data: bytes
    unchanged_since: tuple[tuple[str, str], ...]


def _validators(headers: Any) -> tuple[tuple[str, str], ...]:
    """The headers that ask whether a response's file changed since (RFC 9110's conditional
    requests), or none where it cannot be told: a strong ETag; else a Last-Modified at least
    a second before the response's Date (a file written again within the second it was sent
    would keep its Last-Modified, and be taken for unchanged)."""
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return (("If-None-Match", etag),)
    modified, date = headers.get("Last-Modified"), headers.get("Date")
    try:
        if modified and date and email.utils.parsedate_to_datetime(date) > email.utils.parsedate_to_datetime(modified):
            return (("If-Modified-Since", modified),)
    except (TypeError, ValueError):
        pass
    return ()


class _WholeFiles:
    """Files that servers ignoring Range sent whole, as asked for (`_Asked`), the latest kept
    first, within `WHOLE_FILES_BYTES`; and the servers known to ignore ranges."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: collections.OrderedDict[_Asked, _Kept] = collections.OrderedDict()
        self.ignoring: set[str] = set()
        self.turns: dict[_Asked, list[Any]] = {}  # a lock and how many hold or wait for it

    @contextlib.contextmanager
    def turn(self, asked: _Asked) -> Iterator[None]:
        """Reads of a file one at a time where its server is known to ignore ranges: the
        read-ahead's next pieces wait for the first's whole file, not fetch it again each."""
        with self.lock:
            if _server(asked[0]) not in self.ignoring:
                turn = None
            else:
                turn = self.turns.setdefault(asked, [threading.Lock(), 0])
                turn[1] += 1
        if turn is None:
            yield
            return
        try:
            with turn[0]:
                yield
        finally:
            with self.lock:
                turn[1] -= 1
                if not turn[1]:  # no one waits: a lock a file read once ever is not kept
                    del self.turns[asked]

    def get(self, asked: _Asked) -> _Kept | None:
        with self.lock:
            kept = self.files.get(asked)
            if kept is not None:
                self.files.move_to_end(asked)
            return kept

    def keep(self, asked: _Asked, data: bytes, headers: Any) -> None:
        """`data`, the whole file a server sent for a range (with `headers`), kept where it can
        be asked whether the file changed since; the server is warned of, once a process."""
        unchanged_since = _validators(headers)
        with self.lock:
            self.files.pop(asked, None)
            if unchanged_since:
                self.files[asked] = _Kept(data, unchanged_since)
                while len(self.files) > 1 and sum(len(kept.data) for kept in self.files.values()) > WHOLE_FILES_BYTES:
                    self.files.popitem(last=False)
            server = _server(asked[0])
            warn = server not in self.ignoring
            self.ignoring.add(server)
        if warn:
            warnings.warn(f"shardstream: {server} ignores Range requests (it answered a range with the whole file): "
                          "each shard is fetched whole and held in memory while it is read; serve the shards from "
                          "a server that honours ranges (nginx, S3) for reads of only the samples wanted",
                          stacklevel=2)

    def drop(self, asked: _Asked) -> None:
        with self.lock:
            self.files.pop(asked, None)


_whole_files = PerProcess(_WholeFiles)


def _server(url: str) -> str:
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}" + (f":{port}" if port is not None else "")

MAX_REDIRECTS = 5  # as browsers and fsspec's aiohttp (10) do, a bound on redirect loops


class HTTPStatusError(OSError):
    """A response with an error status, carried as `status` (as aiohttp's errors do), and
    its headers (`Retry-After` is what `RetryPolicy` reads)."""

    def __init__(self, status: int, url: str, headers: Mapping[str, str] | None = None, why: str = ""):
        super().__init__(f"HTTP {status} for {shown_url(url)}" + (f" ({why})" if why else ""))
        self.status = status
        self.headers = dict(headers or {})


class RangeRefused(Exception):
    """A 416 for a range that runs past the end of a file `total` bytes long, which RFC 9110
    says to answer with the bytes up to the end: asked again up to `total` (`refused_range`)."""

    def __init__(self, total: int):
        super().__init__(total)
        self.total = total


def refused_range(content_range: str | None, url: str, start: int | None, end: int | None,
                  headers: Mapping[str, str] | None = None) -> None:
    """What a 416 answer to bytes [start, end) of `url` means, by the file's size its
    Content-Range gives (``bytes */N``): returns where the range starts at or past the end
    (nothing to read; also where no size is given, as compliant servers mean it); raises
    `RangeRefused` for a range that runs past the end, to be asked again up to it (some
    servers refuse one: read as nothing, a tar streamed as no samples, silently); raises
    `HTTPStatusError` for a range within the file, which the server should have sent."""
    match = re.fullmatch(r"bytes \*/(\d+)", (content_range or "").strip(), re.IGNORECASE)
    if match is None or (start or 0) >= int(match[1]):
        return
    total = int(match[1])
    if end is None or end > total:
        raise RangeRefused(total)
    raise HTTPStatusError(416, url, headers, f"bytes {start or 0}-{end - 1} refused, of a file of {total} bytes")


@functools.cache
def available() -> bool:
    """Whether urllib3 is installed (it comes with botocore, requests and most environments)."""
    return importlib.util.find_spec("urllib3") is not None


def range_header(start: int | None, end: int | None) -> str:
    """The HTTP ``Range`` value for bytes [start, end) (to the end of the file when `end` is None)."""
    return f"bytes={start or 0}-{'' if end is None else end - 1}"


def read_range(url: str, start: int | None, end: int | None, *, headers: Mapping[str, str] = {},
               connect_s: float = 10.0, read_s: float = 20.0, size: int | None = None) -> bytes:
    """Bytes [start, end) of `url` (to its end when `end` is None; the whole file when both are None).

    Like fsspec's `cat_file`, a range that runs past the end of the file gives the bytes
    up to the end. Redirects (CDNs, presigned URLs) are followed, `MAX_REDIRECTS` at most,
    with the same range; any other 3xx is an error. A server that sends less of a range
    than asked (a proxy that caps them; its Content-Range says so) is asked for the rest.
    `connect_s` and `read_s` bound each wait on the socket, `deadline_s` of them each
    request, redirects and all. `size`: the file's size as its reader knows it (a shard's,
    from the manifest); a response for a file of another size raises `SizeMismatchError`.
    """
    return fetch_range(url, start, end, headers=headers, connect_s=connect_s, read_s=read_s, size=size)[0]


def fetch_range(url: str, start: int | None, end: int | None, *, headers: Mapping[str, str] = {},
                connect_s: float = 10.0, read_s: float = 20.0, size: int | None = None) -> tuple[bytes, int]:
    """`read_range`'s bytes, and how many bytes the server sent for them: the whole file's
    where it ignored the range, none where a file kept from such an answer was unchanged."""
    request_headers = dict(headers)
    url = _credentials_to_header(url, request_headers)
    if start is None and end is None:
        return _read_ranges(url, start, end, request_headers, connect_s, read_s, size)
    whole_files = _whole_files.get()
    asked = (url, tuple(sorted(request_headers.items())))
    with whole_files.turn(asked):
        return _read_ranges(url, start, end, request_headers, connect_s, read_s, size, asked,
                            whole_files.get(asked))


def _read_ranges(url: str, start: int | None, end: int | None, request_headers: dict[str, str], connect_s: float,
                 read_s: float, size: int | None, asked: _Asked | None = None,
                 kept: _Kept | None = None) -> tuple[bytes, int]:
    """`fetch_range`'s requests: a range, and the rest of it where the server sent less; a
    whole file sent for it kept as `asked` (`_WholeFiles`), and `kept`, one sent before, read
    where the server says it is unchanged."""
    pieces, sent = [], 0
    while True:
        try:
            data, url, request_headers, more, _, body = _read_once(url, start, end, request_headers, connect_s,
                                                                   read_s, size, keep_whole=asked, kept=kept)
        except RangeRefused as refused:
            end = refused.total
            continue
        pieces.append(data)
        sent += body
        if more is None:
            return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), sent
        start = more


def file_size(url: str, *, headers: Mapping[str, str] = {}, connect_s: float = 10.0, read_s: float = 20.0) -> int:
    """The size of the file at `url`, from a one-byte ranged GET within `read_range`'s
    deadlines (its Content-Range's total; a 200's whole body; a 416's ``bytes */N``), where
    fsspec's HEAD had none (a server trickling it held the lookup forever) and failed on a
    server that sends no Content-Length (chunked, or compressed)."""
    request_headers = dict(headers)
    url = _credentials_to_header(url, request_headers)
    total = _read_once(url, 0, 1, request_headers, connect_s, read_s, size_only=True)[4]
    if total is None:
        raise HTTPStatusError(206, url, None, "its answer to a range gave no size (a Content-Range of '*')")
    return total


def _read_once(url: str, start: int | None, end: int | None, headers: dict[str, str], connect_s: float,
               read_s: float, file_size: int | None = None, size_only: bool = False, keep_whole: _Asked | None = None,
               kept: _Kept | None = None) -> tuple[bytes, str, dict[str, str], int | None, int | None, int]:
    """One request for bytes [start, end) of `url`, its redirects followed: (the bytes, the URL
    that sent them, the headers sent there, where to go on from if the server sent less, the
    file's size where the answer gave it, the bytes of body the server sent). `size_only`: the
    size is all that is wanted, and a server that ignores ranges says it in its whole file's
    length, unread. `keep_whole`: the file as asked for, under which a whole file sent for a
    range is kept (`_WholeFiles`); `kept`, one kept before: asked whether it changed since,
    and read where the server says it did not (304)."""
    request_headers = dict(headers)
    if start is not None or end is not None:
        request_headers["Range"] = range_header(start, end)
    conditions = dict(kept.unchanged_since) if kept is not None else {}
    request_headers.update(conditions)
    import urllib3

    timeout = urllib3.Timeout(connect=connect_s, read=read_s)
    started = time.monotonic()
    for hop in range(MAX_REDIRECTS + 1):
        # Not urllib3's own redirects: those go through its Retry object, which is off
        # here so that every retry is `RetryPolicy`'s, and counted.
        response = _request(url, request_headers, timeout, started, started + deadline_s(0, connect_s, read_s))
        location = response.get_redirect_location()
        if not location or hop == MAX_REDIRECTS:  # the last: an error naming the URL that sent it
            break
        _release(response, url, started, started + deadline_s(0, connect_s, read_s))
        target = urllib.parse.urljoin(url, location)
        if _origin(target) != _origin(url):  # as browsers and urllib3 do: credentials stay with their host
            request_headers = {k: v for k, v in request_headers.items() if k.lower() not in _CREDENTIALS}
        url = target
    size = _content_length(response)
    try:
        if response.status == 404:
            raise FileNotFoundError(shown_url(url))
        if response.status in (401, 403):
            raise PermissionError(f"HTTP {response.status} for {shown_url(url)}")
        if response.status == 416:  # the range starts at or past the end (or runs past it: RangeRefused)
            refused_range(response.headers.get("Content-Range"), url, start, end, response.headers)
            return b"", url, headers, None, content_range_total(response.headers.get("Content-Range")), 0
        if response.status == 304 and kept is not None:  # unchanged since it was sent whole
            data, more = fit_range(200, None, kept.data, url, start, end, file_size)
            return data, url, headers, more, len(kept.data), 0
        if response.status >= 300:  # errors, and redirects beyond MAX_REDIRECTS or without a Location
            raise HTTPStatusError(response.status, url, response.headers,
                                  f"a redirect after {MAX_REDIRECTS}: a loop?" if location else "")
        if response.status == 200:  # the whole file: its length is its size, told before the bound is
            check_size(url, size, file_size)
            if size_only and size is not None:
                response.close()  # not drained: the file is not wanted
                return b"", url, headers, None, size, 0
        ignored = response.status == 200 and "Range" in request_headers
        whole_said = ignored and file_size is None and size is not None
        data = read_body(response, response.read, url, started, size, connect_s, read_s,
                         WHOLE_FILE_MOST if whole_said else most_bytes(end, file_size))
        if size is None and response.status == 200 and file_size is not None and len(data) < file_size \
                and response.headers.get("Transfer-Encoding", "").lower() != "chunked":
            # A body that ends where the connection does, and ended early: a transfer cut
            # short (retried), not a file replaced by a shorter one (a length would say so).
            raise ConnectionError(f"{shown_url(url)} sent {len(data)} bytes of a file of {file_size}, with no "
                                  "length, and closed: cut short")
    finally:
        # An error's body too: the connection goes back to the pool clean.
        _release(response, url, started, started + deadline_s(size or 0, connect_s, read_s))
    for name in ("Range", *conditions):
        request_headers.pop(name, None)
    total = len(data) if response.status == 200 else content_range_total(response.headers.get("Content-Range"))
    whole = data
    data, more = fit_range(response.status, response.headers.get("Content-Range"), data, url, start, end, file_size)
    if keep_whole is not None:
        if ignored:
            _whole_files.get().keep(keep_whole, whole, response.headers)
        elif kept is not None:  # the server honours ranges now
            _whole_files.get().drop(keep_whole)
    return data, url, request_headers, more, total, len(whole)


# What a server that rounds ranges up (to its cache's blocks, say) may send past one.
ROUND_UP_BYTES = 1 << 20


def most_bytes(end: int | None, file_size: int | None) -> int | None:
    """The most bytes an answer for a range ending at `end` of a file of `file_size` may hold,
    None where nothing bounds it: the whole file where its size is known (a server that
    ignores ranges sends it all), else the range from the file's start, rounded up by a
    server by `ROUND_UP_BYTES` at most (a manifest's read asks for one byte past its limit).
    S3 (s3_ranges.py) answers as HTTP does."""
    if file_size is not None:
        return file_size
    return None if end is None else end + ROUND_UP_BYTES


def content_range_total(content_range: str | None) -> int | None:
    """The file's size a Content-Range gives (``bytes a-b/N``, ``bytes */N``), or None."""
    size = (content_range or "").rpartition("/")[2].strip()
    return int(size) if size.isdigit() else None


def fit_range(status: int, content_range: str | None, data: bytes, url: str, start: int | None, end: int | None,
              file_size: int | None = None) -> tuple[bytes, int | None]:
    """Of a response's body `data` (status 200 or 206, for bytes [start, end) of `url`): the
    bytes asked for, and where to go on from if it holds less (`_check_range`). A server
    that ignores ranges (some gateways and proxies in front of object stores) sends the
    whole file with 200, one that rounds a range up sends more: both are cut to the range.
    S3 (s3_ranges.py) answers as HTTP does."""
    if status == 200:
        check_size(url, len(data), file_size)  # the whole file
        return (data[start or 0 : end] if start or end is not None else data), None
    more = _check_range(content_range, data, url, start, end, file_size) if status == 206 else None
    if end is not None and len(data) > end - (start or 0):  # a range past the one asked (servers may round up)
        data = data[: end - (start or 0)]
    return data, more


class RangeMismatchError(OSError):
    """A partial response for another range than the one asked for: the server's fault, not retried."""

    status = 206  # what `retry.is_transient` reads: a status it does not retry


class SizeMismatchError(OSError):
    """A response for a file of another size than its reader knows (a shard replaced since
    its manifest was written, or cut short): its bytes would mix two versions of the file.
    Not retried. `total`: the file's size now; `expected`: the size its reader knows."""

    status = 412  # what `retry.is_transient` reads: a status it does not retry

    def __init__(self, url: str, total: int, expected: int) -> None:
        super().__init__(f"{shown_url(url)} is {total} bytes, where its manifest says {expected}: cut short, or "
                         "replaced since the manifest was written (its bytes would mix two versions)")
        self.total, self.expected = total, expected

    def __reduce__(self) -> tuple[object, ...]:  # an OSError pickles by its args alone
        return (_size_mismatch, (str(self), self.total, self.expected))


def _size_mismatch(text: str, total: int, expected: int) -> SizeMismatchError:
    error = SizeMismatchError("", total, expected)
    error.args = (text,)
    return error


def check_size(url: str, total: int | None, size: int | None) -> None:
    """Raise `SizeMismatchError` if a response says its file is `total` bytes, not `size`."""
    if total is not None and size is not None and total != size:
        raise SizeMismatchError(url, total, size)


def _check_range(content_range: str | None, data: bytes, url: str, start: int | None, end: int | None,
                 file_size: int | None = None) -> int | None:
    """Where to go on from if a 206 response (its `content_range`, its body `data`) holds less
    of [start, end) than asked (its Content-Range ends early), else None; an error if its
    body is not the range it names (cut short: retried) or the range is another than asked
    (the server's fault). Either would otherwise pass as data and fail later as a damaged
    shard: not retried, and a counted skip under ``on_error="skip"``."""
    match = _CONTENT_RANGE.fullmatch((content_range or "").strip())
    if match is None:
        return None  # none given (or "*"): the length was all there was to check
    first, last, total = int(match[1]), int(match[2]), None if match[3] == "*" else int(match[3])
    check_size(url, total, file_size)
    if first != (start or 0):
        raise RangeMismatchError(f"{shown_url(url)} sent bytes {first}-{last} for bytes {start or 0}-")
    if len(data) < last + 1 - first:
        raise ConnectionError(f"{shown_url(url)} sent {len(data)} of the {last + 1 - first} bytes of its range")
    wanted = [stop for stop in (end, total) if stop is not None]
    return last + 1 if wanted and last + 1 < min(wanted) and last >= first else None


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)", re.IGNORECASE)
_CREDENTIALS = frozenset({"authorization", "cookie", "proxy-authorization"})


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _credentials_to_header(url: str, headers: dict[str, str]) -> str:
    """`url` without its user information (``https://user:password@host/...``), which
    urllib3 does not send, as HTTP Basic authorization in `headers` (unless they carry
    their own), as fsspec's HTTP client sends it."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url
    if not any(k.lower() == "authorization" for k in headers):
        user, password = urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


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
            within(response, response.drain_conn, url, started, deadline)
        except RequestDeadlineError:
            response.close()
    response.release_conn()
