#!/usr/bin/env bash
# The serving engine's GPU expert path on a synthetic GLM-5.3-Flash-sized packed store.
# Usage: scripts/gpu_engine_bench.sh OUT_DIR [STEP ...]   (run from the repository root)
#   make    write the store (scripts/synth_glm_store.py; skipped when $STORE has a manifest)
#   decode  tiermoe bench decode, --gpu-expert-gb = $BUDGET of the expert bytes: Triton expert
#           kernel (the default on CUDA), then the torch path for comparison
#   tiers   tiermoe eval tiers on cuda: logits bit-identical for GPU budgets 100 %, 10 %, 0 %
#           (host tier all / none) through the Triton backend
#   serve   tiermoe serve smoke test: one chat completion over HTTP, /stats saved
# Default steps: make decode tiers serve (about 6-8 minutes with 8 MoE layers on an H200).
# Environment: STORE (/tmp/tiermoe-synth-glm), MOE_LAYERS (8), KIND (int4), BUDGET (0.11),
# TOKENS (64, decode tokens per sequence), TORCH_TOKENS (16), BATCHES (1,1,2,4: the first
# batch-1 run also lets the host tier's background pinning finish), PYTHON (python3), DEVICE
# (cuda; cpu with TRITON_INTERPRET=1 and STORE made with --tiny is a slow dry run of the script).
set -uo pipefail
out=${1:-gpu-engine-out}
shift || true
steps=${*:-make decode tiers serve}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
store=${STORE:-/tmp/tiermoe-synth-glm}
dev=${DEVICE:-cuda}
tm="$py -m tiermoe.cli"
{
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null
  $py -c 'import torch, triton
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
print("torch", torch.__version__, "triton", triton.__version__, gpu)'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  free -g | head -2
} | tee -a "$out/env.txt"

gpu_gb() {  # GiB of expert slots for a share of all expert records
  $py -c "import json,sys; m=json.load(open('$store/manifest.json'))
print(round(sum(r['length'] for r in m['records'])*float(sys.argv[1])/2**30, 6))" "$1"
}

for step in $steps; do
  t0=$(date +%s)
  case $step in
    make)
      if [ -f "$store/manifest.json" ]; then
        echo "store exists: $store"
      else
        $py scripts/synth_glm_store.py "$store" --moe-layers "${MOE_LAYERS:-8}" --kind "${KIND:-int4}" \
          2>>"$out/stderr.log" | tee "$out/make.log"
      fi
      du -sh "$store" | tee -a "$out/make.log"
      ;;
    decode)
      gb=$(gpu_gb "${BUDGET:-0.11}")
      echo "gpu expert budget: $gb GiB (${BUDGET:-0.11} of the experts)"
      common=(--model "$store" --device "$dev" --gpu-expert-gb "$gb" --expert-stats "$store/expert-stats.json" \
        --prompt-len 32)
      [ "${REPLAY:-1}" = 1 ] && common+=(--routing-replay "$store/expert-stats.json")  # the real model's picks
      timeout 280 $tm bench decode "${common[@]}" --expert-kernel triton --batch-sizes "${BATCHES:-1,1,2,4}" \
        --tokens "${TOKENS:-64}" --out "$out/decode_triton.json" 2>>"$out/stderr.log" | tail -4
      timeout 200 $tm bench decode "${common[@]}" --expert-kernel torch --batch-sizes 1,4 \
        --tokens "${TORCH_TOKENS:-16}" --out "$out/decode_torch.json" 2>>"$out/stderr.log" | tail -2
      ;;
    tiers)
      timeout 400 $tm eval tiers --model "$store" --device "$dev" --gpu-fractions 1.0,0.1,0.0 --host-fractions all,0.0 \
        2>>"$out/stderr.log" | tee "$out/tiers_cuda.txt" | head -8
      ;;
    serve)
      gb=$(gpu_gb "${BUDGET:-0.11}")
      port=8131
      $tm serve "$store" --device "$dev" --port $port --served-model-name synth --max-num-seqs 4 --gpu-expert-gb "$gb" \
        --expert-stats "$store/expert-stats.json" --routing-replay "$store/expert-stats.json" >"$out/server.log" 2>&1 &
      pid=$!
      timeout 240 $py - "$port" "$out" <<'PY'
import json, sys, time, urllib.request
port, out = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
for _ in range(480):
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except Exception:
        time.sleep(0.5)
body = {"model": "synth", "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 32,
        "temperature": 0, "ignore_eos": True}
t0 = time.time()
headers = {"Content-Type": "application/json"}
req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), headers)
try:
    r = json.loads(urllib.request.urlopen(req, timeout=180).read())
    print("chat completion:", r["usage"], f"{time.time() - t0:.2f} s")
except Exception as exc:
    print("chat completion failed:", exc)
stats = json.loads(urllib.request.urlopen(base + "/stats", timeout=10).read())
open(f"{out}/serve_stats.json", "w").write(json.dumps(stats, indent=1))
experts = stats.get("engine", {}).get("experts", {})
shown = ("expert_kernel", "triton", "slots", "host", "per_decode_token")
print("experts:", json.dumps({k: experts.get(k) for k in shown}))
PY
      kill -TERM $pid 2>/dev/null; wait $pid
      ;;
    *) echo "unknown step: $step" >&2 ;;
  esac
  echo "step $step: $(( $(date +%s) - t0 )) s"
done
tail -5 "$out/stderr.log" 2>/dev/null
