"""Storage: where bytes live. Local paths and any fsspec URL behind one small interface.

A `Store` is a root location plus fsspec options. It is a frozen, picklable value that
opens its filesystem lazily, so it can be built in the main process and cross into
DataLoader workers. Everything above this layer (shard reading, the writer, the packer)
names files relative to a store and never touches fsspec directly.

Local paths bypass fsspec on the read path: a plain `open` + `seek` + `read` costs a
few microseconds, fsspec's LocalFileSystem several times that, and the raw reader
makes one such call per zstd frame.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, Mapping

import fsspec

from .errors import StorageError

__all__ = ["Store", "is_local", "split_url"]


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def split_url(url: str) -> tuple[str, str]:
    """Split a file URL into (parent location, file name)."""
    url = url.rstrip("/")
    if "://" in url:
        scheme, rest = url.split("://", 1)
        parent, _, name = rest.rpartition("/")
        return f"{scheme}://{parent}", name
    parent, name = os.path.split(url)
    return parent or ".", name


@dataclass(frozen=True)
class Store:
    """A directory or URL prefix holding a dataset's files.

    `options` are passed to fsspec (credentials, ``endpoint_url``, ...). For S3 the
    standard AWS environment variables (``AWS_ENDPOINT_URL``, keys, region) are read by
    s3fs/botocore themselves.
    """

    root: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        return is_local(self.root)

    def url(self, name: str) -> str:
        """The full URL (or path) of the file `name` in this store."""
        if self.local:
            return os.path.join(_local_path(self.root), name)
        return posixpath.join(self.root.rstrip("/"), name)

    def _fs_path(self, name: str) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, path = fsspec.core.url_to_fs(self.url(name), **dict(self.options))
        return fs, path

    def _wrap(self, name: str, action: str, error: BaseException) -> StorageError:
        return StorageError(f"could not {action}: {type(error).__name__}: {error}", url=self.url(name))

    # -- reading ---------------------------------------------------------------

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read bytes [start, end) of `name` (the whole file when both are None)."""
        try:
            if self.local:
                with open(self.url(name), "rb") as f:
                    if start:
                        f.seek(start)
                    return f.read() if end is None else f.read(end - (start or 0))
            fs, path = self._fs_path(name)
            if start is None and end is None:
                return fs.cat_file(path)
            return fs.cat_file(path, start=start, end=end)
        except FileNotFoundError as e:
            raise StorageError("file not found", url=self.url(name)) from e
        except OSError as e:
            raise self._wrap(name, "read", e) from e

    def open(self, name: str) -> BinaryIO:
        """A binary file object for sequential reading."""
        try:
            if self.local:
                return open(self.url(name), "rb")
            fs, path = self._fs_path(name)
            return fs.open(path, "rb")
        except FileNotFoundError as e:
            raise StorageError("file not found", url=self.url(name)) from e
        except OSError as e:
            raise self._wrap(name, "open", e) from e

    def exists(self, name: str) -> bool:
        if self.local:
            return os.path.exists(self.url(name))
        fs, path = self._fs_path(name)
        return bool(fs.exists(path))

    def size(self, name: str) -> int:
        try:
            if self.local:
                return os.path.getsize(self.url(name))
            fs, path = self._fs_path(name)
            return int(fs.size(path))
        except FileNotFoundError as e:
            raise StorageError("file not found", url=self.url(name)) from e

    def list(self, suffix: str = "") -> list[str]:
        """Names of the files directly in this store that end with `suffix`, sorted."""
        if self.local:
            root = _local_path(self.root)
            if not os.path.isdir(root):
                return []
            return sorted(n for n in os.listdir(root) if n.endswith(suffix))
        fs, path = self._fs_path("")
        try:
            entries = fs.ls(path.rstrip("/"), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e) for e in entries if e.endswith(suffix))

    # -- writing ---------------------------------------------------------------

    def makedirs(self) -> None:
        if self.local:
            os.makedirs(_local_path(self.root), exist_ok=True)

    def scratch_dir(self) -> str:
        """A local directory for files on their way into this store.

        Local stores get a hidden folder inside the root, so that the final rename is
        atomic (same file system); remote stores get a system temporary folder.
        """
        if self.local:
            path = os.path.join(_local_path(self.root), ".shardstream-tmp")
            os.makedirs(path, exist_ok=True)
            return path
        return tempfile.mkdtemp(prefix="shardstream-")

    def put(self, local_file: str, name: str) -> None:
        """Move a finished local file into the store under `name`, atomically.

        Locally this is a rename, so no reader ever sees a half-written file. Remotely
        the file is uploaded whole (object stores publish an object only when its
        upload completes), then the local copy is removed.
        """
        try:
            if self.local:
                os.replace(local_file, self.url(name))
                return
            fs, path = self._fs_path(name)
            fs.put_file(local_file, path)
            os.remove(local_file)
        except OSError as e:
            raise self._wrap(name, "write", e) from e

    def write(self, name: str, data: bytes) -> None:
        """Write `data` as the file `name`, atomically (see `put`)."""
        tmp, f = scratch_file(self, name)
        try:
            with f:
                f.write(data)
            self.put(tmp, name)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def remove(self, name: str) -> None:
        if self.local:
            try:
                os.remove(self.url(name))
            except FileNotFoundError:
                pass
            return
        fs, path = self._fs_path(name)
        if fs.exists(path):
            fs.rm_file(path)

    def cleanup_scratch(self) -> None:
        """Remove the local scratch folder if it is empty (a crashed pack may leave parts)."""
        if self.local:
            path = os.path.join(_local_path(self.root), ".shardstream-tmp")
            if os.path.isdir(path) and not os.listdir(path):
                shutil.rmtree(path, ignore_errors=True)


def scratch_file(store: Store, name: str) -> tuple[str, BinaryIO]:
    """A new temporary file for `name` on its way into `store`, open for writing.

    Its mode follows the umask like any new file (mkstemp alone would give 0600).
    """
    fd, path = tempfile.mkstemp(dir=store.scratch_dir(), prefix=f".{name}.", suffix=".part")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return path, os.fdopen(fd, "wb")


def iter_chunks(f: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    """Read a file object in chunks of `size` bytes until EOF."""
    while chunk := f.read(size):
        yield chunk
