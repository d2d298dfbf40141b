"""Storage: where bytes live. Local paths and any fsspec URL behind one small interface.

A `Store` is a root location plus fsspec options. It is a frozen, picklable value that
opens its filesystem lazily, so it can be built in the main process and cross into
DataLoader workers. Everything above this layer (shard reading, the writer, the packer)
names files relative to a store and never touches fsspec directly.

Local paths bypass fsspec on the read path: a plain `open` + `seek` + `read` costs a
few microseconds, fsspec's LocalFileSystem several times that, and the raw reader
makes one such call per zstd frame.

What a store uses but does not own lives below it: what a URL names (`urls`), the
scratch files that writes go through (`scratch`), which errors are retried and how
(`retry`), s3fs cut to one try per call below those retries (`s3fs_one_try`), the
per-process I/O counters every read adds to (`iostats`), and what a forked child must
be told about fsspec's event loop (`forkloop`).
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable, Iterator, Mapping

from . import forkloop  # noqa: F401 - registers the fork handlers for fsspec's event loop
from . import http_ranges, s3_ranges
from .errors import FileSizeError, StorageError, described, safe_cause, shown_url
from .iostats import io_stats
from .retry import RetryPolicy, http_status
from .scratch import drop_scratch, scratch_file, sync_file, sync_folder
from .threads import ordered_map
from .urls import check_chain, expand_home, is_local, local_path, split_query, without_userinfo

if TYPE_CHECKING:
    import fsspec

# fsspec is imported where a remote store first needs it: it takes about 0.1 s, which
# every command on local files and every process a local pack starts would pay.

__all__ = ["Store"]


OPEN_BLOCK_BYTES = 8 << 20  # bytes per ranged request of a remote file read front to back (`Store.open`)

# aiohttp (fsspec's HTTP) waits up to 300 s for a response by default. A request that
# gets lost should fail fast and be retried by RetryPolicy instead. The limits are per
# read, so a slow large transfer is unaffected. Options given by the user
# (client_kwargs={"timeout": ...}) win. The ranged reads of `http_ranges` and
# `s3_ranges` also give each request a deadline derived from these and its size
# (`deadlines.deadline_s`): a server trickling a byte per read timeout fails it.
REMOVE_THREADS = 16  # remote files removed at once (`Store.remove_all`)
HTTP_CONNECT_TIMEOUT_S = 10.0
HTTP_READ_TIMEOUT_S = 20.0


# The fsspec filesystems known to keep listings and to take the listings cache's options:
# others get the user's options as given (sftp hands every one to paramiko's connect, which
# refused this one, so every sftp:// dataset failed); their listings are dropped before each
# `ls` instead (`_listing`).
_LISTINGS_KEPT = ("http://", "https://", "s3://", "s3a://", "gs://", "gcs://", "abfs://", "abfss://", "az://")


def _with_timeouts(root: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The fsspec options for `root`: the user's, with timeouts on HTTP, and without fsspec's
    listings cache: it never expires, and the filesystem instance (shared by every Store of
    the same options in a process) kept a listing from before another process wrote there
    (a part finished elsewhere stayed missing, and `merge` refused). A copy, nested options
    too: fsspec updates a chained URL's per-protocol options in place, which were the
    caller's."""
    options = {key: dict(value) if isinstance(value, Mapping) else value for key, value in options.items()}
    if root.startswith(_LISTINGS_KEPT):
        options.setdefault("use_listings_cache", False)
    if root.startswith("s3://"):
        # One try per botocore call below ours: its retries (5) ran inside s3fs's own (5,
        # cut to one by `_s3_filesystem_class`) under `RetryPolicy`: 25 requests and half a
        # minute per call with attempts=1, out of reach of deadlines and cancellation. The
        # user's settings win.
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("connect_timeout", HTTP_CONNECT_TIMEOUT_S)
        config.setdefault("read_timeout", HTTP_READ_TIMEOUT_S)
        options["config_kwargs"] = config
    if root.startswith(("http://", "https://")):
        try:
            import aiohttp
        except ImportError:  # the extra not installed: say which, not a bare module name
            raise StorageError("http(s):// needs aiohttp, which fsspec's HTTP file system reads with (and "
                               "urllib3 for ranged reads): pip install 'shardstream[http]'", url=root) from None
        if "timeout" not in options.get("client_kwargs", {}):
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_CONNECT_TIMEOUT_S,
                                            sock_read=HTTP_READ_TIMEOUT_S)
            options["client_kwargs"] = {**options.get("client_kwargs", {}), "timeout": timeout}
    return options


