"""Ranged S3 reads through botocore (`s3_ranges`), against moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

import pytest

from shardstream import StorageError
from shardstream.http_ranges import RequestDeadlineError
from shardstream.s3_ranges import read_range, supports
from shardstream.storage import Store
from shardstream.testing import MotoS3Server

try:  # tests/ may or may not be a package
    from .test_http_ranges import _HeaderTrickler, serving, trickling
except ImportError:
    from test_http_ranges import _HeaderTrickler, serving, trickling

DATA = bytes(range(256)) * 40  # 10,240 bytes
BUCKET = "ranges"


@pytest.fixture(scope="module")
def moto():
    import s3fs

    with MotoS3Server() as server:
        fs = s3fs.S3FileSystem(**server.storage_options)
        fs.call_s3("create_bucket", Bucket=BUCKET)
        fs.pipe(f"{BUCKET}/dir/blob.bin", DATA)
        yield server


def test_ranges_as_cat_file_gives_them(moto):
    url, options = f"s3://{BUCKET}/dir/blob.bin", moto.storage_options
    assert read_range(url, None, None, options) == DATA
    assert read_range(url, 10, 20, options) == DATA[10:20]
    assert read_range(url, 10_000, None, options) == DATA[10_000:]
    assert read_range(url, 10_000, 20_000, options) == DATA[10_000:]  # past the end: up to the end
    assert read_range(url, 20_000, 30_000, options) == b""  # wholly past the end


def test_a_missing_object_is_not_found(moto):
    with pytest.raises(FileNotFoundError):
        read_range(f"s3://{BUCKET}/dir/missing.bin", 0, 10, moto.storage_options)
    with pytest.raises(StorageError, match=r"missing\.bin: file not found"):
        Store(f"s3://{BUCKET}/dir", moto.storage_options).read("missing.bin", 0, 10)


def test_an_object_of_another_size_than_its_reader_knows_is_refused(moto):
    """Regression: a shard replaced while an epoch read it (a dataset packed again to the same place) gave
    bytes of both versions, mixed, with no error. An object whose size is not the manifest's is refused,
    not retried, whole or by ranges."""
    url, options = f"s3://{BUCKET}/dir/blob.bin", moto.storage_options
    assert read_range(url, 10, 20, options, size=len(DATA)) == DATA[10:20]
    for start, end in ((10, 20), (None, None)):
        with pytest.raises(OSError, match=f"is {len(DATA)} bytes, where its manifest says 9000: cut short, or replaced"):
            read_range(url, start, end, options, size=9000)
    with pytest.raises(StorageError, match="replaced since the manifest was written") as caught:
        Store(f"s3://{BUCKET}/dir", options).read("blob.bin", 0, 10, size=9000)
    assert "after" not in str(caught.value)  # not retried: "failed after N attempts" says it was


def test_which_stores_read_through_botocore(moto):
    assert supports(moto.storage_options) and supports({}) and supports({"anon": True})
    assert not supports({"requester_pays": True}) and not supports({"client_kwargs": {"verify": False}})
    # A store with an option botocore is not given reads through s3fs, with the same result.
    options = {**moto.storage_options, "default_block_size": 1 << 20}
    store = Store(f"s3://{BUCKET}/dir", options)
    assert store._direct is None and store.read("blob.bin", 5, 9) == DATA[5:9]
    assert Store(f"s3://{BUCKET}/dir", moto.storage_options)._direct == "s3"


def _child_reads(url: str, options: dict, queue) -> None:
    queue.put(read_range(url, 0, 16, options))


def test_a_forked_child_reads_with_its_own_client(moto):
    url, options = f"s3://{BUCKET}/dir/blob.bin", moto.storage_options
    assert read_range(url, 0, 16, options) == DATA[:16]  # the parent holds a client and a connection
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_reads, args=(url, options, queue))
    child.start()
    assert queue.get(timeout=60) == DATA[:16]
    child.join(60)
    assert child.exitcode == 0
    assert read_range(url, 16, 32, options) == DATA[16:32]


@pytest.mark.parametrize("what", ["body", "headers"])
def test_a_trickling_server_fails_the_request_at_its_deadline(what):
    """An S3 endpoint whose every byte comes within the read timeout (1 s), the whole in 20 s:
    the request fails at its deadline (about 1.5 s), a timeout that `RetryPolicy` retries.
    Regression for the headers: botocore's connections read them with only each read's
    timeout, so an endpoint trickling its headers held the reader all 20 s."""
    server = trickling() if what == "body" else serving(_HeaderTrickler)
    message = {"body": "no whole response from", "headers": "no whole response headers from"}[what]
    with server as (endpoint, requests):
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        started = time.monotonic()
        with pytest.raises(RequestDeadlineError, match=rf"{message} s3://ranges/dir/blob\.bin"):
            read_range(f"s3://{BUCKET}/dir/blob.bin", 0, 200, options, connect_s=0.5, read_s=1.0)
        assert time.monotonic() - started < 10
        assert len(requests) == 1


def test_the_deadline_counts_from_the_request_not_from_making_its_client():
    """The first read in a process imports botocore and makes a client (most of a second
    here): the deadline (0.3 s) is the request's, not theirs."""
    with trickling(interval=0) as (endpoint, requests):
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        code = ("import sys\nfrom shardstream.s3_ranges import read_range\n"
                f"data = read_range('s3://{BUCKET}/dir/blob.bin', 0, 200, {options!r}, connect_s=0.1, read_s=0.2)\n"
                "assert 'botocore' in sys.modules and data == bytes(range(200)), data\n")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        assert len(requests) == 1


