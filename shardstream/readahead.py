"""How much an iteration reads ahead: a window of pieces that widens while its reader waits.

What must be in flight to keep a reader fed is its rate times the storage's latency (the
bandwidth-delay product), and both vary by orders of magnitude: a local read against a
50 ms object-store request, a worker cutting raw samples at 400 MB/s against one
decoding JPEGs at a quarter of that. A fixed read-ahead fits one pair. `ReadAhead`
starts where the fixed one did (at least `prefetch` pieces in flight, more within
half of `prefetch` full pieces' bytes while they are small, `max_pieces` at most) and
doubles its byte budget each time the reader, with the window full, finds the piece it
needs not yet read, up to `GROWTH` times the start: memory goes to read-ahead only where
the reader has shown it waits. Raw samples read in one process over HTTP came 1.35x
faster per round than with the window fixed at 50 ms a request, and 1.65x at 150 ms; through
one DataLoader worker at 50 ms, at 84-87% of the local rate against 78% (BENCHMARKS.md,
"Twenty-fifth session"). Decoding workers, whose reads keep up, ran as fast as before.

Only the timing changes: pieces are read and handed over in the same order whatever the
window, so the samples are the same. The window of local shards does not grow: a reader
of local files waits on the threads that decompress, not on latency, and a larger window
only holds more memory (reading well-compressed local samples, it grew past the bound
`tests/test_memory.py` holds reading to).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GROWTH", "ReadAhead"]

GROWTH = 4  # the budget grows to at most this many times its start


@dataclass
class ReadAhead:
    """The read-ahead window of one iteration: how many pieces, and bytes, may be in flight."""

    prefetch: int  # pieces kept in flight whatever their bytes
    budget: int  # bytes in flight beyond `prefetch` pieces
    limit: int  # the most `budget` grows to
    max_pieces: int  # pieces in flight at most, however small
    remote: bool = True  # storage with latency to hide: the window grows, and its waits are counted
    taken: int = 0  # pieces taken from a full window so far

    @classmethod
    def start(cls, prefetch: int, piece_bytes: int, max_pieces: int, *, remote: bool = True) -> ReadAhead:
        """The window an iteration starts with: `prefetch` pieces, or more while they are
        small (the first pieces are: pieces.ramp), up to half of `prefetch` full pieces' bytes.
        Of local files (not `remote`), it stays so."""
        budget = prefetch * piece_bytes // 2
        return cls(prefetch, budget, budget * GROWTH if remote else budget, max_pieces, remote)

    def full(self, pieces: int, in_flight: int) -> bool:
        """Whether `pieces` in flight, of `in_flight` bytes, fill the window: the reader takes
        one before another is asked for."""
        return pieces > self.max_pieces or (pieces > self.prefetch and in_flight > self.budget)

    def took(self, ready: bool) -> bool:
        """The reader took a piece from a full window, `ready` or not yet read: where it must
        wait, the window was too small for the storage's latency at the reader's rate, and
        its budget doubles. The first piece of an iteration waits for its request whatever
        the window, so its wait says nothing of the window. True where the reader of remote
        storage waited with the window at its largest: only a larger `prefetch` (or a cache)
        would have spared that wait. A reader of local files waits on the threads that
        decompress, not on latency: nothing grows, and nothing is counted."""
        self.taken += 1
        if ready or self.taken == 1 or not self.remote:
            return False
        at_limit = self.budget >= self.limit
        self.budget = min(self.limit, self.budget * 2)
        return at_limit
