"""The Ray executor: the parts of a pack as Ray tasks on a local 2-CPU Ray instance.

Ray is an optional extra (`pip install 'shardstream[ray]'`); without it these tests skip.
"""

from __future__ import annotations

import pytest

import shardstream as ss
from shardstream.synthetic import make_image_folder

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def keys(url: str) -> list[str]:
    return sorted(s["__key__"] for ref in ss.open_dataset(url).shards for s in ref.reader())


def test_ray_parts_equal_a_single_pack(tmp_path, local_ray):
    from shardstream.executors import pack_with_ray

    make_image_folder(tmp_path / "src", num_classes=3, images_per_class=[7, 9, 5], size_range=((32, 24), (48, 40)))
    ss.pack(str(tmp_path / "src"), str(tmp_path / "single"), shard_size="8KB", progress=False)
    manifest, summaries = pack_with_ray(str(tmp_path / "src"), str(tmp_path / "ray"), parts=3, shard_size="8KB",
                                        progress=False)
    single = ss.open_dataset(str(tmp_path / "single")).manifest
    assert len(summaries) == 3
    assert keys(str(tmp_path / "ray")) == keys(str(tmp_path / "single"))
    assert (manifest.classes, manifest.class_counts) == (single.classes, single.class_counts)
