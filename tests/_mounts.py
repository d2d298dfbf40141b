"""A tmpfs mounted for one test: a real file system that fills up, runs out of inodes or
turns read-only on demand. Mounting needs privileges the test machine may not grant: the
test is then skipped, saying so."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: int, options: str = "") -> Iterator[Path]:
    """A tmpfs of `size` bytes at `path` (more mount `options`, comma-separated, such as
    ``nr_inodes=40``); skips the test where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    extra = f",{options}" if options else ""
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{extra}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, options: str) -> None:
    """Mount the tmpfs at `path` again with `options` (``ro``, ``size=...``)."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)