def _s3_filesystem_class() -> type[fsspec.AbstractFileSystem]:
    """The filesystem class of a store's s3:// files: s3fs's, with its own retry loop run
    once (`s3fs_one_try`: each `RetryPolicy` attempt is one request, which deadlines,
    cancellation and the counters see), or a class the user registered with fsspec for
    "s3" as it is: its retries are its maker's choice. s3fs takes no option for its
    tries; setting `S3FileSystem.retries` tunes every s3fs filesystem in the process, the
    user's own, and is not read here: a store's retries are `RetryPolicy`'s alone."""
    import fsspec

    try:
        registered = fsspec.get_filesystem_class("s3")  # imports s3fs where that is what is registered
    except ImportError:  # fsspec's "Install s3fs to access S3", with the extra that brings it
        raise StorageError("s3:// needs s3fs: pip install 'shardstream[s3]'") from None
    s3fs = sys.modules.get("s3fs")
    if s3fs is None or registered is not s3fs.S3FileSystem:
        return registered
    from .s3fs_one_try import OneTryS3FileSystem

    return OneTryS3FileSystem


def _bounded_timeout_only(client_kwargs: Mapping[str, Any]) -> bool:
    """Whether aiohttp's `client_kwargs` hold nothing but a `ClientTimeout` that bounds reads,
    which the direct reader then keeps (`Store._timeouts`). Anything else, a timeout that
    is no ClientTimeout (aiohttp refuses a number) or one without a bound on reads (None:
    wait as long as it takes), is aiohttp's to take, on fsspec's path."""
    if not client_kwargs:
        return True
    timeout = client_kwargs.get("timeout")
    return (set(client_kwargs) == {"timeout"} and type(timeout).__name__ == "ClientTimeout"
            and bool(getattr(timeout, "sock_read", None) or getattr(timeout, "total", None)))


def _cat_file(fs: fsspec.AbstractFileSystem, path: str, **byte_range: int | None) -> bytes:
    """`fs.cat_file(path, ...)`, where a cache wrapper's "not found" is the store's.

    fsspec's cache wrappers (``simplecache::``, ``filecache::``) ask the store `exists()`,
    which answers False for any failure, and raise a FileNotFoundError with no cause: a
    503 through ``simplecache::http://`` read as "no manifest", never tried again. The
    store's own look-up then says what it was: its error (a transient one is retried),
    or the file, which the wrapper missed (retried too)."""
    try:
        return fs.cat_file(path, **byte_range)
    except FileNotFoundError as error:
        import fsspec

        inner = getattr(fs, "fs", None)
        if error.__cause__ is not None or not isinstance(inner, fsspec.AbstractFileSystem):
            raise
        inner.info(path)  # raises what the store says
        raise ConnectionError(f"the cache wrapper found no file where the store has one ({path})") from error


def _fitted(data: bytes, url: str, start: int | None, end: int | None, size: int | None) -> bytes:
    """Bytes [start, end) of `url`, from what fsspec's `cat_file` gave for them (`size`: the
    file's, where its reader knows it). A server that ignores Range answers 200 with the
    whole file, which fsspec's HTTP passes on as it came: the range is cut from it (as the
    direct reader does, http_ranges.py). Anything else longer is another range (a proxy that
    rounds ranges out): failed as damaged data, not retried. Anything shorter than the file
    holds is a transfer cut short (`CutShort`, retried), unless the file itself is shorter
    than its reader knows (`Store._remote_read_bytes` asks)."""
    first = start or 0
    if end is not None and len(data) > end - first:
        if size is not None and len(data) != size:
            raise http_ranges.RangeMismatchError(f"{shown_url(url)} sent {len(data)} bytes for bytes {first}-{end - 1} "
                                                 f"of a file of {size}")
        return data[first:end]
    if size is not None and len(data) < min(size if end is None else end, size) - first:
        raise CutShort(f"{shown_url(url)} sent {len(data)} of the bytes {first}-{min(end or size, size) - 1} "
                       "asked: cut short")
    return data


class CutShort(ConnectionError):
    """A response with fewer bytes than its file holds for the range: retried, as a connection dropped."""


