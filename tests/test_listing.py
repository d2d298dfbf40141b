"""The listing's fast paths against the definitions they replace.

A listing runs once for every file of the source, in every part of a pack in parts, so
it does per folder what it can and avoids os.path.relpath and os.path.splitext; the
keys it makes are in every shard, and must never change. These properties hold it to
the slow definitions: WebDataset's key rule as written out here, splitext, relpath.
"""

from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from shardstream.filelist import _relative
from shardstream.listing import list_source
from shardstream.sourcefile import IMAGE_FIELDS, image_field, key_prefix, sample_key, stem_key


def reference_key(relpath: str) -> str:
    """The key rule as listing.py wrote it before it was made fast: the file's name before
    its last dot, the other dots made '_' (WebDataset splits a member's name at its first
    dot, so a key holds none), '.' and empty components dropped, and '..' made '_up_' (a
    key must not climb out of a folder when a shard is extracted)."""
    parts = [("_up_" if p == ".." else p) for p in relpath.split("/") if p not in ("", ".")]
    parts[-1] = parts[-1].rsplit(".", 1)[0].replace(".", "_")
    return "/".join(parts)


NAME = st.text(alphabet="ab._-é", min_size=1, max_size=8).filter(lambda n: n not in (".", ".."))
FOLDER = st.lists(st.sampled_from(["a", "b.c", ".", "..", "", ".hidden", "é"]), max_size=3)


@settings(max_examples=500, deadline=None)
@given(FOLDER, NAME)
def test_keys_are_those_of_the_rule(folder, name):
    relpath = "/".join([*folder, name])
    assert sample_key(relpath) == reference_key(relpath)
    # The folder loop's form: the folder's part once, then each file's stem.
    assert key_prefix("/".join(folder) + "/") + stem_key(name) == reference_key(relpath)


@settings(max_examples=500, deadline=None)
@given(NAME)
def test_a_file_names_field_is_its_extension_as_splitext_finds_it(name):
    assert image_field(name) == IMAGE_FIELDS.get(os.path.splitext(name)[1].lower())


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(["a", "b.jpg", ".", "..", "", "c.d", "é.png"]), min_size=1, max_size=5),
       st.sampled_from(["", "/", "//", "/tmp/x/"]), st.sampled_from(["/tmp/x", "/", "/tmp/x/y"]))
def test_a_rows_path_is_relative_to_the_list_as_relpath_makes_it(parts, lead, root):
    file = lead + "/".join(parts)
    if not file.strip("/."):
        return  # the list's folder itself, or nothing: no file a row could name
    expected = os.path.relpath(os.path.join(root, file), root).replace(os.sep, "/")
    assert _relative(file, root) == expected


def test_a_listing_sorts_by_path_and_makes_colliding_keys_unique(tmp_path):
    names = ["a.b.jpg", "a_b.png", "x.jpg", "x.png", "x_1.jpg", ".jpg", "y.JPEG", "notes.txt"]
    for folder in ("c1", "c0/sub"):
        (tmp_path / folder).mkdir(parents=True)
        for name in names:
            (tmp_path / folder / name).write_bytes(b"")
    listing = list_source(str(tmp_path))
    paths = [f.path for f in listing.files]
    assert paths == sorted(paths) and listing.classes == ("c0", "c1")
    keys = [f.key for f in listing.files]
    assert len(set(keys)) == len(keys)
    by_path = {f.path: f.key for f in listing.files}
    # Sorted by path, the first of two files wanting one key keeps it; the next gets _1, ...
    assert by_path["c1/a.b.jpg"] == "c1/a_b" and by_path["c1/a_b.png"] == "c1/a_b_1"
    assert by_path["c1/x.jpg"] == "c1/x" and by_path["c1/x.png"] == "c1/x_1" and by_path["c1/x_1.jpg"] == "c1/x_1_1"
    assert by_path["c0/sub/y.JPEG"] == "c0/sub/y"
    assert {f.field for f in listing.files} == {"jpg", "png"}
    assert sorted(listing.ignored) == ["c0/sub/.jpg", "c0/sub/notes.txt", "c1/.jpg", "c1/notes.txt"]
    assert {(f.size, f.modified) for f in listing.files} == {(-1, -1)}  # names only: nothing looked up


def test_a_link_back_into_the_source_from_a_hidden_folder_is_not_followed(tmp_path):
    """Regression: a hidden folder (not a class; its files counted as not images) holding a link back to the
    source counted every image of every class again as "not images", so the summary's files in were more
    than the files there. Links into the source are not followed from a hidden folder, as from a class."""
    root = tmp_path / "src"
    for path in ("cat/a.jpg", "cat/b.jpg", "dog/c.jpg", ".ipynb_checkpoints/x.jpg"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(b"\xff\xd8 not decoded by a listing")
    os.symlink("..", root / ".ipynb_checkpoints" / "up")
    listing = list_source(str(root))
    assert sorted(f.path for f in listing.files) == ["cat/a.jpg", "cat/b.jpg", "dog/c.jpg"]
    assert list(listing.ignored) == [".ipynb_checkpoints/x.jpg"]


def test_a_link_in_a_loop_beside_the_class_folders_is_counted_not_fatal(tmp_path):
    """Found by a walk of a messy collection: a link to itself beside the class folders stopped
    the pack ("Too many levels of symbolic links"); within a class folder it was counted as not
    an image. It is counted as not an image at the top too."""
    root = tmp_path / "src"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.jpg").write_bytes(b"\xff\xd8 not decoded by a listing")
    os.symlink("selfloop", root / "selfloop")
    os.symlink("loop", root / "cat" / "loop")
    listing = list_source(str(root))
    assert [f.path for f in listing.files] == ["cat/a.jpg"] and listing.classes == ("cat",)
    assert sorted(listing.ignored) == ["cat/loop", "selfloop"]


def test_a_folder_nested_deeper_than_pythons_recursion_is_listed(tmp_path):
    """Regression (found by a review of pack under stress): Python 3.11's os.walk recurses, and an image 1,100
    folders down ended `pack` in a bare RecursionError. The walk keeps its own stack, in os.walk's order. (Here
    300 folders down, in a process whose recursion limit is 150: as deep, for os.walk.)"""
    import subprocess
    import sys

    deep = str(tmp_path / "src" / "c")
    os.makedirs(deep)
    for _ in range(300):
        deep = os.path.join(deep, "d")
        os.mkdir(deep)
    with open(os.path.join(deep, "x.jpg"), "wb") as f:
        f.write(b"\xff\xd8 not read by the listing")
    (tmp_path / "src" / "c" / "y.jpg").write_bytes(b"\xff\xd8")
    script = ("import sys; sys.setrecursionlimit(150); from shardstream.listing import list_source; "
              "print(*(f.path.count('/') for f in list_source(sys.argv[1]).files))")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "src")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["301", "1"], run.stderr[-2000:]
