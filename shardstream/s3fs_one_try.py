"""s3fs's filesystem with its own retry loop run once: a store's `RetryPolicy` does the retrying.

s3fs wraps each S3 call in a loop of its own (`S3FileSystem.retries`, 5 tries, sleeping
0.1 s to 0.8 s after each failed one), and a read in two such loops, one inside the
other. Under `RetryPolicy` an attempt to read from an S3 that throttled (503 SlowDown)
made 5 requests over 2 s, and one whose connections dropped 25 tries (50 requests:
aiohttp resends such a request once itself) over 11 s, in waits that no deadline or
cancellation reached and no counter saw.

s3fs takes no option for its tries: `retries` is a class attribute. Setting it on the
filesystem instance a store uses would not stay the store's: fsspec hands out one
instance per class and options in a process, so a user's own `fsspec.filesystem("s3",
...)` with the same options (or one made before the store's) would be the same object,
and lose its retries. Stores make their S3 filesystems of this subclass instead, which
fsspec caches apart (the class is part of the cache key), and leave s3fs's class as it
is. This module imports s3fs: `storage` imports it when a store first goes through s3fs.
"""

from __future__ import annotations

import s3fs

__all__ = ["OneTryS3FileSystem"]


class OneTryS3FileSystem(s3fs.S3FileSystem):
    """`s3fs.S3FileSystem` whose calls make one try each (s3fs still waits 0.1 s after a
    throttled or dropped try before raising it: its loop sleeps after every failed try)."""

    retries = 1
