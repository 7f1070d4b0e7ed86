"""Builds the PyTorch extension smoe_torch ahead of time: `pip install --no-build-isolation .`

The core library (CUDA kernels, CUTLASS grouped GEMMs) is built by the project's own CMake into
build-torch/ (shared cudart, position-independent code, no tests); the binding
(python/smoe_torch/csrc/ops.cpp) is a host-only C++ file compiled against the installed torch and
linked with that static library. No nvcc is needed at import time.
Needs: the CUTLASS headers (scripts/setup.sh puts them in .deps/), nvcc, cmake, ninja, torch.
"""
import os
import shutil
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("SMOE_TORCH_BUILD_DIR", os.path.join(ROOT, "build-torch"))


def cutlass_dir():
    env = {}
    with open(os.path.join(ROOT, "scripts", "versions.env")) as f:
        for line in f:
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.strip().split("=", 1)
                env[k] = v.strip('"')
    d = os.path.join(ROOT, ".deps", "cutlass-" + env["CUTLASS_PIP_VERSION"], "cutlass_library", "source")
    if not os.path.exists(os.path.join(d, "include", "cutlass", "cutlass.h")):
        raise RuntimeError(f"CUTLASS headers not found in {d}: run scripts/setup.sh first")
    return d


class BuildWithCMake(BuildExtension):
    def run(self):
        nvcc = shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")
        subprocess.check_call([
            "cmake", "-S", ROOT, "-B", BUILD, "-G", "Ninja", "-Wno-dev", "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DSMOE_CUDART=Shared", "-DSMOE_BUILD_TESTS=OFF",
            f"-DSMOE_CUTLASS_DIR={cutlass_dir()}"])
        subprocess.check_call(["cmake", "--build", BUILD, "--target", "smoe", "-j", str(os.cpu_count() or 2)])
        super().run()


ext = CppExtension(
    "smoe_torch._C",
    ["python/smoe_torch/csrc/ops.cpp"],
    include_dirs=[os.path.join(ROOT, "include"), os.path.join(CUDA_HOME, "include")],
    extra_objects=[os.path.join(BUILD, "libsmoe.a")],
    library_dirs=[os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib")],
    libraries=["cublas", "cudart"],
    extra_compile_args=["-O2", "-std=c++17"],
)

setup(
    name="smoe-torch",
    version="0.1.0",
    description="Hopper MoE training kernels (SonicMoE-style) for PyTorch",
    packages=["smoe_torch"],
    package_dir={"": "python"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildWithCMake},
)
