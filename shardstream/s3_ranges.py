"""Ranged reads from S3 through botocore's own client (urllib3, in the asking thread).

s3fs (aiobotocore and aiohttp, driven by fsspec's event loop in its own thread) still
does everything else on S3: sizes, listings, writing, and the reads of a store given
options this module does not map. The reads that stream shards come here because they
are the hot path and measurement says so: 8 MB ranges from moto's S3 server, 6 at a
time, cost 1.2-2.4 ms of CPU per MB through s3fs against 0.8-1.3 ms through botocore
(BENCHMARKS.md).

Options understood, by s3fs's names: `key`, `secret`, `token`, `anon`, `endpoint_url`,
`client_kwargs` holding `endpoint_url` and `region_name`, and `config_kwargs` holding
`connect_timeout` and `read_timeout` (read by the store, which passes them in). Anything not given comes
from botocore's usual chain (the AWS environment variables, `AWS_ENDPOINT_URL` among
them, ~/.aws, instance roles), as it does for s3fs. botocore does not retry by itself
here: `RetryPolicy` does, and counts every retry. Each request has a deadline, as
over HTTP (`deadlines.deadline_s`), its headers' included: a client's connection
pools are made `deadlines.watched` when the client is made.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import threading
import time
from typing import Any, Mapping

from .deadlines import deadline_s, headers_due, read_body, watched
from .http_ranges import (RangeRefused, check_size, content_range_total, fit_range, most_bytes, range_header,
                          refused_range)
from .perprocess import PerProcess
from .retry import is_transient


__all__ = ["supports", "read_range"]

_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_CONFIG_KWARGS = {"connect_timeout", "read_timeout"}  # the caller's `connect_s` and `read_s`
_clients = PerProcess(lambda: (threading.Lock(), {}))  # options (as JSON) -> client, per process


def supports(options: Mapping[str, Any]) -> bool:
    """Whether botocore is installed and `options` (s3fs's) hold nothing this module would
    ignore, nor does fsspec's own configuration for S3 (``FSSPEC_S3_*`` variables, a
    config file), which s3fs applies and this module would not: its reads went to another
    endpoint than the listings and writes."""
    return (set(options) <= _OPTIONS and set(options.get("client_kwargs") or {}) <= _CLIENT_KWARGS
            and set(options.get("config_kwargs") or {}) <= _CONFIG_KWARGS and not _fsspec_s3_config() and _installed())


def _fsspec_s3_config() -> bool:
    import fsspec.config

    return bool(fsspec.config.conf.get("s3"))


@functools.cache
def _installed() -> bool:
    # botocore is imported when first used: it takes a quarter of a second, which every
    # `shardstream` command and DataLoader worker would otherwise pay.
    return importlib.util.find_spec("botocore") is not None


def _client(options: Mapping[str, Any], connect_s: float, read_s: float) -> Any:
    lock, clients = _clients.get()
    key = json.dumps(options, sort_keys=True, default=str)
    with lock:  # botocore's clients are thread-safe; making one is not
        if key not in clients:
            import botocore.config
            import botocore.session
            from botocore import UNSIGNED

            config = {"max_pool_connections": 32, "retries": {"total_max_attempts": 1},
                      "connect_timeout": connect_s, "read_timeout": read_s}
            if options.get("anon"):
                config["signature_version"] = UNSIGNED
            kwargs = dict(options.get("client_kwargs") or {})
            if options.get("endpoint_url"):
                kwargs.setdefault("endpoint_url", options["endpoint_url"])
            client = botocore.session.get_session().create_client(
                "s3", aws_access_key_id=options.get("key"), aws_secret_access_key=options.get("secret"),
                aws_session_token=options.get("token"), config=botocore.config.Config(**config), **kwargs)
            _watch_headers(client)
            clients[key] = client
        return clients[key]


def _watch_headers(client: Any) -> None:
    """Make `client`'s connections read response headers within `deadlines.headers_due`.

    botocore keeps its pool classes by scheme in `_pool_classes_by_scheme` (a private
    name, as `_raw_stream` below), shared with its pool managers, proxies' too, which
    make their pools from it on first use. Were it gone, header reads would be bounded
    by their reads' timeouts only, as before."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    classes = getattr(session, "_pool_classes_by_scheme", None)
    if isinstance(classes, dict):
        for scheme, pool_class in list(classes.items()):
            classes[scheme] = watched(pool_class)


def read_range(url: str, start: int | None, end: int | None, options: Mapping[str, Any], *,
               connect_s: float = 10.0, read_s: float = 20.0, size: int | None = None) -> bytes:
    """Bytes [start, end) of the object at ``s3://bucket/key`` (as `http_ranges.read_range`:
    a store, or a gateway in front of it, that sends less of a range than asked is asked
    for the rest; one that ignores ranges has its whole object cut to the range)."""
    pieces = []
    while True:
        try:
            data, more = _read_once(url, start, end, options, connect_s, read_s, size)
        except RangeRefused as refused:
            end = refused.total
            continue
        pieces.append(data)
        if more is None:
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        start = more


def _read_once(url: str, start: int | None, end: int | None, options: Mapping[str, Any], connect_s: float,
               read_s: float, size: int | None) -> tuple[bytes, int | None]:
    """One GET of bytes [start, end): the bytes, and where to go on from if it sent less."""
    bucket, _, key = url[len("s3://"):].partition("/")
    request: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if start is not None or end is not None:
        request["Range"] = range_header(start, end)
    from botocore.exceptions import ClientError

    client = _client(options, connect_s, read_s)  # the first in a process takes most of a second: not the server's
    started = time.monotonic()
    try:
        with headers_due(url, started, started + deadline_s(0, connect_s, read_s)) as late:
            response = client.get_object(**request)
            if late():
                response["Body"].close()
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
            raise FileNotFoundError(url) from e
        # A 403 is access denied, unless its code says throttling (some S3-compatible stores):
        # RetryPolicy then retries it.
        if code == "AccessDenied" or (status == 403 and not is_transient(e)):
            raise PermissionError(f"{code or status} for {url}") from e
        if status == 416 or code == "InvalidRange":  # the range starts at or past the end (or runs past it)
            sent = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            refused_range(sent.get("content-range"), url, start, end, sent)
            return b"", None
        raise  # RetryPolicy reads the status: 5xx and throttling are retried
    body = response["Body"]
    total = (response.get("ContentLength") if "Range" not in request
             else content_range_total(response.get("ContentRange")))
    try:
        check_size(url, total, size)
        # botocore's body wraps urllib3's response (`_raw_stream`, a private name), whose
        # socket the deadline shuts; were it gone, a read past the deadline would still fail, once done.
        data = read_body(getattr(body, "_raw_stream", None), body.read, url, started,
                         response.get("ContentLength"), connect_s, read_s, most_bytes(end, size))
    finally:
        body.close()
    if "Range" not in request:
        return data, None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 206)
    return fit_range(status, response.get("ContentRange"), data, url, start, end, size)
