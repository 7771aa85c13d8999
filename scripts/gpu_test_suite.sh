#!/usr/bin/env bash
# The whole GPU test suite on a CUDA machine in one call, ending in ONE summary line (the line
# docs/results.md keeps), e.g.
#   GPU suite PASS: 150 passed, 0 failed, 0 errors, 6 skipped (250 s); mailbox soak PASS: 10000 fast-mode
#   steps, 20000 posts, 20000 served, 0 unanswered (45 s); commit abc1234; torch 2.11.0+cu130; Triton 3.6.0;
#   Python 3.12.3; NVIDIA H200
# 1. pytest with TIERMOE_KERNEL_TESTS_ON_GPU=1 over every test that runs differently on a GPU:
#    the kernels compiled on CUDA (tests/kernels, including the ahead-of-time compile check for
#    sm_90/89/86 with the installed Triton), the device cache and the Triton expert backend,
#    decode graphs against eager steps (exact and fast mode, with and without the warm-up),
#    routing replay, the CUDA expert store; the CPU lane and the warm-up beside them.
# 2. scripts/fast_mode_mailbox_soak.py: SOAK_STEPS fast-mode decode steps through graphs, then
#    the mailbox counters /stats reports: every post answered exactly once.
# Usage: scripts/gpu_test_suite.sh   (from the repository root; python3 with torch + CUDA, Triton,
# transformers, pytest; wheels in .whl/ are installed aside first if the image lacks packages)
# Environment: OUT (a folder for the full logs: pytest.txt, junit.xml, soak.json, summary.txt),
# PYTHON (python3), COMMIT (the commit, where the tree has no .git), SOAK_STEPS (10000; 0 skips
# the soak), SOAK_ARGS (more soak flags, e.g. "--device cpu --tokens 30" for a dry run on a CPU), TESTS
# (the pytest arguments), TEST_TIMEOUT (360 s), SOAK_TIMEOUT (180 s; together under 10 minutes).
# Exit status 0 only when both parts pass.
set -uo pipefail
py=${PYTHON:-python3}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl > /dev/null 2>&1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TIERMOE_KERNEL_TESTS_ON_GPU=1
# every test file that runs differently on a GPU (it reads the switch or asks torch for CUDA), found
# afresh so new ones join; the CPU lane and warm-up tests beside them
gpu_files=$(grep -rlE "TIERMOE_KERNEL_TESTS_ON_GPU|ON_GPU|cuda\.is_available" tests --include='test_*.py' | sort)
tests=${TESTS:-tests/kernels $gpu_files tests/moe/test_cpu_lane.py tests/runner/test_warm_up.py}

commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit+uncommitted"; fi
env_line=$("$py" - 2>&1 <<'PY' | tail -1
import platform

import torch
import triton

name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}; Triton {triton.__version__}; Python {platform.python_version()}; {name}")
PY
)

t0=$SECONDS
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-360}" "$py" -m pytest -q -p no:cacheprovider -rfEs --junitxml "$out/junit.xml" $tests \
  > "$out/pytest.txt" 2>&1
test_rc=$?
test_s=$((SECONDS - t0))
tests_part=$("$py" - "$out/junit.xml" "$test_rc" "$test_s" <<'PY'
import sys
import xml.etree.ElementTree as ET

path, rc, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError):
    why = "timed out" if rc in (124, 137) else f"exit status {rc}, no report"
    print(f"GPU suite FAIL: pytest {why} ({secs} s)")
    sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
verdict = "PASS" if rc == 0 and not n["failures"] and not n["errors"] else "FAIL"
print(f"GPU suite {verdict}: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"
      f" ({secs} s)")
PY
)

soak_part="mailbox soak skipped"
soak_ok=1
if [ "${SOAK_STEPS:-10000}" != 0 ]; then
  t0=$SECONDS
  timeout "${SOAK_TIMEOUT:-180}" "$py" scripts/fast_mode_mailbox_soak.py --steps "${SOAK_STEPS:-10000}" \
    --deadline-s $(( ${SOAK_TIMEOUT:-180} - 50 )) --out "$out/soak.json" ${SOAK_ARGS:-} > "$out/soak.txt" 2>&1
  soak_rc=$?
  soak_part=$("$py" - "$out/soak.json" "$soak_rc" $((SECONDS - t0)) <<'PY'
import json
import sys

path, rc, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    r = json.loads(open(path).read())
except (OSError, ValueError):
    print(f"mailbox soak FAIL: exit status {rc}, no report ({secs} s)")
    sys.exit()
m = r.get("mailbox", {})
verdict = "PASS" if r["ok"] and rc == 0 else "FAIL"
text = (f"mailbox soak {verdict}: {r['steps']} fast-mode steps, {m.get('posts')} posts, {m.get('served')} served,"
        f" {m.get('unanswered')} unanswered")
print(text + (f", {'; '.join(r['problems'])}" if r["problems"] else "") + f" ({secs} s)")
PY
)
  [[ $soak_part == "mailbox soak PASS"* ]] || soak_ok=0
fi

summary="$tests_part; $soak_part; commit $commit; $env_line"
echo "$summary" > "$out/summary.txt"
echo "$summary"
[[ $tests_part == "GPU suite PASS"* ]] && [ "$soak_ok" = 1 ]
