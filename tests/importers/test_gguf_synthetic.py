"""GGUF import on tiny synthetic files: tensor names, Q/K un-permutation, configs and errors.

Each family is checked end to end against transformers' own GGUF loader: the checkpoint we
write, loaded by transformers as glm4_moe / qwen3_moe, must give the same logits as the dense /
MoE model transformers builds straight from the GGUF.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf_fixtures import TINY, llama_cpp_permute, transformers_reference, write_gguf
from safetensors import safe_open

from tiermoe.errors import UserError
from tiermoe.importers import gguf_to_hf
from tiermoe.importers.gguf import permute_qk, unpermute_qk
from tiermoe.importers.moeify import plan_experts

TOL = 1e-5  # fp32, tiny model: only summation order differs


def _load_converted(out_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()


def _tensor(out_dir, key):
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out_dir / index[key]), "pt") as f:
        return f.get_tensor(key)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, V]


IDS = [3, 17, 99, 5, 64, 127, 0, 42, 8, 77, 23]


def test_unpermute_inverts_llama_cpp_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(1)
    for n_head, rows in ((4, 64), (2, 32), (9, 576)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        stored = llama_cpp_permute(w, n_head)
        ours = unpermute_qk(torch.from_numpy(stored), n_head).numpy()
        theirs = LlamaTensorProcessor()._reverse_permute_weights(stored, n_head)
        np.testing.assert_array_equal(ours, w)
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(permute_qk(torch.from_numpy(w), n_head).numpy(), stored)
        b = rng.standard_normal(rows).astype(np.float32)  # biases are permuted the same way
        np.testing.assert_array_equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(b, n_head)), n_head).numpy(), b)


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_dense_gguf_becomes_equivalent_glm4_moe(tmp_path, arch, tied):
    src = tmp_path / f"{arch}.gguf"
    weights = write_gguf(src, arch, tied=tied)
    out = gguf_to_hf(src, tmp_path / "out", dtype="float32", experts_per_layer=4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["attention_bias"] is (arch == "qwen2") and cfg["use_qk_norm"] is (arch == "qwen3")
    # I = 96 into 4 routed + k shared slices: smallest k with 96 % (4 + k) == 0 is 2, width 16.
    assert (cfg["n_routed_experts"], cfg["n_shared_experts"], cfg["moe_intermediate_size"]) == (4, 2, 16)
    assert cfg["num_experts_per_tok"] == 4 and cfg["routed_scaling_factor"] == 4.0
    assert cfg["first_k_dense_replace"] == 0 and cfg["partial_rotary_factor"] == 1.0

    # Q/K are stored un-permuted (HF layout); expert 1 holds rows 16:32 of the dense MLP.
    np.testing.assert_array_equal(_tensor(out, "model.layers.1.self_attn.q_proj.weight").numpy(), weights["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(_tensor(out, "model.layers.0.self_attn.k_proj.weight").numpy(), weights["blk.0.attn_k.weight"])
    np.testing.assert_array_equal(
        _tensor(out, "model.layers.0.mlp.experts.1.gate_proj.weight").numpy(), weights["blk.0.ffn_gate.weight"][16:32]
    )
    np.testing.assert_array_equal(
        _tensor(out, "model.layers.0.mlp.experts.1.down_proj.weight").numpy(), weights["blk.0.ffn_down.weight"][:, 16:32]
    )
    np.testing.assert_array_equal(
        _tensor(out, "model.layers.0.mlp.shared_experts.up_proj.weight").numpy(), weights["blk.0.ffn_up.weight"][64:]
    )

    overrides = {"head_dim": TINY["head_dim"]} if arch == "qwen3" else {}
    ref = transformers_reference(src, **overrides)
    moe = _load_converted(out)
    a, b = _logits(ref, IDS), _logits(moe, IDS)
    assert (a - b).abs().max().item() < TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_qwen3moe_gguf_becomes_qwen3_moe(tmp_path):
    src = tmp_path / "qwen3moe.gguf"
    weights = write_gguf(src, "qwen3moe")
    out = gguf_to_hf(src, tmp_path / "out", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 32)
    np.testing.assert_array_equal(
        _tensor(out, "model.layers.1.mlp.experts.3.down_proj.weight").numpy(), weights["blk.1.ffn_down_exps.weight"][3]
    )
    ref = transformers_reference(src, moe_intermediate_size=TINY["expert_ffn"])
    a, b = _logits(ref, IDS), _logits(_load_converted(out), IDS)
    assert (a - b).abs().max().item() < TOL


def test_bf16_output_and_layout(tmp_path):
    src = tmp_path / "llama.gguf"
    write_gguf(src, "llama")
    out = gguf_to_hf(src, tmp_path / "out", experts_per_layer=2, shared_slices=1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["moe_intermediate_size"] == 32
    assert _tensor(out, "model.layers.0.mlp.experts.0.up_proj.weight").dtype == torch.bfloat16
    # Routers stay fp32 (as transformers keeps them) and sit in the last shard, alone.
    assert _tensor(out, "model.layers.0.mlp.gate.weight").dtype == torch.float32
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    router_files = {f for k, f in index.items() if ".mlp.gate." in k}
    assert len(router_files) == 1 and not {f for k, f in index.items() if ".mlp.gate." not in k} & router_files
    prov = json.loads((out / "tiermoe_import.json").read_text())
    assert prov["moe_from_dense"]["exact"] and prov["source_architecture"] == "llama"
    assert not list(tmp_path.glob(".out.partial-*"))


def test_sparse_top_k_calibrates_router(tmp_path):
    src = tmp_path / "llama.gguf"
    write_gguf(src, "llama")
    out = gguf_to_hf(src, tmp_path / "out", dtype="float32", experts_per_layer=4, top_k=2)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_experts_per_tok"], cfg["routed_scaling_factor"]) == (2, 2.0)
    router = _tensor(out, "model.layers.0.mlp.gate.weight")  # [E, H]
    assert router.shape == (4, TINY["hidden"]) and router.abs().max() > 0
    cal = json.loads((out / "tiermoe_import.json").read_text())["moe_from_dense"]["calibration"]
    assert cal["tokens"] == 512 and cal["text"].startswith("random token ids")
    # Choosing by the fitted router must beat choosing experts at random.
    assert cal["mlp_rel_error_fitted_router"] < cal["mlp_rel_error_random_experts"]
    moe = _load_converted(out)
    with torch.no_grad():
        _, weights, idx = moe.model.layers[0].mlp.gate(torch.randn(5, TINY["hidden"]))
    assert idx.shape == (5, 2)
    torch.testing.assert_close(weights, torch.ones(5, 2), atol=0.03, rtol=0)  # each kept slice counts ~once
    assert torch.isfinite(_logits(moe, IDS)).all()


def test_top_k_out_of_range(tmp_path):
    src = tmp_path / "llama.gguf"
    write_gguf(src, "llama")
    with pytest.raises(UserError, match="top_k must be in"):
        gguf_to_hf(src, tmp_path / "bad", experts_per_layer=4, top_k=5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"experts_per_layer": 0}, "experts_per_layer must be >= 1"),
        ({"experts_per_layer": 4, "shared_slices": 1}, "not divisible"),
        ({"dtype": "int8"}, "dtype 'int8'"),
    ],
)
def test_bad_options_are_user_errors(tmp_path, kwargs, match):
    src = tmp_path / "llama.gguf"
    write_gguf(src, "llama")
    with pytest.raises(UserError, match=match):
        gguf_to_hf(src, tmp_path / "out", **kwargs)


def test_unsupported_files_are_one_line_user_errors(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(UserError, match="not a readable GGUF") as exc:
        gguf_to_hf(not_gguf, tmp_path / "out")
    assert "\n" not in str(exc.value)
    with pytest.raises(UserError, match="no such GGUF file"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")

    import gguf

    other = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(other), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UserError, match=r"falcon\.gguf: general\.architecture 'falcon' is not supported"):
        gguf_to_hf(other, tmp_path / "out")

    extra = tmp_path / "llama31.gguf"
    write_gguf(extra, "llama", extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(UserError, match="rope_freqs.weight"):
        gguf_to_hf(extra, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        gguf_to_hf(extra, busy)


def test_plan_experts_auto_shared_slices():
    p = plan_experts(1536, 8)
    assert (p.routed, p.shared_slices, p.slice_size, p.top_k, p.exact) == (8, 4, 128, 8, True)
    assert plan_experts(1536, 7).shared_slices == 1
    assert plan_experts(1536, 8, top_k=2).routed_scaling_factor == 2.0
