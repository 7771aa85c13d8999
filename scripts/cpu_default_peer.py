"""transformers' decode rate on the embedded default model's converted checkpoint (the peer of
`tiermoe bench decode --device cpu` in docs/results.md section 35): greedy, 64 new tokens after a
4-token prompt, batch 1 and 4. Usage: python scripts/cpu_default_peer.py [CHECKPOINT]
(default: the cache `make serve` converts into)."""

from __future__ import annotations

import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiermoe.default_model import ensure_default_model


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = tok("Once upon a time", return_tensors="pt").input_ids  # [1, 4]
    for batch in (1, 4):
        x = ids.repeat(batch, 1)  # [B, 4]
        with torch.inference_mode():
            model.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            dt = time.perf_counter() - t0
        print(f"transformers {type(model).__name__} bf16 cpu batch {batch}: {64 * batch / dt:.1f} tok/s aggregate "
              f"({dt:.2f} s, torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
