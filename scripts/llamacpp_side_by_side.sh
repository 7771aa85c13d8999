#!/usr/bin/env bash
# tiermoe vs llama.cpp's MoE expert offload (--n-cpu-moe), one synthetic Qwen3-MoE model, one
# machine, equal GPU memory for experts and equal CPU threads. Method: docs/side-by-side.md.
#
#   scripts/llamacpp_side_by_side.sh prepare        # on a machine with PyPI: .peer/ sdist + .whl/ wheels
#   scripts/llamacpp_side_by_side.sh prebuild       # optional, with nvcc, no GPU needed: llama-server for
#                                                   # sm_$CUDA_ARCH into .peer/carry-bin/ (build skipped there)
#   scripts/llamacpp_side_by_side.sh start          # GPU machine: every phase, in the background
#   scripts/llamacpp_side_by_side.sh wait [SECS]    # GPU machine: follow the log; results into $OUT
#   scripts/llamacpp_side_by_side.sh PHASE          # one phase in the foreground, PHASE one of
#       setup build model-store tiermoe model-gguf check llamacpp report all
#
# State lives in $SBS_DIR on the machine's disk, so phases run as separate commands only while
# the machine stays warm between them; `start`/`wait` avoid that by running everything in one
# background job. Every knob is an environment variable (defaults below).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-python3}
SBS_DIR=${SBS_DIR:-${HOME:-/root}/sbs}
STORE_DIR=${STORE_DIR:-auto}          # where each format is written (auto: see plan_layout)
GGUF_DIR=${GGUF_DIR:-auto}
RES=$SBS_DIR/results
LOGS=$SBS_DIR/logs
LAYERS=${LAYERS:-24}
N_CPU_MOE=${N_CPU_MOE:-16}            # llama.cpp: experts of the first N layers stay on the CPU
MODEL_ARGS=${MODEL_ARGS:-}            # extra make-qwen3moe flags (e.g. a small shape for a CPU dry run)
THREADS=${THREADS:-$(nproc)}
NP=${NP:-4}                           # parallel sequences (C4 needs 4)
CTX=${CTX:-20480}                     # context per sequence (16k prompt + decode)
UBATCH=${UBATCH:-4096}                # tokens per engine step (llama.cpp -b/-ub, tiermoe --max-num-batched-tokens)
PREFILL_SIZES=${PREFILL_SIZES:-4k,16k}
REPS=${REPS:-3}
CONC=${CONC:-1,4}
MAX_TOKENS=${MAX_TOKENS:-256}
WARMUP_SIZE=${WARMUP_SIZE:-4k}
TIERMOE_MODES=${TIERMOE_MODES:-exact fast}    # MODE or MODE@storepath|eager; the first runs before llama.cpp
TIERMOE_EXTRA_ARGS=${TIERMOE_EXTRA_ARGS:-}
# tiermoe's routers pick from the real GLM-5.3-Flash statistics written beside the model (the
# random model's own routing hits 95 % of its slots; the real model's, under 40 %). llama.cpp
# computes every pick of its CPU layers on the CPU, so its speed does not depend on the picks.
REPLAY=${REPLAY:-1}
LLAMA_EXTRA_ARGS=${LLAMA_EXTRA_ARGS:-}
# MIX_CHECK=1: llama.cpp's decode sweep once more on story requests and on random words (other
# routed experts), results/mix-*.json: its rate should not depend on which experts are picked
MIX_CHECK=${MIX_CHECK:-1}
# llama.cpp's own advice when experts are overridden to the CPU: "tensor overrides to CPU are used
# with mmap enabled - consider using --load-mode none for better performance" (its log, 2026-12-01)
LLAMA_LOAD_MODE=${LLAMA_LOAD_MODE:-none}
LLAMA_CUDA=${LLAMA_CUDA:-auto}        # auto: CUDA build when nvcc is found
CUDA_ARCH=${CUDA_ARCH:-90}
SERVER_WAIT=${SERVER_WAIT:-600}       # seconds a server may take to load
SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-600}   # seconds one sweep may take (a hung server must not eat the lease)
NAME=qwen3moe-synthetic
CARRY=$ROOT/.peer/carry                # what travels to the GPU machine (carry: .peer/carry and .whl)
SRC_TGZ=$CARRY/llama.cpp-src.tar.gz
LLAMA_SRC=$SBS_DIR/llama.cpp
LLAMA_BUILD=${LLAMA_BUILD:-$SBS_DIR/llama-build}
PREBUILT=${PREBUILT:-auto}            # auto: use .peer/carry-bin's server when carried, else build; off: build
PREBUILD_DIR=${PREBUILD_DIR:-$ROOT/.peer/cuda-build}   # where `prebuild` compiles
PREBUILT_TAR=$ROOT/.peer/carry-bin/llama-server-cuda-sm$CUDA_ARCH.tar.xz
export PYTHONPATH=$ROOT/src:$SBS_DIR/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

