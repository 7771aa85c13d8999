#!/bin/bash
# Decode rate of `tiermoe serve` on the embedded default model through HTTP, three sequential requests
# of 48 greedy tokens (docs/results.md section 35 compares --cpu-threads settings, quiet and beside a
# spinning process). Usage: scripts/cpu_serve_probe.sh PORT [serve flags...]; PY (default python3) runs it.
port=$1; shift
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PYTHONPATH=src $PY -c "import sys, tiermoe.cli as c; sys.exit(c.main(sys.argv[1:]))" serve --host 127.0.0.1 \
  --port "$port" "$@" > "${TMPDIR:-/tmp}/cpu_serve_probe_$port.log" 2>&1 &
pid=$!
for _ in $(seq 1 120); do curl -s -m 2 "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
body='{"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": true}'
for r in 1 2 3; do
  t0=$(date +%s.%N)
  n=$(curl -s -m 120 "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' -d "$body" \
      | $PY -c "import sys, json; print(json.load(sys.stdin)['usage']['completion_tokens'])")
  t1=$(date +%s.%N)
  $PY -c "print('$* request $r: %d tokens in %.2f s = %.1f tok/s' % ($n, $t1 - $t0, $n / ($t1 - $t0)))"
done
kill $pid; wait $pid 2>/dev/null
