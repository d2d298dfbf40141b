"""Building frames in parallel: `build_job` over a pack's jobs in threads or processes, results in plan order.

The workers are threads when the images are large (a mean of `THREADS_FROM_BYTES`
or more): reading, zstd, SHA-256 and writing release the GIL, and no frame then
crosses a pipe. They are processes when the images are small, where the per-image
Python work (about 50 µs) would hold the GIL for most of the time (BENCHMARKS.md).
Either way a job's result, or its exception, comes back at its place in the plan, so
the caller appends frames in order and the output does not depend on the workers.
In memory, the frames ahead are bounded in number and in bytes: at most 4 x workers
frames handed out beyond the one due (built or being built: a worker building one holds
about 3 times its bytes, the files, the tar, the compressed frame), and no more than
`bytes_ahead(workers)`, max(256 MB, 8 MB x workers), by their planned sizes (a shrunk
image's, which is what a frame holds), but always the frame due, however large. A
frame is about 1 MB, or one image where images are larger: with images of 20 MB, 2
workers hold up to 8 frames (about 160 MB), and 64 workers 25 (512 MB, about 1.5 GB
while built) where the count alone let 256 (about 15 GB) be held. Frames of images
under 1 MB are bounded by their number alone. Beside this, the shard writer's queue
(shardfile.py: 16 MB, or one frame).

Processes run in `_FramePool`, not `multiprocessing.Pool`, and a frame's data crosses
the pipe raw, read straight into its final buffer: the transport costs what it must
(see `_FramePool`, `_send_data`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import struct
import sys
import threading
import warnings
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator

from PIL import Image

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

from .errors import ShardstreamError
from .framebuild import FrameResult, build_job
from .sourcefile import SourceFile
from .shardfile import FRAME_SIZE, Frame
from .threads import Ahead, ordered_map

log = logging.getLogger("shardstream")

__all__ = ["THREADS_FROM_BYTES", "threads_pay", "pool_context", "bytes_ahead", "thread_results", "process_results"]


def pool_context() -> multiprocessing.context.BaseContext | None:
    """How to start worker processes here; None where they cannot be started safely (use threads).

    fork starts in milliseconds, but forking a process that runs threads can deadlock the
    child: forkserver then (and spawn on platforms without either). Those run the main
    script again in every child, so a script that calls in at its top level, outside
    ``if __name__ == "__main__":``, would start its work over in each: a pack to `s3://`
    (fsspec runs a thread) from a plain script died so, where a local one worked. Threads
    then (`_reruns_main`), said once.
    """
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    where = _reruns_main()
    if where is None:
        return context
    if where not in _said_reruns:
        _said_reruns.add(where)
        log.warning("%s calls shardstream outside `if __name__ == \"__main__\":`, and worker processes, started "
                    "by %s here (this process runs threads), would run it again: using threads instead (slower "
                    "for small images; put the call under that `if` for processes)", where, context.get_start_method())
    return None


_said_reruns: set[str] = set()


def _reruns_main() -> str | None:
    """Where (file:line) the main script, run again in a forkserver or spawn child, would call
    in again: its top-level code calling us, outside ``if __name__ == "__main__":``. None where
    it would not, or where that cannot be told (no script, its source not readable)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return None  # an interactive session or a notebook: children run nothing of it
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return None  # `python -m package`: children leave a package's __main__ alone
    frame = sys._getframe(1)
    # The script's own top level: code it exec()s has such frames too, with another file's lines.
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"
                                     and frame.f_code.co_filename == path):
        frame = frame.f_back
    if frame is None:
        return None  # not called from the script's top level (a thread, a callback)
    line = frame.f_lineno
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _tests_main(node.test) and node.body[0].lineno <= line <= \
                (node.body[-1].end_lineno or line):
            return None
    return f"{path}:{line}"


def _tests_main(test: ast.expr) -> bool:
    """Whether `test` compares `__name__` with "__main__" (the guard, as written anyhow)."""
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    return "__name__" in names and any(isinstance(n, ast.Constant) and n.value == "__main__" for n in ast.walk(test))


