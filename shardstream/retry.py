"""Retries of storage requests: which errors are worth another try, and how long to wait.

`RetryPolicy` wraps every remote request a `Store` makes; `is_transient` decides from
the error alone (its type, or the HTTP status aiohttp, botocore, `http_ranges` and
`s3_ranges` attach to it) whether the request may succeed again, and `retry_after`
reads how long a throttling server asks to wait. They live apart from the store
because they know nothing of where bytes live: only errors, clocks and counts (every
retry is counted in `io_stats`).
"""

from __future__ import annotations

import errno
import math
import random
import ssl
from dataclasses import dataclass
from typing import Any

from .arguments import integer
from .cancel import pause, raise_if_cancelled
from .errors import RetriesSpentError, ShardstreamError, StorageError, described, safe_cause
from .iostats import io_stats

__all__ = ["RetryPolicy", "error_code", "http_status", "is_transient", "retry_after"]


_LASTING_ERRNOS = frozenset({errno.EROFS, errno.ENAMETOOLONG, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: 5xx, throttling, timeouts, dropped connections."""
    if error_code(error) in _TRANSIENT_CODES:  # whatever status, or exception, it came as
        return True
    if isinstance(error, FileNotFoundError) and type(error.__cause__).__module__.startswith("aiohttp"):
        # fsspec's HTTP `info` raises FileNotFoundError from whatever aiohttp raised: a 503 or a
        # dropped connection too, which through `simplecache::http://` read as "no manifest", untried.
        # (Only aiohttp's: another library's wrapped OSError may well be the missing file's own.)
        return is_transient(error.__cause__)
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    # A local file system's lasting answers: `shardstream index` on a read-only mount was
    # tried 10 times, reading and hashing every shard again each time, before saying so.
    if isinstance(error, OSError) and not isinstance(error, ssl.SSLError) and error.errno in _LASTING_ERRNOS:
        return False  # (an SSLError's errno is OpenSSL's code, no errno)
    # A URL that does not parse (urllib3's LocationParseError, aiohttp's InvalidURL) will not on the
    # next try: a ValueError, where the client library's module alone read as transient.
    if isinstance(error, ValueError):
        return False
    if any(isinstance(e, ssl.SSLCertVerificationError) or "CertificateError" in type(e).__name__
           for e in _causes(error)):
        return False  # a certificate that does not verify will not on the next try (aiohttp's, too)
    status = http_status(error)
    if status is not None:
        return (status >= 500 and status != 501) or status in (408, 429)  # 501: the server never will
    if isinstance(error, (ConnectionError, TimeoutError, OSError)):
        return True  # resets, broken pipes, EIO: the request may well succeed again
    name, module = type(error).__name__, type(error).__module__
    if module.startswith("botocore"):
        # The connection's failures; not its configuration's (no credentials, a bad bucket
        # name, no region), which were tried 10 times over 20 s before saying so.
        return any(c.__name__ in _BOTOCORE_TRANSIENT for c in type(error).__mro__) or "Timeout" in name
    return module.startswith(("aiohttp", "urllib3", "requests")) or "Timeout" in name


def _causes(error: BaseException, most: int = 8) -> list[BaseException]:
    """`error` and what it came of: its cause or context, each in turn, and exceptions passed
    as arguments. Client libraries wrap the error that says what happened: urllib3's SSLError
    holds the certificate's failure as its context and argument, and botocore's SSLError
    holds urllib3's as its context."""
    found: list[BaseException] = []
    todo = [error]
    while todo and len(found) < most:
        e = todo.pop(0)
        if e in found:
            continue
        found.append(e)
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return found


# S3's error codes that another try can get past, some sent with a status that says otherwise:
# RequestTimeout with 400 (the request's body came too slowly), throttling with 400 or 403
# on some S3-compatible stores.
_TRANSIENT_CODES = frozenset({"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException",
                              "RequestLimitExceeded", "TooManyRequestsException", "InternalError",
                              "ServiceUnavailable"})

# botocore's connection and transfer failures (and their subclasses: endpoint, proxy and
# connect-timeout errors; closed connections, read timeouts).
_BOTOCORE_TRANSIENT = frozenset({"ConnectionError", "HTTPClientError", "IncompleteReadError", "ResponseStreamingError"})


def retry_after(error: BaseException) -> float | None:
    """The seconds a server's ``Retry-After`` header asks to wait, where the error carries it
    (urllib3's and aiohttp's `headers`, botocore's response metadata); None if it does not,
    or gives an HTTP date (not worth a clock-skew guess)."""
    headers = getattr(error, "headers", None)
    response = getattr(error, "response", None)
    if headers is None and isinstance(response, dict):
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders")
    if not headers:
        return None
    value = next((v for k, v in dict(headers).items() if str(k).lower() == "retry-after"), None)
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def error_code(error: BaseException) -> str | None:
    """The S3 error code (botocore's ``Error.Code``) an error, or the error it was raised from
    (s3fs's OSErrors), carries."""
    for candidate in (error, error.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if isinstance(code, str) and code:
                return code
    return None


def http_status(error: BaseException) -> int | None:
    """The HTTP status an error carries: its own (aiohttp's `status`, botocore's response),
    or that of the error it was raised from. s3fs turns botocore's errors into plain
    OSErrors (a 400 or a 416 into EINVAL, a 503 into EBUSY) and keeps the original as the
    cause: the status there says whether another try can succeed."""
    for candidate in (error, error.__cause__):
        if candidate is None:
            continue
        status = getattr(candidate, "status", None)  # aiohttp
        if isinstance(status, int):
            return status
        response = getattr(candidate, "response", None)  # botocore
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
    return None


# The jitter's own generator: drawn from Python's global one, a retry in a prefetch thread
# moved the numbers a sample's seeded transform draws meanwhile (prepare.py), so the same
# sample got other augmentations when storage failed. From the OS: no state, so forked
# workers do not back off in step.
_JITTER = random.SystemRandom()


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded in attempts.

    A transient error is tried up to `attempts` times in all, waiting a random time up
    to ``min(max_delay, base_delay * 2**try)`` between tries, or as long as a server's
    ``Retry-After`` asks where that is longer (up to `max_delay`); then, or on a
    permanent error, the last error is raised. A retry is counted, never a skip.

    The defaults wait up to about 33 s in all (16 s on average) before giving up: object
    stores throttle (S3's 503 SlowDown) and blip for seconds at a time, and a training
    run that dies of a two-second blip loses far more than it would have waited.
    """

    attempts: int = 10
    base_delay: float = 0.1
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        # A whole number of tries (2.5 made every request fail in range(); True was "1 attempts"),
        # and finite delays (nan failed the first retry).
        object.__setattr__(self, "attempts", integer(self.attempts, "RetryPolicy's attempts", 1))
        if not (math.isfinite(self.base_delay) and math.isfinite(self.max_delay)) or self.base_delay < 0 \
                or self.max_delay < 0:
            raise ValueError(f"RetryPolicy needs finite delays >= 0, not {self}")

    def delay(self, attempt: int, error: BaseException | None = None) -> float:
        """Seconds to wait after failed try number `attempt` (from 0)."""
        backoff = _JITTER.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        asked = retry_after(error) if error is not None else None
        return backoff if asked is None else max(backoff, min(asked, self.max_delay))

    def call(self, fn: Any, *args: Any, url: str) -> Any:
        for attempt in range(self.attempts):
            raise_if_cancelled(url)  # work nobody will take (cancel.py)
            try:
                return fn(*args)
            except Exception as error:  # classified right below; unknown errors propagate
                if not is_transient(error):
                    if isinstance(error, (OSError, ShardstreamError)):  # already says what went wrong
                        raise
                    raise StorageError(described(error), url=url) from safe_cause(error)
                if attempt + 1 == self.attempts:
                    raise RetriesSpentError(
                        f"failed after {self.attempts} attempts: {described(error)}", url=url
                    ) from safe_cause(error)
                io_stats.add(retries=1)
                pause(self.delay(attempt, error), url)
        raise AssertionError("unreachable")  # attempts >= 1: the loop returns or raises
