"""Ranged HTTP reads through urllib3 (`http_ranges`), against real local HTTP servers."""

from __future__ import annotations

import contextlib
import http.server
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import urllib3

import shardstream
from shardstream import StorageError, storage
from shardstream.http_ranges import HTTPStatusError, RequestDeadlineError, read_range
from shardstream.storage import RetryPolicy, Store, is_transient

try:
    from . import _remote_helpers as H
except ImportError:
    import _remote_helpers as H

DATA = bytes(range(256)) * 40  # 10,240 bytes


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "blob.bin").write_bytes(DATA)
    return tmp_path


class _Recorder(http.server.SimpleHTTPRequestHandler):
    """Python's file server, which ignores Range (answers 200 with the whole file), and records headers."""

    seen: list = []
    protocol_version = "HTTP/1.0"  # a connection per request: no handler thread outlives the test

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.seen.append(dict(self.headers))
        super().do_GET()


@pytest.fixture
def plain_server(folder):
    handler = type("Handler", (_Recorder,), {"seen": [], "directory": str(folder)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(folder)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_ranges_as_cat_file_gives_them(folder):
    with H.CountingHTTPServer(str(folder)) as server:
        url = f"{server.url}/blob.bin"
        assert read_range(url, None, None) == DATA
        assert read_range(url, 10, 20) == DATA[10:20]
        assert read_range(url, 10_000, None) == DATA[10_000:]
        assert read_range(url, 10_000, 20_000) == DATA[10_000:]  # past the end: up to the end
        assert server.gets("blob.bin") == 4


def test_a_server_that_ignores_ranges_and_headers_passed_through(plain_server):
    url, seen = plain_server
    assert read_range(f"{url}/blob.bin", 100, 200, headers={"X-Token": "abc"}) == DATA[100:200]
    assert seen[-1]["X-Token"] == "abc" and seen[-1]["Range"] == "bytes=100-199"
    store = Store(url, {"headers": {"X-Token": "xyz"}})
    assert store.read("blob.bin", 5, 9) == DATA[5:9]
    assert seen[-1]["X-Token"] == "xyz"


def test_errors_are_classified_for_the_retry_policy(folder):
    with H.CountingHTTPServer(str(folder), fail_fraction=1.0, seed=0) as server:
        errors = []
        for _ in range(8):  # every request fails: half 503s, half dropped connections
            with pytest.raises(Exception) as info:
                read_range(f"{server.url}/blob.bin", 0, 10)
            errors.append(info.value)
        assert all(is_transient(e) for e in errors)
        assert any(isinstance(e, HTTPStatusError) and e.status == 503 for e in errors)
        assert any(not isinstance(e, HTTPStatusError) for e in errors)  # a dropped connection
    with H.CountingHTTPServer(str(folder)) as server:
        with pytest.raises(FileNotFoundError):
            read_range(f"{server.url}/missing.bin", 0, 10)
        store = Store(server.url, {}, RetryPolicy(attempts=2, base_delay=0.001))
        with pytest.raises(StorageError, match=r"missing\.bin: file not found"):
            store.read("missing.bin", 0, 10)
        assert server.gets("blob.bin") == 0


class _Redirector(http.server.BaseHTTPRequestHandler):
    """Sends /moved/<path> on to `target` with a 302, /loop to itself, /other with a bare 304."""

    target = ""
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/moved/"):
            self.send_response(302)
            self.send_header("Location", self.target + self.path[len("/moved"):])
        elif self.path == "/loop":
            self.send_response(307)
            self.send_header("Location", "/loop")
        else:
            self.send_response(304)
        self.send_header("Content-Length", "18")
        self.end_headers()
        self.wfile.write(b"<html>moved</html>")


def test_redirects_are_followed_with_the_range(folder, packed):
    """CDNs and presigned URLs redirect: the body of a 302 is not the file's bytes."""
    with H.CountingHTTPServer(str(folder)) as files, H.CountingHTTPServer(packed) as ds:
        handler = type("Handler", (_Redirector,), {"target": files.url})
        front = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=front.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{front.server_address[1]}"
        try:
            assert read_range(f"{url}/moved/blob.bin", 10, 20) == DATA[10:20]
            assert files.gets("blob.bin") == 1
            with pytest.raises(HTTPStatusError, match="307"):  # a loop ends, with an error
                read_range(f"{url}/loop", 0, 10)
            with pytest.raises(HTTPStatusError, match="304"):
                read_range(f"{url}/other", 0, 10)
            # A whole dataset behind the redirect streams as it does directly.
            handler.target = ds.url
            keys = sorted(s["__key__"] for s in shardstream.StreamingDataset(f"{url}/moved", decode=None))
            assert keys == sorted(s["__key__"] for s in shardstream.StreamingDataset(packed, decode=None))
        finally:
            front.shutdown()
            front.server_close()
            thread.join(5)


class _Throttling(http.server.BaseHTTPRequestHandler):
    """Answers 429 with ``Retry-After: 1`` twice, then the data."""

    protocol_version = "HTTP/1.0"
    answered = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).answered += 1
        if type(self).answered <= 2:
            self.send_response(429)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")


def test_retry_after_is_honoured_up_to_the_policy_cap(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr("shardstream.storage.time.sleep", waits.append)
    handler = type("Handler", (_Throttling,), {"answered": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        store = Store(url, {}, RetryPolicy(attempts=4, base_delay=0.001, max_delay=5))
        assert store.read("x", 0, 5) == b"hello"
        assert waits == [1.0, 1.0]  # the server's 1 s, not the 1-2 ms of the backoff
        handler.answered = 0
        waits.clear()
        capped = Store(url, {}, RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.25))
        assert capped.read("x", 0, 5) == b"hello"
        assert waits == [0.25, 0.25]  # a server cannot stall a run past the policy's cap
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_retry_policy_must_try_at_least_once():
    with pytest.raises(ValueError, match="attempts >= 1"):
        RetryPolicy(attempts=0)


@pytest.mark.parametrize("status, transient", [(500, True), (502, True), (503, True), (408, True), (429, True),
                                                (501, False), (400, False), (416, False)])
def test_which_statuses_are_retried(status, transient):
    assert is_transient(HTTPStatusError(status, "http://x/y")) is transient


def _child_reads(url: str, queue) -> None:
    queue.put(read_range(url, 0, 16))


def test_a_forked_child_reads_on_its_own_connections(folder):
    with H.CountingHTTPServer(str(folder)) as server:
        url = f"{server.url}/blob.bin"
        assert read_range(url, 0, 16) == DATA[:16]  # the parent's pool holds a connection now
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child_reads, args=(url, queue))
        child.start()
        assert queue.get(timeout=30) == DATA[:16]
        child.join(30)
        assert child.exitcode == 0
        assert read_range(url, 16, 32) == DATA[16:32]  # and the parent's connection still works


class _Served(http.server.BaseHTTPRequestHandler):
    """A handler for `serving`: quiet, a connection per request, each GET's path recorded."""

    protocol_version = "HTTP/1.0"
    stopping = threading.Event()  # set when the server stops
    requests: list = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.requests.append(self.path)
        self.answer()

    def answer(self) -> None:
        raise NotImplementedError


@contextlib.contextmanager
def serving(handler: type[_Served], **attributes: object):
    """(URL, paths requested) of a server on 127.0.0.1 answering with `handler` given
    `attributes`; on exit, stopped and its handlers told to stop."""
    handler = type("Handler", (handler,), {"stopping": threading.Event(), "requests": [], **attributes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        handler.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


class _Trickler(_Served):
    """Answers with the first `size` bytes of DATA, one every `interval` seconds (all at once
    if 0), with a Content-Length unless `length` is False (then the body ends where the
    connection does). Each byte comes well within a read timeout of 1 s."""

    size, interval, length = 200, 0.1, True

    def answer(self) -> None:
        self.send_response(200)
        if self.length:
            self.send_header("Content-Length", str(self.size))
        self.end_headers()
        try:
            if not self.interval:
                self.wfile.write(DATA[: self.size])
            for i in range(self.size if self.interval else 0):
                if self.stopping.wait(self.interval):
                    return
                self.wfile.write(DATA[i : i + 1])
        except OSError:
            pass  # the client gave up: what the tests expect of it


def trickling(**settings: object):
    """`serving` a `_Trickler` with `settings`."""
    return serving(_Trickler, **settings)


def test_a_trickling_server_fails_the_request_at_its_deadline(monkeypatch):
    """Every byte comes within the read timeout; the whole would take 20 s. The deadline of
    200 bytes with timeouts of 0.5 s and 1 s is about 1.5 s."""
    with trickling() as (url, requests):
        started = time.monotonic()
        with pytest.raises(RequestDeadlineError, match=r"no whole response from http://.*/blob\.bin"):
            read_range(f"{url}/blob.bin", 0, 200, connect_s=0.5, read_s=1.0)
        assert time.monotonic() - started < 15
        assert is_transient(RequestDeadlineError())
        # Through a store: retried as any timeout is, then a StorageError naming the file.
        monkeypatch.setattr(storage, "HTTP_CONNECT_TIMEOUT_S", 0.5)
        monkeypatch.setattr(storage, "HTTP_READ_TIMEOUT_S", 1.0)
        store = Store(f"{url}/data", {}, RetryPolicy(attempts=2, base_delay=0.001))
        with pytest.raises(StorageError, match=r"data/blob\.bin: failed after 2 attempts: RequestDeadlineError"):
            store.read("blob.bin", 0, 200)
        assert requests == ["/blob.bin"] + ["/data/blob.bin"] * 2


def test_a_body_without_a_length_is_read_whole_and_within_deadlines():
    """A body that ends where the connection does is read a block at a time, each within
    its deadline (2.5 s for the first here, against 20 s for the trickle)."""
    with trickling(interval=0, length=False) as (url, _):
        assert read_range(f"{url}/blob.bin", None, None) == DATA[:200]
        assert read_range(f"{url}/blob.bin", 10, 20) == DATA[10:20]  # the server ignores the range
    with trickling(length=False) as (url, _):
        started = time.monotonic()
        with pytest.raises(RequestDeadlineError):
            read_range(f"{url}/blob.bin", None, None, connect_s=0.5, read_s=1.0)
        assert time.monotonic() - started < 15


class _Refuser(_Served):
    """Answers every request with `status` (and a short body)."""

    status = 503

    def answer(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"no")


@pytest.fixture(scope="module")
def fsspec_loop():
    """fsspec's IO thread, started before the tests that use it (it lives on, as fsspec's)."""
    import fsspec.asyn

    fsspec.asyn.get_loop()


@pytest.mark.parametrize("status", [403, 503])
def test_a_token_in_the_url_stays_out_of_messages(status, fsspec_loop):
    """Messages hide an HTTP(S) URL's query (a token, a SAS signature), the messages of other
    libraries quoted in ours too: aiohttp's (fsspec's HTTP client, which reads for a store
    with options urllib3's reads do not take, and looks up sizes) name the whole URL,
    urllib3's its path and query. The errors' `url` keeps the token."""
    with serving(_Refuser, status=status) as (url, _):
        store = Store(f"{url}/data?token=secret", {"block_size": 1 << 20}, RetryPolicy(attempts=2, base_delay=0.001))
        for call in (lambda: store.read("blob.bin", 0, 10), lambda: store.size("blob.bin"),
                     lambda: store.exists("blob.bin"), lambda: store.open("blob.bin").read(10)):
            with pytest.raises(StorageError, match=f"{status}") as info:
                call()
            assert "secret" not in str(info.value) and "blob.bin?..." in str(info.value)
            assert info.value.url == f"{url}/data/blob.bin?token=secret"
        pool = urllib3.PoolManager(retries=urllib3.Retry(total=0, status_forcelist=[status]))
        with pytest.raises(StorageError, match=r"with url: /data/blob\.bin\?\.\.\. ") as info:
            RetryPolicy(attempts=1).call(pool.request, "GET", store.url("blob.bin"), url=store.url("blob.bin"))
        assert "secret" not in str(info.value) and "secret" in info.value.url
        pool.clear()
