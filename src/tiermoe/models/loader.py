"""Load a Hugging Face checkpoint (config.json + sharded safetensors) into the generic decoder.

Tensors are read one at a time from memory-mapped safetensors files straight into their final
dtype and device, so peak memory is the model plus one tensor (never a second full copy).
Routed experts are stacked per layer for the resident backend, or left on disk when a
tiered expert store serves them.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from tiermoe.errors import UserError
from tiermoe.models.decoder import CausalLM
from tiermoe.models.fp32_params import Fp32Plan
from tiermoe.models.registry import family_module, load_hf_config
from tiermoe.models.spec import ModelSpec
from tiermoe.moe.experts import ExpertBackend, ResidentExperts

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}

# Kept in fp32 when transformers has no class for the model type (its own lists win otherwise).
FALLBACK_FP32 = ("e_score_correction_bias", "gate.weight")


def parse_dtype(name: str | None, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    if name is None or name == "auto":
        return default
    if name not in DTYPES:
        raise UserError(f"--dtype: unsupported value '{name}' (choose bfloat16, float16 or float32)")
    return DTYPES[name]


def checkpoint_dtype(hf_config) -> torch.dtype:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value), torch.bfloat16)


def load_spec(model_dir: str | Path) -> ModelSpec:
    hf_config = load_hf_config(model_dir)
    module = family_module(hf_config.model_type, str(Path(model_dir) / "config.json"))
    return module.build_spec(hf_config, str(Path(model_dir) / "config.json"))


class TensorIndex:
    """key -> file for every tensor of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: str | Path, stack: ExitStack):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"{model_dir}: no *.safetensors weight files found")
        index_path = model_dir / "model.safetensors.index.json"
        if index_path.is_file():
            wanted = set(json.loads(index_path.read_text()).get("weight_map", {}).values())
            missing = sorted(w for w in wanted if not (model_dir / w).is_file())
            if missing:
                raise UserError(f"{model_dir / missing[0]}: not found (listed in {index_path.name})")
        self.handles = {}
        self.key_file: dict[str, Path] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
            except Exception as exc:
                raise UserError(f"{f}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
            self.handles[f] = handle
            for key in handle.keys():
                self.key_file[key] = f
        self.model_dir = model_dir

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def get(self, key: str, dtype: torch.dtype | None, device) -> torch.Tensor:
        if key not in self.key_file:
            raise UserError(f"{self.model_dir}: missing tensor '{key}' in the *.safetensors files")
        t = self.handles[self.key_file[key]].get_tensor(key)
        return t.to(device=device, dtype=dtype or t.dtype)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    expected = getattr(owner, attr).shape
    if tuple(tensor.shape) != tuple(expected):
        raise UserError(f"tensor '{name}': shape {tuple(tensor.shape)} does not match config ({tuple(expected)})")
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))


def _load_resident_experts(spec: ModelSpec, index: TensorIndex, dtype, device) -> ResidentExperts:
    moe = spec.moe
    backend = ResidentExperts(moe.swiglu_limit if moe else None)
    if moe is None:
        return backend
    e, i_, h = moe.num_experts, moe.intermediate_size, spec.hidden_size
    for layer in spec.moe_layers:
        fused = f"model.layers.{layer}.{spec.mlp_name}.experts.gate_up_proj"
        if fused in index:
            gate_up = index.get(fused, dtype, device)
            down = index.get(f"model.layers.{layer}.{spec.mlp_name}.experts.down_proj", dtype, device)
        else:
            gate_up = torch.empty(e, 2 * i_, h, dtype=dtype, device=device)  # [E, 2I, H]
            down = torch.empty(e, h, i_, dtype=dtype, device=device)  # [E, H, I]
            for x in range(e):
                gk, uk, dk = spec.expert_keys(layer, x)
                gate_up[x, :i_] = index.get(gk, dtype, device)
                gate_up[x, i_:] = index.get(uk, dtype, device)
                down[x] = index.get(dk, dtype, device)
        backend.add_layer(layer, gate_up, down)
    return backend


def load_model(
    model_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    expert_backend: ExpertBackend | None = None,
) -> CausalLM:
    """Build the family's model and fill it from the checkpoint.

    expert_backend: an ExpertBackend serving routed experts (a store backend, moe/backends.py);
    when None every expert is loaded resident.
    """
    hf_config = load_hf_config(model_dir)
    module = family_module(hf_config.model_type, str(Path(model_dir) / "config.json"))
    if hasattr(module, "build_model"):  # families with their own structure (glm5_next)
        dtype = dtype or checkpoint_dtype(hf_config)
        return module.build_model(model_dir, hf_config, device=device, dtype=dtype, expert_backend=expert_backend)
    spec = module.build_spec(hf_config, str(Path(model_dir) / "config.json"))
    dtype = dtype or checkpoint_dtype(spec.hf_config)
    model = CausalLM(spec)
    with ExitStack() as stack:
        index = TensorIndex(model_dir, stack)
        keeps_fp32 = Fp32Plan(model_dir, hf_config.model_type, dtype, FALLBACK_FP32)
        for name, param in list(model.named_parameters()):
            _assign(model, name, index.get(name, torch.float32 if keeps_fp32(name) else dtype, device))
        if expert_backend is None:
            expert_backend = _load_resident_experts(spec, index, dtype, device)
    model.rotary.to(device)
    _install(model, expert_backend, dtype, device)
    return model.eval()


def _install(model: CausalLM, backend: ExpertBackend, dtype: torch.dtype, device) -> None:
    """The loaded model's serving state, set in one place: every MoE layer computes its routed
    experts through `backend` (told the layers once, `attach`), and the engine reads the
    backend, dtype and device from the model."""
    layers = model.moe_layers()
    for moe_layer in layers:
        moe_layer.backend = backend
    backend.attach(layers)
    model.expert_backend = backend
    model.dtype = dtype
    model.device = torch.device(device)
