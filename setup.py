"""Build step for the one optional C extension; everything else is in pyproject.toml.

`shardstream._jpegregion` decodes only the rows and columns of a JPEG that a crop
needs, through libjpeg-turbo (the `libjpeg-turbo8-dev` / `libjpeg62-turbo-dev` /
`libjpeg-turbo-devel` package, and a C compiler). It is optional: where it does not
build, pip warns and goes on, and shardstream decodes whole images instead
(`shardstream.decode.REGION_DECODER` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardstream._jpegregion",
            ["shardstream/_jpegregion.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
