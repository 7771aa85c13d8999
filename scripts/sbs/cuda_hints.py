#!/usr/bin/env python3
"""CMake hints for llama.cpp's CUDA build where the toolkit lacks cuBLAS or the driver stub.

python3 scripts/sbs/cuda_hints.py LINK_DIR   -> prints one CMake argument per line

Some CUDA installs are assembled from pip wheels (nvcc, runtime, CCCL) and keep cuBLAS in the
Python `nvidia` namespace package that PyTorch depends on (nvidia/cu13/{include,lib}), with
only versioned library names, and the driver library outside the toolkit. CMake's
FindCUDAToolkit then fails on CUDA::cublas or CUDA::cuda_driver. This finds what is missing,
links unversioned names into LINK_DIR, and prints the cache variables that point CMake there;
it prints nothing for what the toolkit already has. Those directories also go into the binaries'
run path (and LINK_DIR/libdirs.txt, for LD_LIBRARY_PATH). Extra search roots: $CUDA_EXTRA_ROOTS (':').
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys


def toolkit_root() -> str | None:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    real = os.path.realpath(nvcc)
    try:
        with open(real, "rb") as f:
            script = f.read(4) != b"\x7fELF"  # e.g. /usr/local/bin/nvcc: `exec /opt/cuda-X/bin/nvcc "$@"`
    except OSError:
        script = False
    if script or os.path.basename(real) != "nvcc" or not real.endswith("/bin/nvcc"):  # a wrapper: read its target
        try:
            text = open(nvcc).read(4096)
            for word in text.split():
                word = word.strip("\"'")
                if word.endswith("/bin/nvcc"):
                    real = os.path.realpath(word)
        except (OSError, UnicodeDecodeError):
            pass
    return os.path.dirname(os.path.dirname(real))


def nvidia_roots() -> list[str]:
    roots = [r for r in os.environ.get("CUDA_EXTRA_ROOTS", "").split(":") if r]
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for base in nvidia.__path__:
            roots += sorted(glob.glob(os.path.join(base, "*")))
    except ImportError:
        pass
    return roots


def _first(patterns: list[str]) -> str | None:
    for pat in patterns:
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[0]
    return None


def hints(link_dir: str) -> tuple[list[str], list[str]]:
    root = toolkit_root() or "/usr/local/cuda"
    tk_inc = [f"{root}/include", f"{root}/targets/*/include"]
    tk_lib = [f"{root}/lib64", f"{root}/lib", f"{root}/targets/*/lib"]
    args: list[str] = []
    libdirs: list[str] = []
    os.makedirs(link_dir, exist_ok=True)
    if not _first([f"{d}/cublas_v2.h" for d in tk_inc]):
        inc = _first([f"{r}/include/cublas_v2.h" for r in nvidia_roots()])
        if inc:
            d = os.path.dirname(inc)
            args += [f"-DCMAKE_CUDA_FLAGS=-I{d}", f"-DCMAKE_CXX_FLAGS=-I{d}", f"-DCMAKE_C_FLAGS=-I{d}"]
    for name in ("cublas", "cublasLt"):
        if _first([f"{d}/lib{name}.so" for d in tk_lib]):
            continue
        lib = _first([f"{r}/lib/lib{name}.so*" for r in nvidia_roots()] + [f"{d}/lib{name}.so.*" for d in tk_lib])
        if lib:
            link = os.path.join(link_dir, f"lib{name}.so")
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(lib, link)
            args.append(f"-DCUDA_{name}_LIBRARY={link}")
            libdirs.append(os.path.dirname(lib))
    if libdirs:  # libggml-cuda's cuBLAS soname must resolve when linking the server and when running it
        flags = " ".join(f"-Wl,-rpath,{d} -Wl,-rpath-link,{d}" for d in sorted(set(libdirs)))
        args += [f"-DCMAKE_EXE_LINKER_FLAGS={flags}", f"-DCMAKE_SHARED_LINKER_FLAGS={flags}"]
    if not _first([f"{d}/stubs/libcuda.so" for d in tk_lib] + [f"{d}/libcuda.so" for d in tk_lib]):
        drv = None
        try:
            out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
            for line in out.splitlines():
                if "libcuda.so" in line and "=>" in line:
                    drv = line.split("=>")[-1].strip()
                    break
        except (OSError, subprocess.TimeoutExpired):
            pass
        drv = drv or _first(["/usr/local/nvidia/lib64/libcuda.so*", "/usr/lib/x86_64-linux-gnu/libcuda.so*",
                             "/usr/lib64/libcuda.so*"])
        if drv:
            args.append(f"-DCUDA_cuda_driver_LIBRARY={drv}")
        else:
            args.append("-DGGML_CUDA_NO_VMM=ON")  # no driver library to link: skip the VMM pool
    return args, sorted(set(libdirs))


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    args, libdirs = hints(sys.argv[1])
    with open(os.path.join(sys.argv[1], "libdirs.txt"), "w") as f:
        f.write("\n".join(libdirs) + ("\n" if libdirs else ""))
    print("\n".join(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