# Threads pay from this mean image size up: measured on 4,000 JPEGs each (2 workers),
# threads took 0.83-0.89 s against 1.04-1.33 s for processes at 114 KB, broke even at
# 29 KB, and took twice as long at 2 KB (0.28-0.34 s against 0.15-0.16 s).
THREADS_FROM_BYTES = 64 << 10


def threads_pay(entries: list[SourceFile]) -> bool:
    """Whether threads beat processes as workers for these files: large images (see the module doc)."""
    return bool(entries) and sum(entry.size for entry in entries) >= THREADS_FROM_BYTES * len(entries)


FRAMES_AHEAD = 4  # per worker, handed out beyond the frame due
# The bytes ahead, at least: under 1 GB while built (3 times, at most), which a machine
# that packs can spare, and what 2 workers held before by frames alone with images of
# 32 MB: a small machine packs large images as before.
MIN_BYTES_AHEAD = 256 << 20


def bytes_ahead(workers: int) -> int:
    """How many bytes (`PlannedFrame.size`) the frames handed out beyond the one due may plan, together."""
    # 2 x FRAME_SIZE a frame ahead: a frame is cut once it reaches FRAME_SIZE, so one of
    # images under FRAME_SIZE plans less than twice that. Their frames (photos, ImageNet)
    # are then bounded by number first, as before, whatever `workers` is.
    return max(MIN_BYTES_AHEAD, FRAMES_AHEAD * workers * 2 * FRAME_SIZE)


def thread_results(jobs: list[Any], workers: int, job_bytes: list[int], budget: int | None = None
                   ) -> Iterator[FrameResult]:
    """`build_job` over `jobs` in `workers` threads, results in plan order; a job's
    exception is raised at its place in that order. `job_bytes`: each job's planned size
    (`PlannedFrame.size`), of which the jobs ahead plan `budget` at most (default `bytes_ahead`)."""
    budget = budget or bytes_ahead(workers)
    with contextlib.closing(ordered_map(lambda i: build_job(jobs[i]), range(len(jobs)), workers,
                                        ahead=FRAMES_AHEAD * workers, weigh=job_bytes.__getitem__,
                                        weight_ahead=budget, name="shardstream-pack")) as futures:
        for future in futures:
            yield future.result()


def process_results(jobs: list[Any], workers: int, context: multiprocessing.context.BaseContext,
                    job_bytes: list[int], budget: int | None = None) -> Iterator[FrameResult]:
    """As `thread_results`, in `workers` processes started by `context`."""
    pool = _FramePool(jobs, workers, context, job_bytes, budget or bytes_ahead(workers))
    try:
        yield from pool
        pool.close(wait=True)
    finally:
        pool.close(wait=False)


