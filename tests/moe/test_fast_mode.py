"""Fast mode end to end on CPU: the CPU lane serves decode misses of a packed store, its output
stays close to exact mode (paired KL), exact mode stays bit-identical, and the counters move."""

from __future__ import annotations

import json

import pytest
import torch
from testkit.stores import pack_tiny

from tiermoe.engine.build import build_engine_core
from tiermoe.eval.paired_kl import decode_logits, prompt_ids, run_paired_kl
from tiermoe.eval.parity import compare, engine_logits
from tiermoe.moe.lane_kernel import native_library

NATIVE = native_library() is not None  # the compiled lane kernel builds here

RECORD_INT4 = 4096  # bytes of one tiny int4 record (H=64, I=32, G=32): one 4 KiB page
GIB = 2**30
SHORT = ["Hi there.", "Name three primary colors, comma separated."]


@pytest.fixture(scope="module")
def int4_store(tiny_dir, tmp_path_factory):
    # fp32 checkpoint: 2 MoE layers x 8 experts, top-2
    return pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", quant="int4", group_size=32)[1]


@pytest.fixture(scope="module")
def bf16_store(tiny_dir, tmp_path_factory):
    return pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", dtype="bfloat16", quant="bf16")


def test_paired_kl_below_target(int4_store):
    r = run_paired_kl(str(int4_store), device="cpu", tokens=16, texts=SHORT)
    shown = {k: r[k] for k in ("positions", "kl_mean", "kl_max", "top1")}
    print("paired-kl tiny glm4_moe int4 fp32:", json.dumps(shown))
    assert r["positions"] == 2 * 16
    assert r["kl_mean"] < 1e-3 and r["top1"] > 0.995
    lane = r["cpu_lane"]
    assert lane["kernel"].startswith("native-" if NATIVE else "torch")  # the record's own layout, in place
    # every decode pick of the 2 MoE layers (top-2) misses the (empty) CPU slot tier: 4 per token
    assert lane["per_decode_token"] == pytest.approx(4.0)
    assert lane["repacks"] == (0 if NATIVE else lane["experts"]) and lane["wait_s"] >= 0.0


def test_fast_mode_bf16_activations_close(int4_store):
    """bf16 engine: the lane feeds its int4 kernel bf16 activations (the fast path)."""
    eng = build_engine_core(str(int4_store), device="cpu", dtype="bfloat16", max_num_seqs=1, options={"mode": "fast"})
    be = eng.model.expert_backend
    try:
        prompt = prompt_ids(eng.tokenizer, ["Name three primary colors, comma separated."])[0]
        assert be.host_cores_busy()  # fast mode: the engine's thread waits for steps asleep
        assert not be.reads_disk() and not be.lane.beside_disk_reads  # host RAM holds every expert
        be.set_mode("exact")
        assert not be.host_cores_busy() and not be.inner.host_cores_busy()
        toks, exact = decode_logits(eng, prompt, 8)
        be.set_mode("fast")
        _, fast = decode_logits(eng, prompt, 8, forced=toks)
        lane = be.counters()["cpu_lane"]
    finally:
        be.close()
    m = compare(exact, fast)
    assert lane["act_dtype"] == "bfloat16" and lane["decode_experts"] == 8 * 4
    assert m["top1"] >= 7 / 8 and m["kl_mean"] < 0.05, m


def test_exact_mode_bit_identical_with_lane_built(bf16_store):
    """A backend opened in fast mode and switched to exact matches resident experts bit for
    bit in decode steps; in fast mode, prefill chunks (never served by the lane) are too."""
    src, store = bf16_store
    resident = build_engine_core(str(src), device="cpu", dtype="bfloat16", max_num_seqs=1)
    tiered = build_engine_core(str(store), device="cpu", dtype="bfloat16", max_num_seqs=1,
                               options={"mode": "fast", "host_expert_gb": 4 * 12288 / GIB})
    be = tiered.model.expert_backend
    try:
        prompts = prompt_ids(tiered.tokenizer, SHORT[1:])
        ref_chunked = torch.cat([engine_logits(resident, p, chunk=len(p)) for p in prompts])
        ref_decode = torch.cat([engine_logits(resident, p, chunk=1) for p in prompts])
        be.set_mode("exact")
        exact = torch.cat([engine_logits(tiered, p, chunk=1) for p in prompts])  # decode steps, lane off
        be.set_mode("fast")
        prefill = torch.cat([engine_logits(tiered, p, chunk=len(p)) for p in prompts])  # prefill: no lane
        assert be.counters()["cpu_lane"]["experts"] == 0
        decode = torch.cat([engine_logits(tiered, p, chunk=1) for p in prompts])  # lane on
        lane = be.counters()["cpu_lane"]
    finally:
        be.close()
    assert torch.equal(ref_decode, exact) and torch.equal(ref_chunked, prefill)
    assert lane["experts"] > 0 and lane["kernel"].startswith("native-" if NATIVE else "torch")
    assert be.reads_disk() and be.lane.beside_disk_reads  # 4 RAM entries for 16 experts: the rest on disk
    m = compare(ref_decode, decode)
    # bf16 logits tie often in this tiny vocabulary, so top-1 flips on ties; KL is the measure
    assert m["kl_mean"] < 1e-3 and m["top1"] > 0.85, m


