"""Shrinking images at pack time (`pack(max_side=...)`, `shardstream pack --max-side`)."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image, ImageCms

import shardstream as ss
from shardstream import PackError
from shardstream.errors import ManifestError
from shardstream.parts import merge
from shardstream.shrink import shrink_image, shrunk_size
from shardstream.synthetic import make_image_folder
from shardstream.verify import verify_dataset


def photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A smooth picture with structure at several scales, so a wrong resize shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = [127 + 100 * np.sin(x / (7 + 5 * c) + rng.uniform(0, 6)) * np.cos(y / (11 + 3 * c)) for c in range(4)]
    array = np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)
    return Image.fromarray(array, "RGBA").convert(mode)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def opened(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def difference(a: Image.Image, b: Image.Image) -> float:
    """Mean absolute pixel difference of two images of one size and mode."""
    return float(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).mean())


@pytest.mark.parametrize("size, expected", [
    ((640, 480), (320, 240)),
    ((480, 640), (240, 320)),
    ((321, 100), (320, 100)),
    ((320, 200), (320, 200)),  # fits: unchanged
    ((10000, 3), (320, 1)),  # never a zero side
])
def test_shrunk_size(size, expected):
    assert shrunk_size(size, 320) == expected


def test_an_image_that_fits_keeps_its_bytes():
    data = encode(photo(120, 90), "JPEG", quality=75)
    assert shrink_image(data, 120) is data
    assert shrink_image(data, 500) is data


@pytest.mark.parametrize("fmt, mode", [("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGB"),
                                       ("PNG", "RGBA"), ("PNG", "L"), ("WEBP", "RGB"), ("WEBP", "RGBA")])
def test_a_larger_image_is_shrunk_in_its_own_format(fmt, mode):
    original = photo(400, 300, mode)
    data = encode(original, fmt, **({"quality": 95} if fmt != "PNG" else {}))
    out = opened(shrink_image(data, 100))
    assert (out.format, out.mode, out.size) == (fmt, mode, (100, 75))
    # The same picture, shrunk: Pillow's own resize of the decoded original, exactly
    # where the format is lossless (JPEG and WebP lose some, chroma most of all); its alpha
    # resized apart from its colours, which the decoders read without it (not weighted by it).
    def resized(image: Image.Image) -> Image.Image:
        return image.resize((100, 75), Image.Resampling.BICUBIC, reducing_gap=2.0)

    decoded = opened(data)
    reference = resized(decoded) if "A" not in mode else Image.merge(
        mode, (*resized(decoded.convert(mode[:-1])).split(), resized(decoded.getchannel("A"))))
    assert difference(out, reference) == 0 if fmt == "PNG" else difference(out, reference) < 8
    # ... and far from a picture that is merely the same size (a crop of it).
    assert difference(out, opened(data).crop((0, 0, 100, 75))) > 20


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
@pytest.mark.parametrize("source", ["WEBP", "PNG"])
def test_a_lossless_image_shrunk_into_webp_stays_lossless(source, mode):
    """Regression: a lossless WebP was shrunk into a lossy one (a mean error of 8 levels on a screenshot-like
    picture). Lossless in (a lossless WebP, or a PNG stored under a `webp` name), lossless out: exactly
    Pillow's resize of the decoded picture, the colours under transparent pixels kept."""
    from shardstream.shrink import _lossless_webp

    original = photo(400, 300, mode)
    data = encode(original, source, **({"lossless": True} if source == "WEBP" else {}))
    assert source != "WEBP" or _lossless_webp(data)
    out_bytes = shrink_image(data, 100, as_format="WEBP")
    assert _lossless_webp(out_bytes) and not _lossless_webp(encode(original, "WEBP", quality=90))
    out = opened(out_bytes)

    def resized(image: Image.Image) -> Image.Image:
        return image.resize((100, 75), Image.Resampling.BICUBIC, reducing_gap=2.0)

    decoded = opened(data)
    reference = resized(decoded) if mode == "RGB" else Image.merge(
        mode, (*resized(decoded.convert("RGB")).split(), resized(decoded.getchannel("A"))))
    assert (out.format, out.mode, out.size) == ("WEBP", mode, (100, 75))
    assert difference(out, reference) == 0


