"""Which of our GPU paths parts from transformers in bf16: `tiermoe eval parity` on one checkpoint with the
Triton kernels on and off, the merged projections on and off, and the prompt in one chunk.

On a CPU our bf16 logits equal transformers' bit for bit (the kernels' plain-torch twins run there and the
projections stay separate); on a GPU the Triton kernels (mHC, norms, router, KDA, SwiGLU) and the merged
GEMMs round in their own order. Turning each off in turn shows which of them moves the top-1 agreement.

    PYTHONPATH=src python3 scripts/parity_kernels.py MODEL [--device cuda] [--chunk 64] [--decode-from N]

Prints one JSON line per variant (eval parity's figures and the variant's name). A diagnostic: the switches
are patches made here, not engine options.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json

# modules that import the predicate by name (models/blocks/common.device_kernels): each is patched where it is read
KERNEL_GATES = ("tiermoe.models.blocks.common", "tiermoe.models.blocks.hyperconnection", "tiermoe.models.blocks.router",
                "tiermoe.models.blocks.attention", "tiermoe.models.blocks.kda", "tiermoe.models.glm5_next.layers")


@contextlib.contextmanager
def patched(kernels: bool, fuse: bool, gates: tuple[str, ...] = KERNEL_GATES):
    """Within: the Triton kernels off (their twins) in `gates` unless `kernels`; no merged projections unless
    `fuse`."""
    from tiermoe.models.glm5_next.model import Glm5NextModel

    saved = []
    if not kernels:
        for name in gates:
            mod = importlib.import_module(name)
            saved.append((mod, "device_kernels", mod.device_kernels))
            mod.device_kernels = lambda *tensors: False
    if not fuse:
        saved.append((Glm5NextModel, "fuse_projections", Glm5NextModel.fuse_projections))
        Glm5NextModel.fuse_projections = lambda self: None
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode-from", type=int, default=None)
    args = ap.parse_args()

    from tiermoe.eval.parity import run_parity

    variants = [("default", True, True, args.chunk), ("no-merged-projections", True, False, args.chunk),
                ("no-triton-kernels", False, True, args.chunk), ("neither", False, False, args.chunk),
                ("one-chunk", True, True, 4096), ("one-chunk-neither", False, False, 4096)]
    variants = [(*v, KERNEL_GATES) for v in variants] + [
        (f"twins-in-{g.rsplit('.', 1)[1]}-only", False, True, args.chunk, (g,)) for g in KERNEL_GATES]
    for name, kernels, fuse, chunk, gates in variants:
        with patched(kernels, fuse, gates):
            try:
                out = run_parity(args.model, None, args.device, "bfloat16", chunk=chunk, fp32_floor=False,
                                 decode_from=args.decode_from)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, the others go on
                out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"variant": name, **{k: out.get(k) for k in ("positions", "top1", "kl_mean", "chunk",
                                                                         "error") if k in out}}), flush=True)


if __name__ == "__main__":
    main()