def test_lane_reads_disk_and_host_and_counts(int4_store):
    """Small host tier: the lane takes host-resident misses first, then reads disk-only ones;
    /stats counters report it."""
    eng = build_engine_core(str(int4_store), device="cpu", dtype="auto", max_num_seqs=1,
                            options={"mode": "fast", "host_expert_gb": 4 * RECORD_INT4 / GIB, "cpu_lane_experts": 1})
    be = eng.model.expert_backend
    try:
        prompt = prompt_ids(eng.tokenizer, ["Hello there"])[0]
        decode_logits(eng, prompt, 6)
        c = be.counters()
        stats = eng.stats()
    finally:
        be.close()
    lane = c["cpu_lane"]
    assert c["mode"] == "fast" and lane["max_experts_per_layer"] == 1
    assert lane["per_decode_token"] == pytest.approx(2.0)  # one per MoE layer and token
    assert 0 < lane["disk_experts"] < lane["experts"] and lane["repacks"] == (0 if NATIVE else lane["experts"])
    assert c["disk"]["reads"] > 0 and c["host"]["hits"] > 0
    assert stats["experts"]["cpu_lane"]["experts"] == lane["experts"]
    assert be.reads_disk() and be.lane.beside_disk_reads  # the lane's workers leave the cores to the disk readers


def _lane_layers(store, partial: bool) -> tuple[list[torch.Tensor], dict]:
    """Four one-token decode steps (lane steps) and a 5-token prefill chunk (no lane) of MoE layer 1 through a
    fresh fast-mode backend on the torch store path (HostLaneHandoff): the outputs and the lane's counters."""
    from tiermoe.engine.build import engine_config
    from tiermoe.moe.backends import open_expert_backend

    cfg = engine_config(str(store), device="cpu", dtype="bfloat16", max_num_seqs=1,
                        options={"mode": "fast", "cpu_lane_experts": 1, "expert_kernel": "torch"})
    be = open_expert_backend(cfg.experts)
    g = torch.Generator().manual_seed(5)
    outs = []
    try:
        for tokens in (1, 1, 1, 1, 5):
            x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)  # [T, H]
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])  # [T, 2]
            w = torch.rand(tokens, 2, generator=g)  # [T, 2]
            be.begin_step(tokens, decode=tokens == 1)
            outs.append(be.forward(1, x, ids, w, partial=partial))
            be.end_step()
        return outs, be.counters()["cpu_lane"]
    finally:
        be.close()


def test_fast_mode_partial_is_the_sum_before_its_rounding(int4_store):
    """forward(partial=True) in fast mode (an expert-parallel rank's part): in a lane step, the device's and the
    lane's fp32 parts added and not yet rounded; rounded to bf16, the partial=False result bit for bit (two
    backends, one call each, so the lane takes the same experts in both)."""
    rounded, lane = _lane_layers(int4_store, partial=False)
    parts, _ = _lane_layers(int4_store, partial=True)
    assert lane["experts"] == 4  # one lane expert in each decode step
    for step, (out, part) in enumerate(zip(rounded, parts)):
        assert out.dtype == torch.bfloat16 and part.dtype == torch.float32
        assert torch.equal(part.to(torch.bfloat16), out), step
    unrounded = [not torch.equal(p.to(torch.bfloat16).float(), p) for p in parts]
    assert any(unrounded[:4]) and not unrounded[4]  # the lane's fp32 part kept; prefill: the torch path's