class _FramePool:
    """Worker processes that build frames; their results in plan order.

    Like `Pool.imap(build_job, jobs, chunksize=1)`: jobs go to whichever worker is free
    (at most `DEPTH` queued per worker), results come back in plan order, and a worker's
    exception is re-raised in the parent at its job's place in that order. Results that
    arrive early wait in the parent, and the jobs handed out and not yet passed on are
    bounded in number and in planned bytes (`Ahead`: the job due always goes), which
    bounds the memory that a slow worker can make the others hold up.

    Not `multiprocessing.Pool`: its worker-handler thread wakes up whenever a result
    waits in the result pipe, which with results of ~1 MB is nearly always, and then
    burns about as much CPU as a worker (tens of thousands of wake-ups per 4,000 images;
    BENCHMARKS.md). Here the parent sleeps in `connection.wait` until a result is there.
    """

    DEPTH = 2  # jobs sent to a worker and not yet answered

    def __init__(self, jobs: list[Any], workers: int, context: multiprocessing.context.BaseContext,
                 job_bytes: list[int], budget: int):
        self.jobs = jobs
        self.job_bytes = job_bytes
        self.budget = budget
        self.procs: list[Any] = []
        self.tasks: list[Any] = []  # parent -> worker: (job number, job)
        self.results: list[Any] = []  # worker -> parent
        forked = context.get_start_method() == "fork"
        pixels = Image.MAX_IMAGE_PIXELS
        try:
            for w in range(workers):
                task_recv, task_send = context.Pipe(duplex=False)
                result_recv, result_send = context.Pipe(duplex=False)
                _grow_pipe(result_send.fileno())
                # A forked worker holds copies of the parent's ends of every pipe made so far (its
                # own, and the earlier workers'): it closes them, or a parent killed outright
                # (SIGKILL, the OOM killer) would leave the workers waiting on each other forever.
                parents = tuple(c.fileno() for c in (*self.tasks, *self.results, task_send, result_recv)) \
                    if forked else ()
                proc = context.Process(target=_frame_worker, args=(task_recv, result_send, parents, pixels),
                                       daemon=True, name=f"shardstream-pack-{w}")
                proc.start()
                task_recv.close()
                result_send.close()
                self.procs.append(proc)
                self.tasks.append(task_send)
                self.results.append(result_recv)
        except BaseException:
            self.close(wait=False)
            raise

    def __iter__(self) -> Iterator[FrameResult]:
        count, workers = len(self.jobs), len(self.procs)
        ahead = Ahead(FRAMES_AHEAD * workers, self.budget)  # from next_due to next_job
        outstanding = [0] * workers
        early: dict[int, Any] = {}  # job number -> FrameResult, or the exception to raise there
        next_job = next_due = 0
        failed_at = count  # no job at or after a failed one is sent

        sent: list[list[int]] = [[] for _ in range(workers)]  # each worker's jobs not yet answered
        dead: set[int] = set()  # workers a send found gone: their end of file says the rest

        def top_up() -> None:
            nonlocal next_job
            # A job to each worker before a second to any: where the bytes ahead let few
            # jobs go, they are built side by side, not queued behind one worker's.
            for depth in range(1, self.DEPTH + 1):
                for w in range(workers):
                    if w in dead or outstanding[w] >= depth:
                        continue
                    if next_job >= min(count, failed_at) or not ahead.admits(self.job_bytes[next_job]):
                        return
                    try:
                        self.tasks[w].send((next_job, self.jobs[next_job]))
                    except OSError:  # it died: its results pipe reports that, naming its jobs
                        dead.add(w)
                        continue
                    ahead.hand_out(self.job_bytes[next_job])
                    sent[w].append(next_job)
                    outstanding[w] += 1
                    next_job += 1

        top_up()
        while next_due < count:
            if next_due in early:
                result = early.pop(next_due)
                if isinstance(result, BaseException):
                    raise result
                next_due += 1
                ahead.pass_on()
                top_up()
                yield result
                continue
            for conn in multiprocessing.connection.wait(self.results):
                w = self.results.index(conn)
                try:
                    message = conn.recv()
                    if message[0] == "error":
                        _, i, error = message
                        early[i], failed_at = error, min(failed_at, i)
                    else:
                        _, i, frame_fields, result_fields = message
                        early[i] = FrameResult(frame=Frame(data=_recv_data(conn), **frame_fields), **result_fields)
                except EOFError:
                    proc = self.procs[w]
                    proc.join(5)
                    raise ShardstreamError(
                        f"pack worker process {proc.name} exited unexpectedly (exit code {proc.exitcode}) "
                        f"while building {_job_files(self.jobs, sent[w])}"
                    ) from None
                sent[w].remove(i)
                outstanding[w] -= 1
            top_up()

    def close(self, wait: bool) -> None:
        """Stop the workers: let them exit (`wait`, after the last result), or end them now."""
        if wait:
            for conn in self.tasks:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for conn in self.tasks + self.results:
            conn.close()
        for proc in self.procs:
            if wait:
                proc.join(10)
            if proc.is_alive():
                proc.terminate()
            proc.join()
        self.procs, self.tasks, self.results = [], [], []


def _job_files(jobs: list[Any], numbers: list[int]) -> str:
    """The images of the jobs `numbers` (build_job's), in words: what a dead worker was at."""
    files = [entry.path for i in numbers for entry in jobs[i][1]]
    if not files:
        return "nothing"
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more images" if len(files) > 3 else "")


def _grow_pipe(fd: int) -> None:
    # A result is ~1 MB; the default 64 KB pipe makes each one take 16 round trips
    # between worker and parent. Best effort (Linux only; the limit may be lower).
    if fcntl is not None and hasattr(fcntl, "F_SETPIPE_SZ"):
        for size in (4 << 20, 1 << 20):
            try:
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
                return
            except OSError:
                continue


