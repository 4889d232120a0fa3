"""Builds trainstream_hf._C, the native extension.

Switches (environment variables):
  TRAINSTREAM_CUDA=0/1   build the CUDA kernels and the cudaHostAlloc arena. Default: on when CUDA_HOME
                         exists and torch was built with CUDA. Never decided by torch.cuda.is_available(),
                         so a build on a GPU-less build host still gets CUDA kernels.
  TORCH_CUDA_ARCH_LIST   respected; default "9.0" plus 10.0 / 12.0 where the nvcc in use supports them.
  DEBUG=1                -O0 -g, no NDEBUG.
  MAX_JOBS               parallel compile jobs (ninja).
  TRAINSTREAM_SKIP_EXT=1 install the Python package without building the extension (the Makefile's install
                         step: `make build` then compiles it once, in place, incrementally).
"""
import glob
import os
import re
import subprocess

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise SystemExit(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _nvcc_version(cuda_home):
    try:
        out = subprocess.check_output([os.path.join(cuda_home, "bin", "nvcc"), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _default_arch_list(cuda_home):
    archs = ["9.0"]
    version = _nvcc_version(cuda_home)
    if version is not None and version >= (12, 8):  # first nvcc with sm_100 / sm_120
        archs += ["10.0", "12.0"]
    return ";".join(archs)


def _cublaslt(cuda_home):
    """(include dirs, library dirs, link args) for cuBLASLt (csrc/cuda/fp8_gemm.cu): first the copy torch's CUDA
    wheels install (site-packages/nvidia/cu*/ or nvidia/cublas/: the very library torch loads, so its soname is
    resolved when the extension loads), else the toolkit's; None where neither has header and library (the GEMM is
    then left out of the build, with a warning: it is opt-in, and everything else builds without it)."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    for inc in sorted(glob.glob(os.path.join(site, "nvidia", "*", "include", "cublasLt.h")), reverse=True):
        root = os.path.dirname(os.path.dirname(inc))
        libs = sorted(glob.glob(os.path.join(root, "lib", "libcublasLt.so*")))
        if libs:
            return [os.path.join(root, "include")], [os.path.join(root, "lib")], [f"-l:{os.path.basename(libs[0])}"]
    header = os.path.join(cuda_home, "include", "cublasLt.h")
    if os.path.exists(header) and glob.glob(os.path.join(cuda_home, "lib*", "libcublasLt.so*")):
        return [], [], ["-lcublasLt"]
    return None


cuda_home = cpp_extension.CUDA_HOME
with_cuda = _flag("TRAINSTREAM_CUDA", bool(cuda_home) and torch.version.cuda is not None)
if with_cuda and not cuda_home:
    raise SystemExit("TRAINSTREAM_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME")
if with_cuda and torch.version.cuda is None:
    raise SystemExit(f"TRAINSTREAM_CUDA=1 but torch {torch.__version__} was built without CUDA")
debug = _flag("DEBUG", False)

sources = ["csrc/trainstream.cpp"]
sources += sorted(glob.glob("csrc/cpu/*.cpp")) + sorted(glob.glob("csrc/runtime/*.cpp"))
sources += sorted(glob.glob("csrc/autograd/*.cpp"))  # autograd nodes in C++ (device-generic, dispatcher ops)
define_macros = []
opt = ["-O0", "-g"] if debug else ["-O3"]
# -g0: Python's own CFLAGS carry -g; with it an ATen-heavy unit takes ~40% longer to compile and its object file is
# ~30x larger (benchmarks/NOTES.md, 2026-12-06), for debug information only DEBUG=1 builds use.
# -fno-math-errno: sqrt is one instruction (the same correctly rounded result; nothing reads errno), so compiler-
# vectorized loops such as csrc/cpu/adamw.cpp's bf16-moment step vectorize.
cxx_flags = opt + ([] if debug else ["-g0"]) + ["-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas",
                                               "-fno-math-errno"]
nvcc_flags = opt + ["--expt-relaxed-constexpr", "-lineinfo"]
if debug:
    cxx_flags.append("-UNDEBUG")
    nvcc_flags += ["-G", "-UNDEBUG"]

if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list(cuda_home))
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("TRAINSTREAM_WITH_CUDA", "1"))
    lt = _cublaslt(cuda_home)
    if lt is None:
        print("setup.py: warning: cuBLASLt not found (neither torch's nvidia/*/include + lib nor CUDA_HOME has "
              "cublasLt.h and libcublasLt.so): building without ops.fp8_gemm_rowwise (TRAINSTREAM_FP8_GEMM=cublaslt)")
        sources = [s for s in sources if not s.endswith("fp8_gemm.cu")]
        lt = ([], [], [])
    lt_include, lt_libdirs, lt_link = lt
    ext = cpp_extension.CUDAExtension(
        "trainstream_hf._C",
        sources,
        define_macros=define_macros,
        include_dirs=lt_include,
        library_dirs=lt_libdirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=lt_link,
        libraries=["cudart", "rt"],  # rt: shm_open on glibc < 2.34
    )
else:
    ext = cpp_extension.CppExtension(
        "trainstream_hf._C", sources, define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags}, libraries=["rt"],
    )

setup(
    ext_modules=[] if _flag("TRAINSTREAM_SKIP_EXT", False) else [ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
