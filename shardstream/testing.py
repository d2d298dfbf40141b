"""Real servers for tests and benchmarks: an HTTP server with latency and failures, and moto's S3.

`HTTPTestServer` serves a folder over HTTP on 127.0.0.1 with Range support, adds a
fixed latency to every request and fails a chosen fraction of them (503 or a dropped
connection), deterministically from a seed. `MotoS3Server` runs moto's S3-compatible
server in a subprocess. Both bind to loopback only and stop on `close()`.
"""

from __future__ import annotations

import http.server
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

__all__ = ["HTTPTestServer", "MotoS3Server"]


def _announced_port(process: subprocess.Popen, timeout_s: float) -> int:
    """The port a server started on port 0 says it bound ("Running on http://127.0.0.1:PORT",
    werkzeug's line on stderr). Its stderr is then read to its end in a thread, which a
    server that logs every request would otherwise fill and block on."""
    found: list[int] = []
    announced = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            match = re.search(r"Running on http://127\.0\.0\.1:(\d+)", line)
            if match and not found:
                found.append(int(match.group(1)))
                announced.set()
        announced.set()  # it exited

    threading.Thread(target=read, name="moto-stderr", daemon=True).start()
    if not announced.wait(timeout_s):
        raise RuntimeError(f"moto server did not start in {timeout_s:.0f} s")
    if not found:
        raise RuntimeError(f"moto server exited at start (exit status {process.wait()})")
    return found[0]


@dataclass
class Faults:
    latency_s: float = 0.0
    fail_fraction: float = 0.0  # of requests, answered 503 or by dropping the connection
    seed: int = 0
    requests: int = 0
    failures: int = 0
    rng: random.Random = field(default_factory=random.Random)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def decide(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.rng.random() >= self.fail_fraction:
                return None
            self.failures += 1
            return "503" if self.rng.random() < 0.5 else "drop"


class _Handler(http.server.BaseHTTPRequestHandler):
    root = ""
    faults = Faults()
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else delayed ACKs add ~40 ms to small responses

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _path(self) -> str | None:
        rel = urllib.request.url2pathname(self.path.split("?", 1)[0]).lstrip("/")
        path = os.path.realpath(os.path.join(self.root, rel))
        return path if path.startswith(os.path.realpath(self.root)) and os.path.isfile(path) else None

    def _fault(self) -> bool:
        if self.faults.latency_s:
            time.sleep(self.faults.latency_s)
        fault = self.faults.decide()
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return True
        return False

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        if self._fault():
            return
        path = self._path()
        if path is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        start, end = 0, size
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if match and (match.group(1) or match.group(2)):
            if match.group(1):
                start = int(match.group(1))
                end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            else:
                start = max(0, size - int(match.group(2)))
            if start >= size:  # a range past the end: 416, as real servers answer (RFC 9110)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if body:
            # sendfile: the kernel copies the file to the socket. The server shares the
            # machine with the loader it serves in the benchmarks, and real storage
            # spends none of the client's CPU on serving.
            with open(path, "rb") as f:
                self.wfile.flush()
                self.connection.sendfile(f, start, end - start)


class HTTPTestServer:
    """Serve `root` at ``http://127.0.0.1:<port>/`` with injected latency and failures."""

    def __init__(self, root: str, *, latency_s: float = 0.0, fail_fraction: float = 0.0, seed: int = 0):
        self.faults = Faults(latency_s, fail_fraction, seed, rng=random.Random(seed))
        handler = type("Handler", (_Handler,), {"root": root, "faults": self.faults})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="http-test-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        try:  # out of LISTEN for every process: forked DataLoader workers hold the socket too
            self.server.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> "HTTPTestServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MotoS3Server:
    """moto's S3-compatible server on 127.0.0.1, in a subprocess (``moto[server]``).

    It binds a port the kernel picks and says which: a port found free beforehand could
    be taken by another test's server before moto bound it, and the tests would then talk
    to that one."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            self.port = _announced_port(self.process, timeout_s=30.0)
        except BaseException:
            self.close()
            raise
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.endpoint,
                                                                          "region_name": "us-east-1"}}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "MotoS3Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