log() { echo "[sbs $(date -u +%H:%M:%S)] $*"; }
die() { log "ERROR: $*"; exit 1; }
tm() { $PY -m tiermoe.cli "$@"; }
json_get() { $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$1" \
  "$2"; }

phase_prepare() {  # needs PyPI: the llama.cpp sources (trimmed) and the wheels the GPU image lacks
  mkdir -p "$CARRY" "$ROOT/.whl"
  grep -qx '/.peer/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.peer/' >> "$ROOT/.git/info/exclude"
  grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
  local v=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
  [ -f "$ROOT/.peer/llama_cpp_python-$v.tar.gz" ] || \
    $PY -m pip download --no-deps --no-binary :all: "llama-cpp-python==$v" -d "$ROOT/.peer" \
      || die "sdist download failed"
  bash "$ROOT/scripts/sbs/trim_llamacpp_sdist.sh" "$ROOT/.peer/llama_cpp_python-$v.tar.gz" "$SRC_TGZ" \
    || die "trim failed"
  echo "$v" > "$CARRY/llama-cpp-python.version"
  git -C "$ROOT" rev-parse HEAD > "$CARRY/tiermoe-commit.txt" 2>/dev/null
  local spec name
  while read -r spec; do
    case "$spec" in ''|'#'*) continue ;; esac
    name=${spec%%==*}
    ls "$ROOT"/.whl/"$name"-*.whl >/dev/null 2>&1 && continue
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$ROOT/.whl" "$spec" || die "wheel download failed: $spec"
  done < "$ROOT/scripts/sbs/wheels.txt"
  log "carry .whl and .peer/carry ($(du -sh "$ROOT/.whl" "$CARRY" | cut -f1 | tr '\n' ' '))"
}

plan_layout() {  # where the store and the GGUF go; kept in $SBS_DIR/layout.env for later phases
  if [ -f "$SBS_DIR/layout.env" ]; then . "$SBS_DIR/layout.env"; return 0; fi
  local sizes
  # shellcheck disable=SC2086
  sizes=$(tm bench make-qwen3moe /unused --layers "$LAYERS" --sizes-only $MODEL_ARGS) || die "cannot size the model"
  # Disk first (the store is read with O_DIRECT), then /dev/shm (RAM); both at once when they fit,
  # else one after the other in one place (SEQUENTIAL=1: the store is removed before the GGUF).
  $PY - "$SBS_DIR" "$STORE_DIR" "$GGUF_DIR" "$sizes" > "$SBS_DIR/layout.env" <<'PY' \
    || { rm -f "$SBS_DIR/layout.env"; die "no room for the model on disk or in /dev/shm (lower LAYERS)"; }
import json, os, shutil, sys
sbs, want_store, want_gguf, sizes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
need = {"store": sizes["store_bytes"] * 1.05, "gguf": sizes["gguf_bytes"] * 1.05}
places = [os.path.join(sbs, "model")] + (["/dev/shm/sbs-model"] if os.path.isdir("/dev/shm") else [])
def free(p):
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free, os.stat(p).st_dev
left = {}
for p in places:
    f, dev = free(p)
    left.setdefault(dev, f)
dev_of = {p: free(p)[1] for p in places}
chosen = {}
for fmt, want in (("store", want_store), ("gguf", want_gguf)):
    opts = [want] if want != "auto" else places
    for p in opts:
        d = dev_of.get(p, free(p)[1])
        left.setdefault(d, free(p)[0])
        if left[d] >= need[fmt]:
            chosen[fmt] = p
            left[d] -= need[fmt]
            break
seq = 0
if "store" not in chosen:
    sys.exit(1)
if "gguf" not in chosen:  # one place for one format at a time
    chosen["gguf"], seq = chosen["store"], 1
print(f"STORE_DIR={chosen['store']}\nGGUF_DIR={chosen['gguf']}\nSEQUENTIAL={seq}")
PY
  . "$SBS_DIR/layout.env"
  log "layout: store in $STORE_DIR, GGUF in $GGUF_DIR$([ "$SEQUENTIAL" = 1 ] && echo ' (one at a time)')"
}