def _frame_worker(tasks: Any, conn: Any, parents: tuple[int, ...] = (), pixels: int | None = None) -> None:
    """A worker process: build the jobs that come down `tasks`, send each result to `conn`.

    A thread sends, so that the next frame is built while the parent reads the last one,
    and so that this loop is always back at `tasks.recv()` soon: the parent may be
    blocked sending a job here, and must never wait on a worker that waits on it.
    `parents`: the parent's pipe ends a forked worker inherited, closed first, so that the
    parent's death ends `tasks`. `pixels`: the parent's `PIL.Image.MAX_IMAGE_PIXELS`, which a
    worker started by spawn or forkserver would not have (found by review: a limit raised
    for trusted images packed them with threads, and skipped them with processes); Pillow's
    warning below its error threshold is not said, as in the parent (`pack`).
    """
    _leave_stopping_to_the_parent()
    Image.MAX_IMAGE_PIXELS = pixels
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    for fd in parents:
        with contextlib.suppress(OSError):
            os.close(fd)
    out: queue.Queue = queue.Queue()  # bounded by the parent: DEPTH jobs at a time
    broken = threading.Event()

    def send() -> None:
        while (item := out.get()) is not None:
            if broken.is_set():
                continue  # the parent has gone: drain, and let the main loop notice
            payload, data = item
            try:
                conn.send_bytes(payload)
                if data is not None:
                    _send_data(conn, data)
            except OSError:
                broken.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while not broken.is_set():
            try:
                task = tasks.recv()
            except (EOFError, OSError):
                break
            if task is None:
                break
            i, job = task
            try:
                result = build_job(job)
            except Exception as e:  # as Pool does: the parent re-raises it
                out.put((_pickle_error(i, e), None))
                continue
            frame = result.frame
            # Every field of the result and of its Frame but the data, which follows raw (see _send_data).
            message = ("ok", i, _fields_but(frame, "data"), _fields_but(result, "frame"))
            out.put((bytes(ForkingPickler.dumps(message)), frame.data))
    finally:
        out.put(None)
        sender.join()
        conn.close()


def _leave_stopping_to_the_parent() -> None:
    """A worker ignores Ctrl-C and dies of SIGTERM, whatever its parent set.

    Ctrl-C at a terminal signals every process of the group: a worker that raised the
    KeyboardInterrupt printed its traceback (one run in three or so, as the parent's
    `close` raced it), and one that got the signal alone died and failed the pack. The
    parent decides: it stops the workers (`_FramePool.close`, by SIGTERM), and its death
    ends their tasks. A forked worker inherits the parent's Python handlers: with a
    handler that raises on SIGTERM (the CLI's), `terminate` would leave a worker blocked
    sending a result that nobody reads, and `close` waiting for it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _fields_but(instance: Any, left_out: str) -> dict[str, Any]:
    """A dataclass instance's fields by name, but one."""
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.name != left_out}


# Frame data goes through the pipe's file descriptor as a length and the raw bytes, and
# is read straight into its final buffer: Connection.recv_bytes would copy it twice more.
_RAW_PIPES = os.name == "posix"


def _send_data(conn: Any, data: bytes) -> None:
    if not _RAW_PIPES:
        conn.send_bytes(data)
        return
    fd = conn.fileno()
    for chunk in (struct.pack("<Q", len(data)), data):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def _recv_data(conn: Any) -> bytes | bytearray:
    if not _RAW_PIPES:
        return conn.recv_bytes()
    fd = conn.fileno()
    head = b""
    while len(head) < 8:
        chunk = os.read(fd, 8 - len(head))
        if not chunk:
            raise EOFError
        head += chunk
    size = struct.unpack("<Q", head)[0]
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            raise EOFError
        got += n
    return data


def _pickle_error(i: int, e: Exception) -> bytes:
    try:
        return bytes(ForkingPickler.dumps(("error", i, ExceptionWithTraceback(e, e.__traceback__))))
    except Exception as failed:  # an exception that does not pickle, reported as Pool reports it
        return bytes(ForkingPickler.dumps(("error", i, MaybeEncodingError(failed, e))))
