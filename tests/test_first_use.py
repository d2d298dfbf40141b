"""What a new user meets first: mixed image formats, misplaced options, forgotten calls, wrong paths.

Regressions from a walk through README as a new user (the thirty-sixth session's first
review): each of these once failed without a word, or with an error that pointed elsewhere.
"""

from __future__ import annotations

import io
import re
import shutil
import tarfile
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import shardstream as ss
from shardstream import ManifestError, MissingFieldError, PackError
from shardstream.errors import CollateError
from shardstream.format import MANIFEST_NAME

from _data import listed

FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, str]:
    """An image folder of JPEGs, PNGs and WebPs in two classes (4 of each format a class), packed."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / "src" / name).mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 255, (40 + i, 48, 3), dtype=np.uint8)
            for extension, kind in FORMATS.items():
                Image.fromarray(pixels).save(root / "src" / name / f"{extension}{i}.{extension}", kind)
    ss.pack(str(root / "src"), str(root / "ds"), workers=1, progress=False)
    return root / "src", str(root / "ds")


def test_images_of_several_formats_read_through_one_field_name(mixed):
    """pack stores each image under its format's field: a JPEG-only `fields` fails at the first
    PNG, naming the field that takes them all; that field reads every image, decoded alike."""
    _, url = mixed
    with pytest.raises(MissingFieldError, match=re.escape("fields=('jpg;png;webp', ...) takes whichever")):
        list(ss.StreamingDataset(url, fields=("jpg", "cls")))
    ds = ss.StreamingDataset(url, fields=("jpg;png;webp", "cls", "__key__"), decode=ss.RandomResizedCropJPEG(32))
    got = list(ds)
    assert len(got) == 24 and {tuple(image.shape) for image, _, _ in got} == {(3, 32, 32)}
    assert sorted(key.split("/")[1][:-1] for _, _, key in got) == sorted(list(FORMATS) * 8)


def test_a_batch_of_samples_of_several_image_formats_names_the_field_that_takes_them(mixed):
    _, url = mixed
    with pytest.raises(CollateError, match=re.escape("fields=('jpg;png;webp', ...) takes whichever")):
        list(ss.StreamingDataset(url, batch_size=6, shuffle=True))


def test_classes_name_the_labels(mixed):
    _, url = mixed
    assert ss.StreamingDataset(url).classes == ("cat", "dog")
    first = str(next(Path(url).glob("*.tar.zst")))
    assert ss.StreamingDataset([first]).classes == ()  # a shard named alone: no manifest
    assert ss.StreamingDataset(ss.Mix((url, url), (1, 1))).classes == ("cat", "dog")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_batching_the_datasets_batches_again_is_refused(mixed, num_workers):
    """`DataLoader(ds)` (torch's default batch_size=1) over a dataset that batches stacked every
    batch into a batch of one, and a short last batch failed in torch's stack: refused now,
    saying what to pass. `batch_size=None` works, and so does a collate_fn of the user's own."""
    _, url = mixed
    ds = ss.StreamingDataset(url, fields=("jpg;png;webp", "cls"), decode=ss.RandomResizedCropJPEG(16), batch_size=5)
    with pytest.raises(ValueError, match=re.escape("pass DataLoader(batch_size=None)")):
        listed(torch.utils.data.DataLoader(ds, num_workers=num_workers))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers))
    assert [len(labels) for _, labels in batches] == [5] * 4 + [4]
    grouped = list(torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=list, num_workers=num_workers))
    assert sum(len(group) for group in grouped) == 5


@pytest.mark.parametrize("option", ["shuffle", "drop_last", "collate_fn", "sampler", "worker_init_fn"])
def test_torch_dataloader_options_name_where_they_go(mixed, option):
    _, url = mixed
    with pytest.raises(TypeError, match=rf"takes no {option}; {option}: "):
        ss.DataLoader(ss.StreamingDataset(url), batch_size=2, **{option: None})
    with pytest.raises(TypeError, match="no_such_option: no such option"):
        ss.DataLoader(ss.StreamingDataset(url), batch_size=2, no_such_option=1)


