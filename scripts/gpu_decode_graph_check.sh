#!/usr/bin/env bash
# Decode CUDA graphs on the GPU machine, in one call: correctness, then the side-by-side
# model's decode rate over HTTP and the in-process step profile (docs/results.md section 13).
# Usage: scripts/gpu_decode_graph_check.sh OUT_DIR   (from the repository root; carry .whl)
#   1. tests/runner/test_decode_graph.py, tests/moe/test_device_cache.py,
#      tests/kernels/test_paged_attention.py and test_fused_moe.py compiled on CUDA (graph replays
#      bit-identical to the eager engine at batch 1 and 2, with SDPA and with the paged decode
#      kernel; K tiles spanning several scale groups); then `tiermoe bench tune-moe` for the store's shape
#   2. the side-by-side Qwen3-MoE store (24 layers, random weights) written to $STORE
#   3. per serving variant in $VARIANTS: tiermoe serve with the side-by-side flags and the
#      variant's own, `tiermoe bench sweep` (4k prefill once, decode C1 and C4, $MAX_TOKENS
#      tokens), /stats before and after, and scripts/engine_thread_check.py (ms per token in-process)
#   4. scripts/profile_engine_decode.py on the same store: graphs off vs on, and a 4000-token
#      prefill (the default paged decode kernel); then the same with SDPA decode attention
#      and with two prefill staging buffers (copies one layer ahead, --prefill-staging-gb 1.75)
#   5. the same profile with misses read in place instead of staged (--no-stage-misses)
# Environment: STORE ($HOME/sbs-graph-model), MAX_TOKENS (256),
# VARIANTS ("default: sdpa:--decode-attention,sdpa": space-separated NAME:FLAGS, flags joined by
#   commas, e.g. "noborrow:--no-prefill-borrow-slots ahead:--prefill-staging-gb,1.75 fast:--mode,fast"),
# SPY (1: after the measured sweep, a C1 sweep recorded by py-spy, summarised per thread by
#   scripts/pyspy_summary.py; carry .peer/tools, which holds the py-spy wheel),
# PACK (1: OUT_DIR.tgz instead of OUT_DIR), PYTHON (python3), THREAD_CHECK (1: run engine_thread_check after each
# sweep), USE_TUNED (1: a
# configs.json tuned by an earlier call on this machine replaces the working copy's), STEPS
# ("tests tune store serve profile": any subset, in that order; the whole script runs longer
# than one 10-minute call, so split it, e.g. STEPS="tests tune store" then STEPS="serve" while
# the machine is still warm). `tune` rewrites the package's configs.json in the working copy
# (kept as OUT/configs.json: commit it if the figures improve).
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
store=${STORE:-${HOME:-.}/sbs-graph-model}
site=/tmp/tiermoe-site
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:$site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[graph $(date -u +%H:%M:%S)] $*"; }
get() { "$py" -c \
  "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" "$1"; }
flags=(--gpu-expert-gb 10.125 --host-expert-gb 31.38 --max-num-batched-tokens 4096 --dtype bfloat16)
# REPLAY=1 (default): the routers' picks come from the real GLM-5.3-Flash statistics written beside
# the model (a random model's own routing hits 95 % of the slots, the real one under 40 %)
[ "${REPLAY:-1}" = 1 ] && flags+=(--routing-replay "$store/expert-stats.json" --expert-stats "$store/expert-stats.json")

want() { [[ " ${STEPS:-tests tune store serve profile} " == *" $1 "* ]]; }

if want tests; then
  log "tests on CUDA"
  TIERMOE_KERNEL_TESTS_ON_GPU=1 timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/runner/test_decode_graph.py \
    tests/moe/test_device_cache.py tests/kernels/test_paged_attention.py tests/kernels/test_fused_moe.py \
    > "$out/tests.txt" 2>&1
  log "tests rc=$?: $(tail -1 "$out/tests.txt")"
fi

if want tune; then  # the store's record shape has no tuned launch configuration yet (results section 15)
  log "tune the fused MoE kernel for int4/H4096/I1536/G32 (written to the package's configs.json)"
  if timeout 300 "$py" -m tiermoe.cli bench tune-moe --hidden 4096 --inter 1536 --experts 128 --top-k 8 \
    --group-size 32 \
    --time-budget 150 > "$out/tune.json" 2>&1; then
    cp src/tiermoe/kernels/triton/configs.json "$out/configs.json"
    cp src/tiermoe/kernels/triton/configs.json "${HOME:-.}/tuned-configs.json"  # a later call on this machine uses it
  fi
  tail -16 "$out/tune.json"
fi
# A later call on the same machine gets a fresh working copy: take the configs tuned earlier.
[ -f "${HOME:-.}/tuned-configs.json" ] && [ "${USE_TUNED:-1}" = 1 ] && \
  cp "${HOME:-.}/tuned-configs.json" src/tiermoe/kernels/triton/configs.json

