"""The one exception hierarchy of shardstream.

Every error the library raises on bad data or bad input is a `ShardstreamError`.
Messages name where the problem is: the URL or file, the sample key and the byte
offset when they are known, so that a failure at hour 40 of a run can be found
and fixed without a debugger.
"""

from __future__ import annotations

import re
from typing import NoReturn


class ShardstreamError(Exception):
    """Base of every error shardstream raises on bad data or bad input.

    `url`, `key` and `offset` locate the problem when known; they are also part
    of the message, which shows no HTTP(S) query string (`shown_url`, `scrubbed`).
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        key: str | None = None,
        offset: int | None = None,
    ) -> None:
        message = scrubbed(message)  # it may quote another library's error, whole URL and all
        self.detail = message
        self.url = url
        self.key = key
        self.offset = offset
        where = []
        if url is not None:
            where.append(shown_url(url))
        if key is not None:
            where.append(f"sample {key!r}")
        if offset is not None:
            where.append(f"byte {offset}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)

    def keyed(self, key: str) -> "ShardstreamError":
        """This error naming the sample `key`, where it named none: the error of a frame or
        a shard, met while reading one of its samples."""
        if self.key is not None:
            return self
        try:
            return _rebuild(type(self), self.detail, self.url, key, self.offset)
        except TypeError:  # a subclass made otherwise
            return self

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps url/key/offset where the error is pickled (pack's process pool, a queue,
        # `RaisedInWorker`). torch's DataLoader does not pickle a worker's error: it makes a
        # new one of the same type from the traceback's text, with these unset.
        return (_rebuild, (type(self), self.detail, self.url, self.key, self.offset))


def _rebuild(cls, message, url, key, offset):  # type: ignore[no-untyped-def]
    return cls(message, url=url, key=key, offset=offset)


class RaisedInWorker:
    """A `ShardstreamError` raised in a worker of `shardstream.DataLoader`, sent to the main
    process as the worker's next item, the error pickled whole: torch's DataLoader would
    raise there a new error of the same type made from the traceback's text, its `url`,
    `key` and `offset` unset. The loader raises it where torch would have (`reraise`)."""

    def __init__(self, error: ShardstreamError, where: str, traceback: str) -> None:
        self.error = error
        self.where = where  # "in DataLoader worker process N", as torch words it
        self.traceback = traceback  # the worker's, as text: its frames do not pickle

    def reraise(self) -> NoReturn:
        # Let go of the error first: the traceback then holds it only as a local of this
        # frame, which the loader clears (`_free_frames_holding`), not in a reference cycle.
        error, self.error = self.error, None  # type: ignore[assignment]
        add_note(error, f"Raised {self.where}{_TRACEBACK_THERE}{self.traceback}")
        raise error


_TRACEBACK_THERE = "; its traceback there:\n"


def notes_in_short(error: BaseException) -> list[str]:
    """The notes on `error` for a one-line report (the command line's): a worker's traceback
    left out, its "Raised in DataLoader worker process N" kept. Bad data is told by its
    message; the traceback of where it was met is for a program's logs."""
    return [str(note).split(_TRACEBACK_THERE, 1)[0] for note in getattr(error, "__notes__", ())]


def shown_url(url: str) -> str:
    """`url` as messages show it: an HTTP(S) query string (a token, a SAS signature) and a
    password in the URL (``https://user:password@host``) hidden, since messages end up in
    logs; the exception's `url` attribute keeps it whole."""
    if url.startswith(("http://", "https://")):
        url = USERINFO.sub(r"\1***@", url)
        if "?" in url:
            return url.split("?", 1)[0] + "?..."
    return shown_name(url)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shown_name(name: str) -> str:
    """`name` (a file's path) with its control characters written as Python writes them
    (``\\n``, ``\\t``, ``\\x1b``): a newline in a file name made an error two lines, and a
    summary's "skipped" line a forged one (found by a walk of a messy collection)."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], name) if _CONTROL.search(name) else name


# The user information of an HTTP(S) URL (``user:password@``), shown as ``***@``.
USERINFO = re.compile(r"""(https?://)[^\s/?#@'"<>]+@""", re.IGNORECASE)


# The query string of an HTTP(S) URL inside text: a whole URL (aiohttp's "url='https://host/f?sig=...'",
# requests' "for url: https://..."), or the path that urllib3's "Max retries exceeded with url: /f?sig=..."
# names. It runs to the first blank or quote; one already shown as "?..." is left as it is.
_QUERY = re.compile(r"""((?:https?://|\burl: /)[^\s?#'"<>]*)\?(?!\.\.\.)[^\s'"<>]+""", re.IGNORECASE)


def scrubbed(text: str) -> str:
    """`text` with the query string and user information of every HTTP(S) URL in it hidden,
    as `shown_url` hides them: another library's error message, quoted in ours, may name
    the URL whole."""
    return _QUERY.sub(r"\1?...", USERINFO.sub(r"\1***@", text))


class ScrubbedError(Exception):
    """Stands in for another library's error whose text named an HTTP(S) URL's query
    string (`safe_cause`): its type's name and its text, the query hidden, and its traceback."""


def safe_cause(error: BaseException) -> BaseException:
    """`error` to chain to one of ours (``raise ... from safe_cause(error)``): itself, or
    where its text, or that of an error it chains, names an HTTP(S) URL's query string, a
    `ScrubbedError` that says the same with the query hidden. A chained error is printed
    with every traceback (a DataLoader worker's too, which travels as text), and
    tracebacks end up in logs."""
    cause = error.__cause__ if error.__cause__ is not None or error.__suppress_context__ else error.__context__
    safe = safe_cause(cause) if cause is not None else None
    text = str(error)
    if scrubbed(text) == text and safe is cause:
        return error
    kind = type(error)
    stand_in = ScrubbedError(f"{kind.__module__}.{kind.__qualname__}: {scrubbed(text)}").with_traceback(
        error.__traceback__)
    stand_in.__cause__ = safe
    return stand_in


def add_note(error: BaseException, note: str) -> None:
    """`error.add_note(note)`, which Python 3.10 (supported) lacks: there the note is kept in
    `__notes__`, as 3.11 keeps it, and the error is raised as it was, unharmed (its traceback
    shows no notes before 3.11)."""
    try:
        error.add_note(note)
    except AttributeError:  # Python 3.10
        try:
            error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
        except AttributeError:  # an exception without a __dict__: nowhere to keep it
            pass


class CorruptShardError(ShardstreamError):
    """A shard's bytes are not what the format promises (tar, zstd or checksum)."""


class CorruptIndexError(ShardstreamError):
    """A shard index is unreadable or disagrees with its shard."""


class ManifestError(ShardstreamError):
    """A manifest is missing, unreadable, or inconsistent."""


class DecodeError(ShardstreamError):
    """A sample field could not be decoded (e.g. a truncated JPEG)."""


class MissingFieldError(ShardstreamError):
    """A sample lacks a field that was asked for."""


class CollateError(ShardstreamError):
    """A batch's samples could not be collated: they differ in their fields or shapes."""


class StorageError(ShardstreamError):
    """Reading or writing storage failed after the allowed retries."""


class FileSizeError(StorageError):
    """A remote file is of another size than its manifest says: cut short, or replaced
    since the manifest was written. `offset` is where the file ends now."""


class DownloadStalledError(StorageError):
    """Another process's download of a shard into the cache is stopped (SIGSTOP, a job
    suspended by its scheduler), waited for a minute: the shard is read uncached, by
    ranges, rather than waited for as long as that process stays stopped."""


class RetriesSpentError(StorageError):
    """A storage request met a transient error (5xx, throttling, a timeout, a dropped
    connection) at every attempt its `RetryPolicy` allows."""


class DownloadChecksumError(StorageError):
    """A shard downloaded whole into the cache never matched its manifest's checksum: the
    stored file is not the one the manifest describes (damaged, or replaced)."""


class CacheFullError(StorageError):
    """The cache's disk had no room for a shard's download (full, or over a quota), after
    the cache evicted what it could: the shard is read uncached instead."""


class BracePatternError(ShardstreamError, ValueError):
    """A brace pattern that names no shards: unbalanced braces, a range of mixed kinds, or too many names."""


class WorkerDiedError(ShardstreamError, RuntimeError):
    """A DataLoader worker process ended outright (killed by a signal, or exited) mid-epoch.

    A RuntimeError too, as torch's own error for a dead worker is: a training script that
    catches that keeps working under `shardstream.DataLoader`."""


class DuplicateKeyError(ShardstreamError):
    """A sample's key is one a sample written before had: a dataset's keys are unique."""


class PackError(ShardstreamError):
    """Packing could not proceed: bad source, unreadable or corrupt input file."""


class ResumeMismatchError(ShardstreamError):
    """`pack(resume=True)` over an earlier, unfinished run of the same pack that it cannot
    continue, which differs from this run only as a fix after a failure does: another
    `on_error`, or source files changed since (an image repaired)."""


class MissingPartsError(ShardstreamError):
    """A pack in parts has parts not finished yet: there is nothing wrong to merge, only too little."""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Pillow names the in-memory file it was given (`cannot identify image file <_io.BytesIO object
# at 0x...>`), which tells a reader nothing: the sample is named beside it.
_IN_MEMORY_FILE = re.compile(r" <_io\.BytesIO object( at 0x[0-9a-fA-F]+)?>")


def described(error: BaseException) -> str:
    """`error` as our messages quote it: its type's name and its text. urllib3 starts its
    text with the connection pool the error came from, "None" where a response's read had
    none ("None: Read timed out."): that None is left out."""
    text = str(error)
    # The attribute itself, not a property: NewConnectionError's `pool` is a deprecated one
    # that warns (a stray warning line, and a FutureWarning raised where warnings are errors).
    if vars(error).get("pool", True) is None and text.startswith("None: "):
        text = text[len("None: "):]
    return f"{type(error).__name__}: {text}"


def reason(error: BaseException) -> str:
    """`error`'s message without object addresses (Pillow names ``<_io.BytesIO object at 0x...>``)
    and, for a failed file operation, without the file's path (the caller names the file
    by its path in the source): the same bad input gives the same words in every run and
    wherever the source lies, in reports and manifests alike."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return error.strerror
    # Some say nothing (msgpack's FormatError on a reserved byte): their type's name is all there is to tell.
    return scrubbed(_ADDRESS.sub("", _IN_MEMORY_FILE.sub("", str(error)))) or type(error).__name__