phase_setup() {
  mkdir -p "$RES" "$LOGS" "$SBS_DIR/site"
  if ! $PY -c "import gguf, fastapi, uvicorn, pydantic" 2>/dev/null && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 \
     && [ ! -f "$SBS_DIR/site/.installed" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SBS_DIR/site" \
      "$ROOT"/.whl/*.whl && touch "$SBS_DIR/site/.installed" || die "wheel install failed"
  fi
  $PY -c "import gguf, fastapi, uvicorn, httpx, torch" || die "missing Python packages (run prepare, carry .whl)"
  [ -f "$RES/env.json" ] || $PY "$ROOT/scripts/sbs/probe.py" "$RES/env.json" --threads "$THREADS" \
    --host-gib "${PROBE_HOST_GIB:-8}" > "$LOGS/probe.log" 2>&1 \
    || log "probe failed (see logs/probe.log)"
  # COMMIT (set by whoever started the run from a tree without .git) before the one `prepare` noted
  if [ -n "${COMMIT:-}" ]; then echo "$COMMIT" > "$RES/tiermoe-commit.txt"
  else git -C "$ROOT" rev-parse HEAD > "$RES/tiermoe-commit.txt" 2>/dev/null \
    || cp "$CARRY/tiermoe-commit.txt" "$RES/" 2>/dev/null || echo unknown > "$RES/tiermoe-commit.txt"; fi
  plan_layout
}

llama_env() {  # cuBLAS outside the toolkit (source build) or every library dir (prebuilt) on the loader path
  local f
  for f in "$SBS_DIR/cuda-links/libdirs.txt" "$LLAMA_BUILD/libdirs.txt"; do
    if [ -s "$f" ]; then
      LD_LIBRARY_PATH=$(paste -sd: "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      export LD_LIBRARY_PATH
    fi
  done
}

phase_prebuild() {  # here (nvcc, no GPU): compile and pack what phase_build then only unpacks
  [ -f "$SRC_TGZ" ] || die "$SRC_TGZ missing: run 'prepare' first"
  export CUDA_ARCH SOURCE_NOTE
  local pinned
  pinned=$(cat "$CARRY/llama-cpp-python.version" 2>/dev/null || echo '?')
  SOURCE_NOTE="llama-cpp-python $pinned sdist (vendor/llama.cpp)"
  bash "$ROOT/scripts/sbs/prebuild_cuda.sh" build "$SRC_TGZ" "$PREBUILD_DIR" || die "prebuild failed"
  bash "$ROOT/scripts/sbs/prebuild_cuda.sh" pack "$PREBUILD_DIR" "$PREBUILT_TAR" || die "pack failed"
  log "carry .peer/carry-bin too ($(du -sh "$(dirname "$PREBUILT_TAR")" | cut -f1))"
}

use_prebuilt() {  # unpack the carried server; keep it only if it resolves its libraries and sees a GPU
  [ "$PREBUILT" != off ] && [ -f "$PREBUILT_TAR" ] || return 1
  local bin=$LLAMA_BUILD/bin/llama-server
  log "unpacking the prebuilt llama-server ($(basename "$PREBUILT_TAR"))"
  rm -rf "$LLAMA_BUILD" && mkdir -p "$LLAMA_BUILD"
  if ! $PY "$ROOT/scripts/sbs/prebuilt.py" unpack "$PREBUILT_TAR" "$LLAMA_BUILD" > "$LOGS/prebuilt.log" 2>&1; then
    log "prebuilt: unpack failed (logs/prebuilt.log); building from source"; rm -rf "$LLAMA_BUILD"; return 1
  fi
  if ! $PY "$ROOT/scripts/sbs/prebuilt.py" libdirs "$LLAMA_BUILD/bin" > "$LLAMA_BUILD/libdirs.txt" \
    2>> "$LOGS/prebuilt.log"; then
    log "prebuilt: $(grep unresolved "$LOGS/prebuilt.log" | tr '\n' ' '); building from source"
    rm -rf "$LLAMA_BUILD"; return 1
  fi
  # The CUDA backend is a module loaded at run time and skipped silently when it cannot load.
  ( llama_env; timeout 120 "$bin" --list-devices ) >> "$LOGS/prebuilt.log" 2>&1
  if ! grep -q "CUDA0" "$LOGS/prebuilt.log"; then
    log "prebuilt: no CUDA device listed (logs/prebuilt.log); building from source"; rm -rf "$LLAMA_BUILD"; return 1
  fi
  record_llama_version \
    "prebuilt for sm_$CUDA_ARCH elsewhere ($(grep -E '^(nvcc|cuda_arch)=' "$LLAMA_BUILD/MANIFEST.txt" | tr '\n' ' '))"
  log "prebuilt: $(grep -m1 CUDA0 "$LOGS/prebuilt.log" | sed 's/^ *//'); $(tr '\n' ' ' < "$RES/llamacpp-version.txt")"
}

record_llama_version() {  # record_llama_version NOTE
  llama_env
  { echo "sdist llama-cpp-python $(cat "$CARRY/llama-cpp-python.version" 2>/dev/null || echo '?'); $1"
    "$LLAMA_BUILD/bin/llama-server" --version 2>&1 | grep -E "version|built with" | head -3; } \
      > "$RES/llamacpp-version.txt"
}

phase_build() {
  local bin=$LLAMA_BUILD/bin/llama-server
  if [ -x "$bin" ]; then
    log "llama-server already built"
    [ -f "$RES/llamacpp-version.txt" ] || record_llama_version "prebuilt at $LLAMA_BUILD"
    return 0
  fi
  use_prebuilt && return 0
  [ -f "$SRC_TGZ" ] || die "$SRC_TGZ missing: run 'prepare' on a machine with PyPI and carry .peer/carry"
  rm -rf "$LLAMA_SRC" && mkdir -p "$SBS_DIR" && tar -xzf "$SRC_TGZ" -C "$SBS_DIR" || die "unpack failed"
  local cuda=OFF
  if [ "$LLAMA_CUDA" = ON ] || { [ "$LLAMA_CUDA" = auto ] && command -v nvcc >/dev/null; }; then cuda=ON; fi
  local hints=()
  if [ $cuda = ON ]; then  # cuBLAS / driver library outside the toolkit (pip-assembled CUDA): point CMake at them
    mapfile -t hints < <($PY "$ROOT/scripts/sbs/cuda_hints.py" "$SBS_DIR/cuda-links")
  fi
  log "building llama-server (CUDA=$cuda, arch $CUDA_ARCH, $(nproc) jobs${hints[*]:+, hints: ${hints[*]}})"
  local t0=$SECONDS
  cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda \
    -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF "${hints[@]}" > "$LOGS/llama-configure.log" 2>&1 \
    || die "cmake failed (logs/llama-configure.log)"
  ninja -C "$LLAMA_BUILD" -j "$(nproc)" llama-server > "$LOGS/llama-build.log" 2>&1 \
    || die "build failed (logs/llama-build.log)"
  record_llama_version "CUDA $cuda, arch $CUDA_ARCH, built in $((SECONDS - t0)) s"
  log "built: $(tr '\n' ' ' < "$RES/llamacpp-version.txt")"
}

make_model() {  # make_model FORMAT DIR
  local f=$1 dir=$2 meta=$2/synthetic-$1.json target=$2/store/manifest.json
  [ "$f" = gguf ] && target=$dir/model.gguf
  if [ -f "$meta" ] && [ -f "$target" ] && [ "$(json_get "$meta" "d['spec']['layers']")" = "$LAYERS" ]; then
    log "$f model present ($meta)"; cp "$meta" "$RES/"; return 0
  fi
  log "writing the $f model ($LAYERS layers) into $dir"
  # shellcheck disable=SC2086
  tm bench make-qwen3moe "$dir" --layers "$LAYERS" --formats "$f" --force $MODEL_ARGS \
    > "$LOGS/make-$f.log" 2>&1 || die "make-qwen3moe $f failed (logs/make-$f.log)"
  cp "$meta" "$RES/"
  grep -v '%|' "$LOGS/make-$f.log" | tail -3
}

phase_model_store() { make_model store "$STORE_DIR"; }

phase_model_gguf() {
  if [ "$SEQUENTIAL" = 1 ] && [ -d "$STORE_DIR/store" ] && [ ! -f "$GGUF_DIR/model.gguf" ]; then
    log "no room for both formats: removing the store before writing the GGUF (its digest stays in results/)"
    echo "The store was removed before the GGUF was written (no room for both)." >> "$RES/notes.txt"
    rm -rf "$STORE_DIR/store"
  fi
  make_model gguf "$GGUF_DIR"
}

phase_check() {
  if [ -d "$STORE_DIR/store" ] && [ -f "$GGUF_DIR/model.gguf" ]; then
    local both=$SBS_DIR/check-view  # one directory view of both formats and their summaries
    rm -rf "$both" && mkdir -p "$both"
    ln -s "$STORE_DIR/store" "$STORE_DIR/synthetic-store.json" "$GGUF_DIR/model.gguf" "$GGUF_DIR/synthetic-gguf.json" \
      "$both/"
    tm bench check-qwen3moe "$both" > "$RES/check.txt" 2>"$LOGS/check.err"; log "$(tail -1 "$RES/check.txt")"
  else
    log "check skipped (store and GGUF are not both on disk); report compares generation digests"
  fi
}

expert_gib() {  # GiB of expert weights of N layers (the same bytes per expert in both formats)
  json_get "$RES/synthetic-store.json" \
    "round($1 * d['spec']['experts'] * d['sizes']['store_bytes_per_expert'] / 2**30, 4)"
}

wait_http() {  # wait_http URL PID SECONDS
  $PY - "$1" "$2" "$3" <<'PY'
import os, sys, time, urllib.request
url, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.time()
while time.time() - t0 < limit:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                print(f"ready after {time.time() - t0:.0f} s"); sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        print("server exited"); sys.exit(1)
    time.sleep(2)
print("timed out"); sys.exit(2)
PY
}

stop_pid() {  # stop_pid PID: TERM, then KILL after 60 s (only processes this script started)
  local pid=$1 n=0
  kill -TERM "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null && [ $n -lt 60 ]; do sleep 1; n=$((n + 1)); done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

vram_start() {  # vram_start FILE: sample GPU memory every 0.5 s
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$1" 2>/dev/null &
    echo $!
  else echo 0; fi
}

stats() {  # stats URL FILE: the server's /stats JSON (tiermoe's tier counters)
  $PY -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "$1/stats" > "$2" 2>/dev/null || rm -f "$2"
}

measure() {  # measure LABEL URL STATS(0|1) BENCH...: warm-up, sweep into results/ (+ /stats around the sweep)
  local label=$1 url=$2 with_stats=$3; shift 3
  local bench=("$@")
  timeout 300 "${bench[@]}" bench sweep --url "$url" --model "$NAME" --prefill-sizes "$WARMUP_SIZE" --reps 1 \
    --concurrency "$CONC" \
    --max-tokens 32 --long-prompt 0 --seed 7 --out "$LOGS/warmup-$label.json" > "$LOGS/warmup-$label.log" 2>&1 \
    || log "warm-up of $label failed (logs/warmup-$label.log)"
  [ "$with_stats" = 1 ] && stats "$url" "$RES/stats-before-$label.json"
  timeout "$SWEEP_TIMEOUT" "${bench[@]}" bench sweep --url "$url" --model "$NAME" --prefill-sizes "$PREFILL_SIZES" \
    --reps "$REPS" \
    --concurrency "$CONC" --max-tokens "$MAX_TOKENS" --long-prompt 0 --seed 1 --out "$RES/sweep-$label.json" \
    > "$LOGS/sweep-$label.log" 2>&1 || { log "sweep of $label failed (logs/sweep-$label.log)"; return 1; }
  [ "$with_stats" = 1 ] && stats "$url" "$RES/stats-$label.json"
  grep -E "prefill|decode" "$LOGS/sweep-$label.log" | sed "s/^/  [$label] /"
}

mix_check() {  # mix_check LABEL URL BENCH...: the same decode sweep on story requests and on random words
  local label=$1 url=$2 kind; shift 2
  for kind in story random; do
    timeout "$SWEEP_TIMEOUT" "$@" bench sweep --url "$url" --model "$NAME" --prefill-sizes 1k --reps 1 \
      --concurrency "$CONC" --max-tokens "$MAX_TOKENS" --long-prompt 0 --seed 11 --decode-prompts "$kind" \
      --out "$RES/mix-$kind-$label.json" > "$LOGS/mix-$kind-$label.log" 2>&1 \
      || { log "$label: the $kind mix failed (logs/mix-$kind-$label.log)"; return 0; }
    grep -E "decode" "$LOGS/mix-$kind-$label.log" | sed "s/^/  [$label, $kind prompts] /"
  done
}

run_tiermoe() {  # run_tiermoe MODE[@VARIANT]  (storepath: --device-cache off; eager: --enforce-eager;
  #                                          own: the model's own routing even when REPLAY=1)
  local mode=${1%%@*} variant="" port=8101 gpu_gb host_gb dio="" vargs="" replay=$REPLAY
  [ "$1" != "$mode" ] && variant=${1#*@}
  case "$variant" in
    "") ;;
    storepath) vargs="--device-cache off" ;;
    eager) vargs="--enforce-eager" ;;
    own) replay=0 ;;
    *) log "unknown tiermoe variant '$variant' (known: storepath, eager, own)"; return 0 ;;
  esac
  local label=tiermoe-$mode${variant:+-$variant}
  [ -d "$STORE_DIR/store" ] || die "no store in $STORE_DIR (phase model-store)"
  gpu_gb=$(expert_gib $((LAYERS - N_CPU_MOE)))
  host_gb=$($PY -c "print(round($(expert_gib "$LAYERS") + 1, 2))")
  [ "$($PY -c "import os,sys; print(int(os.path.realpath(sys.argv[1]).startswith('/dev/shm')))" "$STORE_DIR")" = 1 ] \
    && dio=--no-direct-io
  local cmd=("$PY" -m tiermoe.cli serve "$STORE_DIR/store" --host 127.0.0.1 --port $port --served-model-name "$NAME"
    --max-model-len "$CTX" --max-num-seqs "$NP" --max-num-batched-tokens "$UBATCH" --gpu-expert-gb "$gpu_gb"
    --host-expert-gb "$host_gb" --mode "$mode" --cpu-lane-threads "$THREADS" $dio $vargs $TIERMOE_EXTRA_ARGS)
  [ "$replay" = 1 ] && cmd+=(--routing-replay "$STORE_DIR/expert-stats.json" \
    --expert-stats "$STORE_DIR/expert-stats.json")  # the same statistics warm-start the slot cache
  echo "tiermoe ${cmd[*]:3}" > "$RES/cmd-$label.txt"
  log "$label: --gpu-expert-gb $gpu_gb --host-expert-gb $host_gb"
  local vpid t0=$SECONDS
  vpid=$(vram_start "$LOGS/vram-$label.csv")
  "${cmd[@]}" > "$LOGS/server-$label.log" 2>&1 &
  local pid=$!
  if wait_http "http://127.0.0.1:$port/health" $pid "$SERVER_WAIT" > "$LOGS/wait-$label.txt"; then
    echo "$((SECONDS - t0))" > "$RES/startup-s-$label.txt"
    measure "$label" "http://127.0.0.1:$port" 1 "$PY" -m tiermoe.cli
    timeout 300 $PY "$ROOT/scripts/sbs/greedy.py" record "http://127.0.0.1:$port" "$RES/greedy-$label.json" \
      --model "$NAME" \
      > "$LOGS/greedy-$label.log" 2>&1 || log "greedy record failed (logs/greedy-$label.log)"
  else
    log "$label did not start: $(cat "$LOGS/wait-$label.txt"); tail of its log:"; tail -5 "$LOGS/server-$label.log"
  fi
  stop_pid $pid
  [ "$vpid" != 0 ] && kill "$vpid" 2>/dev/null
  return 0
}