@dataclass(frozen=True)
class Store:
    """A directory or URL prefix holding a dataset's files.

    `options` are passed to fsspec (credentials, ``endpoint_url``, ...). For S3 the
    standard AWS environment variables (``AWS_ENDPOINT_URL``, keys, region) are read by
    s3fs/botocore themselves.
    """

    root: str
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # credentials: never in a repr
    retry: "RetryPolicy" = field(default_factory=lambda: RetryPolicy())
    # Local writes reach the disk before they are published, and the publishing rename
    # before the call returns (fsync of the file, then of its folder): so that after a
    # power loss or a kernel crash, and not only after the writing process dies, no file
    # that names another (a manifest, a journal) names one that is lost. Off by default,
    # as in tar, rsync and WebDataset: it waits for the disk. An object store publishes
    # an object only once its upload is complete, so remote stores ignore it.
    durable: bool = False

    def __post_init__(self) -> None:
        # Every dataset location becomes a Store here, so this is where ``~`` is expanded, and
        # URLs the library cannot name files in are refused.
        object.__setattr__(self, "root", expand_home(self.root))
        check_chain(self.root)

    @property
    def local(self) -> bool:
        return is_local(self.root)

    @property
    def _direct(self) -> str | None:
        """Which module reads ranges without fsspec: "http" (`http_ranges`), "s3" (`s3_ranges`),
        or None (fsspec: other protocols, and options those modules would not honour)."""
        if self.root.startswith(("http://", "https://")) and set(self.options) <= {"headers", "client_kwargs"} \
                and _bounded_timeout_only(self.options.get("client_kwargs") or {}):
            return "http" if http_ranges.available() else None
        if self.root.startswith("s3://") and s3_ranges.supports(self.options):
            return "s3"
        return None

    @property
    def _timeouts(self) -> tuple[float, float]:
        """The connect and read timeouts of the direct readers' requests, in seconds: the
        user's where the options set them as fsspec's file systems take them (s3fs's
        ``config_kwargs={"connect_timeout": ..., "read_timeout": ...}``, aiohttp's
        ``client_kwargs={"timeout": ClientTimeout(sock_connect=..., sock_read=...)}``),
        else `HTTP_CONNECT_TIMEOUT_S` and `HTTP_READ_TIMEOUT_S`. Setting them kept a
        store off the direct readers before, for fsspec's slower path."""
        config = self.options.get("config_kwargs") or {}
        timeout = (self.options.get("client_kwargs") or {}).get("timeout")
        connect = config.get("connect_timeout", getattr(timeout, "sock_connect", None) or
                             getattr(timeout, "connect", None) or getattr(timeout, "total", None))
        read = config.get("read_timeout", getattr(timeout, "sock_read", None) or getattr(timeout, "total", None))
        return (float(connect) if connect else HTTP_CONNECT_TIMEOUT_S, float(read) if read else HTTP_READ_TIMEOUT_S)

    @property
    def location(self) -> str:
        """The root without an HTTP(S) query string or password: where the files are, whatever
        token or password (which may rotate) grants access to them."""
        return without_userinfo(split_query(self.root)[0])

    def folder(self) -> tuple[str, str]:
        """The folder this store names, however its URL spells it, to tell two stores apart:
        ("file", its real path) where it is local, also through fsspec's cache wrappers
        (``simplecache::file://``) and ``local://``; else fsspec's filesystem class and the
        path it resolves (``memory://t`` and ``memory:///t`` are one folder, ``s3a://`` and
        ``s3://`` one bucket). No request is made; a protocol fsspec cannot resolve (its
        package not installed) raises a `StorageError`."""
        if self.local:
            return "file", os.path.realpath(local_path(self.root))
        import fsspec.core
        from fsspec.implementations.local import LocalFileSystem

        try:
            fs, path = fsspec.core.url_to_fs(self.location, **_with_timeouts(self.root, self.options))
        except (ImportError, ValueError, TypeError, OSError) as e:  # no such protocol, its package missing
            raise self._wrap("", "resolve the folder", e) from safe_cause(e)
        while isinstance(getattr(fs, "fs", None), fsspec.AbstractFileSystem):  # a cache wrapper: what it wraps
            fs = fs.fs
        if isinstance(fs, LocalFileSystem):
            return "file", os.path.realpath(path)
        return f"{type(fs).__module__}.{type(fs).__qualname__}", fs._strip_protocol(path).rstrip("/")

    def url(self, name: str) -> str:
        """The full URL (or path) of the file `name` in this store.

        An HTTP(S) root's query string (a token, an Azure SAS signature: one for every file
        below the root) goes on each file's URL, after its name, which is percent-encoded
        there (a name with '#', '?', '%' or a space named another file, or cut the query off).
        """
        if self.local:
            return os.path.join(local_path(self.root), name)
        base, query = split_query(self.root)
        if base.startswith(("http://", "https://")):
            name = urllib.parse.quote(name)
        return posixpath.join(base.rstrip("/"), name) + query

    def _fs_path(self, name: str) -> tuple[fsspec.AbstractFileSystem, str]:
        import fsspec.core

        url, options = self.url(name), _with_timeouts(self.root, self.options)
        if not self.root.startswith("s3://"):
            return fsspec.core.url_to_fs(url, **options)
        cls = _s3_filesystem_class()  # as url_to_fs makes it, of this class
        fs = cls(**{**cls._get_kwargs_from_urls(url), **options})
        return fs, cls._strip_protocol(url)

    def _wrap(self, name: str, action: str, error: BaseException) -> StorageError:
        return StorageError(f"could not {action}: {described(error)}", url=self.url(name))

    @contextlib.contextmanager
    def _errors(self, name: str, action: str) -> Iterator[None]:
        """Turn an OSError from `action` on `name` into a StorageError naming its URL.

        `RetryPolicy.call` lets a permanent OSError through as it is (a 403's PermissionError,
        a 501's `http_ranges.HTTPStatusError`, a missing file's FileNotFoundError): every
        method that calls it, or the file system, passes through here, so that what a store
        raises is a StorageError.
        """
        try:
            yield
        except FileNotFoundError as e:
            raise StorageError("file not found", url=self.url(name)) from safe_cause(e)
        except http_ranges.SizeMismatchError as e:
            raise FileSizeError(f"the file is {e.total} bytes, where its manifest says {e.expected}: cut short, or "
                                "replaced since the manifest was written", url=self.url(name),
                                offset=e.total) from safe_cause(e)
        except OSError as e:
            raise self._wrap(name, action, e) from safe_cause(e)

    # -- reading ---------------------------------------------------------------

    def read(self, name: str, start: int | None = None, end: int | None = None, *, size: int | None = None) -> bytes:
        """Read bytes [start, end) of `name` (the whole file when both are None).

        Remote reads are retried on transient errors (see `RetryPolicy`); a permanent
        error, or a transient one that outlasts the retries, raises `StorageError`
        naming the URL. Every read is counted in `io_stats`. `size`, the file's size
        where the caller knows it (a shard's manifest entry): a remote file of another
        size (replaced since) is an error, where the direct HTTP and S3 readers see its
        size, rather than bytes of two versions mixed.
        """
        started = time.perf_counter()
        with self._errors(name, "read"):
            if self.local:
                with open(self.url(name), "rb") as f:
                    if start:
                        f.seek(start)
                    data = f.read() if end is None else f.read(end - (start or 0))
            else:
                data, sent = self.retry.call(self._remote_read, name, start, end, size, url=self.url(name))
        io_stats.add(requests=1, bytes=len(data), remote_bytes=0 if self.local else sent,
                     wait_s=time.perf_counter() - started)
        return data

    def read_into(self, name: str, start: int, out: memoryview) -> int:
        """Read bytes [start, start + len(out)) of `name` into `out`; return how many were read.

        Fewer than ``len(out)`` only where the file ends first. A local file's bytes go
        straight into the caller's buffer, which a reader reuses piece after piece: fresh
        memory for every piece costs page faults, which made raw reading 1.2x (.tar.zst)
        to 1.45x (.tar) slower here (BENCHMARKS.md). Remote bytes come through `read` and
        are copied in.
        """
        if not self.local:
            data = self.read(name, start, start + len(out))
            out[: len(data)] = data
            return len(data)
        started = time.perf_counter()
        with self._errors(name, "read"):
            done = _read_file_into(self.url(name), start, out)
        io_stats.add(requests=1, bytes=done, wait_s=time.perf_counter() - started)
        return done

    def _remote_read(self, name: str, start: int | None, end: int | None,
                     size: int | None = None) -> tuple[bytes, int]:
        """Bytes [start, end) of `name`, and how many bytes the storage sent for them (more
        where a server ignored the range, none where it said a file kept is unchanged)."""
        direct = self._direct
        if direct == "http":
            connect_s, read_s = self._timeouts
            return http_ranges.fetch_range(self.url(name), start, end, headers=self.options.get("headers", {}),
                                           connect_s=connect_s, read_s=read_s, size=size)
        data = self._remote_read_bytes(name, start, end, size)
        return data, len(data)

    def _count_sent(self, name: str) -> None:
        """A one-byte read of `name` that tells whether it is there, its bytes sent counted
        (a server that ignores ranges sends the whole file: found by review, uncounted)."""
        io_stats.add(remote_bytes=self._remote_read(name, 0, 1)[1])

    def _remote_read_bytes(self, name: str, start: int | None, end: int | None, size: int | None) -> bytes:
        if self._direct == "s3":
            connect_s, read_s = self._timeouts
            return s3_ranges.read_range(self.url(name), start, end, self.options,
                                        connect_s=connect_s, read_s=read_s, size=size)
        fs, path = self._fs_path(name)
        if start is None and end is None:
            return _cat_file(fs, path)
        try:
            data = _cat_file(fs, path, start=start, end=end)
        except Exception as e:  # fsspec's HTTP raises aiohttp's errors, which are no OSErrors
            if http_status(e) != 416:
                raise
            # A range from the end on (of an empty file too): nothing, as the direct readers
            # answer; one running past the end that the server refused: asked again up to it.
            sent = getattr(e, "headers", None) or {}
            try:
                http_ranges.refused_range(sent.get("Content-Range"), self.url(name), start, end, sent)
            except http_ranges.RangeRefused as refused:
                return self._remote_read_bytes(name, start, refused.total, size)
            return b""
        try:
            return _fitted(data, self.url(name), start, end, size)
        except CutShort:
            # A file shorter than its manifest says sends short bodies too, which were retried
            # as cut transfers, then called one: told apart by the file's size, asked once.
            try:
                now: int | None = int(fs.info(path)["size"])
            except Exception:  # no size to be had: a transfer cut short, as it looks
                now = None
            http_ranges.check_size(self.url(name), now, size)
            raise

    def open(self, name: str) -> BinaryIO:
        """A binary file object for sequential reading.

        A remote file is read in `OPEN_BLOCK_BYTES` ranges through `read`, each retried
        and counted as any read is (fsspec's file objects retry nothing, and its HTTP
        one reports a 503 as a missing file); nothing is fetched before the first read.
        """
        if not self.local:
            return io.BufferedReader(_RangedFile(self, name), buffer_size=OPEN_BLOCK_BYTES)  # type: ignore[return-value]
        try:
            return open(self.url(name), "rb")
        except FileNotFoundError as e:
            raise StorageError("file not found", url=self.url(name)) from safe_cause(e)
        except OSError as e:
            raise self._wrap(name, "open", e) from safe_cause(e)

    def exists(self, name: str) -> bool:
        """Whether `name` exists; remote errors other than "not found" are retried, never read as "absent"."""
        return self._look_up(name, (FileNotFoundError,))

    def may_read(self, name: str) -> bool:
        """Whether `name` exists and may be read here: as `exists`, with access denied read as
        absent too. For a file that may be missing beside another (a tar's index): a
        presigned URL signs its own object alone, and a public bucket that does not list
        answers 403 for a missing key, so the probe for an index was a fatal error there."""
        return self._look_up(name, (FileNotFoundError, PermissionError))

    def _look_up(self, name: str, absent: tuple[type[OSError], ...]) -> bool:
        if self.local:
            return os.path.exists(self.url(name))
        try:
            self._answered(self._remote_info, name, url=self.url(name))
        except absent:
            return False
        except OSError as e:
            raise self._wrap(name, "look up", e) from safe_cause(e)
        return True

    def _answered(self, call: Any, *args: Any, url: str) -> Any:
        """`call(*args)` through the retry policy, counted in `io_stats` as a request (and its
        wait) where storage answered it, "not found" and "denied" too, as `read` counts a read:
        a look-up, a size or a listing is a round trip a slow start spends its time on."""
        started = time.perf_counter()
        try:
            result = self.retry.call(call, *args, url=url)
        except (FileNotFoundError, PermissionError):
            io_stats.add(requests=1, wait_s=time.perf_counter() - started)
            raise
        io_stats.add(requests=1, wait_s=time.perf_counter() - started)
        return result

    def _remote_info(self, name: str) -> dict:
        if self.root.startswith(("http://", "https://")):
            # fsspec's HTTP info() turns every failure (a 503 too) into FileNotFoundError;
            # a one-byte read tells "not found" (404) from a transient error.
            self._count_sent(name)
            return {"name": self.url(name)}
        fs, path = self._fs_path(name)
        return fs.info(path)

    def size(self, name: str) -> int:
        """The size of `name` in bytes; remote lookups are retried as reads are."""
        with self._errors(name, "look up the size"):
            if self.local:
                return os.path.getsize(self.url(name))
            return int(self._answered(self._remote_size, name, url=self.url(name)))

    def list(self, suffix: str = "") -> list[str]:
        """Names of the files directly in this store that end with `suffix`, sorted; none
        where the folder does not exist. Remote listings are retried as reads are."""
        if self.local:
            root = local_path(self.root)
            if not os.path.isdir(root):
                return []
            return sorted(n for n in os.listdir(root) if n.endswith(suffix) and os.path.isfile(os.path.join(root, n)))
        try:
            entries = self._answered(self._remote_list, url=self.url(""))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._wrap("", "list", e) from safe_cause(e)
        return sorted(name for name in map(self._listed_name, entries) if name.endswith(suffix))

    def folders(self) -> list[str]:
        """Names of the folders directly in this store, sorted (remotely: the prefixes a listing
        shows as folders); none where the store's folder does not exist."""
        if self.local:
            root = local_path(self.root)
            if not os.path.isdir(root):
                return []
            return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        return sorted(self._listed_name(e["name"]) for e in self._listed_entries() if e.get("type") == "directory")

    def _listed_name(self, entry: str) -> str:
        """The file name of a remote listing's `entry`: an HTTP listing's links are
        percent-encoded, as `url` encodes the name again (`my%20shard.tar` was asked for
        as `my%2520shard.tar`)."""
        name = posixpath.basename(entry.rstrip("/"))
        return urllib.parse.unquote(name) if self.root.startswith(("http://", "https://")) else name

    def _remote_list(self) -> list[str]:
        return self._listing(detail=False)

    def _listing(self, *, detail: bool) -> list:
        """This store's folder listed now: a listing fsspec kept (where `use_listings_cache`
        could not be turned off, `_LISTINGS_KEPT`) is dropped first."""
        fs, path = self._fs_path("")
        fs.invalidate_cache(path.rstrip("/"))
        return fs.ls(path.rstrip("/"), detail=detail)

    def sizes(self) -> dict[str, int]:
        """The size in bytes of every file directly in this store, by name: one listing
        (remotely, one request per 1,000 files on S3), where `size` asks once a file; none
        where the folder does not exist. Remote listings are retried as reads are."""
        if self.local:
            return _local_sizes(local_path(self.root))
        # A server that lists no size (fsspec's HTTP) is asked for it.
        return {name: int(size) if size is not None else self.size(name)
                for name, size in ((self._listed_name(e["name"]), e.get("size"))
                                   for e in self._listed_entries() if e.get("type") != "directory")}

    def _listed_entries(self) -> list[dict]:
        """The remote listing's entries, with details (name, type, size), retried as reads are;
        none where the folder does not exist."""
        try:
            return self._answered(self._remote_entries, url=self.url(""))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._wrap("", "list", e) from safe_cause(e)

    def _remote_entries(self) -> list[dict]:
        return self._listing(detail=True)

    def _remote_size(self, name: str) -> int:
        if self._direct == "http":  # within the direct reader's deadlines (fsspec's HEAD has none)
            connect_s, read_s = self._timeouts
            return http_ranges.file_size(self.url(name), headers=self.options.get("headers", {}),
                                         connect_s=connect_s, read_s=read_s)
        fs, path = self._fs_path(name)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            if not self.root.startswith(("http://", "https://")):
                raise
            # fsspec's HTTP size() turns every failure (a 503 too) into FileNotFoundError,
            # as info() does: a one-byte read raises again on a 404 and is retried on a 5xx.
            self._count_sent(name)
            raise ConnectionError("the size lookup failed, though the file is there") from None
        if size is None:
            raise StorageError("the server does not report a size", url=self.url(name))
        return int(size)

    # -- writing ---------------------------------------------------------------

    def makedirs(self) -> None:
        if self.local:
            path = local_path(self.root)
            if os.path.exists(path) and not os.path.isdir(path):  # makedirs says only "File exists"
                raise StorageError("a file is there, where the dataset's folder goes", url=self.root)
            with self._errors("", "make the folder"):  # a file in its path, no permission: its URL named
                os.makedirs(path, exist_ok=True)
            if self.durable:  # the folder's own entry, made just now or not
                sync_folder(os.path.dirname(os.path.abspath(path)))

    def put(self, local_file: str, name: str) -> None:
        """Move a finished local file into the store under `name`, atomically.

        Locally this is a rename, so no reader ever sees a half-written file. Remotely
        the file is uploaded whole (object stores publish an object only when its
        upload completes), then the local copy is removed.
        """
        try:
            if self.local:
                target = self.url(name)
                if self.durable:
                    sync_file(local_file)
                os.replace(local_file, target)
                if self.durable:
                    sync_folder(os.path.dirname(target))
                return
            self.retry.call(self._remote_put, local_file, name, url=self.url(name))
            drop_scratch(local_file)
        except OSError as e:
            raise self._wrap(name, "write", e) from safe_cause(e)

    def _remote_put(self, local_file: str, name: str) -> None:
        fs, path = self._fs_path(name)
        fs.put_file(local_file, path)  # whole, so a retry uploads it whole again

    def write(self, name: str, data: bytes) -> None:
        """Write `data` as the file `name`, atomically (see `put`)."""
        try:
            tmp, f = scratch_file(self, name)
        except OSError as e:  # a read-only folder, a name too long: name the file
            raise StorageError(f"could not write: {e.strerror or e}", url=self.url(name)) from safe_cause(e)
        try:
            try:
                with f:
                    f.write(data)
            except OSError as e:  # disk full, quota, I/O error: name the file
                raise StorageError(f"could not write: {e.strerror or e}", url=self.url(name)) from safe_cause(e)
            self.put(tmp, name)
        finally:
            drop_scratch(tmp)

    def remove(self, name: str) -> None:
        """Remove the file `name`, if it is there."""
        if not name:  # the store's root itself: never a file this removes
            raise ValueError("no file named to remove")
        if self.local:
            try:
                os.remove(self.url(name))
            except FileNotFoundError:
                return
            if self.durable:  # a manifest removed before its shards stays removed
                sync_folder(os.path.dirname(self.url(name)))
            return
        # fsspec's exists() reads every failure (a 403, a 503) as "absent": ours retries, and raises.
        if self.exists(name):
            with self._errors(name, "remove"):
                self.retry.call(self._remote_remove, name, url=self.url(name))

    def remove_all(self, names: Iterable[str]) -> None:
        """Remove each of the files `names` that is there. Remotely several at once: a
        removal is two requests (a look, then the delete), and a pack's journal or an old
        dataset of thousands of shards, removed one after another, took minutes on S3.
        The first error is raised, after the removals under way."""
        if self.local:
            for name in names:
                self.remove(name)
            return
        with contextlib.closing(ordered_map(self.remove, names, REMOVE_THREADS, name="shardstream-remove")) as done:
            for future in done:
                future.result()

    def _remote_remove(self, name: str) -> None:
        fs, path = self._fs_path(name)
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile: as asked
            fs.rm_file(path)