def test_a_lossy_webp_with_alpha_keeps_the_colours_under_transparent_pixels():
    """Found by a walk of a messy collection: a lossy WebP with alpha was shrunk without `exact`,
    so libwebp rewrote the colours under transparent pixels, which the decoders show (they drop
    alpha): 21 levels off on the transparent half, against 1.3 on the opaque one."""
    import numpy as np

    y, x = np.mgrid[0:300, 0:400]
    rgb = np.stack([x * 255 // 399, y * 255 // 299, np.full_like(x, 200)], -1).astype(np.uint8)
    alpha = np.where(x < 200, 255, 0).astype(np.uint8)  # the right half fully transparent
    data = encode(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), "WEBP", quality=90, exact=True)
    out = opened(shrink_image(data, 200, 90))
    reference = opened(data).convert("RGB").resize((200, 150), Image.Resampling.BICUBIC, reducing_gap=2.0)
    shrunk = np.asarray(out.convert("RGB"), dtype=np.int16)
    off = np.abs(shrunk - np.asarray(reference, dtype=np.int16)).mean(-1)
    assert out.mode == "RGBA" and off[:, 102:].mean() < 4, off[:, 102:].mean()


def test_palette_png_is_resampled_not_picked():
    original = photo(200, 100).quantize(64)
    data = encode(original, "PNG")
    out = opened(shrink_image(data, 50))
    assert (out.format, out.mode, out.size) == ("PNG", "RGB", (50, 25))
    reference = original.convert("RGB").resize((50, 25), Image.Resampling.BICUBIC, reducing_gap=2.0)
    assert difference(out, reference) < 2


def test_quality_decides_the_bytes_and_output_is_reproducible():
    data = encode(photo(600, 400), "JPEG", quality=95)
    low, high = shrink_image(data, 300, 40), shrink_image(data, 300, 95)
    assert len(low) < len(high)
    assert shrink_image(data, 300, 95) == high


def test_icc_profile_is_kept():
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    data = encode(photo(300, 200), "JPEG", quality=90, icc_profile=icc)
    assert opened(shrink_image(data, 150)).info.get("icc_profile") == icc


def test_an_image_that_cannot_be_shrunk_names_the_file():
    gif = encode(photo(300, 200).convert("P"), "GIF")
    with pytest.raises(PackError, match=r"^/data/a\.png: cannot shrink a GIF image"):
        shrink_image(gif, 100, path="/data/a.png")
    with pytest.raises(PackError, match=r"/data/b\.jpg"):
        shrink_image(b"\xff\xd8\xff\xe0 not really", 100, path="/data/b.jpg")


def test_a_decompression_bomb_is_refused_by_name():
    data = bytearray(encode(photo(64, 48), "JPEG"))
    sof = data.find(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, 20000, 20000)  # the header now claims 400 megapixels
    with pytest.raises(PackError, match=r"^/data/huge\.jpg: too large to shrink safely"):
        shrink_image(bytes(data), 100, path="/data/huge.jpg")


# -- through pack --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """14 JPEGs of 64x48 to 96x80 px: some fit in 72 px, most do not."""
    root = tmp_path_factory.mktemp("shrink") / "src"
    make_image_folder(root, num_classes=2, images_per_class=7, size_range=((64, 48), (96, 80)))
    return root


def images(url: str) -> dict[str, bytes]:
    return {s["__key__"]: s["jpg"] for ref in ss.open_dataset(url).shards for s in ref.reader()}


def source_images(root) -> dict[str, bytes]:
    return {p.relative_to(root).with_suffix("").as_posix(): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_pack_shrinks_what_is_larger_and_keeps_the_rest(folder, tmp_path):
    dst = str(tmp_path / "ds")
    summary = ss.pack(str(folder), dst, max_side=72, quality=85, workers=1, progress=False)
    sources, packed = source_images(folder), images(dst)
    assert set(packed) == set(sources) and summary.samples == len(sources)
    kept = shrunk = 0
    for key, data in packed.items():
        size = opened(sources[key]).size
        if max(size) <= 72:
            assert data == sources[key]  # the original bytes
            kept += 1
        else:
            assert opened(data).size == shrunk_size(size, 72) and data != sources[key]
            shrunk += 1
    assert kept and shrunk  # the fixture has both kinds
    assert summary.shrunk == shrunk and f"shrunk to max_side: {shrunk}" in str(summary)
    assert summary.bytes_in == sum(len(d) for d in sources.values())
    manifest = ss.open_dataset(dst).manifest
    assert (manifest.options["max_side"], manifest.options["quality"]) == (72, 85)
    # The labels are those of a plain pack.
    plain = str(tmp_path / "plain")
    unshrunk = ss.pack(str(folder), plain, workers=1, progress=False)
    assert unshrunk.shrunk is None and "shrunk" not in str(unshrunk)
    labels = {s["__key__"]: s["cls"] for ref in ss.open_dataset(dst).shards for s in ref.reader()}
    assert labels == {s["__key__"]: s["cls"] for ref in ss.open_dataset(plain).shards for s in ref.reader()}
    assert manifest.class_counts == ss.open_dataset(plain).manifest.class_counts
    assert not verify_dataset(dst).problems


def test_pack_with_shrinking_is_the_same_for_any_number_of_workers(folder, tmp_path, dataset_files):
    ss.pack(str(folder), str(tmp_path / "w1"), max_side=60, shard_size="20KB", workers=1, progress=False)
    ss.pack(str(folder), str(tmp_path / "w2"), max_side=60, shard_size="20KB", workers=2, progress=False)
    assert dataset_files(tmp_path / "w1") == dataset_files(tmp_path / "w2")


def test_shards_are_planned_on_the_shrunk_sizes(tmp_path):
    """Large images shrunk 8x: a shard holds many of them, not as many as their original bytes allow."""
    src = tmp_path / "src"
    make_image_folder(src, num_classes=1, images_per_class=12, size_range=((480, 360), (512, 384)))
    largest = max(p.stat().st_size for p in src.rglob("*.jpg"))
    shard_size = 3 * largest
    plain = ss.pack(str(src), str(tmp_path / "plain"), shard_size=shard_size, workers=1, progress=False)
    small = ss.pack(str(src), str(tmp_path / "small"), shard_size=shard_size, max_side=64, workers=1, progress=False)
    assert plain.shards >= 4
    assert small.shards == 1


def test_parts_packed_with_other_sizes_do_not_merge(folder, tmp_path):
    dst = str(tmp_path / "parts")
    ss.pack(str(folder), dst, max_side=72, part=(0, 2), progress=False)
    with pytest.raises(ManifestError, match="do not merge: other options \\(max_side 80 here, 72 in part 0\\)"):
        ss.pack(str(folder), dst, max_side=80, part=(1, 2), progress=False)  # refused before it packs
    with pytest.raises(ss.ShardstreamError, match="missing 1 of 2 parts"):
        merge(dst)


def test_bad_options_are_refused(folder, tmp_path):
    with pytest.raises(ss.ShardstreamError, match="max_side"):
        ss.pack(str(folder), str(tmp_path / "a"), max_side=0, progress=False)
    with pytest.raises(ss.ShardstreamError, match="quality"):
        ss.pack(str(folder), str(tmp_path / "b"), max_side=64, quality=101, progress=False)


def test_cli_max_side(folder, tmp_path):
    dst = tmp_path / "ds"
    result = subprocess.run([sys.executable, "-m", "shardstream.cli", "pack", str(folder), str(dst),
                             "--max-side", "50", "--quality", "80", "--quiet"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert max(max(opened(data).size) for data in images(str(dst)).values()) == 50
    assert ss.open_dataset(str(dst)).manifest.options["quality"] == 80


# -- animated images and misnamed ones ------------------------------------------------------------


def animated(fmt: str, size: tuple[int, int] = (200, 100), frames: int = 3) -> bytes:
    """An animation of `frames` different pictures: an animated WebP, or an APNG for PNG."""
    pictures = [photo(*size, seed=i) for i in range(frames)]
    return encode(pictures[0], fmt, save_all=True, append_images=pictures[1:], duration=100, loop=0)


def frames_of(data: bytes) -> list[bytes]:
    image = opened(data)
    out = []
    for i in range(getattr(image, "n_frames", 1)):
        image.seek(i)
        out.append(image.convert("RGB").tobytes())
    return out


@pytest.mark.parametrize("fmt", ["WEBP", "PNG"])
def test_an_animated_image_keeps_its_bytes_and_every_frame(fmt):
    data = animated(fmt)
    assert len(set(frames_of(data))) == 3
    assert shrink_image(data, 50) is data

    from shardstream.shrink import KEPT_ANIMATED, shrink_or_keep

    assert shrink_or_keep(data, 50) == (data, KEPT_ANIMATED)
    # One frame alone is no animation: it shrinks.
    still = encode(photo(200, 100), fmt)
    shrunk, kept = shrink_or_keep(still, 50)
    assert kept is None and opened(shrunk).size == (50, 25)


def test_pack_keeps_animated_images_whole_and_counts_them(folder, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (src / "class_000" / "moving.webp").write_bytes(animated("WEBP"))
    (src / "class_001" / "moving.png").write_bytes(animated("PNG"))
    (src / "class_001" / "small.png").write_bytes(animated("PNG", size=(40, 30)))  # fits: nothing to report
    dst = str(tmp_path / "ds")
    summary = ss.pack(str(src), dst, max_side=72, workers=2, progress=False)
    samples = {s["__key__"]: s for ref in ss.open_dataset(dst).shards for s in ref.reader()}
    for rel, field in [("class_000/moving.webp", "webp"), ("class_001/moving.png", "png")]:
        stored = samples[rel.rsplit(".", 1)[0]][field]
        assert len(frames_of(stored)) == 3 and stored == (src / rel).read_bytes()
    assert summary.samples == 17 and not summary.skipped
    assert sorted(summary.kept_whole) == [("class_000/moving.webp", "animated"), ("class_001/moving.png", "animated")]
    assert "kept whole, larger than max_side: 2" in str(summary)
    assert summary.shrunk == sum(max(opened(p.read_bytes()).size) > 72 for p in src.rglob("*.jpg"))


def test_pack_shrinks_a_misnamed_image_into_the_format_of_its_field(tmp_path):
    """A PNG named .jpg that is shrunk is encoded as a JPEG (RGB, its alpha dropped), and a JPEG named .png as a
    PNG: stored under the field of their names, which then tells the truth, and not listed. One that fits keeps
    its bytes, under its name's field, and is listed."""
    src = tmp_path / "src" / "class_0"
    src.mkdir(parents=True)
    (src / "png_named.jpg").write_bytes(encode(photo(200, 100), "PNG"))
    (src / "rgba_named.jpg").write_bytes(encode(photo(200, 100, "RGBA", seed=3), "PNG"))
    (src / "jpeg_named.png").write_bytes(encode(photo(200, 100, seed=1), "JPEG", quality=95))
    (src / "plain.jpg").write_bytes(encode(photo(200, 100, seed=2), "JPEG", quality=95))
    small = encode(photo(40, 20, seed=4), "PNG")
    (src / "small_png_named.jpg").write_bytes(small)
    dst = str(tmp_path / "ds")
    summary = ss.pack(str(src.parent), dst, max_side=50, workers=1, progress=False)
    samples = {s["__key__"]: s for ref in ss.open_dataset(dst).shards for s in ref.reader()}
    for key, field, fmt in [("png_named", "jpg", "JPEG"), ("rgba_named", "jpg", "JPEG"),
                            ("jpeg_named", "png", "PNG"), ("plain", "jpg", "JPEG")]:
        sample = samples[f"class_0/{key}"]
        assert set(sample) == {"__key__", "__url__", field, "cls"}
        image = opened(sample[field])
        assert (image.format, image.mode, image.size) == (fmt, "RGB", (50, 25))
    assert samples["class_0/small_png_named"]["jpg"] == small
    assert not verify_dataset(dst).problems
    assert summary.misnamed == [("class_0/small_png_named.jpg", "PNG")]


# A picture in each mode a PNG or WebP opens in, and the mode its JPEG has: what shardstream's decoders make of
# it (they convert to RGB, dropping alpha), in grey where it is grey.
_INTO_JPEG = {
    "RGBA PNG": (lambda: encode(photo(200, 100, "RGBA"), "PNG"), "RGB"),
    "palette PNG with transparency": (lambda: encode(photo(200, 100, "P"), "PNG", transparency=0), "RGB"),
    "palette PNG": (lambda: encode(photo(200, 100, "P"), "PNG"), "RGB"),
    "LA PNG": (lambda: encode(photo(200, 100, "LA"), "PNG"), "L"),
    "L PNG": (lambda: encode(photo(200, 100, "L"), "PNG"), "L"),
    "1 PNG": (lambda: encode(photo(200, 100, "1"), "PNG"), "L"),
    "16-bit PNG": (lambda: encode(Image.fromarray((np.asarray(photo(200, 100, "L"), np.uint16) * 257)), "PNG"), "L"),
    "RGBA WebP": (lambda: encode(photo(200, 100, "RGBA"), "WEBP", lossless=True), "RGB"),
}


@pytest.mark.parametrize("source", list(_INTO_JPEG))
def test_shrinking_into_jpeg_drops_alpha_as_the_decoders_do(source):
    make, mode = _INTO_JPEG[source]
    data = make()
    shrunk = opened(shrink_image(data, 50, 95, as_format="JPEG"))
    assert (shrunk.format, shrunk.mode, shrunk.size) == ("JPEG", mode, (50, 25))
    # The decoders' view of the original, shrunk: alpha dropped, not composited on any background.
    decoded = opened(data)
    if decoded.mode in ("1", "P"):  # as shrink.py resizes these
        decoded = decoded.convert("RGBA" if "transparency" in decoded.info else "RGB")
    if decoded.mode.startswith("I"):  # 16 bits, read as their top 8 (Pillow's convert would clip)
        from shardstream.decode import narrowed_grey

        decoded = narrowed_grey(decoded)
    expected = decoded.convert(mode).resize((50, 25), Image.Resampling.BICUBIC, reducing_gap=2.0)
    assert difference(shrunk, expected) < 8  # JPEG's loss at 95, with chroma subsampling; a composite on black is 65
    assert shrink_image(data, 50, 95, as_format="JPEG") == shrink_image(data, 50, 95, as_format="JPEG")


def test_shrinking_into_another_format_keeps_the_icc_profile_only_where_it_still_fits():
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    rgba = encode(photo(200, 100, "RGBA"), "PNG", icc_profile=srgb)
    assert opened(shrink_image(rgba, 50, as_format="JPEG")).info.get("icc_profile") == srgb
    cmyk_profile = b"a CMYK profile, as far as this test goes"
    cmyk = encode(photo(200, 100, "CMYK"), "JPEG", quality=95, icc_profile=cmyk_profile)
    assert opened(cmyk).info["icc_profile"] == cmyk_profile
    for fmt in ("PNG", "WEBP"):
        shrunk = opened(shrink_image(cmyk, 50, as_format=fmt))
        assert (shrunk.format, shrunk.mode, shrunk.size) == (fmt, "RGB", (50, 25))
        assert "icc_profile" not in shrunk.info or not shrunk.info["icc_profile"]
    # In its own format, a CMYK JPEG stays CMYK, profile and all, as before.
    own = opened(shrink_image(cmyk, 50))
    assert (own.format, own.mode, own.info.get("icc_profile")) == ("JPEG", "CMYK", cmyk_profile)
    with pytest.raises(ValueError, match="as_format"):
        shrink_image(rgba, 50, as_format="GIF")


def test_a_16_bit_grey_png_is_shrunk_keeping_its_16_bits():
    """Regression: Pillow cannot resize 16-bit grey, so `--max-side` failed on such a PNG
    ("image has wrong mode"). It is widened to 32 bits for the resize and written back as
    a 16-bit PNG, its values those of the same resize on the widened image."""
    y, x = np.mgrid[0:240, 0:320]
    values = ((x * 200 + y * 37) % 65536).astype(np.uint16)
    source = Image.fromarray(values)
    assert source.mode == "I;16"
    out = io.BytesIO()
    source.save(out, "PNG")
    shrunk = Image.open(io.BytesIO(shrink_image(out.getvalue(), 160)))
    assert shrunk.format == "PNG" and shrunk.mode == "I;16" and shrunk.size == (160, 120)
    reference = source.convert("I").resize((160, 120), Image.Resampling.BICUBIC, reducing_gap=2.0)
    expected = np.clip(np.asarray(reference, dtype=np.int64), 0, 65535)
    assert np.array_equal(np.asarray(shrunk, dtype=np.int64), expected)
    assert int(np.asarray(shrunk).max()) > 255  # still 16 bits, not squeezed into 8


def test_images_kept_whole_are_planned_at_their_size_and_a_frame_never_passes_its_limit(tmp_path, monkeypatch):
    """Regression (found by a review of pack under stress): with --max-side, the plan took every larger image
    for its shrunk size, but animated and multi-picture ones are kept whole: three animated PNGs of 760 MB went
    into one frame of 2.28 GB, and the pack said it was done over a shard no reader reads (30 of 1.4 MB made a
    43 MB shard of a 4 MB --shard-size). The plan knows them by their headers now, and a frame is checked as it
    is built (an image grown since it was listed is the other way in): past its limit, an image is a named
    skip, or fails the pack."""
    from shardstream.packplan import _kept_whole

    rng = np.random.default_rng(3)
    left, right = (Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)) for _ in range(2))
    mpo = io.BytesIO()
    left.save(mpo, "MPO", save_all=True, append_images=[right])
    # Not taken for them (found by a later review: each made a shard an image): a JPEG with an ICC profile (an
    # APP2 segment too) whose EXIF text holds "MPF", and an APNG of one frame, which Pillow shrinks as a still.
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    exif = Image.Exif()
    exif[0x010E] = "scene MPF\x00 mode"
    profiled = io.BytesIO()
    photo(200, 100).save(profiled, "JPEG", icc_profile=srgb, exif=exif.tobytes())
    png = encode(photo(200, 100), "PNG")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    one_frame = (png[:33] + chunk(b"acTL", struct.pack(">II", 1, 0))
                 + chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, 200, 100, 0, 0, 1, 10, 0, 0)) + png[33:])
    assert getattr(Image.open(io.BytesIO(one_frame)), "n_frames", 1) == 1
    # Taken for them (a later review): one frame of animation after an image that is not one of its frames
    # (Pillow counts two), and an animation whose acTL comes after a 70 KB comment (past the 64 KB read first).
    from PIL import PngImagePlugin

    default_apart, commented = io.BytesIO(), io.BytesIO()
    photo(200, 100).save(default_apart, "PNG", save_all=True, append_images=[photo(200, 100, seed=1)],
                         default_image=True)
    note = PngImagePlugin.PngInfo()
    note.add_text("comment", "x" * 70_000)
    photo(200, 100).save(commented, "PNG", save_all=True, append_images=[photo(200, 100, seed=1)], pnginfo=note)
    assert Image.open(io.BytesIO(default_apart.getvalue())).n_frames == 2
    for data, kept in ((default_apart.getvalue(), True), (commented.getvalue(), True),(animated("PNG"), True), (animated("WEBP"), True), (mpo.getvalue(), True),
                       (png, False), (encode(photo(200, 100), "WEBP"), False),
                       (encode(photo(200, 100), "JPEG"), False), (profiled.getvalue(), False), (one_frame, False)):
        assert _kept_whole(data[: 1 << 16], io.BytesIO(data)) is kept
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"a{i}.png").write_bytes(animated("PNG", (120, 80)))
    plain = ss.pack(str(tmp_path / "src"), str(tmp_path / "planned"), max_side=16, shard_size="60KB", workers=1,
                    progress=False)
    sizes = [info.bytes for info in ss.open_dataset(str(tmp_path / "planned")).manifest.shards]
    assert plain.samples == 6 and len(sizes) > 1  # planned at their size: not one shard of everything
    import shardstream.framebuild as framebuild

    frame_limit = sum(len(p.read_bytes()) for p in sorted(src.iterdir())[:2]) + 4096  # two fit, not three
    monkeypatch.setattr(framebuild, "MAX_FRAME_BYTES", frame_limit)
    with pytest.raises(PackError, match="past the .* bytes a frame may hold"):
        ss.pack(str(tmp_path / "src"), str(tmp_path / "fail"), workers=1, progress=False)
    summary = ss.pack(str(tmp_path / "src"), str(tmp_path / "skip"), workers=1, progress=False, on_error="skip")
    assert summary.samples + len(summary.skipped) == 6 and summary.skipped
    assert all("a frame may hold" in why for _, why in summary.skipped)
    assert verify_dataset(str(tmp_path / "skip")).ok


