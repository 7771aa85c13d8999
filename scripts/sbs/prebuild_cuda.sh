#!/usr/bin/env bash
# Build llama-server with CUDA for one GPU architecture on a machine WITHOUT a GPU, and pack it
# for the GPU machine, so the GPU machine's time goes to measuring instead of compiling.
#
#   scripts/sbs/prebuild_cuda.sh build SRC.tar.gz WORK   # needs nvcc (CUDA 13) and cmake/ninja; PyPI
#                                                        # only when the toolkit lacks cuBLAS
#   scripts/sbs/prebuild_cuda.sh pack WORK OUT.tar.xz    # stripped, xz-compressed, with a manifest
#
# What is built: llama-server with every ggml backend as a loadable module (BUILD_SHARED_LIBS,
# GGML_BACKEND_DL): libggml-cuda.so for sm_$CUDA_ARCH and the CPU backend in all x86 variants
# (GGML_CPU_ALL_VARIANTS), of which ggml loads the best one the CPU supports. A static build
# would have to fix one CPU instruction set here, without knowing the GPU machine's CPU; the
# source build there uses -march=native, and the experts llama.cpp keeps on the CPU are
# computed by that code, so a weaker variant would handicap it.
#
# cuBLAS: taken from the toolkit when it has it, else from NVIDIA's `nvidia-cublas` wheel
# ($CUBLAS_VERSION, default the first CUDA 13 release: the server then uses no symbol a later
# 13.x runtime lacks). The driver library: without a GPU there is none, so a stub with the
# soname libcuda.so.1 and the driver calls ggml uses is linked (the GPU machine's real driver
# is found at run time); this keeps ggml's VMM memory pool, as a build on the GPU machine has.
# Nothing of the build machine's paths is written into the binaries (no RPATH): the GPU
# machine's loader path is set by `prebuilt.py libdirs`.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PY:-python3}
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-$(nproc)}
NICE=${NICE:-19}
CUBLAS_VERSION=${CUBLAS_VERSION:-13.0.0.19}

log() { echo "[prebuild $(date -u +%H:%M:%S)] $*"; }
die() { log "ERROR: $*"; exit 1; }

cublas_dirs() {  # cublas_dirs TOOLKIT WORK -> "INCLUDE_DIR LIB_DIR" (lib dir holds libcublas{,Lt}.so)
  local tk=$1 work=$2
  if [ -f "$tk/include/cublas_v2.h" ] \
    && [ -e "$tk/lib64/libcublas.so" ]; then echo "$tk/include $tk/lib64 toolkit"; return; fi
  local root=$work/cublas/nvidia/cu13
  if [ ! -f "$root/include/cublas_v2.h" ]; then
    mkdir -p "$work/wheels" "$work/cublas"
    ls "$work"/wheels/nvidia_cublas-"$CUBLAS_VERSION"-*.whl >/dev/null 2>&1 || \
      $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d "$work/wheels" "nvidia-cublas==$CUBLAS_VERSION" >&2 || die "cannot download nvidia-cublas $CUBLAS_VERSION"
    $PY - "$work"/wheels/nvidia_cublas-"$CUBLAS_VERSION"-*.whl "$work/cublas" <<'PY' \
      || die "cannot unpack the cuBLAS wheel"
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("nvidia/")])
PY
  fi
  mkdir -p "$work/link"
  ln -sf "$root/lib/libcublas.so.13" "$work/link/libcublas.so"
  ln -sf "$root/lib/libcublasLt.so.13" "$work/link/libcublasLt.so"
  echo "$root/include $work/link nvidia-cublas==$CUBLAS_VERSION"
}