def test_a_shuffled_epoch_read_again_without_set_epoch_is_warned_of(mixed):
    """Every epoch of a loop that never calls set_epoch is the first's order, as with torch's
    DistributedSampler, and nothing showed it."""
    _, url = mixed

    def dataset(**kwargs) -> ss.StreamingDataset:
        return ss.StreamingDataset(url, fields=("__key__",), **kwargs)

    ds = dataset(shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, again = list(ds), list(ds)
    assert first == again
    sampled = dataset(sampling=ss.Sampling(samples_per_epoch=10))  # unshuffled: an epoch's draw is the epoch's
    with pytest.warns(UserWarning, match=re.escape("epoch 0 begins again")):
        assert list(sampled) == list(sampled)
    assert [str(w.message) for w in caught if "set_epoch" in str(w.message)] == [
        "epoch 0 begins again in the order of the pass just read (a shuffle's order, and a Sampling's draw, are "
        "the epoch's): call set_epoch(epoch) (on the dataset or shardstream.DataLoader) before each epoch, or "
        "every epoch is this one"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = dataset(shuffle=True)
        for epoch in range(3):
            ds.set_epoch(epoch)
            list(ds)
        ds.set_epoch(2)  # the same epoch again, chosen: the loop means it
        list(ds)
        ds = dataset()  # unshuffled: the order is the file order anyway
        list(ds), list(ds)
        ds = dataset(shuffle=True)
        next(iter(ds))  # a pass left early is no epoch read
        list(ds)
        ds = dataset(shuffle=True)
        look = iter(ss.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=False))
        next(look)  # its workers read their shares to their ends ahead of this look
        look.close()
        list(ds)
        ds = dataset(shuffle=True)
        it = iter(ds)
        next(it)
        state = ds.state_dict()
        list(it)
        ds.load_state_dict(state)  # the rest of the epoch from a state, after a pass read to its end
        assert len(list(ds)) == 23


def test_a_worker_warns_of_an_epoch_read_again_without_set_epoch(mixed, tmp_path):
    """In DataLoader workers (here, a script's: pytest's warning capture would keep a forked
    worker's to itself), one worker says so, once a dataset (found by review: said every epoch)."""
    _, url = mixed
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "import shardstream as ss\n"
        "if __name__ == '__main__':\n"
        "    ds = ss.StreamingDataset(sys.argv[1], fields=('__key__',), shuffle=True)\n"
        "    loader = ss.DataLoader(ds, batch_size=4, num_workers=2)\n"
        "    for epoch in range(3):\n"
        "        print(sum(len(keys) for keys, in loader))\n"
        "    ds = ss.StreamingDataset(sys.argv[1], fields=('__key__',), shuffle=True)\n"
        "    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)  # new workers each epoch\n"
        "    for epoch in range(3):\n"
        "        print(sum(1 for _ in loader))\n")
    script.write_text("import torch\n" + script.read_text())
    done = subprocess.run([sys.executable, str(script), url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["24"] * 6, done
    # Once a dataset; torch's own loader with workers tells no process that its loop received an epoch
    # whole (a worker at the end of its share may be far ahead of the loop: a look at one batch was
    # warned of, found by review), so the second dataset is not warned of.
    assert done.stderr.count("begins again in the order of the pass just read") == 1, done.stderr


def test_a_location_without_a_manifest_says_what_is_there(mixed, tmp_path):
    src, url = mixed
    (tmp_path / "empty").mkdir()
    parent = Path(url).parent
    splits = tmp_path / "splits"
    for split in ("train", "val"):
        shutil.copytree(src, splits / split)
    runs = tmp_path / "runs"  # a dataset among many folders (found by review: the first 64 entries only)
    for i in range(300):
        (runs / f"run{i:03d}").mkdir(parents=True)
    shutil.copytree(url, runs / "run150" / "ds")
    (runs / "run150" / "ds").rename(runs / "zz_ds")
    parts = tmp_path / "parts"
    ss.pack(str(src), str(parts), part=(0, 2), workers=1, progress=False)
    gzipped = tmp_path / "gzipped"  # found by a WebDataset migrant's walk: told of `index`, which leaves them out
    gzipped.mkdir()
    for i in range(2):
        with tarfile.open(gzipped / f"shard-{i}.tar.gz", "w:gz") as tar:
            tar.add(next(iter(sorted(src.rglob("*.jpg")))), arcname=f"k{i}.jpg")
    cases = {tmp_path / "nowhere": "(no such folder)", tmp_path / "empty": "(an empty folder)",
             src: "images, not shards: `shardstream pack` packs a folder of class folders",
             src / "cat": "images, not shards", parent: f"datasets in its folders ({Path(url).name}): name one",
             splits: "image folders in its folders (train, val): `shardstream pack` packs each",
             runs: "datasets in its folders (zz_ds): name one",
             parts: "parts of a pack, not merged yet: `shardstream merge` merges them",
             gzipped: "compressed tars (shard-0.tar.gz, ...): stream them by a brace pattern or a list of their "
                      "paths, or `shardstream repack` them"}
    for location, said in cases.items():
        with pytest.raises(ManifestError, match=re.escape(said)):
            ss.StreamingDataset(str(location)).resolve()
    unfinished = tmp_path / "unfinished"  # a pack's own shards, its manifest not written: not "compressed tars"
    shutil.copytree(url, unfinished)
    (unfinished / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match=re.escape("(or packing has not finished;")):
        ss.StreamingDataset(str(unfinished)).resolve()
    # A folder named like a shard is a folder (found by review: "it names shards" for `verify photos.tar/`).
    shutil.copytree(src, tmp_path / "photos.tar")
    with pytest.raises(ManifestError, match=re.escape("images, not shards: `shardstream pack`")):
        ss.open_dataset(str(tmp_path / "photos.tar"))
    shards = sorted(Path(url).glob("*.tar*"))
    pattern = str(Path(url) / (shards[0].name.split("-")[0] + "-{000000..000001}" + shards[0].name[-len(".tar.zst"):]))
    for named in (pattern, str(Path(url) / "shard-00000*.tar.zst")):  # as `inspect` and `verify` open them
        with pytest.raises(ManifestError, match=re.escape("it names shards, not a dataset's folder")):
            ss.open_dataset(named)
    with pytest.raises(ManifestError, match=re.escape("(no such folder)")):  # a name mistyped: nothing there
        ss.open_dataset(str(tmp_path / "nowhere.tar"))
    with pytest.raises(ManifestError, match="a dataset's manifest: the dataset is the folder that holds it"):
        ss.StreamingDataset(str(Path(url) / MANIFEST_NAME)).resolve()


def test_pack_names_a_missing_source_and_images_in_no_class(mixed, tmp_path):
    src, _ = mixed
    with pytest.raises(PackError, match="nothing is there"):
        ss.pack(str(tmp_path / "nowhere"), str(tmp_path / "out"), progress=False)
    folder = tmp_path / "src"
    (folder / "cat").mkdir(parents=True)
    for path in Path(src, "cat").iterdir():
        (folder / "cat" / path.name).write_bytes(path.read_bytes())
    (folder / "stray.jpg").write_bytes((folder / "cat" / "jpg0.jpg").read_bytes())
    (folder / "._stray.jpg").write_bytes(b"\0\5\26\7")  # macOS's AppleDouble file: hidden, no image
    summary = ss.pack(str(folder), str(tmp_path / "out"), workers=1, progress=False)
    assert summary.samples == 12 and summary.unclassed == ["stray.jpg"]
    assert "1 images beside the class folders, in no class (move them into one to pack them): stray.jpg" \
        in str(summary)


def test_cli_help_says_the_defaults():
    for command, options in {"demo": ("--images", "--classes", "--workers"), "bench": ("--batch-size",)}.items():
        shown = subprocess.run([sys.executable, "-m", "shardstream.cli", command, "--help"], capture_output=True,
                               text=True, check=True).stdout
        for option in options:
            assert re.search(rf"{option} \S+\s+.*\(default \d+\)", shown), (option, shown)
