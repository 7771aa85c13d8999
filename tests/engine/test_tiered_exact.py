"""Exact mode: a bf16-packed store gives bit-identical logits whatever the tier sizes, and the
same logits as the checkpoint with every expert resident; an int3 store (dequantized per fetch
by the torch path) gives bit-identical logits whatever the tier sizes too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from testkit.stores import pack_tiny

from tiermoe.engine.build import build_engine_core
from tiermoe.eval.parity import engine_logits, parity_prompts


@pytest.fixture(scope="module")
def packed(tiny_dir, tmp_path_factory):
    return pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", dtype="bfloat16", quant="bf16")


@pytest.fixture(scope="module")
def packed_int3(tiny_dir, tmp_path_factory):
    return pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", dtype="bfloat16", quant="int3", group_size=32)[1]


def _logits(model, min_positions=200, prompts=None, **options):
    """Logits of the parity prompts (the first `prompts` of them, if given) and the expert counters."""
    engine = build_engine_core(str(model), device="cpu", dtype="bfloat16", max_num_seqs=1, options=options)
    prompts = parity_prompts(engine.tokenizer, engine.vocab_size, min_positions=min_positions)[:prompts]
    out = torch.cat([engine_logits(engine, p) for p in prompts])
    backend = engine.runner.experts
    counters = backend.counters()  # None for resident experts
    backend.close()
    return out, counters


def test_bit_identical_across_tiers(packed):
    src, store = packed
    resident, _ = _logits(src)
    all_ram, _ = _logits(store)
    record = 12288  # bytes of one tiny bf16 expert record
    ten_pct, c10 = _logits(store, host_expert_gb=2 * record / 2**30)  # 2 of 16 experts in RAM
    none, c0 = _logits(store, host_expert_gb=0)
    assert torch.equal(resident, all_ram)
    assert torch.equal(resident, ten_pct)
    assert torch.equal(resident, none)
    assert c0 is not None and c10 is not None


def test_int3_bit_identical_across_tiers(packed_int3):
    """Tier moves copy int3 records verbatim and every fetch dequantizes the same bytes the same
    way, so the tiers cannot change a bit; on a CPU the torch path serves int3."""
    record = 4096  # bytes of one tiny int3 expert record (H 64, I 32, G 32)
    all_ram, c_all = _logits(packed_int3, min_positions=0, prompts=3)
    two, c2 = _logits(packed_int3, min_positions=0, prompts=3, host_expert_gb=2 * record / 2**30)
    none, c0 = _logits(packed_int3, min_positions=0, prompts=3, host_expert_gb=0)
    assert torch.equal(all_ram, two) and torch.equal(all_ram, none)
    assert c_all["expert_kernel"] == "torch" and c_all["host"]["capacity"] == 16 and c_all["disk"]["reads"] == 0
    assert c2["host"]["capacity"] == 2 and c0["host"]["capacity"] == 0 and c0["disk"]["reads"] > 0


def test_generate_same_text_with_and_without_ram_tier(packed):
    _, store = packed
    cmd = [sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(store), "--prompt", "Hello",
           "--max-tokens", "16"]
    a = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    b = subprocess.run(cmd + ["--host-expert-gb", "0"], capture_output=True, text=True, timeout=120)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