driver_stub() {  # driver_stub TOOLKIT SRC WORK -> path of a libcuda.so to link against
  local tk=$1 src=$2 work=$3 syms
  # Every driver entry point ggml-cuda calls (cu[A-Z]...), through cuda.h's macros (some are _v2 names).
  syms=$(grep -ohE '\bcu[A-Z][A-Za-z0-9_]+\s*\(' "$src"/ggml/src/ggml-cuda/*.cu "$src"/ggml/src/ggml-cuda/*.cuh \
         | sed -E 's/\s*\($//' | grep -vx 'cuBLAS' | sort -u)
  mkdir -p "$work/link"
  { echo '#include <cuda.h>'; for s in $syms; do echo "SYM $s"; done; } > "$work/link/driver-names.c"
  gcc -E -I"$tk/include" "$work/link/driver-names.c" | awk '/^SYM /{print "int " $2 "(void) { return 999; }"}' \
    > "$work/link/libcuda-stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/link/libcuda.so" "$work/link/libcuda-stub.c" >&2 \
    || die "cannot build the driver stub"
  echo "$work/link/libcuda.so"
}

do_build() {
  local tgz=${1:?SRC.tar.gz} work=${2:?WORK}
  mkdir -p "$work" && work=$(cd "$work" && pwd)
  local tk
  tk=$(cd "$HERE" && $PY -c "import cuda_hints; print(cuda_hints.toolkit_root() or '')")
  [ -n "$tk" ] && [ -x "$tk/bin/nvcc" ] || die "nvcc not found"
  [ -d "$work/llama.cpp" ] || tar -xzf "$tgz" -C "$work" || die "cannot unpack $tgz"
  local inc lib cublas drv
  read -r inc lib cublas < <(cublas_dirs "$tk" "$work")
  # The sources sit in no git repository of their own: keep git from reporting an enclosing
  # one's commit as llama.cpp's (build-info, `llama-server --version`).
  export GIT_CEILING_DIRECTORIES=$work
  drv=$(driver_stub "$tk" "$work/llama.cpp" "$work")
  log "configure: sm_$CUDA_ARCH, nvcc $tk, cuBLAS $cublas ($inc), driver stub $drv"
  nice -n "$NICE" cmake -S "$work/llama.cpp" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" \
    -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF \
    -DCMAKE_SKIP_BUILD_RPATH=ON -DCMAKE_CUDA_FLAGS="-I$inc" -DCMAKE_CXX_FLAGS="-I$inc" -DCMAKE_C_FLAGS="-I$inc" \
    -DCUDA_cublas_LIBRARY="$lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$lib/libcublasLt.so" \
    -DCUDA_cuda_driver_LIBRARY="$drv" > "$work/configure.log" 2>&1 || die "cmake failed ($work/configure.log)"
  # The backends are modules the server loads at run time, not link dependencies: name them.
  local targets
  targets=$(ninja -C "$work/build" -t targets all | grep -oE '^ggml-cpu-[a-z0-9_]+:' | tr -d ':' | sort -u \
    | tr '\n' ' ')
  log "build: llama-server ggml-cuda $targets(-j$JOBS, nice $NICE; log $work/build.log)"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  nice -n "$NICE" ninja -C "$work/build" -j "$JOBS" llama-server ggml-cuda $targets > "$work/build.log" 2>&1 \
    || die "build failed ($work/build.log)"
  { echo "cuda_arch=$CUDA_ARCH"; echo "nvcc=$("$tk/bin/nvcc" --version | grep -o 'release [0-9.]*, V[0-9.]*')"
    echo "cublas=$cublas"; echo "compiler=$(gcc --version | head -1)"; } > "$work/build-info.txt"
  log "built in $((SECONDS - t0)) s"
}

do_pack() {
  local work=${1:?WORK} out=${2:?OUT.tar.xz}
  work=$(cd "$work" && pwd)
  local bin=$work/build/bin stage=$work/stage
  [ -x "$bin/llama-server" ] && [ -f "$bin/libggml-cuda.so" ] \
    || die "no llama-server + libggml-cuda.so in $bin (build first)"
  rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/fallback"
  cp -P "$bin"/llama-server "$bin"/lib*.so* "$stage/bin/"
  find "$stage/bin" -type f -exec strip --strip-unneeded {} + || die "strip failed"
  # OpenMP runtime of the compiler that built ggml-cpu, used only if the GPU machine lacks one.
  cp -L "$(gcc -print-file-name=libgomp.so.1)" "$stage/fallback/" 2>/dev/null || true
  { echo "llama-server, CUDA backend for sm_$CUDA_ARCH, CPU backend in all x86 variants (GGML_BACKEND_DL)"
    cat "$work/build-info.txt" 2>/dev/null
    echo "source=${SOURCE_NOTE:-llama.cpp}"
    echo "version=$(LD_LIBRARY_PATH=$stage/bin "$stage/bin/llama-server" --version 2>&1 | grep -E '^version' | head -1)"
    echo "needs:"; for f in "$stage"/bin/*; do [ -L "$f" ] && continue
      echo "  $(basename "$f"): $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"; done
    echo "sha256:"; (cd "$stage" && find . -type f | sort | xargs sha256sum | sed 's/^/  /')
  } > "$stage/MANIFEST.txt"
  mkdir -p "$(dirname "$out")"
  tar -C "$stage" -cf - MANIFEST.txt bin fallback | xz -9e -T"$JOBS" > "$out.part" && mv "$out.part" "$out" \
    || die "compression failed"
  log "$out: $(stat -c %s "$out") bytes ($(du -sb "$stage" | cut -f1) bytes unpacked)"
}

case "${1:-}" in
  build) shift; do_build "$@" ;;
  pack) shift; do_pack "$@" ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