def _local_sizes(folder: str) -> dict[str, int]:
    sizes = {}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    if entry.is_file():
                        sizes[entry.name] = entry.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return sizes


class _RangedFile(io.RawIOBase):
    """A remote file read front to back by ranged `Store.read`s (retried, counted).

    A range that comes back short is the end of the file: the HTTP and S3 clients raise,
    and are retried, on a body cut short, and answer a range past the end with nothing.
    """

    def __init__(self, store: Store, name: str):
        self.store, self.name, self.position, self.at_end = store, name, 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.at_end or not len(buffer):
            return 0
        data = self.store.read(self.name, self.position, self.position + len(buffer))
        buffer[: len(data)] = data
        self.position += len(data)
        self.at_end = len(data) < len(buffer)  # no request past the end
        return len(data)


def _read_file_into(path: str, start: int, out: memoryview) -> int:
    """Read bytes [start, start + len(out)) of the local file `path` into `out`; how many were read."""
    done = 0
    if not hasattr(os, "preadv"):  # Windows, and macOS before 11: a file object reads into `out` as well
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            while done < len(out) and (got := f.readinto(out[done:])):
                done += got
        return done
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < len(out):
            got = os.preadv(fd, [out[done:]], start + done)
            if got == 0:
                break
            done += got
    finally:
        os.close(fd)
    return done
