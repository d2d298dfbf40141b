"""Work in threads, results in order: for the work that releases the GIL.

Its users: `pack` builds frames in threads when the images are large (reading, zstd and
SHA-256 release the GIL), `StreamingDataset(decode_threads=N)` decodes images in
threads (libjpeg-turbo, Pillow and torch release it), and `verify` and `index` read
shards several at once. All need the results in the order of the inputs, a bounded
number in flight (pack's, bounded in bytes too: `Ahead`), and clean cancellation.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

from .iostats import counting_here

__all__ = ["Ahead", "ordered_map"]

T = TypeVar("T")
R = TypeVar("R")


class Ahead:
    """The work handed out beyond the result last passed on, in the order it goes out:
    at most `items` items, and at most `weight` of their weights together (bytes, say).

    An item that does not fit goes all the same when nothing else is out, so that one
    heavier than `weight` alone still goes, on its own.
    """

    def __init__(self, items: int, weight: int | None = None):
        self.items = items
        self.weight = weight
        self._out: deque[int] = deque()  # the weights of the items out, oldest first
        self._out_weight = 0

    def has_room(self) -> bool:
        """Whether fewer than `items` are out: the next item may be drawn, to be weighed."""
        return len(self._out) < self.items

    def admits(self, weight: int) -> bool:
        """Whether an item of `weight` may go out now."""
        if not self._out:
            return True
        return self.has_room() and (self.weight is None or self._out_weight + weight <= self.weight)

    def hand_out(self, weight: int) -> None:
        self._out.append(weight)
        self._out_weight += weight

    def pass_on(self) -> None:
        """The oldest item out is done with: it no longer counts."""
        self._out_weight -= self._out.popleft()


def ordered_map(function: Callable[[T], R], items: Iterable[T], threads: int, *, ahead: int | None = None,
                weigh: Callable[[T], int] | None = None, weight_ahead: int | None = None,
                name: str = "shardstream") -> Iterator[Future[R]]:
    """`function` over `items` in `threads` threads; the futures, in the order of `items`.

    At most `ahead` calls (default 4 per thread) are submitted beyond the future last
    yielded, which bounds memory; with `weigh`, also calls on items that weigh at most
    `weight_ahead` together (`Ahead`: the next one always goes). `items` is drawn in the
    caller's thread, as the window moves. Closing the iterator cancels the calls not
    started and waits for the running ones.
    """
    bound = Ahead(ahead or 4 * threads, weight_ahead)
    with ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=counting_here()) as pool:
        pending = iter(items)
        window: deque[Future[R]] = deque()
        waiting: list[tuple[T, int]] = []  # an item drawn and weighed that did not fit yet

        def fill() -> None:
            """Submit the next items' calls while they fit; an error drawing one (a shard
            that cannot be read) goes in the window as a failed future, so it is raised at
            its own place, after the items before it, and nothing more is drawn."""
            nonlocal pending
            while waiting or bound.has_room():
                if not waiting:
                    try:
                        item = next(pending)
                    except StopIteration:
                        return
                    except Exception as error:
                        failed: Future[R] = Future()
                        failed.set_exception(error)
                        window.append(failed)
                        bound.hand_out(0)
                        pending = iter(())
                        return
                    waiting.append((item, weigh(item) if weigh is not None else 0))
                item, weight = waiting[0]
                if not bound.admits(weight):
                    return
                waiting.clear()
                window.append(pool.submit(function, item))
                bound.hand_out(weight)

        fill()
        try:
            while window:
                future = window.popleft()
                bound.pass_on()
                fill()
                yield future
        finally:
            for future in window:
                future.cancel()
