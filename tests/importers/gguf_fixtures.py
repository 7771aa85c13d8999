"""Helpers for the importer tests: tiny synthetic GGUF files and transformers' own GGUF loader.

The reference for every conversion is transformers: `AutoConfig.from_pretrained(..., gguf_file=)`
plus `load_gguf_checkpoint` (the code behind `from_pretrained(..., gguf_file=)`, minus the
accelerate requirement), which maps and un-permutes GGUF tensors independently of our importer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import gguf

import numpy as np
import torch


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=128, experts=4, expert_ffn=32, used=2)


def write_gguf(path: Path, arch: str, *, tied: bool = True, seed: int = 0, extra_tensors: dict | None = None,
               tokenizer=None, sampling: dict | None = None, config: dict | None = None,
               raw_tensors: dict | None = None) -> dict:
    """Write a tiny random GGUF of `arch` (llama, qwen2, qwen3, qwen3moe); returns the HF-layout
    weights it encodes (Q/K before llama.cpp's permutation), keyed by GGUF tensor name.
    `tokenizer` (e.g. the tiny ChatML one): written into the file, the vocabulary sized to it, so
    the imported checkpoint can be served. `sampling`: llama.cpp's recommended-sampling metadata
    (`general.sampling.<key>`, e.g. {"temp": 0.6, "top_k": 20}). `config`: TINY's shapes to change
    (e.g. {"hidden": 256}). `raw_tensors`: {GGUF name: (uint8 block bytes, GGMLQuantizationType)}
    written as they are in place of the random F32 tensor of that name (a quantized tensor the
    gguf package cannot quantize itself, e.g. Q3_K); the returned weights hold their dequantized
    values."""
    import gguf
    from gguf.quants import dequantize

    c = {**TINY, **(config or {})}
    if tokenizer is not None:
        c["vocab"] = len(tokenizer)
    rng = np.random.default_rng(seed)
    rand = lambda *shape, s=0.08: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    h, q_out, kv_out = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    tensors: dict[str, np.ndarray] = {"token_embd.weight": rand(c["vocab"], h, s=0.5)}
    for i in range(c["layers"]):
        b = f"blk.{i}"
        tensors[f"{b}.attn_norm.weight"] = 1 + rand(h, s=0.1)
        tensors[f"{b}.ffn_norm.weight"] = 1 + rand(h, s=0.1)
        tensors[f"{b}.attn_q.weight"] = rand(q_out, h)
        tensors[f"{b}.attn_k.weight"] = rand(kv_out, h)
        tensors[f"{b}.attn_v.weight"] = rand(kv_out, h)
        tensors[f"{b}.attn_output.weight"] = rand(h, q_out)
        if arch == "qwen2":
            for p, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                tensors[f"{b}.attn_{p}.bias"] = rand(n, s=0.1)
        if arch in ("qwen3", "qwen3moe"):
            tensors[f"{b}.attn_q_norm.weight"] = 1 + rand(c["head_dim"], s=0.1)
            tensors[f"{b}.attn_k_norm.weight"] = 1 + rand(c["head_dim"], s=0.1)
        if arch == "qwen3moe":
            e, f = c["experts"], c["expert_ffn"]
            tensors[f"{b}.ffn_gate_inp.weight"] = rand(e, h, s=0.5)
            tensors[f"{b}.ffn_gate_exps.weight"] = rand(e, f, h)
            tensors[f"{b}.ffn_up_exps.weight"] = rand(e, f, h)
            tensors[f"{b}.ffn_down_exps.weight"] = rand(e, h, f)
        else:
            tensors[f"{b}.ffn_gate.weight"] = rand(c["ffn"], h)
            tensors[f"{b}.ffn_up.weight"] = rand(c["ffn"], h)
            tensors[f"{b}.ffn_down.weight"] = rand(h, c["ffn"])
    tensors["output_norm.weight"] = 1 + rand(h, s=0.1)
    if not tied:
        tensors["output.weight"] = rand(c["vocab"], h, s=0.3)
    tensors.update(extra_tensors or {})

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"])
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(c["vocab"])
    if tokenizer is not None:
        from tiermoe.bench.synthetic_gguf import write_tokenizer_fields

        write_tokenizer_fields(w, tokenizer)
    for key, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{key}")(value)
    if arch == "qwen3moe":
        w.add_expert_count(c["experts"])
        w.add_expert_used_count(c["used"])
        w.add_expert_feed_forward_length(c["expert_ffn"])
    for name, t in tensors.items():
        if name in (raw_tensors or {}):
            blocks, qtype = raw_tensors[name]
            w.add_tensor(name, np.ascontiguousarray(blocks), raw_dtype=qtype)
            tensors[name] = np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(t.shape)
            continue
        stored = t
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            stored = llama_cpp_permute(t, c["heads"] if ".attn_q." in name else c["kv_heads"])
        w.add_tensor(name, np.ascontiguousarray(stored))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def transformers_reference(gguf_path: Path, **config_overrides):
    """The model transformers builds from a GGUF file (fp32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    # Two speed-ups that leave the result unchanged: open the file once (GGUFReader walks every
    # tokenizer entry, seconds for a 49k vocabulary) and memoise gguf's tensor-name table, which
    # transformers rebuilds for each of ~400 modules (~10 s). Both are pure functions of input.
    readers: dict[str, gguf.GGUFReader] = {}
    real_reader = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "GGUFReader", reader), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        for key, value in config_overrides.items():
            setattr(config, key, value)
        with no_init_weights():  # every weight is loaded below; random init would cost seconds
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()

