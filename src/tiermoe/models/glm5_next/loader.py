"""Load a glm5_next checkpoint (Hugging Face safetensors) into `Glm5NextModel`.

Checkpoint keys are accepted in both layouts transformers knows: the hub layout
(`hc_attn_fn`, `self_attn.f_a_proj`, split `q/k/v_conv1d`, one key per expert projection),
which `save_pretrained` writes, and transformers' in-memory layout (`attn_hc.fn`,
`forget_gate.*`, fused `conv1d`, fused `experts.gate_up_proj`). The key prefix
(`model.language_model.` for the multimodal class, `model.` for flat text-only files) is
detected from the embedding key. The MTP block is checkpoint layer `num_hidden_layers`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

from tiermoe.errors import UserError
from tiermoe.models.fp32_params import Fp32Plan
from tiermoe.moe.experts import ResidentExperts

from .config import Glm5NextConfig, load_config
from .model import Glm5NextModel, MTPLayer
from .weights import Checkpoint

PREFIXES = ("model.language_model.", "model.", "language_model.model.", "")

# Kept in fp32 at bf16/fp16 when transformers lacks the class (its own list wins otherwise).
_FP32_SUFFIXES = (
    "e_score_correction_bias", "gate.weight", "conv1d.weight", "dt_bias", "A_log",
    "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
)

# internal (transformers in-memory) name -> hub name, applied to the part after "layers.{i}.".
_HUB_RENAMES = (
    (re.compile(r"^self_attn\.forget_gate\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$"), r"self_attn.\1"),
    (re.compile(r"^(attn|ffn)_hc\.(fn|base|scale)$"), r"hc_\1_\2"),
)


def detect_prefix(ck: Checkpoint) -> str:
    for p in PREFIXES:
        if f"{p}embed_tokens.weight" in ck:
            return p
    raise UserError(f"{ck.source}: missing tensor 'model.language_model.embed_tokens.weight'")


def layer_key_candidates(prefix: str, layer: int, rest: str) -> list[str]:
    """Checkpoint keys (hub first) for parameter `rest` of decoder layer `layer`."""
    out = []
    for pat, repl in _HUB_RENAMES:
        if pat.match(rest):
            out.append(f"{prefix}layers.{layer}.{pat.sub(repl, rest)}")
    out.append(f"{prefix}layers.{layer}.{rest}")
    return out


def expert_weight_keys(prefix: str, layer: int, expert: int) -> dict[str, str]:
    """Hub-layout keys of one routed expert ({gate_proj, up_proj, down_proj} -> key); each is
    [I, H], [I, H], [H, I]. This is what an expert store packs."""
    base = f"{prefix}layers.{layer}.mlp.experts.{expert}"
    return {p: f"{base}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}


def _param_tensor(ck: Checkpoint, cfg: Glm5NextConfig, prefix: str, name: str) -> torch.Tensor:
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings:
            return ck.get(f"{prefix}embed_tokens.weight")
        return ck.first("lm_head.weight", f"{prefix}lm_head.weight", "language_model.lm_head.weight")
    if name in ("embed_tokens.weight", "norm.weight"):
        return ck.get(prefix + name)
    if name.startswith("mtp."):
        layer, rest = cfg.mtp_layer_idx, name[len("mtp."):]
    else:
        m = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if m is None:
            raise RuntimeError(f"unmapped parameter {name}")
        layer, rest = int(m.group(1)), m.group(2)
    if rest == "self_attn.conv1d.weight":
        fused = f"{prefix}layers.{layer}.{rest}"
        if fused in ck:
            return ck.get(fused)
        parts = [ck.get(f"{prefix}layers.{layer}.self_attn.{c}_conv1d.weight") for c in "qkv"]
        return torch.cat(parts, dim=0)
    return ck.first(*layer_key_candidates(prefix, layer, rest))


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def load_expert_layer(
    ck: Checkpoint, prefix: str, layer: int, n_experts: int, dtype: torch.dtype, device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) of one MoE layer, from either key layout."""
    fused = f"{prefix}layers.{layer}.mlp.experts.gate_up_proj"
    if fused in ck:
        return (ck.get(fused).to(device=device, dtype=dtype),
                ck.get(f"{prefix}layers.{layer}.mlp.experts.down_proj").to(device=device, dtype=dtype))
    gate_up, down = [], []
    for e in range(n_experts):
        keys = expert_weight_keys(prefix, layer, e)
        gate_up.append(torch.cat([ck.get(keys["gate_proj"]), ck.get(keys["up_proj"])], dim=0))
        down.append(ck.get(keys["down_proj"]))
    return (torch.stack(gate_up).to(device=device, dtype=dtype), torch.stack(down).to(device=device, dtype=dtype))


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    expert_backend=None, mtp: bool = True,
) -> Glm5NextModel:
    """Build the model from `model_dir` (config.json + safetensors).

    expert_backend: an ExpertBackend serving routed experts (e.g. the tiered store); when None,
    every routed expert is loaded resident. mtp: load the MTP layer when the config declares
    one (num_nextn_predict_layers > 0). A missing tensor is a one-line UserError."""
    cfg = load_config(model_dir)
    ck = Checkpoint(model_dir)
    prefix = detect_prefix(ck)
    with_mtp = mtp and cfg.num_nextn_predict_layers > 0
    with torch.device("meta"):
        model = Glm5NextModel(cfg, with_mtp=with_mtp)
    keeps_fp32 = Fp32Plan(model_dir, "glm5_next", dtype, _FP32_SUFFIXES)
    for name, p in list(model.named_parameters()):
        t = _param_tensor(ck, cfg, prefix, name)
        if tuple(t.shape) != tuple(p.shape):
            raise UserError(f"{ck.source}: tensor for '{name}' has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        _set_param(model, name, t.to(device=device, dtype=torch.float32 if keeps_fp32(name) else dtype).clone())
    if expert_backend is None:
        expert_backend = ResidentExperts(cfg.swiglu_limit)
        for m in model.moe_layers():
            weights = load_expert_layer(ck, prefix, m.layer, cfg.n_routed_experts, dtype, device)
            expert_backend.add_layer(m.layer, *weights)
    model.set_expert_backend(expert_backend)
    model.checkpoint_prefix = prefix
    model.dtype, model.device = dtype, torch.device(device)
    if model.device.type == "cuda":
        model.fuse_projections()
    return model.eval()


def attach_mtp(model: Glm5NextModel, model_dir: str | Path) -> bool:
    """Load the MTP layer of `model_dir` into a trunk loaded with `mtp=False` (the serving
    engine does this only when speculative decoding is asked for). Its routed experts come
    from the checkpoint when the model's experts are resident, else through the model's
    expert backend (a packed store holds the MTP layer's experts like any other layer's).
    Returns False when the checkpoint has no MTP layer."""
    cfg: Glm5NextConfig = model.cfg
    if model.mtp is not None:
        return True
    if not cfg.num_nextn_predict_layers:
        return False
    model_dir = Path(model_dir)
    ck = Checkpoint(model_dir)
    prefix = detect_prefix(ck)
    dtype, device = model.dtype, model.device
    layer = cfg.mtp_layer_idx
    backend = model.expert_backend
    if not isinstance(backend, ResidentExperts):
        manifest = model_dir / "manifest.json"
        packed = json.loads(manifest.read_text()).get("moe_layers", []) if manifest.is_file() else []
        if layer not in packed:
            raise UserError(f"{model_dir}: the expert store has no experts for the MTP layer {layer}; "
                            "re-pack from a checkpoint that includes them")
    with torch.device("meta"):
        mtp = MTPLayer(cfg)
    keeps_fp32 = Fp32Plan(model_dir, "glm5_next", dtype, _FP32_SUFFIXES)
    for name, p in list(mtp.named_parameters()):
        t = _param_tensor(ck, cfg, prefix, f"mtp.{name}")
        if tuple(t.shape) != tuple(p.shape):
            raise UserError(f"{ck.source}: tensor for 'mtp.{name}' has shape {tuple(t.shape)}, "
                            f"expected {tuple(p.shape)}")
        _set_param(mtp, name, t.to(device=device, dtype=torch.float32 if keeps_fp32(name) else dtype).clone())
    if isinstance(backend, ResidentExperts):
        backend.add_layer(layer, *load_expert_layer(ck, prefix, layer, cfg.n_routed_experts, dtype, device))
    mtp.mlp.backend = backend
    model.mtp = mtp.eval()
    if model.device.type == "cuda":
        model.fuse_projections()
    return True
