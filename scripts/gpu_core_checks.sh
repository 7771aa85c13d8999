#!/usr/bin/env bash
# Engine-core checks on a CUDA machine: bf16 parity of every family against transformers,
# bit-identical logits across expert tier sizes of a packed bf16 store, and a decode benchmark.
# Usage: scripts/gpu_core_checks.sh OUT_DIR   (run from the repository root; needs torch+CUDA,
# transformers, safetensors, tokenizers, tqdm, jinja2 importable by python3)
set -uo pipefail
out=${1:-gpu-core-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{
  date -u +%FT%TZ
  $py -c 'import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} | tee "$out/env.txt"
for arch in ${ARCHS:-qwen3_moe glm4_moe deepseek_v3 glm5_next qwen2_moe olmoe mixtral}; do
  $py -m tiermoe.cli eval parity --tiny "$arch" --device cuda --dtype bfloat16 --chunk ${CHUNK:-32} \
    2>>"$out/stderr.log" | tail -1 | tee -a "$out/parity_bf16_cuda.jsonl"
done
tmp=$(mktemp -d)
$py -m tiermoe.cli tiny glm4_moe "$tmp/src" --dtype bfloat16 >/dev/null 2>>"$out/stderr.log"
$py -m tiermoe.cli pack "$tmp/src" "$tmp/store" 2>>"$out/stderr.log" | tail -1
$py -m tiermoe.cli eval tiers --model "$tmp/store" --device cuda --host-fractions all,0.0 2>>"$out/stderr.log" \
  | tee "$out/tiers_cuda.txt"
$py -m tiermoe.cli bench decode --tiny glm4_moe --device cuda --tokens 64 --out "$out/decode_tiny_cuda.json" \
  2>>"$out/stderr.log" | tail -2
tail -5 "$out/stderr.log"