if want store; then
  log "store"
  [ -f "$store/store/manifest.json" ] || "$py" -m tiermoe.cli bench make-qwen3moe "$store" --layers 24 --formats store \
    --force 2>&1 | grep -v '%|' | tail -2
fi

want serve && for variant in ${VARIANTS:-default: sdpa:--decode-attention,sdpa}; do
  attn=${variant%%:*}  # the variant's name (files are named after it)
  IFS=, read -r -a extra <<< "${variant#*:}"
  log "server + sweep, variant $attn: ${extra[*]:-(defaults)}"
  "$py" -m tiermoe.cli serve "$store/store" --host 127.0.0.1 --port 8111 --served-model-name qwen3moe-synthetic \
    --max-model-len 20480 --max-num-seqs 4 "${flags[@]}" --cpu-lane-threads 16 ${extra[@]+"${extra[@]}"} \
    > "$out/server-$attn.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 150); do
    get http://127.0.0.1:8111/health > /dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    sleep 2
  done
  sweep() { timeout 240 "$py" -m tiermoe.cli bench sweep --url http://127.0.0.1:8111 --model qwen3moe-synthetic \
    --prefill-sizes 4k --reps 1 --concurrency 1,4 --long-prompt 0 "$@"; }
  sweep --max-tokens 32 --seed 7 > "$out/warmup-$attn.log" 2>&1
  get http://127.0.0.1:8111/stats > "$out/stats-before-$attn.json"
  sweep --max-tokens "${MAX_TOKENS:-256}" --seed 1 --out "$out/sweep-$attn.json" > "$out/sweep-$attn.log" 2>&1
  get http://127.0.0.1:8111/stats > "$out/stats-$attn.json"
  if [ "${SPY:-0}" = 1 ]; then  # an extra C1 sweep under py-spy: where each server thread's time goes
    "$py" -m pip install -q --no-index --no-deps --target /tmp/pyspy .peer/tools/py_spy-*.whl > /dev/null 2>&1
    /tmp/pyspy/bin/py-spy record --threads --idle --rate 250 --format raw -o "$out/pyspy-$attn.txt" -p $pid \
      > "$out/pyspy-$attn.log" 2>&1 &
    spy=$!
    timeout 120 "$py" -m tiermoe.cli bench sweep --url http://127.0.0.1:8111 --model qwen3moe-synthetic \
      --prefill-sizes 1k --reps 1 --concurrency 1 --long-prompt 0 --max-tokens 256 --seed 3 \
        > "$out/spy-sweep-$attn.log" 2>&1
    kill -INT $spy; wait $spy 2>/dev/null
    "$py" scripts/pyspy_summary.py "$out/pyspy-$attn.txt" --thread tiermoe-engine --top 15 --frames 4 \
      > "$out/pyspy-summary-$attn.txt" 2>&1
  fi
  grep -E "prefill|decode" "$out/sweep-$attn.log"
  grep -iE "decode steps|graph" "$out/server-$attn.log" | head -5
  kill $pid; wait $pid 2>/dev/null
  [ "${THREAD_CHECK:-1}" = 1 ] && timeout 200 "$py" scripts/engine_thread_check.py "$store/store" "${flags[@]}" \
    ${extra[@]+"${extra[@]}"} --tokens 128 > "$out/thread-check-$attn.txt" 2>&1
  grep -s "ms/token" "$out/thread-check-$attn.txt"
done

# Only a few files come back from the GPU machine (more are dropped): PACK=1 (default) leaves
# one OUT_DIR.tgz instead of the directory; unpack it with tar xzf.
pack() { [ "${PACK:-1}" = 1 ] && tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" \
  && rm -rf "$out"; log "done"; }
want profile || { pack; exit 0; }
log "profile"
timeout 240 "$py" scripts/profile_engine_decode.py "$store/store" "$out/profile" "${flags[@]}" --compare-eager \
  --prefill-tokens 4000 > "$out/profile.log" 2>&1
grep -E "wall per|busy|engine built|prefill" "$out/profile.log"
log "profile, prefill staged one layer ahead (two staging buffers)"
timeout 200 "$py" scripts/profile_engine_decode.py "$store/store" "$out/profile-ahead" "${flags[@]}" \
  --prefill-staging-gb 1.75 \
  --prefill-tokens 4000 > "$out/profile-ahead.log" 2>&1
grep -E "prefill" "$out/profile-ahead.log" | head -3
log "profile, SDPA decode attention (the default is the paged kernel)"
timeout 200 "$py" scripts/profile_engine_decode.py "$store/store" "$out/profile-sdpa" "${flags[@]}" \
  --decode-attention sdpa \
  > "$out/profile-sdpa.log" 2>&1
grep -E "wall per|busy" "$out/profile-sdpa.log"
log "profile, misses read in place (--no-stage-misses)"
timeout 200 "$py" scripts/profile_engine_decode.py "$store/store" "$out/profile-nostage" \
  "${flags[@]}" --no-stage-misses > "$out/profile-nostage.log" 2>&1
grep -E "wall per|busy" "$out/profile-nostage.log"
pack