phase_tiermoe() { for m in $TIERMOE_MODES; do run_tiermoe "$m"; done; }

phase_llamacpp() {
  local label=llamacpp port=8102 bin=$LLAMA_BUILD/bin/llama-server
  [ -x "$bin" ] || die "llama-server not built (phase build)"
  llama_env
  [ -f "$GGUF_DIR/model.gguf" ] || die "no GGUF in $GGUF_DIR (phase model-gguf)"
  local cmd=("$bin" -m "$GGUF_DIR/model.gguf" --alias "$NAME" --host 127.0.0.1 --port $port -ngl 999
    --n-cpu-moe "$N_CPU_MOE" --fit off -t "$THREADS" -tb "$THREADS" -c $((CTX * NP)) -np "$NP" --no-kv-unified
    -b "$UBATCH" -ub "$UBATCH" -fa on --jinja --no-webui ${LLAMA_LOAD_MODE:+--load-mode "$LLAMA_LOAD_MODE"}
    $LLAMA_EXTRA_ARGS)
  echo "llama-server ${cmd[*]:1}" > "$RES/cmd-$label.txt"
  log "llama.cpp: --n-cpu-moe $N_CPU_MOE ($((LAYERS - N_CPU_MOE)) of $LAYERS layers' experts on the GPU)"
  local vpid t0=$SECONDS
  vpid=$(vram_start "$LOGS/vram-$label.csv")
  "${cmd[@]}" > "$LOGS/server-$label.log" 2>&1 &
  local pid=$!
  if wait_http "http://127.0.0.1:$port/health" $pid "$SERVER_WAIT" > "$LOGS/wait-$label.txt"; then
    echo "$((SECONDS - t0))" > "$RES/startup-s-$label.txt"
    grep -E "model buffer size|KV buffer size|compute buffer size|CUDA0|offloaded" "$LOGS/server-$label.log" \
      > "$RES/llamacpp-buffers.txt"
    measure "$label" "http://127.0.0.1:$port" 0 "$PY" "$ROOT/scripts/sbs/bench_llamacpp.py"
    [ "$MIX_CHECK" = 1 ] && mix_check "$label" "http://127.0.0.1:$port" "$PY" "$ROOT/scripts/sbs/bench_llamacpp.py"
    timeout 300 $PY "$ROOT/scripts/sbs/greedy.py" record "http://127.0.0.1:$port" "$RES/greedy-$label.json" \
      --model "$NAME" \
      > "$LOGS/greedy-$label.log" 2>&1 || log "greedy record failed (logs/greedy-$label.log)"
  else
    log "llama-server did not start: $(cat "$LOGS/wait-$label.txt"); tail of its log:"; tail -5 \
      "$LOGS/server-$label.log"
  fi
  stop_pid $pid
  [ "$vpid" != 0 ] && kill "$vpid" 2>/dev/null
  return 0
}

