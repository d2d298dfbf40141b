"""Build step for the two optional C extensions; everything else is in pyproject.toml.

`shardstream._jpegregion` decodes only the rows and columns of a JPEG that a crop
needs, through libjpeg-turbo (1.5 or later: the `libjpeg-dev` or `libjpeg62-turbo-dev`
package on Debian and Ubuntu, `libjpeg-turbo-devel` on Fedora, `jpeg-turbo` in
Homebrew, found through pkg-config where it is installed), and a C compiler. It is
optional: where it does not build, pip warns and goes on, and shardstream decodes
whole images instead (`shardstream.decode.REGION_DECODER` says which).

`shardstream._tarcut` cuts samples out of shard pieces and decompresses zstd frames for
the raw-read path. It needs only a C compiler and libzstd's runtime library
(libzstd.so.1, on nearly every Linux; its header is used where installed). Where it does
not build, the reader does the same in Python and python-zstandard, more slowly
(`shardstream.reader.TARCUT` says which).
"""

import shutil
import subprocess

from setuptools import Extension, setup


def pkg_config(flag: str) -> list[str]:
    """What pkg-config says of libjpeg for `flag`, without the flag's prefix; nothing if it cannot say."""
    if shutil.which("pkg-config") is None:
        return []
    try:
        out = subprocess.run(["pkg-config", flag, "libjpeg"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [item[2:] for item in out.stdout.split()] if out.returncode == 0 else []


setup(
    ext_modules=[
        Extension(
            "shardstream._jpegregion",
            ["shardstream/_jpegregion.c"],
            include_dirs=pkg_config("--cflags-only-I"),
            library_dirs=pkg_config("--libs-only-L"),
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "shardstream._tarcut",
            ["shardstream/_tarcut.c"],
            extra_compile_args=["-O2"],
            extra_link_args=["-l:libzstd.so.1"],
            optional=True,
        ),
    ]
)
