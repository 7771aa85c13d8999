"""Parameters kept in fp32 follow the installed transformers, so bf16 stays exact.

transformers 5.17 creates the glm4_moe / deepseek_v3 router weight in the default dtype and so
rounds it to bf16 at load; 5.24 creates it in fp32 and lists it in `_keep_in_fp32_modules_strict`.
A router weight on the other side of that choice flips expert picks (top-1 0.988 instead of 1.0
on the tiny glm4_moe). Both behaviours are exercised here; the older one by patching the classes.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from tiermoe.eval.parity import run_parity
from tiermoe.models.fp32_params import Fp32Plan, reference_class
from tiermoe.models.loader import load_model

ROUTERS = {"glm4_moe": ("glm4_moe", "Glm4MoeTopkRouter"), "deepseek_v3": ("deepseek_v3", "DeepseekV3TopkRouter")}


def emulate_router_in_model_dtype(monkeypatch, arch: str) -> None:
    """Make the installed reference behave like transformers 5.17 for `arch`."""
    package, router_name = ROUTERS[arch]
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    router = getattr(module, router_name)
    original_init = router.__init__

    def init(self, config):
        original_init(self, config)
        self.weight = nn.Parameter(torch.zeros(self.weight.shape))  # default dtype, as in 5.17

    monkeypatch.setattr(router, "__init__", init)
    for cls in reference_class(arch).__mro__:  # where the list is defined (the PreTrainedModel base)
        if "_keep_in_fp32_modules_strict" in vars(cls):
            monkeypatch.setattr(cls, "_keep_in_fp32_modules_strict", ["e_score_correction_bias"])


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("router_dtype", ["float32", "bfloat16"])
def test_bf16_parity_follows_reference_router_dtype(arch, router_dtype, tiny_dir, monkeypatch):
    if router_dtype == "bfloat16":
        emulate_router_in_model_dtype(monkeypatch, arch)
    path = tiny_dir(arch)
    gate = load_model(path, dtype=torch.bfloat16).moe_layers()[0].gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    reference = reference_class(arch).from_pretrained(str(path), dtype=torch.bfloat16)
    ref_dtype = next(p.dtype for n, p in reference.named_parameters() if n.endswith("mlp.gate.weight"))
    assert gate.weight.dtype == ref_dtype == getattr(torch, router_dtype)
    result = run_parity(str(path), None, "cpu", "bfloat16", arch=arch, fp32_floor=False)
    assert result["top1"] == 1.0 and result["max_abs_logit_diff"] == 0.0


def test_plan_names_and_fallback(tiny_dir):
    plan = Fp32Plan(tiny_dir("glm4_moe"), "glm4_moe", torch.bfloat16)
    assert plan("model.layers.1.mlp.gate.e_score_correction_bias")
    assert not plan("model.layers.1.mlp.shared_experts.gate_proj.weight")
    assert not plan("model.layers.0.self_attn.q_proj.weight")
    assert not Fp32Plan(tiny_dir("glm4_moe"), "glm4_moe", torch.float32)("model.layers.1.mlp.gate.weight")
    # Families the reference keeps entirely in the load dtype (qwen3_moe's router is bf16).
    qwen_plan = Fp32Plan(tiny_dir("qwen3_moe"), "qwen3_moe", torch.bfloat16, ("gate.weight",))
    assert not qwen_plan("model.layers.0.mlp.gate.weight")
    # No class in transformers for the type: the family's own list.
    fallback = Fp32Plan(tiny_dir("glm4_moe"), "no_such_model_type", torch.bfloat16, ("gate.weight",))
    assert fallback("mlp.gate.weight") and not fallback("mlp.up_proj.weight")