phase_report() {
  $PY "$ROOT/scripts/sbs/report.py" "$SBS_DIR" --layers "$LAYERS" --n-cpu-moe "$N_CPU_MOE" --threads "$THREADS" \
    --ubatch "$UBATCH" > "$LOGS/report.log" 2>&1 || { tail -5 "$LOGS/report.log"; die "report failed"; }
  log "table: $RES/side_by_side.md"
}

phase_all() {  # the core comparison (first tiermoe mode vs llama.cpp) first, other modes after it
  phase_setup
  local first=${TIERMOE_MODES%% *} rest=${TIERMOE_MODES#"${TIERMOE_MODES%% *}"}
  log "build and model generation in parallel"
  ( phase_build ) > "$LOGS/phase-build.log" 2>&1 &
  local bpid=$!
  phase_model_store
  [ "$SEQUENTIAL" = 1 ] || { phase_model_gguf; phase_check; }
  wait $bpid && log "build done" || log "build failed: $(tail -2 "$LOGS/phase-build.log")"
  run_tiermoe "$first"
  if [ "$SEQUENTIAL" = 1 ]; then
    for m in $rest; do run_tiermoe "$m"; done
    phase_model_gguf
    rest=""
  fi
  phase_llamacpp
  phase_report
  if [ -n "${rest// /}" ]; then
    for m in $rest; do run_tiermoe "$m"; done
    phase_report
  fi
  log "DONE"
}

collect() {  # copy results (and the logs, compressed) into $OUT when it names a folder
  [ -n "${OUT:-}" ] && [ -d "$SBS_DIR" ] || return 0
  tar -czf "$OUT/sbs-results.tgz" -C "$SBS_DIR" results logs 2>/dev/null
  [ -f "$RES/side_by_side.md" ] && cp "$RES/side_by_side.md" "$OUT/"
  [ -f "$SBS_DIR/run.log" ] && tail -c 200000 "$SBS_DIR/run.log" > "$OUT/run.log"
  return 0
}

phase_start() {
  mkdir -p "$SBS_DIR"
  if [ -f "$SBS_DIR/run.pid" ] && kill -0 "$(cat "$SBS_DIR/run.pid")" \
    2>/dev/null; then log "already running"; return 0; fi
  setsid nohup bash "$0" all > "$SBS_DIR/run.log" 2>&1 < /dev/null &
  echo $! > "$SBS_DIR/run.pid"
  log "started (pid $(cat "$SBS_DIR/run.pid")); follow with: $0 wait"
}

phase_wait() {  # wait [SECONDS]: print the log as it grows until DONE or the time is up
  local limit=${1:-560} t0=$SECONDS seen=0 n
  while :; do
    if [ -f "$SBS_DIR/run.log" ]; then
      n=$(wc -l < "$SBS_DIR/run.log"); [ "$n" -gt "$seen" ] && sed -n "$((seen + 1)),${n}p" "$SBS_DIR/run.log"; seen=$n
    fi
    if ! { [ -f "$SBS_DIR/run.pid" ] && kill -0 "$(cat "$SBS_DIR/run.pid")" 2>/dev/null; }; then
      log "background run finished"; collect; [ -f "$RES/side_by_side.md" ] && cat "$RES/side_by_side.md"; return 0
    fi
    [ $((SECONDS - t0)) -ge "$limit" ] && { log "still running; call wait again within 30 s"; collect; return 0; }
    sleep 5
  done
}

case "${1:-}" in
  prepare) phase_prepare ;;
  prebuild) phase_prebuild ;;
  setup) phase_setup ;;
  build) phase_setup; phase_build; collect ;;
  model-store) phase_setup; phase_model_store; collect ;;
  model-gguf) phase_setup; phase_model_gguf; collect ;;
  check) phase_setup; phase_check; collect ;;
  tiermoe) phase_setup; phase_tiermoe; collect ;;
  llamacpp) phase_setup; phase_llamacpp; collect ;;
  report) phase_setup; phase_report; collect ;;
  all) phase_all; collect ;;
  start) phase_start ;;
  wait) shift; phase_wait "${1:-560}" ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac
