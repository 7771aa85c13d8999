#!/usr/bin/env bash
# Serve a model on this machine and run the speed sweep and stream-delivery check against it.
# Usage: scripts/gpu_sweep.sh OUT_DIR [MODEL_DIR]   (default model: a tiny random glm4_moe)
# Extra wheels (fastapi, uvicorn, pydantic, ...) may be provided in .whl/ when the machine has
# no package index; they are installed into a private target directory.
set -uo pipefail
out=${1:-gpu-sweep-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
model=${2:-}
if [ -z "$model" ]; then
  model=$(mktemp -d)/tiny-glm4_moe
  $py -m tiermoe.cli tiny glm4_moe "$model" --dtype bfloat16 >/dev/null 2>>"$out/stderr.log"
fi
port=8123
$py -m tiermoe.cli serve "$model" --port $port --max-num-seqs 8 >"$out/server.log" 2>&1 &
pid=$!
$py - <<PY
import time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen("http://127.0.0.1:$port/health", timeout=2); break
    except Exception:
        time.sleep(0.5)
PY
url=http://127.0.0.1:$port
$py -m tiermoe.cli bench sweep --url $url --prefill-sizes ${SIZES:-1k,3k} --max-tokens ${MAX_TOKENS:-128} \
  --out "$out/sweep.json" 2>>"$out/stderr.log" | tail -15
$py -m tiermoe.cli bench stream-rate --url $url --min-tokens ${STREAM_TOKENS:-3000} \
  --max-tokens ${STREAM_TOKENS:-3000} --out "$out/stream_rate.json" 2>>"$out/stderr.log" | tail -3
$py -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(\"$url/stats\").read().decode())" \
  > "$out/stats.json"
kill -TERM $pid; wait $pid
$py -m tiermoe.cli bench report "$out/sweep.json" "$out/stream_rate.json" --out "$out/sweep.md" 2>>"$out/stderr.log"
cat "$out/sweep.md"
