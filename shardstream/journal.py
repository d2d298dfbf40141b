"""The pack journal: which planned shards are complete, so `pack --resume` can skip them.

Packing is planned up front (pack.py), so "resume" means: redo exactly the shards
that are not done. Each finished shard appends a record (its manifest entry and the
files it skipped) to a folder beside the shards; the plan record pins the options and
the source listing, so a journal is never applied to another pack. The journal is
removed once the manifest is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import asdict, replace
from typing import Any, Iterator

import msgpack

from .errors import ResumeMismatchError, ShardstreamError
from .format import ShardInfo, safe_name, shard_entry, unpack_limited
from .storage import Store
from .threads import ordered_map

__all__ = ["Journal"]

FOLDER = ".shardstream-pack"
READ_THREADS = 16  # a remote journal's records read at once
REPLACING = "replacing.msgpack"  # the files of the dataset a pack replaces, while they are removed


START_OVER = "; run as it ran, or without resume (--resume) to start over"


def _only_a_fix(previous: Any, plan: dict[str, Any]) -> bool:
    """Whether the journaled run's `previous` record differs from this run's `plan` only as
    a fix after a failure does: another `on_error`, or source files changed since (an image
    repaired), the options, the part, the rules and the listing the same."""
    return isinstance(previous, dict) and all(previous.get(name) == plan[name] for name in
                                              ("options", "part", "pixel_limit", "rules", "listing"))


def _what_changed(previous: Any, plan: dict[str, Any]) -> str:
    """How the journaled run's `previous` plan record differs from this run's `plan`, for the refusal."""
    if not isinstance(previous, dict):
        return "its record is not one this version wrote"
    said = []
    then, now = previous.get("options"), plan["options"]
    then = then if isinstance(then, dict) else {}
    for name in sorted(set(then) | set(now), key=str):
        if then.get(name) != now.get(name):
            said.append(f"{name} {then.get(name)!r} then, {now.get(name)!r} now")
    for name in ("part", "on_error", "pixel_limit"):
        if previous.get(name) != plan[name]:
            said.append(f"{name} {previous.get(name)!r} then, {plan[name]!r} now")
    if previous.get("rules") != plan["rules"]:  # begun by a shardstream that packs otherwise
        said.append("begun by another version of shardstream, which decides otherwise which images are packed and "
                    "how (its shards and this run's would not make one pack's)")
    if said:  # the seed (and the shuffle) order the listing: its digests differ then too
        return "; ".join(said)
    if previous.get("listing") != plan["listing"]:
        return "another source listing: other file names, labels or class folders"
    if previous.get("files") != plan["files"]:
        return "source files modified since: other sizes or modification times"
    return "its record differs"


class Journal:
    def __init__(self, store: Store, name: str):
        self.store = replace(store, root=store.url(f"{FOLDER}/{name}"))
        self.shards = store

    def start(self, plan: dict[str, Any], resume: bool) -> dict[int, tuple[ShardInfo, list[tuple[str, str]]]]:
        """Begin (or, with `resume`, continue) the pack described by `plan`; returns finished shards."""
        self.store.makedirs()
        done: dict[int, tuple[ShardInfo, list[tuple[str, str]]]] = {}
        if resume and self.store.exists("plan.msgpack"):
            previous = unpack_limited(self.store.read("plan.msgpack"), max_bytes=1 << 20,
                                      url=self.store.url("plan.msgpack"), error=ShardstreamError)
            if isinstance(previous, dict) and "files" not in previous:  # journaled before the listing read names only
                raise ShardstreamError("cannot resume: the earlier pack was journaled by an earlier version of "
                                       "shardstream, whose record this one cannot compare; run without resume "
                                       "(--resume) to start over", url=self.store.root)
            if previous != plan:
                # Told apart for the executors, which start over a part whose earlier run differs only so
                # (one set of options goes to every part); a single pack refuses either way.
                kind = ResumeMismatchError if _only_a_fix(previous, plan) else ShardstreamError
                raise kind(f"cannot resume: the earlier pack differs ({_what_changed(previous, plan)})"
                           f"{START_OVER}", url=self.store.root)
            # One listing gives every shard's size: asking whether each shard is there and its
            # size was 2 requests in a row a finished shard (a part's thousand shards on S3: a minute).
            sizes = self.shards.sizes()
            for shard, info, skipped in self._records():
                if sizes.get(info.name) == info.bytes:  # trust the record only if the shard is there, whole
                    done[shard] = (info, skipped)
            return done
        # A fresh start: the shards an earlier, failed run of this pack published go too, or
        # those this run does not write again (other options, another source) would stay
        # beside the dataset, listed by no manifest, for anything that globs shard names.
        with contextlib.suppress(ShardstreamError):
            # A shard whose every image was skipped was never written (no index named).
            self.shards.remove_all(name for _, info, _ in self._records() if info.samples
                                   for name in (info.name, info.index))
            self.shards.remove_all(self._replacing())
        self.clear()
        self.store.makedirs()
        self.store.write("plan.msgpack", msgpack.packb(plan, use_bin_type=True))
        return done

    def exists(self) -> bool:
        """Whether an earlier run of this pack left this journal (killed, or failed): the shard
        files there without a manifest are then taken for that run's."""
        return self.store.exists("plan.msgpack") or self.store.exists(REPLACING)

    def replacing(self, names: list[str]) -> None:
        """Record the files of the dataset this pack replaces, before they are removed: a
        pack killed while removing them left them listed by no manifest, and a plain rerun
        (finding no dataset to replace) knew nothing of them. A fresh start removes what is left."""
        self.store.makedirs()
        self.store.write(REPLACING, msgpack.packb(names, use_bin_type=True))

    def replaced(self) -> None:
        """The replaced dataset's files are gone (`replacing`): nothing left to remove."""
        self.store.remove(REPLACING)

    def _replacing(self) -> list[str]:
        if not self.store.exists(REPLACING):
            return []
        names = unpack_limited(self.store.read(REPLACING), max_bytes=1 << 28, url=self.store.url(REPLACING),
                               error=ShardstreamError)
        # File names in the destination only: a journal found there may not be this library's
        # (a shared folder, a half-done pack handed over), and `../x` or `/x` would be removed.
        return [name for name in names if isinstance(name, str) and safe_name(name)] if isinstance(names, list) else []

    def _records(self) -> Iterator[tuple[int, ShardInfo, list[tuple[str, str]]]]:
        """The finished shards recorded: (shard number, its manifest entry, its skips). A
        remote journal's records are read several at once, their round trips overlapped."""
        names = [name for name in self.store.list(".msgpack") if name.startswith("shard-")]
        if self.store.local:
            yield from map(self._record, names)
            return
        with contextlib.closing(ordered_map(self._record, names, READ_THREADS, name="shardstream-journal")) as futures:
            for future in futures:
                yield future.result()

    def _record(self, name: str) -> tuple[int, ShardInfo, list[tuple[str, str]]]:
        """A record, checked as a manifest's entries are (its names are removed on a fresh
        start: a journal found in the destination may not be this library's), or a
        ShardstreamError naming it."""
        url = self.store.url(name)
        raw = unpack_limited(self.store.read(name), max_bytes=1 << 24, url=url, error=ShardstreamError)
        raw = raw if isinstance(raw, dict) else {}
        shard, skipped = raw.get("shard"), raw.get("skipped")
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0 or not isinstance(skipped, list) \
                or not all(isinstance(s, list) and len(s) == 2 and all(isinstance(v, str) for v in s) for s in skipped):
            raise ShardstreamError("a pack journal record that this library did not write", url=url)
        return shard, _recorded_entry(raw.get("info"), url), [(path, why) for path, why in skipped]

    def record(self, shard: int, info: ShardInfo, skipped: list[tuple[str, str]]) -> None:
        body = {"shard": shard, "info": {**asdict(info), "fields": list(info.fields)}, "skipped": skipped}
        self.store.write(f"shard-{shard:06d}.msgpack", msgpack.packb(body, use_bin_type=True))

    def clear(self, remove_folder: bool = False) -> None:
        """Forget every record. `remove_folder` also drops the journals' common folder if
        empty: only for a single pack, since parts running at once create it concurrently."""
        self.store.remove_all(self.store.list(""))
        if self.store.local:  # drop the (now empty) folder too
            shutil.rmtree(self.store.root, ignore_errors=True)
            if remove_folder:
                remove_journal_folder(os.path.dirname(self.store.root))


def _recorded_entry(info: Any, url: str) -> ShardInfo:
    """A record's shard entry: a manifest's, or that of a shard whose every image was skipped
    (`packoutput.finish_shard`: no file, no index), which a manifest never lists (found by
    review: a resume refused it as a manifest entry naming no index, "unsafe shard file name")."""
    if isinstance(info, dict) and info.get("samples") == 0 and info.get("index") == "":
        name = info.get("name")
        if not isinstance(name, str) or not safe_name(name):
            raise ShardstreamError("a pack journal record that this library did not write", url=url)
        return ShardInfo(name, 0, 0, 0, "", "", 0, "", ())
    return shard_entry(info, url)


def remove_journal_folder(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty, or already gone
