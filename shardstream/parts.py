"""`merge`: join the parts of a pack run on many machines into one dataset.

Every part of ``pack --part I/N`` lists the whole source, sorts and shuffles it with
the seed, and packs only its contiguous slice, so the parts agree on who packs what
without talking to each other, and their union is the same sample set (in the same
global, seeded order) as a single-machine pack. `merge` checks that the N part
manifests are all present and agree, then writes the dataset manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import replace
from typing import Any, Callable

from .arguments import flag
from .errors import ManifestError, MissingPartsError, ShardstreamError
from .format import INDEX_SUFFIX, MANIFEST_NAME, PART_MANIFEST, Manifest, ShardInfo
from .shardtable import ShardTable
from .storage import Store
from .journal import FOLDER as JOURNAL_FOLDER, remove_journal_folder
from .threads import ordered_map
from .writer import write_manifest

__all__ = ["MAX_PARTS", "check_part_agrees", "merge", "missing_parts", "other_journals", "other_packs", "part_shards",
           "unplanned_part_shards", "unplanned_single_shards", "unlisted_single_shards"]

MAX_PARTS = 10**5  # part numbers have five digits in the file names (FORMAT.md)
# A part's shard, or its index: one whose shard went first (a removal killed between the two,
# or removals remote in any order) would be matched by nothing else, and stay for good.
_PART_SHARD = re.compile(r"shard-p(\d{5})-\d{6}\.tar(\.zst)?(\.idx)?")
_SINGLE_SHARD = re.compile(r"shard-\d{6}\.tar(\.zst)?(\.idx)?")
_JOURNAL = re.compile(r"part-\d{5}-of-\d{5}")  # a part's journal (the single pack's is "main")
CHECK_THREADS = 16  # indexes read at once by `merge` from a remote store, whose latency they hide


def part_manifests(store: Store) -> dict[tuple[int, int], str]:
    """The part manifests in `store`: (part number, number of parts) -> file name. Keyed by
    both: two packs' parts of one number (2 parts and 3, copied into one folder) hid each
    other, and a merge found 3 parts that agreed, the others left unsaid."""
    found: dict[tuple[int, int], str] = {}
    for name in store.list(".msgpack"):
        match = PART_MANIFEST.fullmatch(name)
        if match:
            found[int(match.group(1)), int(match.group(2))] = name
    return found


def of_one_pack(found: dict[tuple[int, int], str], url: str) -> tuple[int, dict[int, str]]:
    """The number of parts the part manifests `found` name, and part number -> file name;
    an error where they name several numbers."""
    totals = {total for _, total in found}
    if len(totals) != 1:
        raise ShardstreamError(f"part manifests disagree on the number of parts: {sorted(totals)}", url=url)
    return totals.pop(), {part: name for (part, _), name in found.items()}


def other_packs(store: Store, parts: int | None) -> tuple[list[str], list[str]]:
    """What in `store` another pack left, which a pack in `parts` parts (None: a single
    pack) would overwrite or mix with: (manifest names, shard names).

    Part shard names hold the part's number but not the number of parts (FORMAT.md), so
    part 0 of 3 writes the very names part 0 of 2 wrote; the manifests, which say how many
    parts they belong to, tell whose the files are. Listed: part manifests of another
    number of parts (every part manifest, for a single pack); the dataset manifest unless
    it merges `parts` parts (a single pack checks its own manifest itself); part shards
    numbered `parts` or more, which no part of this pack writes (shards of lower numbers
    may be another part of this pack at work, and cannot be told apart).
    """
    names = store.list()  # one listing answers all three questions (one request, remotely)
    manifests = [name for name in names
                 if (match := PART_MANIFEST.fullmatch(name)) and int(match.group(2)) != parts]
    if parts is None:
        return manifests, []
    if MANIFEST_NAME in names and _merged_parts(store) != parts:
        manifests.insert(0, MANIFEST_NAME)
    # A single pack's shards too (no part writes their names): one killed before its manifest
    # left them, listed by none, holding the samples the parts pack again.
    shards = [name for name in names if (match := _PART_SHARD.fullmatch(name)) and int(match.group(1)) >= parts
              or _SINGLE_SHARD.fullmatch(name)]
    return manifests, shards


def part_shards(store: Store) -> list[str]:
    """Every part's shard names in `store`: what a single pack finds of parts killed before
    their manifests (or left by an overwrite killed while it removed them)."""
    return [name for name in store.list() if _PART_SHARD.fullmatch(name)]


def other_journals(store: Store, parts: int | None) -> list[str]:
    """The journals (`journal.Journal` names) in `store` of packs of another layout than one
    in `parts` parts (None: a single pack): the single pack's (`main`), for a part, and
    those of parts of another number of parts (any part's, for a single pack). A pack
    killed before its manifest left one, which no pack of this layout would remove."""
    names = replace(store, root=store.url(JOURNAL_FOLDER)).folders()
    own = re.compile("main" if parts is None else rf"part-\d{{5}}-of-{parts:05d}")
    return [name for name in names if (name == "main" or _JOURNAL.fullmatch(name)) and not own.fullmatch(name)]


def unplanned_part_shards(store: Store, index: int, planned: set[str]) -> list[str]:
    """Part `index`'s shard names in `store` that are not in its plan (`planned`), once other
    packs' manifests are gone (`other_packs`): a part of another number of parts, numbered
    as this one, wrote them (a removed manifest's shards of this part's number stay, for
    this part to overwrite, as another part of the pack may be writing them), or a part
    of another number killed before its manifest. Listed by no manifest, overwritten by
    none of this part's shards, they would stay beside the dataset for good."""
    prefix = f"shard-p{index:05d}-"
    return [name for name in store.list() if name.startswith(prefix) and _PART_SHARD.fullmatch(name)
            and name.removesuffix(INDEX_SUFFIX) not in planned]


def unlisted_single_shards(store: Store) -> list[str]:
    """The files in `store` named as a single pack names its shards (and their indexes) that
    the manifest there, if any, does not list: another tool's WebDataset tars are often
    named so (`shard-%06d.tar`), and a pack would write over them, or leave them mixed
    with its dataset."""
    listed: set[str] = set()
    if store.exists(MANIFEST_NAME):
        with contextlib.suppress(ShardstreamError):  # unreadable: it lists nothing
            manifest = Manifest.from_bytes(store.read(MANIFEST_NAME), store.url(MANIFEST_NAME))
            listed = {name for shard in manifest.shards for name in (shard.name, shard.index)}
    return [name for name in store.list() if _SINGLE_SHARD.fullmatch(name) and name not in listed]


def unlisted_shards(store: Store, manifest: Manifest) -> list[str]:
    """The files in `store` named as shardstream names shards (a single pack's or a part's, and
    their indexes) that `manifest` does not list: left by an earlier pack into the folder
    (killed, or of another number of parts). Readers never open them; `verify` tells of them."""
    listed = {name for shard in manifest.shards for name in (shard.name, shard.index)}
    return sorted(name for name in store.list()
                  if (_SINGLE_SHARD.fullmatch(name) or _PART_SHARD.fullmatch(name)) and name not in listed)


def unplanned_single_shards(store: Store, planned: set[str]) -> list[str]:
    """The shard files in `store` that a single pack planning `planned` would not write and no
    manifest of it lists: a single pack's beyond the plan, and any part's. An overwrite
    removes the dataset it replaces manifest first, then shards (parts.py's order, so that
    nothing lists a shard that is gone): killed between, the shards stayed, listed by none,
    and the rerun (fresh or resumed) knew nothing of them."""
    return [name for name in store.list() if (_SINGLE_SHARD.fullmatch(name) or _PART_SHARD.fullmatch(name))
            and name.removesuffix(INDEX_SUFFIX) not in planned]


def _merged_parts(store: Store) -> int | None:
    """How many parts the dataset manifest in `store` merges (None: a single pack's, or unreadable)."""
    try:
        parts = Manifest.from_bytes(store.read(MANIFEST_NAME), store.url(MANIFEST_NAME)).options.get("parts")
    except ShardstreamError:
        return None  # not this pack's: listed, so that --overwrite replaces it
    return parts if isinstance(parts, int) else None


def missing_parts(dst: str, parts: int, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The parts of `parts` whose part manifest is not (yet) in `dst`: one listing."""
    found = part_manifests(Store(dst, storage_options or {}))
    return [i for i in range(parts) if (i, parts) not in found]


def merge(dst: str, *, storage_options: dict[str, Any] | None = None, fsync: bool = False) -> Manifest:
    """Check the part manifests in `dst` and write the dataset manifest; returns it.

    Idempotent: the same parts give the same manifest, byte for byte, so two merges
    at once (the last two parts finishing together) write the same file. `fsync`: the
    manifest is on the disk when this returns (`pack`'s `fsync`, which the parts need too).
    """
    store = Store(dst, storage_options or {}, durable=flag(fsync, "fsync"))
    manifest = merged_manifest(store)
    write_manifest(store, manifest)
    if store.local:  # the parts' journals are gone; their common folder can go too
        remove_journal_folder(store.url(JOURNAL_FOLDER))
    return manifest


def merged_manifest(store: Store) -> Manifest:
    """The dataset manifest the part manifests in `store` merge into, every check of `merge`
    made (`verify` of unmerged parts tells what would stop their merge); nothing is written.
    Parts not finished are a MissingPartsError, once the finished ones agree."""
    dst = store.root
    everything = part_manifests(store)
    if not everything:
        there = " (a dataset's manifest is there: a single pack's, with nothing to merge)" \
            if store.exists(MANIFEST_NAME) else ""
        raise ShardstreamError(f"no part manifests (manifest.part-IIIII-of-NNNNN.msgpack) found{there}", url=dst)
    total, found = of_one_pack(everything, dst)
    url_of = lambda n: store.url(found[n])  # noqa: E731 - part n's manifest, named in refusals
    missing = [i for i in range(total) if i not in found]
    if missing:
        # The parts there first: a part packed with other options is named now, not after the
        # missing ones are packed (with its options copied, as the refusal before packing said).
        present = sorted(found)
        finished = [Manifest.from_bytes(store.read(found[i]), store.url(found[i])) for i in present]
        _check_options_agree(finished, present, url_of)
        _check_sources_agree(finished, present, url_of)
        _check_rules_agree(finished, present, url_of)
        begun = _begun_parts(store, total)
        names = ", ".join(f"part {i} (manifest.part-{i:05d}-of-{total:05d}.msgpack"
                          + ("; begun and not finished: still running, or stopped (--resume continues it)"
                             if i in begun else "") + ")"
                          for i in missing)
        raise MissingPartsError(f"missing {len(missing)} of {total} parts: {names}", url=dst)

    parts = [Manifest.from_bytes(store.read(found[i]), store.url(found[i])) for i in range(total)]
    versions = {"sizes" in part.options for part in parts}
    if len(versions) > 1:  # the listing's fingerprint changed with the digest of sizes: they cannot agree
        old = [i for i, part in enumerate(parts) if "sizes" not in part.options]
        raise ManifestError(f"parts {old} were packed by an earlier version of shardstream than the others; pack "
                            "them again with this one (--overwrite)", url=dst)
    first = parts[0]
    common = _common_options(first)
    for i, part in enumerate(parts):
        if part.options.get("part") != [i, total]:
            raise ManifestError(f"this manifest says it is part {part.options.get('part')}, not [{i}, {total}]",
                                url=store.url(found[i]))
    # The options first: another seed orders the listing otherwise, and changes its digest too.
    _check_options_agree(parts, list(range(total)), url_of)
    _check_sources_agree(parts, list(range(total)), url_of)
    _check_rules_agree(parts, list(range(total)), url_of)
    names = [name for part in parts for name in part.shards.names]
    if len(names) != len(set(names)):
        raise ManifestError("parts list the same shard twice", url=dst)
    _check_shards(store, parts)
    return Manifest(
        shards=ShardTable.concat([part.shards for part in parts]),
        compression=first.compression,
        classes=first.classes,
        class_counts=tuple(sum(counts) for counts in zip(*(p.class_counts for p in parts))),
        skipped=tuple(skip for part in parts for skip in part.skipped),
        ignored=first.ignored,
        options={**common, "parts": total},
    )


def _begun_parts(store: Store, total: int) -> set[int]:
    """The parts of `total` whose journal is in `store`: runs begun and, where their manifest is
    missing, not finished (killed); one listing."""
    try:
        folders = replace(store, root=store.url(JOURNAL_FOLDER)).folders()
    except ShardstreamError:
        return set()
    journal = re.compile(rf"part-(\d{{5}})-of-{total:05d}")
    return {int(match.group(1)) for name in folders if (match := journal.fullmatch(name))}


def _source_listed(manifest: Manifest) -> tuple[Any, tuple[str, ...], int]:
    """What a part listed of its source, which every part must share: the listing's digest, the
    class table, the count of files that are not images."""
    return manifest.options.get("listing"), manifest.classes, manifest.ignored


def _options_told(manifest: Manifest) -> dict[str, Any]:
    """The options parts must share but the source listing's digest and the packing rules, which are told apart."""
    return {k: v for k, v in _common_options(manifest).items() if k != "listing" and k not in RULES}


# What decides which images a pack takes beyond its options: the version's rules and Pillow's
# pixel limit (pack.py records both; parts packed before record neither).
RULES = ("pack_rules", "pixel_limit")


def _rules(options: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(options.get(name) for name in RULES)


def _rules_words(options: dict[str, Any]) -> str:
    rules, limit = _rules(options)
    if rules is None:
        return "packing rules and pixel limit not recorded (an earlier version)"
    return f"packing rules {rules}, pixel limit {limit if limit is not None else 'none'}"


def _check_rules_agree(parts: list[Manifest], numbers: list[int], url_of: Callable[[int], str]) -> None:
    """ManifestError where the part manifests `parts` (of the parts `numbers`) were packed by a
    version that decides otherwise which images are packed, or under another pixel limit
    (`PIL.Image.MAX_IMAGE_PIXELS`), than most: their shards and the others' would make no one
    pack's (an image over Pillow's warning threshold skipped in some parts, packed in others)."""
    odd_groups, usual = _odd_ones_out([_rules(part.options) for part in parts])
    if odd_groups:
        odd = sorted(numbers[i] for group in odd_groups for i in group)
        told = "; ".join(f"{_parts([numbers[i] for i in group])}: {_rules_words(parts[group[0]].options)}"
                         for group in (usual, *odd_groups))
        raise ManifestError(f"{_parts(odd)} {'was' if len(odd) == 1 else 'were'} packed by another version of "
                            "shardstream or under another pixel limit (PIL.Image.MAX_IMAGE_PIXELS) than "
                            f"{_parts([numbers[i] for i in usual])} ({told}), which decide which images are packed: "
                            "pack every part with one version and limit (--overwrite)", url=url_of(odd[0]))


def _check_options_agree(parts: list[Manifest], numbers: list[int], url_of: Callable[[int], str]) -> None:
    """ManifestError where the part manifests `parts` (of the parts `numbers`) were packed with
    other options: those that differ from most are named; where no options are most's (a tie),
    each group is, and none is called right (part 0 was, and the right parts were told to pack
    again with the wrong options)."""
    odd_groups, usual = _odd_ones_out([(sorted(_options_told(part).items()), part.compression) for part in parts])
    if not odd_groups:
        return
    named = lambda group: [numbers[i] for i in group]  # noqa: E731
    if any(len(group) == len(usual) for group in odd_groups):
        told = "; ".join(f"{_parts(named(group))}: {_options_words(parts[group[0]])}" for group in (usual, *odd_groups))
        raise ManifestError(f"the parts were packed with other options, and no options are most parts' ({told}): "
                            "pack again, with the options meant, the parts packed otherwise (--overwrite)",
                            url=url_of(numbers[odd_groups[0][0]]))
    odd = sorted(numbers[i] for group in odd_groups for i in group)
    told = "; ".join(f"{_parts(named(group))}: {_told_apart(parts[group[0]], parts[usual[0]])}" for group in odd_groups)
    raise ManifestError(f"{_parts(odd)} {'was' if len(odd) == 1 else 'were'} packed with other options than "
                        f"{_parts(named(usual))} ({told}): pack {'it' if len(odd) == 1 else 'them'} again with the "
                        "others' options (--overwrite)", url=url_of(odd[0]))


def _check_sources_agree(parts: list[Manifest], numbers: list[int], url_of: Callable[[int], str]) -> None:
    """ManifestError where the part manifests `parts` (of the parts `numbers`) listed another
    source than most (`_source_listed`), naming those parts."""
    odd_groups, usual = _odd_ones_out([_source_listed(part) for part in parts])
    if odd_groups:
        odd = sorted(numbers[i] for group in odd_groups for i in group)
        raise ManifestError(f"{_parts(odd)} listed another source than {_parts([numbers[i] for i in usual])} (other "
                            "file names, labels or class folders, or another count of files that are not images): "
                            "every part must list the same source", url=url_of(odd[0]))


def _options_words(part: Manifest) -> str:
    """A part's options that parts must share, in words: "seed 7, level -1, ..."."""
    options = {**_options_told(part), "compression": part.compression}
    return ", ".join(f"{name} {value!r}" for name, value in sorted(options.items()))


def _odd_ones_out(keys: list[Any]) -> tuple[list[list[int]], list[int]]:
    """(the groups of parts whose `keys` differ from most parts', each alike within, the most
    parts'): where parts disagree, the largest group (part 0's, in a tie: the callers say
    there is a tie) is taken for right, so that one bad part among 32 is named, not the 31
    compared with it."""
    groups: list[tuple[Any, list[int]]] = []
    for i, key in enumerate(keys):
        group = next((members for known, members in groups if known == key), None)
        if group is None:
            groups.append((key, [i]))
        else:
            group.append(i)
    usual = max((members for _, members in groups), key=lambda members: (len(members), 0 in members))
    return [members for _, members in groups if members is not usual], usual


def _parts(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:8])) + (f" and {len(numbers) - 8} more" if len(numbers) > 8 else "")
    return f"part {shown}" if len(numbers) == 1 else f"parts {shown}"


def _differing(options: dict[str, Any], compression: str, other: Manifest) -> dict[str, tuple[Any, Any]]:
    """`_differences` of a part's `options` (and `compression`) from part manifest `other`'s."""
    differ = _differences(options, _common_options(other))
    if compression != other.compression:
        differ["compression"] = (compression, other.compression)
    return differ


def _told_apart(odd: Manifest, usual: Manifest) -> str:
    """How an odd part's options differ from the usual ones: each as "name theirs, not ours"."""
    differ = _differing(_common_options(odd), odd.compression, usual)
    return ", ".join(f"{name} {theirs!r}, not {ours!r}" for name, (theirs, ours) in differ.items())


def check_part_agrees(store: Store, part: tuple[int, int], options: dict[str, Any], compression: str,
                      classes: tuple[str, ...], ignored: int) -> None:
    """ManifestError, before part `part` packs anything, where a part of the same pack already
    in `store` was packed with other options or from another source listing: found only at
    the merge, after every part had packed (hours on a cluster). Compared with the options of
    most parts finished (one part 0 packed with a wrong seed made every later part refuse, and
    told them to copy it), each finished part's manifest read."""
    found = {i: name for (i, total), name in part_manifests(store).items() if total == part[1] and i != part[0]}
    finished: dict[int, Manifest] = {}
    for i in sorted(found):
        try:
            manifest = Manifest.from_bytes(store.read(found[i]), store.url(found[i]))
        except ShardstreamError:
            continue  # unreadable: the merge says so
        if "sizes" in manifest.options:  # else an earlier version's part, whose listing digest is of another kind
            finished[i] = manifest
    if not finished:
        return
    numbers = sorted(finished)
    _, usual = _odd_ones_out([(sorted(_options_told(finished[i]).items()), finished[i].compression) for i in numbers])
    group = [numbers[i] for i in usual]
    other, there = group[0], finished[group[0]]
    differ = _differing({k: v for k, v in options.items() if k not in ("part", "prefix", "sizes")}, compression, there)
    said = f"part {part[0]} of {part[1]} and {_parts(group)}, packed already, do not merge: "
    if differ:
        told = "; ".join(f"{name} {mine!r} here, {theirs!r} in {_parts(group)}"
                         for name, (mine, theirs) in differ.items())
        raise ManifestError(f"{said}other options ({told}): pack with the options of {_parts(group)}, or every part "
                            "again with these (--overwrite)", url=store.url(found[other]))
    if (options.get("listing"), classes, ignored) != _source_listed(there):
        raise ManifestError(f"{said}another source listing (other file names, labels or class folders, or another "
                            "count of files that are not images): every part must list the same source",
                            url=store.url(found[other]))
    if _rules(options) != _rules(there.options):
        raise ManifestError(f"{said}another version of shardstream or another pixel limit "
                            f"(PIL.Image.MAX_IMAGE_PIXELS), which decide which images are packed "
                            f"({_rules_words(options)} here, {_rules_words(there.options)} in {_parts(group)}): pack "
                            f"with the version and limit of {_parts(group)}, or every part again with these "
                            "(--overwrite)", url=store.url(found[other]))


def _check_shards(store: Store, parts: list[Manifest]) -> None:
    """ManifestError, for the first in part order, unless every shard and index the parts
    list is in `store` as listed (`_check_shard`).

    The sizes come from one listing, and the indexes are read several at once where the
    store is remote: asked one file at a time, a shard cost 4 requests in a row (22 ms
    against a moto server on the same machine, a few times that across a network to S3),
    so a merge of 500k shards took hours."""
    sizes = store.sizes()
    listed = ((shard, number) for number, part in enumerate(parts) for shard in part.shards)
    if store.local:  # a read costs microseconds here: threads would only add their own
        for shard, number in listed:
            _check_shard(store, sizes, shard, number)
        return
    checks = ordered_map(lambda item: _check_shard(store, sizes, *item), listed, CHECK_THREADS,
                         name="shardstream-merge")
    with contextlib.closing(checks) as futures:
        for future in futures:
            future.result()


def _check_shard(store: Store, sizes: dict[str, int], shard: ShardInfo, part_number: int) -> None:
    """ManifestError unless `shard` and its index are in `store` as part `part_number` lists
    them: the shard at its size (`sizes`: hashing every shard would read the whole dataset),
    the index, small, by its hash too (a part's output copied by hand, or cut short, must
    not make a dataset whose reads fail later)."""
    found = sizes.get(shard.name)
    if found != shard.bytes:
        raise ManifestError(f"part {part_number} lists {shard.name} ({shard.bytes} bytes), which is "
                            f"{_as_found(found, shard.bytes)}", url=store.url(shard.name))
    found = sizes.get(shard.index)
    index = store.read(shard.index) if found == shard.index_bytes else None
    if index is None or len(index) != shard.index_bytes or hashlib.sha256(index).hexdigest() != shard.index_sha256:
        what = _as_found(found, shard.index_bytes) if index is None else "not the index it wrote (another hash)"
        raise ManifestError(f"part {part_number} lists {shard.index} ({shard.index_bytes} bytes), which is {what}",
                            url=store.url(shard.index))


def _as_found(size: int | None, listed: int) -> str:
    """How a file a part lists at `listed` bytes differs, by the size found (None: absent)."""
    if size is None:
        return "missing"
    changed = "cut short (a copy interrupted?)" if size < listed else "changed since the part wrote it"
    return f"{size} bytes here: {changed}"


def _common_options(manifest: Manifest) -> dict[str, Any]:
    """The options every part must share (all but its number, its shard prefix and the
    digest of its own files' sizes)."""
    return {k: v for k, v in manifest.options.items() if k not in ("part", "prefix", "sizes")}


def _differences(options: dict[str, Any], first: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The options but the source listing's digest in which a part differs from part 0:
    name -> (the part's, part 0's). The digest is told apart, as another source: printed
    among the options, two digests read as two options."""
    names = sorted((options.keys() | first.keys()) - {"listing", *RULES})
    return {name: (options.get(name), first.get(name)) for name in names if options.get(name) != first.get(name)}
