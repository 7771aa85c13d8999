"""GGUF side of the synthetic Qwen3-MoE model: llama.cpp's `qwen3moe` layout, Q4_0 or Q3_K experts.

The file is streamed: every tensor's name, shape and type is declared up front (GGUF puts the
tensor directory before the data), then the data is written layer by layer in exactly that
order as the generator produces it, so a 30 GB model never sits in memory.

Tensor types: routed experts Q4_0 for an int4 model, Q3_K for an int3 one (`ffn_{gate,up,down}_exps`,
one 3-D tensor per projection, ggml dims [in, out, E]); attention projections, embeddings and the
output head BF16 (the same bits the packed store's safetensors hold); norms and routers F32
holding bf16 values.

Q4_0 block (ggml `block_q4_0`, 18 bytes per 32 weights): an fp16 scale `d`, then 16 bytes whose
byte j holds element j (low nibble) and element j+16 (high nibble), each as q + 8. Our int4
record packs the same q + 8 values two per byte in column order (low nibble = even column), so
conversion is a nibble shuffle inside each 32-element block plus the scale cast. Scales are
chosen representable in bf16 and fp16 alike, so both formats decode to identical floats.

Q3_K block (ggml `block_q3_K`, 110 bytes per 256 weights): `hmask` (32 bytes: weight i's high
bit at byte i % 32, bit i // 32), `qs` (64 bytes: weight i's low two bits at byte
(i // 128) * 32 + i % 32, bits 2 * ((i % 128) // 32)), 12 bytes of sixteen 6-bit sub-block
scales sc (low nibbles of 0..7 then 8..15 in bytes 0..7, high two bits of scale j at byte
8 + j % 4, bits 2 * (j // 4)), then the fp16 super-block scale d. Weight = d * (sc - 32) * q with
q in -4..3 stored as its low two bits and a high bit that is set for q >= 0: exactly our int3
record's stored u = q + 4 (u & 3 and u >> 2), so conversion moves bits and writes each group's
scale as d * (sc - 32) (a power-of-two d per super-block), with no rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tiermoe.errors import UserError

ARCH = "qwen3moe"
QK4_0 = 32
Q4_0_BLOCK_BYTES = 18
QK_K = 256
Q3_K_BLOCK_BYTES = 110
GGUF_DENSE_FP32 = ("norm", "ffn_gate_inp")  # stored F32 (values are bf16-exact)


def q4_0_bytes_per_expert(hidden: int, intermediate: int) -> int:
    """Bytes one routed expert (gate, up, down) takes as Q4_0."""
    return 3 * hidden * intermediate // QK4_0 * Q4_0_BLOCK_BYTES


def to_q4_0(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Our int4 codes + scales -> Q4_0 block bytes.

    packed uint8 [..., N, K/2] (low nibble = even column), scales bf16 [..., N, K/G] with G a
    multiple of 32 -> uint8 [..., N, K/32 * 18]. Every 32-block takes the scale of its group.
    """
    *lead, n, half = packed.shape
    k = half * 2
    if k % QK4_0:
        raise ValueError(f"input dimension {k} is not a multiple of {QK4_0}")
    blocks = k // QK4_0
    g = k // scales.shape[-1]
    if g % QK4_0 or scales.shape[-1] * g != k:
        raise ValueError(f"group size {g} is not a multiple of {QK4_0}")
    p = packed.reshape(*lead, n, blocks, QK4_0 // 2)  # [..., N, B, 16]
    u = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*lead, n, blocks, QK4_0)  # [..., N, B, 32] values 0..15
    qs = u[..., : QK4_0 // 2] | (u[..., QK4_0 // 2 :] << 4)  # [..., N, B, 16]
    d = scales.to(torch.float32).repeat_interleave(g // QK4_0, dim=-1).to(torch.float16)  # [..., N, B], exact
    d8 = d.contiguous().view(torch.uint8).reshape(*lead, n, blocks, 2)
    return torch.cat((d8, qs), dim=-1).reshape(*lead, n, blocks * Q4_0_BLOCK_BYTES)


def q3_k_bytes_per_expert(hidden: int, intermediate: int) -> int:
    """Bytes one routed expert (gate, up, down) takes as Q3_K."""
    return 3 * hidden * intermediate // QK_K * Q3_K_BLOCK_BYTES


def q3_k_blocks(u: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Q3_K block bytes (layout in the module doc) from stored codes u [M, B, 256] (q + 4, 0..7), the
    fp16 super-block scales d [M, B] and the sub-block scales sc - 32, integers [M, B, 16] in -32..31
    -> uint8 [M, B, 110]; each weight decodes to d * (sc - 32) * (u - 4)."""
    m, nb = u.shape[:2]
    u = u.to(torch.int32)
    sc6 = sc.to(torch.int32) + 32  # [M, B, 16] in 0..63
    lo = (u & 3).view(m, nb, 2, 4, 32)  # [M, B, half, shift, 32]
    qs = (lo[..., 0, :] | (lo[..., 1, :] << 2) | (lo[..., 2, :] << 4) | (lo[..., 3, :] << 6)).view(m, nb, 64)
    hi = (u >> 2).view(m, nb, 8, 32)  # [M, B, bit, 32]
    hmask = sum(hi[..., b, :] << b for b in range(8))  # [M, B, 32]
    low, top = sc6 & 15, ((sc6 >> 4) & 3).view(m, nb, 4, 4)  # [M, B, 16], [M, B, j // 4, j % 4]
    sc_bytes = torch.cat((low[..., :8] | (low[..., 8:] << 4), sum(top[..., j, :] << (2 * j) for j in range(4))), -1)
    bits = d.to(torch.float16).contiguous().view(torch.int16).to(torch.int32)  # [M, B] fp16 bits
    d_bytes = torch.stack((bits & 0xFF, (bits >> 8) & 0xFF), dim=-1)  # [M, B, 2] little-endian
    return torch.cat((hmask, qs, sc_bytes, d_bytes), dim=-1).to(torch.uint8)  # [M, B, 110]


def to_q3_k(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Our int3 codes + scales -> Q3_K block bytes (layout in the module doc).

    packed uint8 [..., N, 3K/8] (bit planes, store/quant.py), scales bf16 [..., N, K/G] with G a
    multiple of 16 and K of 256 -> uint8 [..., N, K/256 * 110]. Every 16-weight sub-block takes the
    scale of its group, written as d * (sc - 32) with d the power of two that puts the block's
    largest |scale| / d in 16..31; a scale that this cannot write exactly raises ValueError (the
    generator's m * 2^e, m in 8..15, always can).
    """
    from tiermoe.store.quant import unpack_int3

    *lead, n, cols = packed.shape
    k = cols * 8 // 3
    if cols * 8 % 3 or k % QK_K:
        raise ValueError(f"input dimension {k} is not a multiple of {QK_K} (Q3_K's block)")
    g = k // scales.shape[-1]
    if g % 16 or scales.shape[-1] * g != k:
        raise ValueError(f"group size {g} is not a multiple of 16 (Q3_K's sub-block)")
    m, nb = packed.numel() // cols, k // QK_K
    u = unpack_int3(packed.reshape(m, cols)).add(4).view(m, nb, QK_K)  # [M, B, 256] stored 0..7
    sub = scales.to(torch.float32).reshape(m, -1).repeat_interleave(g // 16, dim=-1).view(m, nb, 16)  # [M, B, 16]
    amax = sub.abs().amax(dim=-1)  # [M, B]
    d = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax.clamp(min=1e-38))) - 4), torch.zeros_like(amax))
    sc = torch.where(d.unsqueeze(-1) > 0, sub / d.clamp(min=1e-38).unsqueeze(-1), torch.zeros_like(sub))  # [M, B, 16]
    if not (torch.equal(sc, sc.round()) and torch.equal(d.to(torch.float16).to(torch.float32), d)):
        raise ValueError("scales are not d * (sc - 32) with a power-of-two fp16 d and integer sc (not Q3_K-exact)")
    return q3_k_blocks(u, d, sc).reshape(*lead, n, nb * Q3_K_BLOCK_BYTES)  # |sc| < 32 by the choice of d


