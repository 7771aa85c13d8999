"""Synthetic Hugging Face MoE checkpoints for the store tests (written with safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

STATS_FILE = (
    Path(__file__).resolve().parents[2] / "src" / "tiermoe" / "store" / "data"
    / "glm53-flash-decode-expert-counts.json"
)


def make_checkpoint(
    root: Path,
    *,
    layers: int = 2,
    experts: int = 8,
    hidden: int = 64,
    inter: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    style: str = "qwen",  # qwen: gate_proj/up_proj/down_proj; mixtral: w1/w3/w2; fused: gate_up_proj [E,2I,H]
    first_dense: int = 0,
    files: int = 2,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a tiny MoE checkpoint to `root`; return every tensor it holds (name -> tensor)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    root.mkdir(parents=True, exist_ok=True)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(128, hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    block = "block_sparse_moe" if style == "mixtral" else "mlp"
    for L in range(layers):
        p = f"model.layers.{L}"
        t[f"{p}.self_attn.q_proj.weight"] = rnd(hidden, hidden)
        t[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        if L < first_dense:
            t[f"{p}.mlp.gate_proj.weight"] = rnd(inter * 2, hidden)
            continue
        t[f"{p}.{block}.gate.weight"] = rnd(experts, hidden)
        t[f"{p}.mlp.shared_experts.gate_proj.weight"] = rnd(inter, hidden)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(experts, dtype=torch.float32)
        if style == "fused":
            t[f"{p}.mlp.experts.gate_up_proj"] = rnd(experts, 2 * inter, hidden)
            t[f"{p}.mlp.experts.down_proj"] = rnd(experts, hidden, inter)
            continue
        names = ("w1", "w3", "w2") if style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(experts):
            q = f"{p}.{block}.experts.{e}"
            t[f"{q}.{names[0]}.weight"] = rnd(inter, hidden)
            t[f"{q}.{names[1]}.weight"] = rnd(inter, hidden)
            t[f"{q}.{names[2]}.weight"] = rnd(hidden, inter)
    keys = sorted(t)
    chunks = [keys[i::files] for i in range(files)]
    weight_map = {}
    for n, chunk in enumerate(chunks, 1):
        name = f"model-{n:05d}-of-{files:05d}.safetensors" if files > 1 else "model.safetensors"
        save_file({k: t[k].contiguous() for k in chunk}, str(root / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in chunk})
    if files > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (root / "chat_template.jinja").write_text("{{ messages }}")
    return t


def expert_weights(tensors: dict[str, torch.Tensor], layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) of one expert from make_checkpoint's tensors, whatever the style."""
    for block, names in (("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2"))):
        k = f"model.layers.{layer}.{block}.experts.{expert}.{names[0]}.weight"
        if k in tensors:
            q = f"model.layers.{layer}.{block}.experts.{expert}"
            return tuple(tensors[f"{q}.{n}.weight"] for n in names)  # type: ignore[return-value]
    gu = tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert]
    i = gu.shape[0] // 2
    return gu[:i], gu[i:], tensors[f"model.layers.{layer}.mlp.experts.down_proj"][expert]


@pytest.fixture
def ckpt(tmp_path):
    """(checkpoint dir, tensors) of the default tiny bf16 checkpoint."""
    src = tmp_path / "src"
    return src, make_checkpoint(src)


@pytest.fixture(scope="session")
def packed_bf16(tmp_path_factory):
    """A bf16 store of the default checkpoint, shared read-only by tests: (store dir, tensors)."""
    from tiermoe.store.pack import pack

    base = tmp_path_factory.mktemp("packed")
    tensors = make_checkpoint(base / "src")
    pack(base / "src", base / "store", quant="bf16", progress=False, log=lambda s: None)
    return base / "store", tensors
