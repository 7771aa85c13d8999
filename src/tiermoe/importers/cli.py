"""`tiermoe import-gguf SRC OUT`: convert a GGUF file into a checkpoint directory tiermoe serves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _handle(args: argparse.Namespace) -> int:
    from tiermoe.importers.gguf import gguf_to_hf

    out = gguf_to_hf(
        args.src,
        args.out,
        dtype=args.dtype,
        experts_per_layer=args.experts_per_layer,
        top_k=args.top_k,
        shared_slices=args.shared_slices,
    )
    prov = json.loads((Path(out) / "tiermoe_import.json").read_text())
    cfg = json.loads((Path(out) / "config.json").read_text())
    print(f"{out}: {cfg['model_type']} from {prov['source_architecture']} GGUF, {prov['dtype']}, {prov['seconds']} s")
    moe = prov.get("moe_from_dense")
    if moe:
        print(
            f"  {moe['experts_per_layer']} routed experts of width {moe['slice_size']} + shared expert of"
            f" {moe['shared_slices']} slices per layer; top_k {moe['top_k']}"
            + (" (exact: equals the dense model)" if moe["exact"] else f"; calibration {moe.get('calibration')}")
        )
    types = prov.get("expert_source_types") or {}
    if types:
        print("  experts from " + ", ".join(f"{n} {t}" for t, n in sorted(types.items())) + " tensors (dequantized)"
              + (f"; `tiermoe pack {out} STORE --quant int3 --group-size 16` re-quantizes Q3_K nearly losslessly"
                 if "Q3_K" in types else ""))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "import-gguf",
        help="convert a GGUF file into a Hugging Face checkpoint directory (dense models become glm4_moe)",
    )
    p.add_argument("src", help="GGUF file (llama, qwen2, qwen3 or qwen3moe)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype: bfloat16 (default), float32 or float16")
    p.add_argument(
        "--experts-per-layer", type=int, default=8, help="routed experts cut from each dense MLP (default 8)"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="experts per token; default all (exact), fewer calibrates a router"
    )
    p.add_argument(
        "--shared-slices", type=int, default=None,
        help="MLP slices in the shared expert (default: smallest that divides)",
    )
    p.set_defaults(handler=_handle)