def test_fsspecs_own_s3_configuration_sends_reads_through_s3fs(monkeypatch):
    """Regression: with the endpoint in fsspec's configuration (FSSPEC_S3_ENDPOINT_URL, a config file), pack and
    listings went there through s3fs, while the direct reader, which does not read fsspec's configuration, sent
    reads to AWS itself."""
    import fsspec.config

    from shardstream.s3_ranges import supports

    assert supports({"key": "k", "secret": "s"})
    monkeypatch.setitem(fsspec.config.conf, "s3", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})
    assert not supports({"key": "k", "secret": "s"})


def test_botocores_configuration_errors_are_not_retried():
    """Regression: every botocore exception counted as transient: no credentials, or a bad bucket name, was
    tried 10 times over 20 s before it was said. Its connection failures still are retried."""
    import botocore.exceptions as b

    from shardstream.retry import is_transient

    for permanent in (b.NoCredentialsError(), b.ParamValidationError(report="bad bucket"), b.NoRegionError()):
        assert not is_transient(permanent), permanent
    for transient in (b.EndpointConnectionError(endpoint_url="x"), b.ConnectTimeoutError(endpoint_url="x"),
                      b.ReadTimeoutError(endpoint_url="x"), b.ConnectionClosedError(endpoint_url="x"),
                      b.IncompleteReadError(actual_bytes=1, expected_bytes=2)):
        assert is_transient(transient), transient


def test_s3fs_calls_make_one_botocore_try_each_unless_told_otherwise():
    """Regression: botocore's own retries ran inside s3fs's and under RetryPolicy: 25 requests a call."""
    from shardstream.storage import _with_timeouts

    options = _with_timeouts("s3://b/ds", {"key": "k", "config_kwargs": {"read_timeout": 60}})
    assert options["config_kwargs"] == {"read_timeout": 60, "retries": {"total_max_attempts": 1},
                                        "connect_timeout": 10.0}
    assert options["key"] == "k" and options["use_listings_cache"] is False
    assert "config_kwargs" not in _with_timeouts("memory://ds", {})


class _RangeGateway:
    """An HTTP gateway in front of moto that answers a ranged GET as some caching proxies do: with the
    whole object and 200 (`ignore` ranges), or with the first `cap` bytes of the range and a Content-Range
    that says so."""

    def __init__(self, upstream: str, *, ignore: bool = False, cap: int | None = None):
        import http.client
        import http.server
        import re
        import threading
        import urllib.parse

        port = urllib.parse.urlsplit(upstream).port
        gateway = self
        self.ranged_gets = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                headers = dict(self.headers.items())
                if "Range" in headers:
                    gateway.ranged_gets += 1
                    if ignore:
                        del headers["Range"]
                upstream_connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                upstream_connection.request("GET", self.path, headers=headers)
                response = upstream_connection.getresponse()
                body = response.read()
                upstream_connection.close()
                sent = {k.title(): v for k, v in response.getheaders()
                        if k.lower() not in ("content-length", "transfer-encoding", "connection")}
                match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", sent.get("Content-Range", ""))
                if cap is not None and response.status == 206 and match and len(body) > cap:
                    first, total = int(match[1]), int(match[3])
                    body = body[:cap]
                    sent["Content-Range"] = f"bytes {first}-{first + cap - 1}/{total}"
                self.send_response(response.status)
                for k, v in sent.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")  # no handler thread left waiting on a pooled connection
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "_RangeGateway":
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.mark.parametrize("kind", [{"ignore": True}, {"cap": 1000}], ids=["ranges ignored", "ranges capped"])
def test_a_gateway_that_ignores_or_caps_ranges_gives_the_range_asked_for(moto, kind):
    """Regression: the direct S3 reader took any answer to a ranged GET as the range: a gateway that ignores
    ranges (200, the whole object) or caps them (206 for less, saying so) failed every read as a damaged shard
    ("shorter than its index says"), and with on_error="skip" counted good samples as bad. As over HTTP: the
    whole object is cut to the range, and the rest of a capped one is asked for."""
    with _RangeGateway(moto.endpoint, **kind) as gateway:
        options = {**moto.storage_options, "client_kwargs": {**moto.storage_options["client_kwargs"],
                                                             "endpoint_url": gateway.endpoint}}
        url = f"s3://{BUCKET}/dir/blob.bin"
        assert read_range(url, 100, 4100, options, size=len(DATA)) == DATA[100:4100]
        assert read_range(url, 10_000, None, options) == DATA[10_000:]
        assert gateway.ranged_gets == (2 if "ignore" in kind else 4 + 1)  # a capped range: 1000 bytes a GET
