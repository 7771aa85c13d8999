"""Packed-store side of the synthetic Qwen3-MoE model (docs/store-format.md, int4 or int3 records).

The generator already holds each expert as our int4 (or int3) sections (packed codes + bf16 scales), so
a record is assembled by copying them into the layout's sections (`RecordLayout` and
`section_view`, the same code `tiermoe pack` writes through): no float weights, no
re-quantization. A layer's 128 records are built in one buffer, hashed in parallel, written
with one sequential write and fdatasync'ed; the manifest is written last, like pack does,
so a directory without manifest.json is known to be unfinished.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tiermoe.bench.synthetic_gguf import hf_name
from tiermoe.importers.writer import ShardWriter
from tiermoe.store.records import (
    EXPERTS_NAME,
    FORMAT_VERSION,
    RECORD_ALIGN,
    RecordLayout,
    dtype_from_name,
    write_manifest,
)


def _section(layout: RecordLayout, recs: torch.Tensor, name: str) -> torch.Tensor:
    """View of one section across a batch of records: uint8 [E, length] -> [E, *shape]."""
    s = layout.section(name)
    raw = recs[:, s.offset : s.offset + s.nbytes]  # [E, nbytes], row stride = record length
    return raw.view(dtype_from_name(s.dtype)).view(recs.shape[0], *s.shape)


def build_records(layout: RecordLayout, codes: dict) -> torch.Tensor:
    """uint8 [E, length]: one record per expert from {proj: (q [E, N, K/2 | 3K/8], s [E, N, K/G])}
    (int4 | int3, the layout's kind)."""
    gq, gs = codes["gate"]
    uq, us = codes["up"]
    dq, ds = codes["down"]
    e, i = gq.shape[0], layout.intermediate
    recs = torch.zeros(e, layout.length, dtype=torch.uint8)
    gu_q = _section(layout, recs, "gate_up_q")  # [E, 2I, H/2 | 3H/8]
    gu_s = _section(layout, recs, "gate_up_s")  # [E, 2I, H/G]
    gu_q[:, :i].copy_(gq)
    gu_q[:, i:].copy_(uq)
    gu_s[:, :i].copy_(gs)
    gu_s[:, i:].copy_(us)
    _section(layout, recs, "down_q").copy_(dq)  # [E, H, I/2 | 3I/8]
    _section(layout, recs, "down_s").copy_(ds)  # [E, H, I/G]
    return recs


class StoreSink:
    """Writes OUT (a store directory): experts.bin, dense shards, tokenizer, config, manifest."""

    def __init__(self, root: Path, spec, config: dict, tok, pool: ThreadPoolExecutor):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.spec, self.config, self.pool = spec, config, pool
        self.layout = RecordLayout.build(spec.quant, spec.hidden, spec.moe_intermediate, spec.group_size)
        assert self.layout.length % RECORD_ALIGN == 0
        self.records: list[dict] = []
        self._f = open(self.root / EXPERTS_NAME, "wb")
        self._dense = ShardWriter(self.root)
        tok.save_pretrained(str(self.root))
        (self.root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (self.root / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    def write_dense(self, gguf_name: str, t: torch.Tensor) -> None:
        self._dense.add(hf_name(gguf_name), t.to(torch.bfloat16))

    def write_experts(self, layer: int, codes: dict) -> None:
        recs = build_records(self.layout, codes)  # [E, length]
        arr = recs.numpy()
        shas = list(self.pool.map(lambda e: hashlib.sha256(arr[e]).hexdigest(), range(arr.shape[0])))
        base = len(self.records)
        self._f.write(memoryview(arr).cast("B"))
        for e, sha in enumerate(shas):
            idx = base + e
            self.records.append({"layer": layer, "expert": e, "offset": idx * self.layout.length,
                                 "length": self.layout.length, "sha256": sha, "layout": 0})

    def close(self) -> None:
        self._f.flush()
        os.fdatasync(self._f.fileno())
        self._f.close()
        shards = self._dense.close()
        spec = self.spec
        manifest = {
            "format_version": FORMAT_VERSION,
            "model_config": self.config,
            "quantization": {"kind": self.layout.kind, "group_size": self.layout.group_size},
            "dtype": "bfloat16",
            "source_dtype": "bfloat16",
            "num_layers": spec.layers,
            "moe_layers": list(range(spec.layers)),
            "experts_per_layer": {str(layer): spec.experts for layer in range(spec.layers)},
            "expert_prefixes": {str(layer): f"model.layers.{layer}.mlp.experts" for layer in range(spec.layers)},
            "experts_file": EXPERTS_NAME,
            "record_align": RECORD_ALIGN,
            "layouts": [self.layout.to_json()],
            "records": self.records,
            "dense": {
                "index": "model.safetensors.index.json",
                "shards": [p.name for p in shards],
                "tensors": len(json.loads((self.root / "model.safetensors.index.json").read_text())["weight_map"]),
            },
        }
        write_manifest(self.root, manifest)
