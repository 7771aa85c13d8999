#!/usr/bin/env python3
"""Unpack a prebuilt llama-server (scripts/sbs/prebuild_cuda.sh pack) and find its libraries.

python3 scripts/sbs/prebuilt.py unpack TARBALL DEST   -> DEST/bin/llama-server, DEST/MANIFEST.txt
python3 scripts/sbs/prebuilt.py libdirs BINDIR        -> one loader directory per line; exit 1
                                                         (names on stderr) if a library stays unresolved

The server was built on a machine without a GPU and carries no RPATH. On the GPU machine the
CUDA runtime and cuBLAS come from the pip `nvidia` packages PyTorch uses (nvidia/cu13/lib and
the like), the driver library from the driver install. `libdirs` puts BINDIR first (libllama,
libggml*, the backend modules), then every `nvidia/*/lib` directory of the Python that runs it
(plus $NVIDIA_LIB_ROOTS, ':'-separated), then a directory holding libcuda.so.1 when the loader's
cache does not know it, and the packed libgomp only when the system has none. It checks the
result with `ldd` on every ELF file in BINDIR, as the loader would resolve them. Unpacking uses
Python's lzma, so the GPU machine needs no xz binary.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile

DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib",
               "/usr/local/cuda/compat")


def unpack(tarball: str, dest: str) -> int:
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(tarball, "r:*") as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # Python < 3.12 without the backported filter
            tf.extractall(dest)
    for f in glob.glob(os.path.join(dest, "bin", "*")):  # the data filter drops exec bits on some versions
        if os.path.isfile(f) and not os.path.islink(f):
            os.chmod(f, 0o755)
    return 0 if os.path.isfile(os.path.join(dest, "bin", "llama-server")) else 1


def nvidia_lib_dirs() -> list[str]:
    roots = [r for r in os.environ.get("NVIDIA_LIB_ROOTS", "").split(":") if r]
    try:
        import nvidia  # namespace package of NVIDIA's wheels (the ones PyTorch depends on)

        roots += list(nvidia.__path__)
    except ImportError:
        pass
    dirs: list[str] = []
    for root in roots:
        # A directory of libraries itself (nvidia/cu13/lib, a driver dir) or a root of packages (nvidia/).
        direct = glob.glob(os.path.join(root, "lib*.so*"))
        cands = [root] if direct else sorted(glob.glob(os.path.join(root, "*", "lib")))
        for d in cands:
            if glob.glob(os.path.join(d, "lib*.so*")) and d not in dirs:
                dirs.append(d)
    return dirs


def elf_files(bindir: str) -> list[str]:
    out = []
    for f in sorted(glob.glob(os.path.join(bindir, "*"))):
        if os.path.isfile(f) and not os.path.islink(f):
            with open(f, "rb") as fh:
                if fh.read(4) == b"\x7fELF":
                    out.append(f)
    return out


def missing(bindir: str, dirs: list[str]) -> dict[str, list[str]]:
    """Soname -> the files that need it and cannot find it with LD_LIBRARY_PATH=dirs."""
    env = dict(
        os.environ, LD_LIBRARY_PATH=":".join(dirs + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p])
    )
    gone: dict[str, list[str]] = {}
    for f in elf_files(bindir):
        res = subprocess.run(["ldd", f], capture_output=True, text=True, env=env, timeout=60)
        for line in res.stdout.splitlines():
            if "=> not found" in line:
                gone.setdefault(line.split()[0], []).append(os.path.basename(f))
    return gone


def libdirs(bindir: str) -> int:
    bindir = os.path.abspath(bindir)
    dirs = [bindir] + nvidia_lib_dirs()
    gone = missing(bindir, dirs)
    if "libcuda.so.1" in gone:
        for d in DRIVER_DIRS:
            if os.path.exists(os.path.join(d, "libcuda.so.1")):
                dirs.append(d)
                break
    fallback = os.path.join(os.path.dirname(bindir), "fallback")
    if "libgomp.so.1" in gone and os.path.isfile(os.path.join(fallback, "libgomp.so.1")):
        dirs.append(fallback)
    gone = missing(bindir, dirs)
    print("\n".join(dirs))
    if gone:
        for name, users in sorted(gone.items()):
            print(f"unresolved {name} (needed by {', '.join(users)})", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "unpack":
        return unpack(sys.argv[2], sys.argv[3])
    if len(sys.argv) == 3 and sys.argv[1] == "libdirs":
        return libdirs(sys.argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