def test_a_camera_mpo_keeps_every_picture():
    """Regression: a JPEG holding several pictures (MPO: stereo cameras, depth maps) was
    refused by `--max-side` ("cannot shrink a MPO image"). It keeps its bytes, every picture,
    as an animated image does, and says why."""
    from shardstream.shrink import KEPT_PICTURES, shrink_or_keep

    rng = np.random.default_rng(3)
    left, right = (Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)) for _ in range(2))
    out = io.BytesIO()
    left.save(out, "MPO", save_all=True, append_images=[right])
    data = out.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"
    assert shrink_or_keep(data, 160) == (data, KEPT_PICTURES)
    assert shrink_or_keep(data, 320) == (data, None)  # fits: nothing to say


@pytest.mark.parametrize("as_format", ["JPEG", "WEBP", "PNG"])
def test_a_16_bit_grey_image_shrinks_to_what_the_decoders_read(as_format):
    """Regression: a 16-bit grey PNG stored under a jpg or webp field and shrunk was clipped by Pillow's
    convert (every value over 255 white: mean 254 of 255), where the decoders read its top 8 bits (mean 128)."""
    from shardstream.decode import decode_image
    from shardstream.shrink import shrink_or_keep

    ramp = np.tile(np.linspace(0, 65535, 512).astype(np.uint16), (256, 1))
    out = io.BytesIO()
    Image.fromarray(ramp).save(out, "PNG")  # I;16
    data = out.getvalue()
    whole = decode_image(data, "rgb8").float()
    shrunk, kept = shrink_or_keep(data, 128, 95, path="depth.png", as_format=as_format)
    assert kept is None
    small = decode_image(shrunk, "rgb8").float()
    assert small.shape == (3, 64, 128)
    assert abs(small.mean() - whole.mean()) < 2 and small[:, :, :4].mean() < 8 and small[:, :, -4:].mean() > 247


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_shrunk_into_its_own_format_a_transparent_pixel_keeps_the_colour_stored_under_it(mode):
    """Regression: Pillow resizes RGBA and LA weighting colour by alpha, so a wholly transparent pixel came
    out black where the image stored white: the decoders (dropping alpha, as torchvision's loader does) saw
    the transparent half of a shrunk PNG turn from white to black, unlike the same image unshrunk. (A PNG:
    WebP, shrunk at --quality, is lossy, and its encoder may change what lies under transparent pixels.)"""
    from shardstream.decode import decode_rgb

    fmt = "PNG"

    if mode == "P":
        image = Image.new("P", (400, 400), 1)
        image.putpalette([255, 0, 0, 255, 255, 255] + [0] * 762)
        image.paste(0, (0, 0, 200, 400))
        data = encode(image, fmt, transparency=1)
    else:
        pixels = np.zeros((400, 400, 4), np.uint8)
        pixels[:, :200] = (255, 0, 0, 255)
        pixels[:, 200:] = (255, 255, 255, 0)  # transparent, stored white (as many editors keep it)
        data = encode(Image.fromarray(pixels, "RGBA").convert(mode), fmt)
    before = decode_rgb(data)
    after = decode_rgb(shrink_image(data, 100, as_format=fmt))
    assert before[200, 300].tolist() == after[50, 80].tolist() == ([255, 255, 255] if mode != "LA" else [255] * 3)
    assert after[50, 20].tolist() == before[200, 100].tolist()
