#!/usr/bin/env bash
# Cut llama-cpp-python's source package down to what a CUDA (or CPU) build of llama-server
# needs, so it fits the GPU machine's per-call transfer limit.
#
#   scripts/sbs/trim_llamacpp_sdist.sh SDIST.tar.gz OUT.tar.gz
#
# The sdist vendors llama.cpp under vendor/llama.cpp. Dropped: test-vocabulary GGUFs (models/),
# docs, media, tests, examples, benchmarks, the web UI's sources (the server then embeds an
# empty asset table; the API is unchanged), and every ggml backend except CPU and CUDA.
# The result is a tarball whose top directory is llama.cpp/.
set -euo pipefail
sdist=${1:?usage: trim_llamacpp_sdist.sh SDIST.tar.gz OUT.tar.gz}
out=${2:?usage: trim_llamacpp_sdist.sh SDIST.tar.gz OUT.tar.gz}
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
src=$(find "$work" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -1)
[ -n "$src" ] || { echo "no vendor/llama.cpp inside $sdist" >&2; exit 2; }
cd "$src"
rm -rf .git models docs media tests examples pocs benches app gguf-py conversion skills \
       tools/server/tests tools/server/bench tools/mtmd/test-*.* tools/mtmd/tests vendor/miniaudio/*.md
# The UI target needs only its CMake file and the two templates when no assets are built.
find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name 'ui.*.in' ! -name sources.cmake \
     -exec rm -rf {} +
for b in ggml/src/ggml-*/; do
  case "$b" in
    */ggml-cpu/|*/ggml-cuda/|*/ggml-blas/) ;;
    *) rm -rf "$b" ;;
  esac
done
cd ..
mv "$(basename "$src")" llama.cpp 2>/dev/null || true
tar -czf "$out" llama.cpp
echo "$out: $(du -h "$out" | cut -f1)"
