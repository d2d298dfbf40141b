"""Adopting WebDataset tars: index them where they lie, and write a manifest beside them.

A folder of plain `.tar` shards written by WebDataset (or `tar`) streams as it is,
but without an index each reader scans every shard before its first ranged read, and
without a manifest the planner scans them all to count the samples. `index_tars`
does that scan once: it writes ``<shard>.tar.idx`` beside each shard and
``manifest.msgpack`` beside them all, and leaves the shards untouched, byte for byte,
so WebDataset and `tar` read them as before. The folder is then a shardstream
dataset with every guarantee of a packed one: exact sample-level splitting, `len()`,
ranged reads, checksums, exact resume.

Compressed tars (`.tar.gz`, or a `.tar.zst` of one frame) cannot be read by ranges,
so `index_tars` refuses them. `repack_tars` rewrites tars of any kind as shardstream
shards instead: every sample, every field's bytes, in their order.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import hashlib
import os
import warnings
from typing import Any, Sequence

import numpy as np

from ._version import __version__
from .arguments import flag
from .braces import COMPRESSED_TARS, expand_braces, folder_named, names_shards
from .errors import DuplicateKeyError, ShardstreamError, add_note
from .format import INDEX_SUFFIX, MANIFEST_NAME, Manifest, ShardIndex, ShardInfo
from .indexes import load_index
from .tarstream import CountingReader, StreamTarReader, scan_tar
from .shardfile import IMAGE_LEVEL, LEVEL
from .retry import RetryPolicy
from .storage import Store
from .urls import expand_home, is_local, local_path, split_url
from .threads import ordered_map
from .writer import check_level_used, write_manifest

__all__ = ["index_tars", "repack_tars"]


def index_tars(source: str | os.PathLike[str] | Sequence[str], *, workers: int = 8, overwrite: bool = False,
               storage_options: dict[str, Any] | None = None, progress: bool = False,
               manifest: bool = True) -> Manifest:
    """Index plain `.tar` shards in place and write the manifest that makes them a dataset.

    `source` is a folder or URL prefix (its ``*.tar`` files, in name order), a brace
    pattern (``shards-{000000..000099}.tar``) or a list of shard URLs, all in one folder.
    Each shard is read once (`workers` at a time); samples are the members that share
    a key, as WebDataset groups them; a `cls` field that holds an integer gives the
    sample's class (the class table names classes by their numbers), a `weight` field
    its sampling weight. Tars without samples are left out of the manifest. Returns
    the manifest written. An existing manifest is replaced only with `overwrite`.

    A folder holds one manifest, so one dataset. Without `manifest`, only the indexes
    are written (the manifest is returned, not written): another set of shards in a
    folder that has its dataset (``val-*.tar`` beside ``train-*.tar``) then streams by
    its brace pattern or list, sample by sample, its counts read from the indexes.
    """
    overwrite, progress = flag(overwrite, "overwrite"), flag(progress, "progress")  # "false" replaced it
    write = flag(manifest, "manifest")
    store, names = _shards(source, storage_options or {})
    if store.root.startswith(("http://", "https://")):
        raise ShardstreamError("cannot write indexes over HTTP: index the tars where they can be written "
                               "(a local folder, S3), then serve the folder", url=store.root)
    if write and store.exists(MANIFEST_NAME):
        _check_replaceable(store, overwrite, names)
    if not overwrite:
        _refuse_foreign_indexes(store, names)
    from .progress import progress_bar

    scans: list[tuple[ShardInfo, np.ndarray | None, np.ndarray]] = []
    # A transient storage error mid-read reads the shard again, from the start. On an
    # error, the shards not yet started are not read.
    futures = ordered_map(lambda name: store.retry.call(_index_shard, store, name, url=store.url(name)), names,
                          max(1, workers), name="shardstream-index")
    with contextlib.closing(futures), \
            progress_bar(total=len(names), unit="shard", desc="index", disable=not progress) as bar:
        for future in futures:
            scans.append(future.result())
            bar.update(1)
    shards = tuple(info for info, _, _ in scans if info.samples)
    _warn_of_keys_repeated(store, [(info.name, hashes) for info, _, hashes in scans])
    labels = np.concatenate([lab for _, lab, _ in scans if lab is not None] or [np.zeros(0, np.int64)])
    labels = labels[labels >= 0]
    counts = np.bincount(labels) if labels.size else np.zeros(0, np.int64)
    made = Manifest(
        shards=shards,
        compression="none",
        classes=tuple(str(i) for i in range(len(counts))),
        class_counts=tuple(int(c) for c in counts),
        options={"indexed_in_place": True},
        writer=f"shardstream {__version__} (index)",
    )
    if write:
        write_manifest(store, made)
    if not counts.size and "cls" in made.shards.all_fields():
        # WebDataset writers often store class names there ({"cls": "bird"}): read as labels they fail,
        # sample after sample, long after this had read them all.
        warnings.warn(f"{store.root}: samples hold a cls field, and none is an integer class index (class "
                      "names?): the manifest has no class table, and a cls read decodes as an integer and fails "
                      "on them; leave cls out of fields=, or `shardstream repack --class-names` them, which numbers "
                      "the classes",
                      stacklevel=2)
    return made


def repack_tars(source: str | os.PathLike[str] | Sequence[str], dst: str | os.PathLike[str], *,
                shard_size: int | str = "256MB", compression: str = "zstd", level: int = IMAGE_LEVEL,
                storage_options: dict[str, Any] | None = None, progress: bool = False,
                overwrite: bool = False, class_names: bool = False, prefix_keys: bool = False) -> Manifest:
    """Rewrite tars written by other tools (`.tar`, `.tar.gz`, `.tar.zst`, ...) as a shardstream dataset at `dst`.

    `source` is as for `index_tars`, but compressed tars are welcome: each is read
    once, front to back, and every sample goes to `dst` with its key and its fields'
    bytes unchanged, in order, through `ShardWriter` (zstd frames, indexes, a manifest;
    a `cls` field must then hold an integer, and keys must be unique). With `class_names`,
    a `cls` holds a class's name (`{"cls": "bird"}`, as WebDataset writers often store it):
    the tars are read twice, first for the names, which sorted make the class table (as
    torchvision's ImageFolder sorts its folders), then written with each `cls` its index.
    With `prefix_keys`, each key becomes ``<tar name>/<key>`` (``shards-000003/000017``):
    tars written by several processes often number their samples from 0 each, and a key
    repeated across tars is refused (the refusal names the tar that had it first).
    The shards are read one after another; the output is the same whatever the machine. A dataset
    already at `dst` is replaced only with `overwrite`, as `pack` does.
    """
    from .progress import progress_bar
    from .writer import ShardWriter

    overwrite, progress = flag(overwrite, "overwrite"), flag(progress, "progress")
    check_level_used(compression, level, IMAGE_LEVEL)
    options = storage_options or {}
    dst = os.fspath(dst)
    store, names = _shards(source, options, compressed=True)
    if _same_folder(store, Store(dst, options)):
        # The writer's shards would replace the tars being read (WebDataset names them as it does).
        raise ShardstreamError("the destination is the folder of the tars to repack, which repack would write over "
                               "while it reads them: choose another folder", url=dst)
    if not overwrite and Store(dst, options).exists(MANIFEST_NAME):
        raise ShardstreamError("already holds a dataset; pass overwrite=True (--overwrite) to replace it",
                               url=Store(dst, options).url(MANIFEST_NAME))
    # Another tool's bytes as they came (as `index` keeps them): a field that does not read
    # back as its extension says (Latin-1 text) is the reader's to refuse, one sample, not
    # the whole repack's.
    classes = _class_names(store, names, progress) if flag(class_names, "class_names") else None
    writer = ShardWriter(dst, shard_size, compression=compression, level=level if compression == "zstd" else LEVEL,
                         storage_options=options, overwrite=overwrite, check_bytes=False, classes=classes or ())
    numbers = {name.encode(): str(i).encode() for i, name in enumerate(classes or ())}
    prefix_keys = flag(prefix_keys, "prefix_keys")
    starts: list[int] = []  # how many samples came before each tar: where a repeated key was first
    written = 0
    try:
        with progress_bar(total=len(names), unit="shard", desc="repack", disable=not progress) as bar:
            for name in names:
                starts.append(written)
                prefix = tar_stem(name) + "/" if prefix_keys else ""
                for sample in StreamTarReader(store, name):
                    sample.pop("__url__", None)
                    if prefix and isinstance(sample.get("__key__"), str):
                        sample["__key__"] = prefix + sample["__key__"]
                    if classes is not None and "cls" in sample:
                        sample["cls"] = numbers[bytes(sample["cls"])]
                    try:
                        _write_from(writer, sample, store.url(name))
                    except DuplicateKeyError as e:
                        raise _first_source(e, writer, store, names, starts, prefix_keys) from None
                    except ShardstreamError as e:
                        if classes is None and e.detail.startswith("cls must be an integer"):
                            add_note(e, "class names in cls: repack with --class-names (class_names=True), "
                                       "which numbers them in sorted order")
                        raise
                    written += 1
                bar.update(1)
    except BaseException:
        writer.abort()  # no manifest, no partial shard
        raise
    return writer.close()


def _class_names(store: Store, names: list[str], progress: bool) -> list[str]:
    """Every `cls` of the tars `names`, as text, sorted: a first reading of them all."""
    from .progress import progress_bar

    found: set[str] = set()
    with progress_bar(total=len(names), unit="shard", desc="class names", disable=not progress) as bar:
        for name in names:
            for sample in StreamTarReader(store, name):
                if "cls" in sample:
                    try:
                        found.add(bytes(sample["cls"]).decode("utf-8"))
                    except UnicodeDecodeError:
                        raise ShardstreamError("cls is not UTF-8 text, which class names are", url=store.url(name),
                                               key=sample.get("__key__")) from None
            bar.update(1)
    return sorted(found)


def tar_stem(name: str) -> str:
    """A tar's file name without its folder and its extensions (``shards-000003`` of
    ``x/shards-000003.tar.gz``)."""
    base = name.rsplit("/", 1)[-1]
    for suffix in (*COMPRESSED_TARS, ".tar"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _first_source(error: DuplicateKeyError, writer: Any, store: Store, names: list[str], starts: list[int],
                  prefixed: bool) -> DuplicateKeyError:
    """`error`, for a key repeated in the tars, naming the tar its first sample came from
    (the writer names only the shard it wrote it to, which the user never made)."""
    at = writer.position(error.key) if error.key is not None else None
    if at is None:
        return error
    first = names[bisect.bisect_right(starts, at) - 1]
    if first == names[len(starts) - 1]:
        where = "earlier in this same tar"
    else:
        hint = "" if prefixed else ("; tars written apart often number their samples alike: --prefix-keys "
                                    "(prefix_keys=True) makes each key <tar name>/<key>")
        where = f"first in {store.url(first)}{hint}"
    return DuplicateKeyError(f"duplicate sample key: {where}", url=error.url, key=error.key)


def _same_folder(a: Store, b: Store) -> bool:
    """Whether two stores are one folder, however spelled (`Store.folder`): locally through
    links too; ``memory://t`` and ``memory:///t``, or ``simplecache::file:///x`` and ``/x``,
    were told apart, and repack wrote its shards over the tars it was reading."""
    return a.folder() == b.folder()


def _write_from(writer: Any, sample: dict[str, Any], url: str) -> None:
    """`writer.write(sample)`, its key in normal form (`normal_key`), its refusal naming the
    tar `url` the sample came from (among perhaps a thousand) and the sample."""
    key = sample.get("__key__")
    if isinstance(key, str):
        sample = {**sample, "__key__": normal_key(key)}
    try:
        writer.write(sample)
    except ShardstreamError as e:
        if e.url is not None:  # about another file (the destination refused): as it named it
            raise
        raise type(e)(e.detail, url=url, key=e.key or _printable_key(sample), offset=e.offset) from e


def normal_key(key: str) -> str:
    """`key` as the file `tar -x` makes of it: without empty and "." parts and a leading
    "/" (`tar -C DIR -cf x.tar .` names every member "./..."), which the writer refuses, as
    two such spellings of one file would be two samples. ".." is left for it to refuse."""
    return "/".join(part for part in key.split("/") if part not in ("", "."))


def _printable_key(sample: dict[str, Any]) -> str | None:
    key = sample.get("__key__")
    return key if isinstance(key, str) and key else None


def _check_replaceable(store: Store, overwrite: bool, names: Sequence[str]) -> None:
    """Refuse to replace a manifest unless told to, and never one that `pack` wrote."""
    url = store.url(MANIFEST_NAME)
    try:
        existing: Manifest | None = Manifest.from_bytes(store.read(MANIFEST_NAME), url)
    except ShardstreamError:
        existing = None  # unreadable: nothing is lost by replacing it
    if not overwrite:
        listed = list(existing.shards.names) if existing is not None else []
        if listed and not set(listed) & set(names):  # val-*.tar beside train-*.tar: the folder's dataset would change
            shown = ", ".join(listed[:2]) + (", ..." if len(listed) > 2 else "")
            raise ShardstreamError(f"already holds the manifest of other shards ({shown}: {len(listed)} shards), "
                                   "which --overwrite would replace, and the folder would stream these instead: a "
                                   "folder is one dataset; index these in a folder of their own, or with "
                                   "--no-manifest (manifest=False: their indexes only) and stream them by their "
                                   "brace pattern", url=url)
        raise ShardstreamError("already holds a manifest; pass overwrite=True (--overwrite) to replace it", url=url)
    if existing is None:
        return
    if not existing.options.get("indexed_in_place"):
        raise ShardstreamError(f"a dataset written by {existing.writer}, already indexed; replacing its manifest "
                               "would lose its class names and pack record", url=url)


def _refuse_foreign_indexes(store: Store, names: Sequence[str]) -> None:
    """Refuse to write `<shard>.idx` over a file of that name that is no shardstream index
    (another tool's: written over without a word, where `pack` refuses unlisted files)."""
    present = set(store.list(INDEX_SUFFIX))
    for name in names:
        if name + INDEX_SUFFIX not in present:
            continue
        url = store.url(name + INDEX_SUFFIX)
        try:
            ShardIndex.from_bytes(store.read(name + INDEX_SUFFIX), url)
        except ShardstreamError:
            raise ShardstreamError("already there, and not a shardstream index (another tool's?): pass "
                                   "overwrite=True (--overwrite) to replace it", url=url) from None


def _shards(source: str | os.PathLike[str] | Sequence[str], options: dict[str, Any], *,
            compressed: bool = False) -> tuple[Store, list[str]]:
    """The one folder the shards are in, and their names (plain tars only, unless `compressed`)."""
    kinds = (".tar", *COMPRESSED_TARS) if compressed else (".tar",)
    if isinstance(source, os.PathLike):  # a folder as pathlib.Path, as `pack` and the dataset take one
        source = os.fspath(source)
    # A local folder is a folder whatever its name (`webdataset.tar/`, read as one shard: "is a directory").
    if isinstance(source, str) and (not names_shards(source) or (
            is_local(source) and os.path.isdir(local_path(expand_home(source))))):
        source = folder_named(source)
        store = Store(source, options, RetryPolicy())
        listed = store.list()
        names = [n for n in listed if n.endswith(kinds)]
        packed = [n for n in listed if n.endswith(COMPRESSED_TARS)] if not compressed else []
        if not names:
            if MANIFEST_NAME in listed and packed:  # `index` of what `pack` made: nothing to do
                raise ShardstreamError("already a shardstream dataset (its manifest and indexed shards are here): "
                                       "nothing to index", url=source)
            raise ShardstreamError("no .tar shards here" + (
                f" (only compressed ones, such as {packed[0]}: decompress them first, or `shardstream repack` "
                "the folder)" if packed else ""),
                url=source)
        if packed:  # left out of the manifest: say so, or their samples are missing without a word
            warnings.warn(f"{store.location}: {len(packed)} compressed tars (such as {packed[0]}) are left out: "
                          "they cannot be read by ranges; decompress them, or `shardstream repack` the folder",
                          stacklevel=3)
    else:
        urls = expand_braces(source) if isinstance(source, str) else list(source)
        if not urls:
            raise ShardstreamError("no shards given")
        parents = {split_url(url)[0] for url in urls}
        if len(parents) > 1:
            raise ShardstreamError(f"the shards must share one folder, for the manifest beside them: {sorted(parents)}")
        store = Store(parents.pop(), options, RetryPolicy())
        names = [split_url(url)[1] for url in urls]
    refused = [n for n in names if not n.endswith(kinds)]
    if refused and compressed:
        raise ShardstreamError(f"not tars: {', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''}",
                               url=store.url(refused[0]))
    if refused:
        raise ShardstreamError(
            f"only plain .tar shards can be indexed in place (a compressed tar cannot be read by ranges): "
            f"{', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''}; decompress them first, or "
            "`shardstream repack` them into a new dataset",
            url=store.url(refused[0]))
    repeated = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if repeated:  # a manifest listing a shard twice is refused by every reader
        raise ShardstreamError(f"shards listed more than once: {', '.join(repeated[:5])}", url=store.url(repeated[0]))
    return store, names


def _warn_of_keys_repeated(store: Store, shards: list[tuple[str, np.ndarray]]) -> None:
    """Warn where a key comes back in another shard (tars written by several processes, each
    numbering from 0): FORMAT.md allows it in tars indexed in place, but a sample is then
    told apart by its shard and key, and a metric gathered by key alone (README's validation
    recipe) silently scored half a set (found by a walk of distributed evaluation). By the
    keys' hashes, sorted (16 bytes a sample for the moment); the keys named are read back
    from the two shards' indexes, and a hash shared by two other keys is no repeat."""
    hashes = np.concatenate([h for _, h in shards] or [np.zeros(0, np.int64)])
    owners = np.repeat(np.arange(len(shards)), [len(h) for _, h in shards])
    order = np.argsort(hashes, kind="stable")
    hashes, owners = hashes[order], owners[order]
    again = np.flatnonzero((hashes[1:] == hashes[:-1]) & (owners[1:] != owners[:-1]))
    for at in again:
        first, other = shards[owners[at]][0], shards[owners[at + 1]][0]
        keys = [set(load_index(store, name).keys) for name in (first, other)]
        common = sorted(keys[0] & keys[1])
        if common:
            break
    else:
        return
    repeated = len({int(hashes[at]) for at in again})
    warnings.warn(f"{store.root}: {repeated:,} sample key{'s' if repeated > 1 else ''} come back in another shard "
                  f"(such as {common[0]!r}, in {first} and {other}): a sample is told apart by its shard and key "
                  "(fields=(\"__url__\", \"__key__\")), not by its key alone; `shardstream repack --prefix-keys` "
                  "makes every key unique", stacklevel=3)


def _index_shard(store: Store, name: str) -> tuple[ShardInfo, np.ndarray | None, np.ndarray]:
    """Scan one shard, write its index beside it; its manifest entry, its labels and its keys'
    hashes (this process's `hash`: the threads of one `index` share it)."""
    with store.open(name) as f:
        counted = CountingReader(f, hashlib.sha256())
        index, fields = scan_tar(counted, store.url(name))
        while counted.read(1 << 20):  # the end-of-archive blocks: the checksum covers the whole file
            pass
    index = dataclasses.replace(index, shard_bytes=counted.position)
    if not len(index):
        return ShardInfo(name, 0, counted.position, counted.position, "", "", 0, "", ()), None, np.zeros(0, np.int64)
    data = index.to_bytes()
    store.write(name + INDEX_SUFFIX, data)
    info = ShardInfo(name=name, samples=len(index), bytes=counted.position, raw_bytes=counted.position,
                     sha256=counted.hash.hexdigest(), index=name + INDEX_SUFFIX, index_bytes=len(data),  # type: ignore[union-attr]
                     index_sha256=hashlib.sha256(data).hexdigest(), fields=fields)
    # 8 bytes a key, not the key (111 bytes a sample held to the end: 11 GB at 10^8 samples).
    return info, index.labels, np.fromiter(map(hash, index.keys), dtype=np.int64, count=len(index))