EXPERT_TYPES = {"int4": "Q4_0", "int3": "Q3_K"}  # GGUF type of the experts for each store kind


def tensor_plan(spec) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy-order shape, type) of every tensor, in file order. Type: Q4_0 or Q3_K (experts,
    by spec.quant), BF16 or F32."""
    h, v, e, i = spec.hidden, spec.vocab, spec.experts, spec.moe_intermediate
    qt = EXPERT_TYPES[spec.quant]
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    plan = [
        ("token_embd.weight", (v, h), "BF16"),
        ("output_norm.weight", (h,), "F32"),
        ("output.weight", (v, h), "BF16"),
    ]
    for layer in range(spec.layers):
        b = f"blk.{layer}"
        plan += [
            (f"{b}.attn_norm.weight", (h,), "F32"),
            (f"{b}.attn_q.weight", (q_out, h), "BF16"),
            (f"{b}.attn_k.weight", (kv_out, h), "BF16"),
            (f"{b}.attn_v.weight", (kv_out, h), "BF16"),
            (f"{b}.attn_output.weight", (h, q_out), "BF16"),
            (f"{b}.attn_q_norm.weight", (spec.head_dim,), "F32"),
            (f"{b}.attn_k_norm.weight", (spec.head_dim,), "F32"),
            (f"{b}.ffn_norm.weight", (h,), "F32"),
            (f"{b}.ffn_gate_inp.weight", (e, h), "F32"),
            (f"{b}.ffn_gate_exps.weight", (e, i, h), qt),
            (f"{b}.ffn_up_exps.weight", (e, i, h), qt),
            (f"{b}.ffn_down_exps.weight", (e, h, i), qt),
        ]
    return plan


# HF (store) name of each dense GGUF tensor; experts are handled separately.
def hf_name(gguf_name: str) -> str:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    sub = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
    }[kind]
    return f"model.layers.{layer}.{sub}.weight"


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(shape))
    if kind == "Q4_0":
        return n // QK4_0 * Q4_0_BLOCK_BYTES
    if kind == "Q3_K":
        return n // QK_K * Q3_K_BLOCK_BYTES
    return n * (2 if kind == "BF16" else 4)


def write_tokenizer_fields(w, tok) -> None:
    """Write tokenizer `tok` (ChatML template) into GGUFWriter `w` as llama.cpp's GPT-2 vocabulary."""
    import gguf

    from tiermoe.models.tiny_tokenizer import CHAT_TEMPLATE

    n = len(tok)
    tokens = tok.convert_ids_to_tokens(list(range(n)))
    if any(t is None for t in tokens):
        raise UserError("tokenizer: ids are not contiguous; cannot write a GGUF vocabulary")
    special = set(tok.all_special_ids)
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp: GPT-2 split regex, as the HF ByteLevel pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n)])
    w.add_token_merges(merges)
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_pad_token_id(tok.pad_token_id)
    w.add_bos_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


