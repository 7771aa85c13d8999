"""`tiermoe bench check-qwen3moe OUT`: prove the store and the GGUF carry the same weights.

Independent decoders on each side: the store's normative `decode_record` (quant.py) and the
`gguf` package's own Q4_0 / BF16 dequantizers. Sampled experts of the checked layers must
decode to identical float32 weights (and identical bf16, which the generator's scale choice
makes exact); every dense tensor of those layers must match bit for bit; and the two
generation runs must have recorded the same weights digest.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from tiermoe.errors import UserError


def _layers(spec_layers: int, text: str) -> list[int]:
    if text == "all":
        return list(range(spec_layers))
    if text == "first,last":
        return sorted({0, spec_layers - 1})
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--layers {text!r}: use first,last, all or a list like 0,5") from None
    if not out or out[0] < 0 or out[-1] >= spec_layers:
        raise UserError(f"--layers {text!r}: layers are 0..{spec_layers - 1}")
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: not found (run `tiermoe bench make-qwen3moe` first)")
    return json.loads(path.read_text())


def gguf_expert(tensor, e: int) -> torch.Tensor:
    """float32 [N, K] of expert e of a Q4_0 [E, N, K] GGUF tensor (gguf's own dequantizer)."""
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(tensor.data[e], tensor.tensor_type), dtype=np.float32))


def check_synthetic(out: str | Path, samples: int = 4, layers: str = "first,last", seed: int = 0) -> dict:
    """{'ok': bool, 'lines': [...], 'checked': {...}}; UserError if a half is missing."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    from tiermoe.bench.synthetic_gguf import hf_name, tensor_plan
    from tiermoe.bench.synthetic_qwen3 import GGUF_FILE, STORE_DIR, SyntheticSpec
    from tiermoe.store.records import decode_record, load_manifest

    out = Path(out)
    meta = {f: _read_json(out / f"synthetic-{f}.json") for f in ("store", "gguf")}
    lines, ok = [], True
    same = meta["store"]["weights_sha256"] == meta["gguf"]["weights_sha256"]
    ok &= same
    lines.append(f"{'OK  ' if same else 'FAIL'} generation digests: store {meta['store']['weights_sha256'][:16]}, "
                 f"gguf {meta['gguf']['weights_sha256'][:16]}")
    spec = SyntheticSpec(**meta["store"]["spec"])
    m = load_manifest(out / STORE_DIR)
    reader = GGUFReader(str(out / GGUF_FILE))
    tensors = {t.name: t for t in reader.tensors}
    weight_map = json.loads((out / STORE_DIR / "model.safetensors.index.json").read_text())["weight_map"]
    rng = random.Random(seed)
    checked = {"experts": 0, "dense": 0}
    with open(m.experts_path, "rb") as f:
        for layer in _layers(spec.layers, layers):
            ids = sorted(rng.sample(range(spec.experts), min(samples, spec.experts)))
            for e in ids:
                r = m.record(layer, e)
                f.seek(r.offset)
                buf = np.frombuffer(bytearray(f.read(r.length)), dtype=np.uint8)
                gu, dn = decode_record(m.layout, buf, dtype=torch.float32)  # [2I, H], [H, I]
                gu16, dn16 = decode_record(m.layout, buf, dtype=torch.bfloat16)
                i = spec.moe_intermediate
                ref = {"gate": gu[:i], "up": gu[i:], "down": dn}
                ref16 = {"gate": gu16[:i], "up": gu16[i:], "down": dn16}
                for proj in ("gate", "up", "down"):
                    got = gguf_expert(tensors[f"blk.{layer}.ffn_{proj}_exps.weight"], e)
                    exact = torch.equal(got, ref[proj]) and torch.equal(got.to(torch.bfloat16), ref16[proj])
                    ok &= exact
                    if not exact:
                        lines.append(f"FAIL layer {layer} expert {e} {proj}: max |diff| "
                                     f"{(got - ref[proj]).abs().max().item():.3g}")
                checked["experts"] += 1
            names = [n for n, _, _ in tensor_plan(spec) if n.startswith(f"blk.{layer}.") and "_exps" not in n]
            if layer == 0:
                names += ["token_embd.weight", "output_norm.weight", "output.weight"]
            for n in names:
                key = hf_name(n)
                with safe_open(str(out / STORE_DIR / weight_map[key]), framework="pt") as st:
                    mine = st.get_tensor(key).to(torch.float32)
                t = tensors[n]
                theirs = torch.from_numpy(
                    np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
                )  # a writable copy
                same_t = torch.equal(mine, theirs.reshape(mine.shape))
                ok &= same_t
                if not same_t:
                    lines.append(
                        f"FAIL {n} / {key}: max |diff| {(mine - theirs.reshape(mine.shape)).abs().max().item():.3g}"
                    )
                checked["dense"] += 1
    lines.append(
        f"{'OK  ' if ok else 'FAIL'} {checked['experts']} experts x 3 projections identical in fp32 and bf16, "
        f"{checked['dense']} dense tensors bit-identical "
        f"({meta['store']['sizes']['store_bytes_per_expert']:,} B/expert store, "
        f"{meta['gguf']['sizes']['gguf_bytes_per_expert']:,} B/expert Q4_0)"
    )
    return {"ok": bool(ok), "lines": lines, "checked": checked}
