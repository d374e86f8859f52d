"""Builds the C++ kernels in kernels/ as extension modules of the rlflow package.

Every ``kernels/<name>.cpp`` becomes ``rlflow._C_<name>``; each has a pure-Python
twin in rlflow that the tests compare it against.
"""

from __future__ import annotations

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

_HERE = os.path.dirname(os.path.abspath(__file__))


# Kernels that run on OpenMP threads: linked to libgomp by its soname, which torch's wheel ships
# under the same one, so that in a process that imported torch they share its threads (the
# comment on on_threads in kernels/cpu.h).
_OPENMP = {"attention": ["-fopenmp"], "decode": ["-fopenmp"], "fused": ["-fopenmp"]}


def _kernel_extensions() -> list[Pybind11Extension]:
    extensions = []
    for source in sorted(glob.glob(os.path.join("kernels", "*.cpp"))):
        name = os.path.splitext(os.path.basename(source))[0]
        extensions.append(
            Pybind11Extension(
                f"rlflow._C_{name}",
                [source],
                include_dirs=[os.path.join(_HERE, "kernels")],
                cxx_std=17,
                extra_compile_args=["-O3", *_OPENMP.get(name, [])],
                extra_link_args=_OPENMP.get(name, []),
            )
        )
    return extensions


setup(ext_modules=_kernel_extensions(), cmdclass={"build_ext": build_ext})
