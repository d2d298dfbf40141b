"""Helpers for test_remote.py: a request-counting HTTP test server, and ranks run as processes.

`CountingHTTPServer` is `shardstream.testing.HTTPTestServer` (same handler: Range
support, latency, injected 503s and dropped connections) with three additions for tests:
it records every response it sends by (method, path, status), the most GETs it served
at once of each kind of file (`most_at_once`), and `close()` also shuts down the
keep-alive connections still open, so no handler thread outlives the server.

`run_ranks` runs simulated ranks at the same time, each a process streaming a dataset
through a torch DataLoader with real worker processes, and collects what they received.
`digests_in_subprocess` reads a dataset in a new Python process with a given environment.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from shardstream.testing import HTTPTestServer

HERE = os.path.abspath(__file__)


class CountingHTTPServer(HTTPTestServer):
    """An `HTTPTestServer` that counts the responses it sends per (method, path, status)."""

    def __init__(self, root: str, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.responses: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._handlers: set[threading.Thread] = set()
        self._gets: collections.Counter = collections.Counter()  # by file suffix: being served now, latency included
        self._most_gets: collections.Counter = collections.Counter()  # by file suffix: the most at once so far
        base = self.server.RequestHandlerClass  # the configured subclass of testing._Handler
        outer = self

        class Handler(base):  # type: ignore[misc,valid-type]
            def setup(self) -> None:
                super().setup()
                with outer._lock:
                    outer._connections.add(self.connection)
                    outer._handlers.add(threading.current_thread())

            def finish(self) -> None:
                try:
                    super().finish()
                finally:
                    with outer._lock:
                        outer._connections.discard(self.connection)

            def do_GET(self) -> None:
                suffix = "." + self.path.split("?", 1)[0].rsplit("/", 1)[-1].split(".", 1)[-1]
                with outer._lock:
                    outer._gets[suffix] += 1
                    outer._most_gets[suffix] = max(outer._most_gets[suffix], outer._gets[suffix])
                try:
                    super().do_GET()
                finally:
                    with outer._lock:
                        outer._gets[suffix] -= 1

            def send_response(self, code: int, message: str | None = None) -> None:
                with outer._lock:
                    outer.responses[(self.command, self.path.split("?", 1)[0], code)] += 1
                super().send_response(code, message)

        # No request has been served yet: swapping the class is safe.
        self.server.RequestHandlerClass = Handler

    def most_at_once(self, suffix: str) -> int:
        """The most GETs of files named ``*<suffix>`` (``.tar.zst``, ``.tar.zst.idx``) served at once."""
        with self._lock:
            return self._most_gets[suffix]

    def gets(self, name: str) -> int:
        """Successful GETs (200 or 206) of the file `name` at the root."""
        with self._lock:
            return sum(n for (method, path, code), n in self.responses.items()
                       if method == "GET" and path == "/" + name and code in (200, 206))

    def get_counts(self) -> dict[str, int]:
        """Successful GETs by file name."""
        with self._lock:
            out: dict[str, int] = collections.Counter()
            for (method, path, code), n in self.responses.items():
                if method == "GET" and code in (200, 206):
                    out[path.lstrip("/")] += n
            return dict(out)

    def close(self) -> None:
        self.server.shutdown()  # stop accepting first
        with self._lock:
            connections, handlers = list(self._connections), list(self._handlers)
        for conn in connections:  # idle keep-alive connections: the handler threads see EOF
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.server.server_close()
        self.thread.join(timeout=5)
        for thread in handlers:
            thread.join(timeout=5)


# -- ranks as processes --------------------------------------------------------------------------


def read_items(url: str, *, rank: int | None = None, world_size: int | None = None, num_workers: int = 2,
               prefetch: int = 2, cache_dir: str | None = None, cache_limit: int | str = "50GB",
               storage_options: dict | None = None, with_bytes: bool = False) -> list[list[str]]:
    """[key] per sample (or [key, sha256 of its jpg bytes]), through a DataLoader with real workers."""
    from torch.utils.data import DataLoader

    import shardstream

    kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        kwargs.update(cache_dir=cache_dir, cache_limit=cache_limit)
    ds = shardstream.StreamingDataset(
        url, rank=rank, world_size=world_size, decode=None,
        fields=("__key__", "jpg") if with_bytes else ("__key__",),
        prefetch=prefetch, storage_options=storage_options, **kwargs,
    )
    out = []
    for item in DataLoader(ds, batch_size=None, num_workers=num_workers):
        out.append([item[0], hashlib.sha256(item[1]).hexdigest()] if with_bytes else [item[0]])
    return out


def _rank_main(out: str, url: str, kwargs: dict[str, Any]) -> None:
    try:
        items = read_items(url, **kwargs)
    except BaseException:
        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise
    with open(out, "w") as f:
        json.dump(items, f)


def run_ranks(url: str, world_size: int, *, timeout: float = 120, **kwargs: Any) -> list[list[list[str]]]:
    """Run `world_size` ranks at once, each a process iterating a DataLoader with real workers.

    The rank processes are forked (as DataLoader workers are), so they start in
    milliseconds instead of importing torch again; each is a fresh process as far as the
    cache is concerned (this process never opens the caches these tests use).
    """
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        outs = [os.path.join(tmp, f"rank{rank}.json") for rank in range(world_size)]
        procs = [context.Process(target=_rank_main, name=f"rank{rank}",
                                 args=(outs[rank], url, dict(kwargs, rank=rank, world_size=world_size)))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        failures = []
        for rank, proc in enumerate(procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
                failures.append(f"rank {rank} did not finish in {timeout} s")
            elif proc.exitcode != 0:
                error = outs[rank] + ".error"
                detail = open(error).read() if os.path.exists(error) else ""
                failures.append(f"rank {rank} exited {proc.exitcode}:\n{detail}")
        if failures:
            raise AssertionError("\n\n".join(failures))
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
        return results


# -- reading without torch, in a subprocess with its own environment --------------------------------------


def sample_digests(url: str, storage_options: dict | None = None) -> dict[str, str]:
    """{key: sha256 of its jpg} of every sample of a packed dataset, read shard by shard."""
    import shardstream

    source = shardstream.open_dataset(url, storage_options=storage_options)
    return {s["__key__"]: hashlib.sha256(s["jpg"]).hexdigest() for ref in source.shards for s in ref.reader()}


def digests_in_subprocess(url: str, env: dict[str, str]) -> dict[str, str]:
    """`sample_digests(url)` run by a new Python process with environment `env`."""
    done = subprocess.run([sys.executable, HERE, "digests", url], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


if __name__ == "__main__":
    if sys.argv[1:2] == ["digests"]:
        print(json.dumps(sample_digests(sys.argv[2])))
