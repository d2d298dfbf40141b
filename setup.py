"""Build step for the two optional C extensions; everything else is in pyproject.toml.

`shardstream._jpegregion` decodes only the rows and columns of a JPEG that a crop
needs, through libjpeg-turbo (1.5 or later: the `libjpeg-dev` or `libjpeg62-turbo-dev`
package on Debian and Ubuntu, `libjpeg-turbo-devel` on Fedora, `jpeg-turbo` in
Homebrew, found through pkg-config where it is installed), and a C compiler. It is
optional: where it does not build, setuptools warns (pip shows it with `-v` only) and
goes on, and shardstream decodes whole images instead (`shardstream.decode.REGION_DECODER`
says which; `shardstream demo` says it too).

`shardstream._tarcut` cuts samples out of shard pieces and decompresses zstd frames for
the raw-read path. It needs only a C compiler and libzstd's runtime library
(libzstd.so.1, on nearly every Linux; its header is used where installed); elsewhere libzstd
itself (`zstd` in Homebrew, found through pkg-config where it is installed). Where it does
not build, the reader does the same in Python and python-zstandard, more slowly
(`shardstream.reader.TARCUT` says which).
"""

import shutil
import subprocess
import sys

from setuptools import Extension, setup


def pkg_config(flag: str, library: str) -> list[str]:
    """What pkg-config says of `library` for `flag`, without the flag's prefix; nothing if it cannot say."""
    if shutil.which("pkg-config") is None:
        return []
    try:
        out = subprocess.run(["pkg-config", flag, library], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [item[2:] for item in out.stdout.split()] if out.returncode == 0 else []


def zstd_linking() -> dict[str, list[str]]:
    """How `_tarcut` links libzstd: on Linux its runtime library by name (no development
    package needed); elsewhere as `-lzstd`, which macOS's linker wants (it has no `-l:`)."""
    if sys.platform.startswith("linux"):
        return {"extra_link_args": ["-l:libzstd.so.1"]}
    return {"libraries": ["zstd"], "include_dirs": pkg_config("--cflags-only-I", "libzstd"),
            "library_dirs": pkg_config("--libs-only-L", "libzstd")}


setup(
    ext_modules=[
        Extension(
            "shardstream._jpegregion",
            ["shardstream/_jpegregion.c"],
            include_dirs=pkg_config("--cflags-only-I", "libjpeg"),
            library_dirs=pkg_config("--libs-only-L", "libjpeg"),
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "shardstream._tarcut",
            ["shardstream/_tarcut.c"],
            extra_compile_args=["-O2"],
            **zstd_linking(),
            optional=True,
        ),
    ]
)
