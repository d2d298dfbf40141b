"""Work in threads, results in order: for the work that releases the GIL.

Its users: `pack` builds frames in threads when the images are large (reading, zstd and
SHA-256 release the GIL), `StreamingDataset(decode_threads=N)` decodes images in
threads (libjpeg-turbo, Pillow and torch release it), and `verify` and `index` read
shards several at once. All need the results in the order of the inputs, a bounded
number in flight, and clean cancellation.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

__all__ = ["ordered_map"]

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(function: Callable[[T], R], items: Iterable[T], threads: int, *, ahead: int | None = None,
                name: str = "shardstream") -> Iterator[Future[R]]:
    """`function` over `items` in `threads` threads; the futures, in the order of `items`.

    At most `ahead` calls (default 4 per thread) are submitted beyond the future last
    yielded, which bounds memory. `items` is drawn in the caller's thread, as the window
    moves. Closing the iterator cancels the calls not started and waits for the running ones.
    """
    ahead = ahead or 4 * threads
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        pending = iter(items)
        window: deque[Future[R]] = deque()

        def draw() -> None:
            """Submit the next item's call; an error drawing it (a shard that cannot be read)
            goes in the window as a failed future, so it is raised at its own place, after
            the items before it, and nothing more is drawn."""
            nonlocal pending
            try:
                item = next(pending)
            except StopIteration:
                return
            except Exception as error:
                failed: Future[R] = Future()
                failed.set_exception(error)
                window.append(failed)
                pending = iter(())
                return
            window.append(pool.submit(function, item))

        for _ in range(ahead):
            draw()
        try:
            while window:
                future = window.popleft()
                draw()
                yield future
        finally:
            for future in window:
                future.cancel()
