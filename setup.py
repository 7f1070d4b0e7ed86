"""Builds the PyTorch extension smoe_torch ahead of time: `pip install --no-build-isolation .`

The core library (routing, the fused grouped-GEMM engine, the layer) is built by the project's own CMake into
build-torch/ (shared cudart, position-independent code, no tests); the binding
(python/smoe_torch/csrc/ops.cpp) is a host-only C++ file compiled against the installed torch and
linked with that static library. No nvcc is needed at import time.
Needs: the CUTLASS headers (scripts/setup.sh puts them in .deps/), nvcc, cmake, ninja, torch.
"""
import os
import shutil
import subprocess
import sys

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
            f"-DSMOE_CUTLASS_DIR={cutlass_dir()}", f"-DPython3_EXECUTABLE={sys.executable}"])
        targets = ["smoe"] + (["smoe_ep"] if NCCL else [])
        subprocess.check_call(["cmake", "--build", BUILD, "--target", *targets, "-j", str(os.cpu_count() or 2)])
        super().run()


ext = CppExtension(
    "smoe_torch._C",
    ["python/smoe_torch/csrc/ops.cpp", "python/smoe_torch/csrc/expert_major_ops.cpp",
     "python/smoe_torch/csrc/common.cpp"],
    include_dirs=[os.path.join(ROOT, "include"), os.path.join(CUDA_HOME, "include")],
    extra_objects=[os.path.join(BUILD, "libsmoe.a")],
    library_dirs=[os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib")],
    libraries=["cublas", "cudart"],
    extra_compile_args=["-O2", "-std=c++17"],
)

def nccl_dirs():
    """(include, lib) of the NCCL torch loads (the nvidia-nccl-cu13 wheel), else the toolkit's; the
    same search as CMakeLists.txt, so the EP library and this binding see one NCCL. None: no EP."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia.nccl")
    cands = [list(spec.submodule_search_locations)[0]] if spec and spec.submodule_search_locations else []
    cands.append(CUDA_HOME)
    for root in cands:
        inc = os.path.join(root, "include")
        for lib in ("lib", "lib64"):
            so = os.path.join(root, lib, "libnccl.so.2")
            if os.path.exists(os.path.join(inc, "nccl_device.h")) and os.path.exists(so):
                return inc, os.path.dirname(so)
    return None


NCCL = None if os.environ.get("SMOE_WITH_EP", "1") == "0" else nccl_dirs()
exts = [ext]
if NCCL:
    exts.append(CppExtension(
        "smoe_torch._ep",
        ["python/smoe_torch/csrc/ep_ops.cpp"],
        include_dirs=[os.path.join(ROOT, "include"), NCCL[0], os.path.join(CUDA_HOME, "include")],
        extra_objects=[os.path.join(BUILD, "libsmoe_ep.a"), os.path.join(BUILD, "libsmoe.a")],
        library_dirs=[os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib")],
        libraries=["cublas", "cudart"],
        # The wheel has only the versioned libnccl.so.2 (the one torch has already loaded).
        extra_link_args=[f"-L{NCCL[1]}", "-l:libnccl.so.2", f"-Wl,-rpath,{NCCL[1]}"],
        extra_compile_args=["-O2", "-std=c++17"],
    ))

setup(
    name="smoe-torch",
    version=open(os.path.join(ROOT, "VERSION")).read().strip(),  # the one version number (VERSION)
    description="Hopper MoE training kernels (SonicMoE-style) for PyTorch",
    packages=["smoe_torch", "smoe_torch.dropins"],
    package_dir={"": "python"},
    ext_modules=exts,
    cmdclass={"build_ext": BuildWithCMake},
)
