"""`shardstream demo`: the whole path on a small realistic image folder, with timings.

Makes ImageNet-like JPEGs in a temporary folder, packs them, verifies the shards,
streams two shuffled epochs through `shardstream.DataLoader` with decoding and a
random-resized-crop in worker processes, checks that every image arrived exactly once
per epoch, and shows a mid-epoch resume landing on the very batches it should.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from .dataset import StreamingDataset
from .decode import jpeg_crop_decoder
from .errors import ShardstreamError
from .listing import list_source
from .loader import DataLoader, Normalize
from .pack import pack
from .reader import TARCUT
from .streams import say
from .synthetic import make_image_folder
from .transforms import RandomResizedCropJPEG
from .verify import verify_dataset


def run_demo(images: int = 400, classes: int = 4, workers: int = 2, keep: str | None = None) -> list[str]:
    """Run the demo, printing each step; returns the checks that failed (none, normally).

    With `keep`, a folder an earlier demo kept is used again if it holds the images this
    run would make, and refused if not (a ShardstreamError), so that the counts checked
    and printed are those of the images there.
    """
    if images < classes:  # a class of no image; `images // classes` per class made `classes` of them
        raise ShardstreamError(f"the demo makes at least one image a class: {images} images for {classes} classes")
    if keep is not None and os.path.exists(keep) and not os.path.isdir(keep):
        raise ShardstreamError("--keep needs a folder, and this is a file", url=keep)
    root = keep or tempfile.mkdtemp(prefix="shardstream-demo-")
    os.makedirs(root, exist_ok=True)
    src, dst = os.path.join(root, "images"), os.path.join(root, "shards")
    failed: list[str] = []
    try:
        t = time.perf_counter()
        per_class = [images // classes + (c < images % classes) for c in range(classes)]  # exactly `images`
        total = images
        if os.path.isdir(src):
            _check_kept_images(src, total, classes)
            say(f"1. reused the {total} ImageNet-like JPEGs an earlier demo made in {src}")
        else:
            make_image_folder(src, num_classes=classes, images_per_class=per_class, seed=0, workers=2)
            say(f"1. made {total} ImageNet-like JPEGs in {src} ({time.perf_counter() - t:.1f} s)")

        summary = pack(src, dst, shard_size="8MB", overwrite=True, progress=False)
        say(f"2. {summary}".replace("\n", "\n   "))

        report = verify_dataset(dst)
        say(f"3. verify: {report.shards} shard{'' if report.shards == 1 else 's'}, {report.images} images decoded, "
              f"{'ok' if report.ok else report.problems}")
        if not report.ok or report.images != total:
            failed.append(f"verify ({len(report.problems)} problems, {report.images} of {total} images decoded)")

        dataset = StreamingDataset(dst, shuffle=True, seed=0, decode=RandomResizedCropJPEG(224),
                                   fields=("jpg", "cls", "__key__"))
        loader = DataLoader(dataset, batch_size=32, num_workers=workers, transform_on_device=Normalize(field=0))
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen: list[str] = []
            for images_, labels, keys in loader:
                seen += keys
            s = loader.stats
            once = len(seen) == len(set(seen)) == total
            if not once:
                failed.append(f"epoch {epoch}: {len(seen)} images, {len(set(seen))} different, not each of {total} once")
            say(f"{'4.' if epoch == 0 else '  '} epoch {epoch}: {s.batches} batch{'es' if s.batches != 1 else ''} of "
                f"{tuple(images_.shape[1:])} float images, {s.samples_per_s:,.0f} img/s with {workers} workers, "
                f"first batch after {s.first_batch_s:.2f} s, waited {100 * s.wait_fraction:.0f}% of the time "
                "(the loop trains nothing: it only waits); "
                + ("each image exactly once" if once else "NOT each image exactly once"))

        loader.set_epoch(2)
        after = max(0, min(3, len(loader) - 1))  # a few batches in, and at least one left to resume onto
        it = iter(loader)
        for _ in range(after):
            next(it)
        state = loader.state_dict()
        del it
        expected = [keys for _, _, keys in loader][after:]
        resumed = DataLoader(StreamingDataset(dst, shuffle=True, seed=0, decode=RandomResizedCropJPEG(224),
                                              fields=("jpg", "cls", "__key__")), batch_size=32, num_workers=workers)
        resumed.load_state_dict(state)
        got = [keys for _, _, keys in resumed]
        say(f"5. resumed epoch 2 after {after} batches from a {len(str(state))}-byte state: "
              f"{'the same' if got == expected else 'DIFFERENT'} {len(got)} batch{'es' if len(got) != 1 else ''} as "
              "the uninterrupted run")
        if got != expected:
            failed.append(f"resume: {len(got)} batches, not the {len(expected)} of the uninterrupted run")
        say(f"   JPEG crops decoded by {jpeg_crop_decoder()}")
        say("   samples cut out of shards " + ("in C (shardstream._tarcut)" if TARCUT else
                                              "in Python (the _tarcut extension is not built)"))
        say(f"   device: {'cuda' if torch.cuda.is_available() else 'cpu (no CUDA here)'}; files in {root}"
              + ("" if keep else " (removed)"))
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return failed


def _check_kept_images(src: str, total: int, classes: int) -> None:
    """Refuse a kept image folder that does not hold what this run would make (another
    --images or --classes, or a demo stopped while making them): the checks would fail."""
    listing = list_source(src)
    if (len(listing.files), len(listing.classes)) != (total, classes):
        raise ShardstreamError(f"holds {len(listing.files)} images in {len(listing.classes)} classes (kept by an "
                               f"earlier demo), not the {total} in {classes} this run makes; remove it, or give "
                               "--keep another folder", url=src)
