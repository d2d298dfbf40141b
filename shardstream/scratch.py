"""Files on their way into a store: written whole in a scratch folder, then put in place.

A local store's scratch folder is a hidden folder inside its root, so that the final
rename is atomic (one file system); a remote store's is a folder of this process in the
system's temporary folder. A new scratch file gets the mode the umask gives any new
file. What killed writers left behind is removed: in a store's folder by name, since
other writers may share it; in the temporary folder with the folder of each process
that has ended, found by the next process that uploads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import tempfile
import threading
from typing import TYPE_CHECKING, BinaryIO, Iterable

from .urls import local_path

if TYPE_CHECKING:
    from .storage import Store

__all__ = ["cleanup_scratch", "drop_scratch", "scratch_dir", "scratch_file", "sync_file", "sync_folder"]

SCRATCH = ".shardstream-tmp"
UPLOADS = "shardstream-uploads"  # in the system's temporary folder: a folder per process below

# This process's upload folder is made as a file goes into it and removed once empty: one
# thread's removal between another's making of the folder and of its file failed that upload
# ("File exists", or "No such file" three times over; seen with 8 threads). Both are done
# under this lock. (A local store's scratch folder is shared with other processes: retried.)
_uploads_lock = threading.Lock()
if hasattr(os, "register_at_fork"):  # a child forked while a thread held it starts with its own
    os.register_at_fork(after_in_child=lambda: globals().update(_uploads_lock=threading.Lock()))


def scratch_dir(store: Store) -> str:
    """A local folder for files on their way into `store`.

    Local stores get a hidden folder inside the root, so that the final rename is
    atomic (same file system); remote stores the system's temporary folder itself (a
    folder made per file was left behind, empty, for every file uploaded).
    """
    if store.local:
        path = os.path.join(local_path(store.root), SCRATCH)
        _make_folder(path)
        return path
    return _uploads_dir()


def _make_folder(path: str) -> None:
    # "File exists" from makedirs(exist_ok=True): made by another writer, and removed again by
    # its cleanup before makedirs looked; the file's making then finds it gone, and retries.
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, exist_ok=True)
    if not os.path.isdir(path) and os.path.exists(path):  # else mkstemp's "Not a directory" leaves it unsaid
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is a file, where shardstream's folder of files being "
                                 "written goes: remove it")


def _uploads_dir() -> str:
    """This process's folder for files on their way to remote stores; made on first use,
    when the folders of ended processes (a killed pack's partial shards) are removed."""
    own = os.path.join(tempfile.gettempdir(), UPLOADS, _process_tag(os.getpid()) or str(os.getpid()))
    if not os.path.isdir(own):
        _remove_ended(os.path.dirname(own))
        _make_folder(own)
    return own


def drop_scratch(path: str) -> None:
    """Remove the scratch file `path` if it is there, and its process's upload folder once
    empty (made again by the next upload: a folder left per process would pile up)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    folder = os.path.dirname(path)
    if os.path.basename(os.path.dirname(folder)) == UPLOADS:
        with _uploads_lock, contextlib.suppress(OSError):  # not empty: another thread's upload is on its way
            os.rmdir(folder)


def _process_tag(pid: int) -> str | None:
    """``PID-START``: the process id and its start time (from /proc), which tell a running
    process from an ended one whose id was reused; None for no such process. Where there
    is no /proc (macOS, Windows) the start is 0, and the id alone tells (`_running`)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The start time is field 22; the command name (field 2) may hold spaces, in parentheses.
            start = f.read().rsplit(b")", 1)[1].split()[19].decode()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
        # Taking every process for ended here had each upload remove the folders of the
        # others, running ones included: the parts of a pack lost their shards mid-write.
        return f"{pid}-0" if _running(pid) else None
    except (OSError, IndexError):
        start = "0"  # /proc/<pid>/stat unreadable: the process id alone
    return f"{pid}-{start}"


def _running(pid: int) -> bool:
    """Whether a process `pid` is running, by signal 0; taken as running where that cannot
    be asked (on Windows, os.kill ends the process whatever the signal)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: running
        pass
    return True


def _remove_ended(folder: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(folder):
            pid, _, _ = entry.partition("-")
            if pid.isdigit() and _process_tag(int(pid)) != entry:
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def cleanup_scratch(store: Store, names: Iterable[str] = ()) -> None:
    """Remove what killed writers left in `store`'s local scratch folder, then the folder if
    empty: the files of `names`, whoever wrote them, and any file that a process of this
    host wrote and ended without putting in place (its name says which: `_writer_tag`).

    Other writers (the other parts of a pack, say, on this host or another sharing the
    folder) may be writing into the same folder at this moment: their files stay.
    """
    if not store.local:
        return
    path = os.path.join(local_path(store.root), SCRATCH)
    if not os.path.isdir(path):
        return
    prefixes = tuple(f".{_stand_in(name)}." for name in names)
    for entry in os.listdir(path):
        if entry.endswith(".part") and (prefixes and entry.startswith(prefixes) or _left_by_an_ended_process(entry)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, entry))
    with contextlib.suppress(OSError):
        os.rmdir(path)  # only if empty; another writer may still be using it


# This host's name in scratch file names, where it may hold no dot (names are split at them)
# and no dash (the tag's fields are).
_HOST = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def _writer_tag() -> str:
    """``HOST-PID-START``: which process, on which host, writes a scratch file. A merge killed
    while writing the dataset manifest left a file no later writer named (every part was
    finished): one per killed merge stayed for good, until the tag told its process ended."""
    return f"{_HOST}-{_process_tag(os.getpid()) or os.getpid()}"


def _left_by_an_ended_process(entry: str) -> bool:
    """Whether the scratch file `entry` (``.<name>.<tag>.<random>.part``) was written by a
    process of this host that has ended. Another host's processes cannot be asked about."""
    fields = entry.removesuffix(".part").rsplit(".", 2)
    if len(fields) != 3:
        return False
    host, _, process = fields[1].partition("-")
    pid = process.partition("-")[0]
    return host == _HOST and pid.isdigit() and _process_tag(int(pid)) != process


def _umask_by_setting() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


# Read by setting it once, at import, for systems without /proc (see `_umask`).
_IMPORT_UMASK = _umask_by_setting()


def _umask() -> int:
    """The process umask, read without changing it (Linux's /proc/self/status).

    `os.umask` can only read it by setting it: between that call and the one that
    restores it, a file another thread creates gets mode 0666.
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORT_UMASK


def _stand_in(name: str) -> str:
    """`name` as scratch file names hold it: whole where short, else its first 64 bytes and a
    digest of the rest. A scratch name is about 40 bytes longer than the file's (the writer's
    tag, mkstemp's letters), and a legal name of 230 bytes (a long `prefix`, a long tar
    name to index) made one past the file system's 255: "File name too long"."""
    data = name.encode("utf-8", "surrogateescape")
    if len(data) <= 100:
        return name
    return data[:64].decode("utf-8", "ignore") + "~" + hashlib.sha256(data).hexdigest()[:16]


def scratch_file(store: Store, name: str) -> tuple[str, BinaryIO]:
    """A new temporary file for `name` on its way into `store`, open for writing.

    Its mode follows the umask like any new file (mkstemp alone would give 0600).
    """
    for attempt in range(3):
        try:
            with contextlib.nullcontext() if store.local else _uploads_lock:
                fd, path = tempfile.mkstemp(dir=scratch_dir(store), prefix=f".{_stand_in(name)}.{_writer_tag()}.",
                                            suffix=".part")
            break
        except FileNotFoundError:  # another writer's `cleanup_scratch` removed the folder, then empty
            if attempt == 2:
                raise
    if hasattr(os, "fchmod"):  # not on Windows before Python 3.13, whose files have no such modes
        os.fchmod(fd, 0o666 & ~_umask())
    return path, os.fdopen(fd, "wb")


def sync_file(path: str) -> None:
    """Wait until the bytes of the file `path` are on the disk (fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(path: str) -> None:
    """Wait until the entries of the folder `path` (a rename into it) are on the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        # Some file systems (network ones, some FUSE) cannot sync a folder: their entries
        # are as durable as they make them, which is all anyone gets there.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
