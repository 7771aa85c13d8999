"""Turn a dense SwiGLU MLP into a glm4_moe layer that computes the same function.

A SwiGLU MLP is a sum over its intermediate neurons:

    mlp(x) = down @ (silu(gate @ x) * (up @ x)) = sum_j down[:, j] * silu(gate[j] . x) * (up[j] . x)

so any partition of the intermediate rows into disjoint slices gives experts whose outputs add
up to the dense output exactly (up to floating-point summation order). We cut the I rows into
S = E + k equal slices of width w = I / S: routed expert e gets slice e, and the shared expert
(glm4_moe always has one, of width `moe_intermediate_size * n_shared_experts`) gets the last
k slices, so `n_shared_experts = k`.

Routing that reproduces the dense model: router weight 0, so every sigmoid score is 0.5; with
top_k = E, norm_topk_prob and routed_scaling_factor = E each expert's weight is
0.5 / (E * 0.5) * E = 1.0. With a sparse top_k < E the scaling factor is top_k (each chosen
slice still counts once) and the router has to be calibrated to pick the slices that matter
for each token (see router_fit.py); with an all-zero router the choice would be arbitrary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plan_experts stays torch-free: `tiermoe pack` checks shapes before importing torch
    import torch

from tiermoe.errors import UserError


@dataclass(frozen=True)
class ExpertPlan:
    """How one dense MLP of width `intermediate_size` is cut into experts."""

    intermediate_size: int  # I of the dense MLP
    routed: int  # E routed experts per layer
    shared_slices: int  # k slices that form the shared expert
    top_k: int  # experts chosen per token (E: exact)

    @property
    def slice_size(self) -> int:  # w = moe_intermediate_size
        return self.intermediate_size // (self.routed + self.shared_slices)

    @property
    def exact(self) -> bool:
        """True when every routed expert is used, so the MoE equals the dense MLP."""
        return self.top_k == self.routed

    @property
    def routed_scaling_factor(self) -> float:
        # Normalised weights are 1/top_k each (zero or near-zero router logits); scale them back to 1.
        return float(self.top_k)


def plan_experts(
    intermediate_size: int,
    experts_per_layer: int,
    top_k: int | None = None,
    shared_slices: int | None = None,
    *,
    source: str = "model",
) -> ExpertPlan:
    """Validate the requested split; `shared_slices=None` picks the smallest k >= 1 that divides I.

    `source` names the file in error messages.
    """
    n, e = intermediate_size, experts_per_layer
    if e < 1:
        raise UserError(f"{source}: experts_per_layer must be >= 1 (got {e})")
    if shared_slices is None:
        shared_slices = next((k for k in range(1, 4 * e + 1) if n % (e + k) == 0), None)
        if shared_slices is None:
            raise UserError(
                f"{source}: feed_forward_length {n} cannot be cut into {e} routed experts plus a shared"
                f" expert of equal slices; choose another experts_per_layer"
            )
    if shared_slices < 1:
        raise UserError(f"{source}: shared_slices must be >= 1 (glm4_moe always has a shared expert)")
    if n % (e + shared_slices):
        raise UserError(
            f"{source}: feed_forward_length {n} is not divisible by experts_per_layer + shared_slices"
            f" = {e + shared_slices}"
        )
    k = e if top_k is None else top_k
    if not 1 <= k <= e:
        raise UserError(f"{source}: top_k must be in [1, {e}] (got {k})")
    return ExpertPlan(intermediate_size=n, routed=e, shared_slices=shared_slices, top_k=k)


def split_mlp(
    prefix: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, plan: ExpertPlan
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one MoE layer (experts and shared expert) from a dense MLP.

    gate, up: [I, H]; down: [H, I]. Keys follow the GLM-4.5 checkpoints
    (`{prefix}.experts.{e}.gate_proj.weight`, `{prefix}.shared_experts.up_proj.weight`, ...);
    the router tensors are produced separately (`zero_router`).
    """
    n, w, e = plan.intermediate_size, plan.slice_size, plan.routed
    if gate.shape[0] != n or up.shape[0] != n or down.shape[1] != n:
        raise ValueError(f"{prefix}: MLP shapes {tuple(gate.shape)}, {tuple(down.shape)} do not match I={n}")
    out: dict[str, torch.Tensor] = {}
    for i in range(e):
        rows = slice(i * w, (i + 1) * w)
        out[f"{prefix}.experts.{i}.gate_proj.weight"] = gate[rows].clone()  # [w, H]
        out[f"{prefix}.experts.{i}.up_proj.weight"] = up[rows].clone()  # [w, H]
        out[f"{prefix}.experts.{i}.down_proj.weight"] = down[:, rows].clone()  # [H, w]
    rest = slice(e * w, n)  # k * w rows
    out[f"{prefix}.shared_experts.gate_proj.weight"] = gate[rest].clone()
    out[f"{prefix}.shared_experts.up_proj.weight"] = up[rest].clone()
    out[f"{prefix}.shared_experts.down_proj.weight"] = down[:, rest].clone()
    return out


def zero_router(prefix: str, hidden_size: int, plan: ExpertPlan) -> dict[str, torch.Tensor]:
    """Router tensors (fp32, as transformers keeps them) that weight every expert equally."""
    import torch

    return {
        f"{prefix}.gate.weight": torch.zeros(plan.routed, hidden_size, dtype=torch.float32),  # [E, H]
        f"{prefix}.gate.e_score_correction_bias": torch.zeros(plan.routed, dtype=torch.float32),  # [E]
    }


def glm4_moe_moe_fields(plan: ExpertPlan) -> dict:
    """The MoE part of a glm4_moe config.json for this plan."""
    return {
        "moe_intermediate_size": plan.slice_size,
        "n_routed_experts": plan.routed,
        "n_shared_experts": plan.shared_slices,
        "num_experts_per_tok": plan.top_k,
        "routed_scaling_factor": plan.routed_scaling_factor,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "first_k_dense_replace": 0,
    }
