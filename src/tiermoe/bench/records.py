"""Random but valid expert records of any shape, for tuning and synthetic stores.

`bench tune-moe` times launch configurations on them, and the synthetic GLM-5.3 store
(scripts/synth_glm_store.py) and the developer benchmarks (benchmarks/) fill their experts
with them: quantized weights are uniform random bytes and the scales are sized so that a
matrix-vector product keeps roughly unit variance, like a trained model's, so the kernels see
realistic magnitudes without a checkpoint.
"""

from __future__ import annotations

import torch

from tiermoe.kernels.layout import ExpertLayout


def random_records(layout: ExpertLayout, n: int, device: torch.device, gen: torch.Generator,
                   chunk: int = 32) -> torch.Tensor:
    """uint8 [n, R] valid random records built on `device` (see reference.make_record)."""
    h, i, g = layout.hidden, layout.inter, layout.group_size
    rec = torch.zeros(n, layout.length, dtype=torch.uint8, device=device)
    sections = ((layout.gate_up_q, layout.gate_up_s, (2 * i, h)), (layout.down_q, layout.down_s, (h, i)))
    for c0 in range(0, n, chunk):  # bounded temporaries
        part = rec[c0 : c0 + chunk]
        m = part.shape[0]
        for q_off, s_off, (rows, k) in sections:
            if layout.kind == "bf16":
                w = torch.randn(m, rows * k, generator=gen, device=device) * k**-0.5
                part[:, q_off : q_off + rows * k * 2].view(torch.bfloat16).copy_(w)
                continue
            qbytes = rows * k * layout.bits // 8  # int3: K/4 low-plane + K/8 high-plane bytes a row
            q = torch.randint(0, 256, (m, qbytes), generator=gen, device=device, dtype=torch.uint8)
            part[:, q_off : q_off + qbytes] = q  # uniform bytes: uniform codes of every kind
            qstd = {"int3": 2.3, "int4": 4.6}.get(layout.kind, 73.0)  # std of uniform stored codes
            base = 1.0 / (qstd * k**0.5)
            s = base * (0.5 + torch.rand(m, rows * (k // g), generator=gen, device=device))
            part[:, s_off : s_off + s.shape[1] * 2].view(torch.bfloat16).copy_(s)
    return rec