class GGUFSink:
    """Writes the model's GGUF: header and tensor directory at open, then data in plan order."""

    def __init__(self, path: Path, spec, tok, name: str):
        import gguf

        self.path = Path(path)
        self.plan = tensor_plan(spec)
        self._next = 0
        w = gguf.GGUFWriter(str(self.path), ARCH)
        w.add_name(name)
        w.add_block_count(spec.layers)
        w.add_context_length(spec.max_position)
        w.add_embedding_length(spec.hidden)
        w.add_feed_forward_length(spec.dense_intermediate)
        w.add_head_count(spec.heads)
        w.add_head_count_kv(spec.kv_heads)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_rope_dimension_count(spec.head_dim)
        w.add_rope_freq_base(spec.rope_theta)
        w.add_layer_norm_rms_eps(spec.rms_eps)
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.top_k)
        w.add_expert_feed_forward_length(spec.moe_intermediate)
        w.add_vocab_size(spec.vocab)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q3_K_S if spec.quant == "int3" else gguf.LlamaFileType.MOSTLY_Q4_0)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_tokenizer_fields(w, tok)
        types = {
            "Q4_0": gguf.GGMLQuantizationType.Q4_0,
            "Q3_K": gguf.GGMLQuantizationType.Q3_K,
            "BF16": gguf.GGMLQuantizationType.BF16,
            "F32": gguf.GGMLQuantizationType.F32,
        }
        for name, shape, kind in self.plan:
            nbytes = _nbytes(shape, kind)
            if kind == "F32":
                w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
            else:
                byte_shape = (*shape[:-1], nbytes // int(np.prod(shape[:-1])))
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=types[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self._w = w
        self._f = w.fout[0]
        self.bytes_written = 0

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> None:
        """Write the next tensor of the plan (its raw bytes, in file order)."""
        want, shape, kind = self.plan[self._next]
        if name != want:
            raise RuntimeError(f"GGUF data out of order: got {name}, expected {want}")
        buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        if buf.nbytes != _nbytes(shape, kind):
            raise RuntimeError(f"{name}: {buf.nbytes} bytes, expected {_nbytes(shape, kind)}")
        self._w.write_padding(self._f, self._f.tell())
        self._f.write(buf)
        self._w.write_padding(self._f, buf.nbytes)
        self.bytes_written += buf.nbytes
        self._next += 1

    def write_dense(self, gguf_name: str, t: torch.Tensor) -> None:
        """A bf16 tensor as BF16 (matrices) or F32 (norms, routers) bytes."""
        kind = self.plan[self._next][2]
        t = t.detach().cpu().contiguous()
        if kind == "F32":
            self.write(gguf_name, t.to(torch.float32).numpy())
        else:
            self.write(gguf_name, t.to(torch.bfloat16).view(torch.int16).numpy())

    def close(self) -> None:
        if self._next != len(self.plan):
            raise RuntimeError(f"GGUF incomplete: {self._next} of {len(self.plan)} tensors written")
        self._f.flush()
        self._w.close()
