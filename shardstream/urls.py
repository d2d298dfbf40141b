"""Locations: what a URL or path names, before any storage is touched.

Local paths and ``file://`` URLs are read by the library itself; every other protocol
goes through fsspec (storage.py). An HTTP(S) URL's query string (a token, a SAS
signature) belongs to its location and is put back on every file's URL there.
"""

from __future__ import annotations

import os
import urllib.parse

from .errors import USERINFO, ShardstreamError

__all__ = ["check_chain", "expand_home", "is_local", "local_path", "preload_driver", "split_query", "split_url"]


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def preload_driver(url: str) -> None:
    """Import the fsspec implementation for `url`'s protocol now (no network).

    Called in the process that builds a dataset, before DataLoader workers fork from it:
    they inherit the module instead of each importing it on its first request (about
    0.2-0.3 s for aiohttp, behind HTTP, or for s3fs and botocore), which delays every
    worker's first batch.
    """
    if not is_local(url):
        import fsspec

        try:
            fsspec.get_filesystem_class(url.split("://", 1)[0])
        except (ImportError, ValueError):
            pass  # an unknown or uninstalled protocol: the first real request says so, naming the URL


def check_chain(url: str) -> None:
    """Refuse a chained fsspec URL whose files live inside another file (``zip://ds::file:///x.zip``,
    ``tar://...``): its files are named where the path is, in the archive's segment, while the
    library joins names onto the URL's end (which named a file inside ``x.zip/``: "not a
    directory", and a ``tar://`` URL was taken for one shard). fsspec's cache wrappers
    (``simplecache::``, ``filecache::``, ``blockcache::``) keep their path at the end, and
    are read as any other URL."""
    if "::" not in url or is_local(url) or url.startswith(("http://", "https://", "s3://")):
        return  # read by the library's own readers, never parsed by fsspec: "::" is in a name (run::1, [::1])
    import fsspec
    from fsspec.implementations.cached import CachingFileSystem

    for segment in url.split("::")[:-1]:
        protocol = segment.split("://", 1)[0]
        try:
            wrapper = issubclass(fsspec.get_filesystem_class(protocol), CachingFileSystem)
        except (ImportError, ValueError):
            wrapper = False
        if not wrapper or segment.split("://", 1)[1:] not in ([], [""]):
            raise ShardstreamError(f"a chained URL is read through fsspec's cache wrappers only (simplecache::, "
                                   f"filecache::, blockcache::), each without a path of its own: {protocol}:// is "
                                   f"not one (a dataset inside an archive is read once unpacked)", url=url)


def expand_home(url: str) -> str:
    """A local path starting with ``~`` or ``~user`` with the home folder put in, as a shell
    would (a path from Python code or a config file reaches us unexpanded); others as they are."""
    return os.path.expanduser(url) if url.startswith("~") else url


def local_path(url: str) -> str:
    """The file system path of a local `url`: a path as it is; a ``file://`` URL (also
    ``file://localhost/``) percent-decoded, as `Path.as_uri()` writes one."""
    if not url.startswith("file://"):
        return url
    path = url[len("file://"):]
    if path.startswith("localhost/"):
        path = path[len("localhost"):]
    return urllib.parse.unquote(path)


def split_url(url: str) -> tuple[str, str]:
    """Split a file URL into (parent location, file name); an HTTP(S) query string stays
    with the parent (`Store.url` puts it back on every file's URL)."""
    url, query = split_query(url)
    url = url.rstrip("/")
    if "://" in url:
        scheme, rest = url.split("://", 1)
        parent, _, name = rest.rpartition("/")
        # The file's name decoded, as `Store.url` encodes it again (HTTP) or `local_path`
        # decodes the folder (file://, as `Path.as_uri()` writes one).
        if scheme in ("http", "https", "file"):
            name = urllib.parse.unquote(name)
        return f"{scheme}://{parent}{query}", name
    parent, name = os.path.split(url)
    return parent or ".", name


def without_userinfo(url: str) -> str:
    """An HTTP(S) `url` without its user information (``user:password@``); others as they are."""
    return USERINFO.sub(r"\1", url, count=1)


def split_query(url: str) -> tuple[str, str]:
    """(URL without its query, ``?query`` or "") for HTTP(S); other URLs have no query."""
    if url.startswith(("http://", "https://")) and "?" in url:
        base, query = url.split("?", 1)
        return base, "?" + query
    return url, ""
