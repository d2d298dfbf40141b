"""macOS and Windows, emulated on Linux: Python processes without what those platforms lack.

`run_as(platform, tmp, command, *args)` runs one of this module's commands in a new Python
process whose `sitecustomize` takes away, before anything else is imported, what that
platform does not have. The emulation is in the environment, so the processes it starts
(DataLoader workers, pack workers) are emulated too. A command prints its result as JSON.

What is emulated: macOS has no /proc, no `os.sched_getaffinity`, no `fcntl.F_SETPIPE_SZ`,
no `os.posix_fadvise`, no epoll, and starts processes by spawn by default. Windows has no
`fcntl`, no `resource`, no fork (spawn only), no `os.register_at_fork`, no `os.preadv` or
`os.pread`, no `os.fchmod` before Python 3.13, and no `os.O_DIRECTORY`. What is not: path
separators, `os.name`, files that cannot be deleted or replaced while open, and the
platforms' own builds of torch and numpy (imported first on "windows", so that torch's Linux
build does not trip over the missing parts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

_MACOS = '''
import builtins, io, multiprocessing, os, select, fcntl
for name in ("sched_getaffinity", "sched_setaffinity", "posix_fadvise", "O_DIRECT", "memfd_create", "eventfd",
             "pipe2", "splice", "copy_file_range", "O_NOATIME", "O_TMPFILE"):
    if hasattr(os, name):
        delattr(os, name)
for name in ("F_SETPIPE_SZ", "F_GETPIPE_SZ"):
    if hasattr(fcntl, name):
        delattr(fcntl, name)
if hasattr(select, "epoll"):
    del select.epoll

def _in_proc(path):
    try:
        path = os.fsdecode(path)
    except TypeError:  # a file descriptor
        return False
    return path == "/proc" or path.startswith("/proc/")

def _without_proc(real):
    def call(path=".", *args, **kwargs):
        if _in_proc(path):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, *args, **kwargs)
    return call

builtins.open = io.open = _without_proc(builtins.open)
for name in ("listdir", "scandir", "stat", "lstat"):
    setattr(os, name, _without_proc(getattr(os, name)))
multiprocessing.set_start_method("spawn")
'''

_WINDOWS = '''
import multiprocessing, os, sys
import torch, torch.utils.data
for name in ("fcntl", "resource", "termios", "pwd", "grp"):
    sys.modules[name] = None
for name in ("fork", "forkpty", "register_at_fork", "sched_getaffinity", "preadv", "pread", "pwrite", "fchmod",
             "fchown", "sysconf", "O_DIRECTORY", "posix_fadvise", "getuid", "geteuid", "killpg", "getpgid"):
    if hasattr(os, name):
        delattr(os, name)
multiprocessing.set_start_method("spawn")
multiprocessing.get_all_start_methods = lambda: ["spawn"]
'''

EMULATIONS = {"macos": _MACOS, "windows": _WINDOWS}


def run_as(platform: str, tmp: Path, command: str, *args: str) -> Any:
    """`command(*args)` of this module run on the emulated `platform`; what it printed, from JSON.
    `tmp` holds the emulation and is the process's temporary folder (TMPDIR)."""
    site = tmp / f"emulate-{platform}"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(EMULATIONS[platform])
    env = dict(os.environ, TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE), command, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# -- commands ----------------------------------------------------------------------------------------------


def each(calls: str) -> list[Any]:
    """Several of this module's commands, `calls` a JSON list of [command, *args], run one after another in
    this one process: their results, in order. One interpreter start (torch's import: seconds of CPU) for
    reads that need no process of their own; the worker processes each read starts are its own all the same."""
    return [globals()[name](*args) for name, *args in json.loads(calls)]


def keys_read(url: str, workers: str, *cache_dir: str) -> list[str]:
    """The keys of a dataset as a DataLoader with `workers` workers (started by the platform's
    default method) delivers them, shuffled, the images decoded."""
    import shardstream
    from torch.utils.data import DataLoader

    dataset = shardstream.StreamingDataset(url, shuffle=True, seed=5, fields=("__key__", "jpg"),
                                           cache_dir=cache_dir[0] if cache_dir else None)
    return [key for key, image in DataLoader(dataset, batch_size=None, num_workers=int(workers))]


def packed_keys(src: str, dst: str) -> list[str]:
    """Pack `src` into `dst` with worker processes (small images); the keys packed, by the manifest."""
    import shardstream

    shardstream.pack(src, dst, shard_size="20KB", workers=2, progress=False)
    source = shardstream.open_dataset(dst)
    return [sample["__key__"] for ref in source.shards for sample in ref.reader()]


def cache_refusal(url: str, cache_dir: str) -> str:
    """The error a dataset with `cache_dir` raises, as ``type: message``; "" for none."""
    import shardstream

    try:
        shardstream.StreamingDataset(url, cache_dir=cache_dir)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def uploads_kept(running_pid: str, ended_pid: str) -> dict[str, bool]:
    """Folders for files on their way to remote storage, left as a running process and an ended
    one would: which of them are still there once this process starts an upload of its own."""
    import tempfile

    from shardstream.scratch import UPLOADS, scratch_file
    from shardstream.storage import Store

    uploads = Path(tempfile.gettempdir(), UPLOADS)
    folders = {"running": uploads / f"{running_pid}-0", "ended": uploads / f"{ended_pid}-0"}
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / ".shard-000000.tar.x.part").write_bytes(b"in flight")
    path, f = scratch_file(Store("s3://bucket/ds"), "shard-000001.tar")
    f.close()
    return {name: folder.exists() for name, folder in folders.items()}


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]](*sys.argv[2:])))
