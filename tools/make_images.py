#!/usr/bin/env python
"""Generate a synthetic ImageNet-like ImageFolder tree (see shardstream.synthetic).

Example, from the repository root::

    python tools/make_images.py /tmp/imgs --classes 10 --per-class 400 --seed 0 --workers 2
    python tools/make_images.py /tmp/imbalanced --per-class 1000,100,10

Works before the package is installed, and even if ``shardstream/__init__.py``
is missing or cannot be imported (e.g. it needs torch): the generator module
only needs numpy and Pillow, so it is then loaded straight from its file.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time
from types import ModuleType

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_synthetic() -> ModuleType:
    """Import ``shardstream.synthetic``, falling back to loading the file directly."""
    try:
        import shardstream.synthetic as synthetic
        return synthetic
    except Exception:  # not on sys.path, or the package __init__ failed
        pass
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
        try:
            import shardstream.synthetic as synthetic
            return synthetic
        except Exception:  # e.g. the package __init__ imports torch
            pass
    # Register under a top-level name so worker processes (forked) can unpickle
    # its functions without importing the ``shardstream`` package.
    name = "shardstream_synthetic"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "shardstream" / "synthetic.py")
    if spec is None or spec.loader is None:
        raise ImportError("cannot locate shardstream/synthetic.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _per_class(text: str) -> int | list[int]:
    """Parse ``--per-class``: one count (``400``) or a comma list (``1000,100,10``)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list of integers, got {text!r}")
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"counts must be non-negative integers, got {text!r}")
    return counts[0] if len(counts) == 1 and "," not in text else counts


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, generate the folder and print a short summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="output root directory")
    parser.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    parser.add_argument("--per-class", type=_per_class, default=20,
                        help="images per class, or a comma list per class, e.g. 1000,100,10 (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    parser.add_argument("--min-size", type=int, nargs=2, default=(400, 350), metavar=("W", "H"),
                        help="smallest width and height (default 400 350)")
    parser.add_argument("--max-size", type=int, nargs=2, default=(500, 375), metavar=("W", "H"),
                        help="largest width and height (default 500 375)")
    args = parser.parse_args(argv)

    per_class = args.per_class
    num_classes = len(per_class) if isinstance(per_class, list) else args.classes
    if isinstance(per_class, list) and args.classes not in (10, len(per_class)):
        parser.error(f"--per-class lists {len(per_class)} counts but --classes is {args.classes}")

    synthetic = _load_synthetic()
    start = time.perf_counter()
    paths = synthetic.make_image_folder(
        args.out, num_classes=num_classes, images_per_class=per_class, seed=args.seed,
        size_range=(tuple(args.min_size), tuple(args.max_size)), quality=args.quality,
        workers=args.workers)
    elapsed = time.perf_counter() - start

    n = len(paths)
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {n} images in {num_classes} classes to {args.out}")
    if n:
        from PIL import Image
        dims = [Image.open(p).size for p in paths]
        mean_w = sum(d[0] for d in dims) / n
        mean_h = sum(d[1] for d in dims) / n
        print(f"total {total / 2**20:.1f} MB, mean {total / n / 1024:.1f} KB, mean size {mean_w:.0f}x{mean_h:.0f} px")
    print(f"took {elapsed:.2f} s ({1000 * elapsed / max(n, 1):.2f} ms per image, {args.workers} worker(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
