"""The synthetic Qwen3-MoE generator: one set of weights, an int4 store and a Q4_0 GGUF.

A small shape (2 layers, 16 experts, hidden 256) is generated once per module on the CPU; the
tests check that the store loads and generates, that the GGUF has llama.cpp's qwen3moe layout,
that both formats decode to identical weights (through independent decoders), and that the
GGUF, read back by the GGUF importer, computes the logits the store computes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiermoe.bench.synthetic_gguf import to_q4_0
from tiermoe.bench.synthetic_qwen3 import SyntheticSpec, make_synthetic, silenced_tokens, sizes
from tiermoe.errors import UserError
from tiermoe.store.quant import dequantize_groupwise

ROOT = Path(__file__).resolve().parents[2]
SMALL = SyntheticSpec(layers=2, hidden=256, experts=16, moe_intermediate=128, top_k=4, heads=4, kv_heads=2,
                      head_dim=64, max_position=2048, seed=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    make_synthetic(out, SMALL, device="cpu", progress=False, log=lambda _msg: None)
    return out


@pytest.fixture(scope="module")
def engine(model):
    from tiermoe.engine.build import build_engine_core

    return build_engine_core(str(model / "store"), device="cpu", dtype="float32", max_num_seqs=1)


def test_full_shape_bytes_per_expert():
    s = sizes(SyntheticSpec(vocab=512))  # Qwen3-235B-A22B's expert: 3 x 4096 x 1536 weights
    assert s["weights_per_expert"] == 18_874_368
    assert s["store_bytes_per_expert"] == s["gguf_bytes_per_expert"] == 10_616_832  # 4.5 bits per weight each
    g128 = sizes(SyntheticSpec(vocab=512, group_size=128))
    assert g128["store_bytes_per_expert"] == 9_732_096 and g128["gguf_bytes_per_expert"] == 10_616_832


@pytest.mark.parametrize("group", [32, 64])
def test_q4_0_blocks_decode_like_our_int4(group):
    import gguf
    from gguf.quants import dequantize

    g = torch.Generator().manual_seed(group)
    n, k = 6, 128
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)  # [N, K/2] packed nibbles
    s = (torch.randint(8, 16, (n, k // group), generator=g).float() * 2.0**-12).to(torch.bfloat16)
    blocks = to_q4_0(q, s)  # [N, K/32 * 18]
    assert blocks.shape == (n, k // 32 * 18)
    theirs = torch.from_numpy(np.array(dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_0)))
    ours = dequantize_groupwise(q, s, 4, group, torch.float32)
    assert torch.equal(theirs, ours)
    assert torch.equal(theirs.to(torch.bfloat16), dequantize_groupwise(q, s, 4, group, torch.bfloat16))


def test_gguf_has_llama_cpp_qwen3moe_layout(model):
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    meta = json.loads((model / "synthetic-gguf.json").read_text())
    r = GGUFReader(str(model / "model.gguf"))
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe"
    assert field("qwen3moe.expert_count") == 16 and field("qwen3moe.expert_used_count") == 4
    assert field("qwen3moe.expert_feed_forward_length") == 128 and field("qwen3moe.block_count") == 2
    assert field("tokenizer.ggml.model") == "gpt2"
    vocab = meta["spec"]["vocab"]
    assert len(field("tokenizer.ggml.tokens")) == vocab
    t = {x.name: x for x in r.tensors}
    assert len(t) == 3 + 2 * 12
    for proj, ne in (("gate", [256, 128, 16]), ("up", [256, 128, 16]), ("down", [128, 256, 16])):
        x = t[f"blk.1.ffn_{proj}_exps.weight"]
        assert x.tensor_type == T.Q4_0 and list(x.shape) == ne  # ggml order: [in, out, experts]
    assert t["blk.0.attn_q.weight"].tensor_type == T.BF16 and list(t["blk.0.attn_q.weight"].shape) == [256, 256]
    assert t["blk.0.attn_k.weight"].tensor_type == T.BF16 and list(t["blk.0.attn_k.weight"].shape) == [256, 128]
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == T.F32 and list(t["blk.0.ffn_gate_inp.weight"].shape) == [
        256,
        16,
    ]
    assert t["blk.0.attn_q_norm.weight"].tensor_type == T.F32 and list(t["blk.0.attn_q_norm.weight"].shape) == [64]
    assert list(t["token_embd.weight"].shape) == [256, vocab] and list(t["output.weight"].shape) == [256, vocab]


def test_both_formats_decode_to_identical_weights(model):
    from tiermoe.bench.synthetic_check import check_synthetic

    report = check_synthetic(model, samples=16, layers="all")
    assert report["ok"], report["lines"]
    assert report["checked"] == {"experts": 32, "dense": 2 * 9 + 3}


def test_store_verifies_loads_and_generates(model, engine):
    from tiermoe.engine.llm_engine import generate_ids
    from tiermoe.protocol import SamplingParams
    from tiermoe.store import verify_store

    checked, bad = verify_store(model / "store", direct_io=False)
    assert checked == 2 * 16 and not bad
    ids = engine.tokenizer("The capital of France is").input_ids
    out = generate_ids(engine, [ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert len(out) == 12  # the silenced LM-head rows (EOS among them) never win a greedy pick
    assert not set(out) & set(silenced_tokens(engine.tokenizer))


def test_gguf_read_back_computes_the_store_logits(model, engine, tmp_path):
    """The GGUF, imported by an independent reader (gguf's dequantizers) and run by transformers,
    vs our engine on the store: the same logits at every position of a chat prompt."""
    from tiermoe.engine.prompts import chat_prompt_ids
    from tiermoe.eval.parity import compare, engine_logits, reference_logits
    from tiermoe.importers.gguf import gguf_to_hf

    ref = gguf_to_hf(model / "model.gguf", tmp_path / "hf", dtype="float32")
    ids = chat_prompt_ids(engine.tokenizer, "Name three primary colors.")
    ours = engine_logits(engine, ids, chunk=8)  # [T, V], through the paged KV cache in chunks
    r = compare(reference_logits(ref, [ids], "cpu", torch.float32)[0], ours)
    assert r["positions"] == len(ids) and r["top1"] == 1.0
    assert r["max_abs_logit_diff"] < 1e-3 and r["kl_max"] < 1e-8


def test_separate_runs_write_the_same_weights(model, tmp_path):
    meta = make_synthetic(tmp_path, SMALL, formats=["gguf"], device="cpu", progress=False, log=lambda _m: None)
    both = json.loads((model / "synthetic-store.json").read_text())["weights_sha256"]
    assert meta["weights_sha256"] == both
    assert (tmp_path / "model.gguf").read_bytes() == (model / "model.gguf").read_bytes()
    other = make_synthetic(
        tmp_path / "seed4",
        SyntheticSpec(**{**SMALL.__dict__, "seed": 4}),
        formats=["gguf"],
        device="cpu",
        progress=False,
        log=lambda _m: None,
    )
    assert other["weights_sha256"] != both


def test_refuses_existing_output_and_bad_shapes(model):
    with pytest.raises(UserError, match="exists"):
        make_synthetic(model, SMALL, formats=["store"], device="cpu", progress=False)
    with pytest.raises(UserError, match="group-size"):
        make_synthetic(model / "x", SyntheticSpec(**{**SMALL.__dict__, "group_size": 48}), device="cpu", progress=False)


def test_cli_sizes_only(capsys):
    from .conftest import run_bench

    rc, out = run_bench(["make-qwen3moe", "unused", "--layers", "24", "--sizes-only"], capsys)
    assert rc == 0
    s = json.loads(out)
    assert s["store_bytes_per_expert"] == 10_616_832
    assert s["store_bytes"] > 24 * 128 * 10_616_832


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "sbs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_comparison_rows():
    rep = _load_script("report")

    def sweep(pre, c1, c4):
        return {
            "prefill": [{"target_tokens": 4096, "median_tok_s": pre}],
            "decode": [
                {"concurrency": 1, "per_stream_tok_s": c1, "aggregate_tok_s": c1},
                {"concurrency": 4, "per_stream_tok_s": c4 / 4, "aggregate_tok_s": c4},
            ],
        }

    floors = {"tiermoe-exact": {"tok_s": 120.0, "gpu_share": 0.95}, "llamacpp": {"tok_s": 40.0, "gpu_share": 1 / 3}}
    lines = rep.comparison({"tiermoe-exact": sweep(900.0, 30.0, 80.0), "llamacpp": sweep(1000.0, 20.0, 60.0)}, floors)
    table = "\n".join(lines)
    assert "| prefill 4096 | 900.0 | 1,000.0 | 0.90x |" in table
    assert "| C1 per-stream | 30.0 | 20.0 | 1.50x |" in table
    # each engine against the floor of its own expert placement
    assert "| expert reads from HBM (the floor's split) | 95.0 % | 33.3 % | |" in table
    assert "| C1 per-stream / floor (tok/s) | 25 % of 120.0 | 50 % of 40.0 | |" in table
    share = rep.slot_hit_share(
        {"engine": {"experts": {"slots": {"hits": 130, "misses": 10}}}},
        {"engine": {"experts": {"slots": {"hits": 30, "misses": 5}}}},
    )
    assert share == 100 / 105 and rep.slot_hit_share({}, None) is None
    assert "Rows where tiermoe is not ahead: prefill 4096" in table
    assert rep.vram_peak_mib(Path("/nonexistent")) is None


def test_greedy_agreement_reads_both_logprobs_shapes():
    greedy = _load_script("greedy")
    legacy = {
        "text": "ab",
        "logprobs": {
            "tokens": ["a", "b"],
            "token_logprobs": [-0.1, -0.2],
            "top_logprobs": [{"a": -0.1, "x": -2.0}, {"b": -0.2, "y": -3.0}],
        },
    }
    chat = {
        "text": "ac",
        "logprobs": {
            "content": [
                {
                    "token": "a",
                    "logprob": -0.15,
                    "top_logprobs": [{"token": "a", "logprob": -0.15}, {"token": "x", "logprob": -2.1}],
                },
                {
                    "token": "c",
                    "logprob": -0.3,
                    "top_logprobs": [{"token": "c", "logprob": -0.3}, {"token": "b", "logprob": -0.4}],
                },
            ]
        },
    }
    one = {"items": [{"text": legacy["text"], "tokens": greedy.normalize(legacy)}]}
    two = {"items": [{"text": chat["text"], "tokens": greedy.normalize(chat)}]}
    c = greedy.compare(one, two)
    assert c["identical_completions"] == 0 and c["tokens"] == 2 and c["tokens_before_divergence"] == 1
    assert c["topn_overlap_on_prefix"] == 1.0 and abs(c["max_abs_logprob_diff"] - 0.05) < 1e-9


def test_real_routing_statistics_beside_the_model(model):
    """The generator writes the real GLM-5.3-Flash counts fitted to the model (its layers, its expert
    count), in the --expert-stats / --routing-replay format, keeping the real skew."""
    from tiermoe.bench.real_routing import REAL_STATS
    from tiermoe.store.planner import load_stats

    stats = load_stats(model / "expert-stats.json")
    assert sorted(stats) == [0, 1] and all(len(v) == 16 for v in stats.values())
    real = load_stats(REAL_STATS)
    for mine, theirs in ((stats[0], real[min(real)]), (stats[1], real[max(real)])):  # first and last real layers
        assert sum(mine) > 0 and min(theirs) <= min(mine) and max(mine) <= max(theirs)
    cv = [np.std(stats[i]) / np.mean(stats[i]) for i in (0, 1)]
    assert cv[1] > cv[0]  # the last real layer is heavy-tailed, the first nearly flat
    assert json.loads((model / "synthetic-store.json").read_text())["routing_stats"].endswith("expert-stats.json")
