"""Small building blocks shared by the glm5_next layers: norms, clamped SwiGLU, mHC.

Every function mirrors the dtype handling of transformers' `glm5_next` so that fp32 results
agree to rounding and bf16 results agree to bf16 rounding: norms compute in fp32 and cast back
before the weight multiply; mHC mixing weights are computed in fp32 from fp32 `base`/`scale`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Weighted RMSNorm: fp32 statistics, result cast to the input dtype, then the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): GLM-5.3's swiglu_limit, applied to the
    dense MLPs, the shared expert and every routed expert alike."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MLP(nn.Module):
    """Dense SwiGLU MLP with the swiglu_limit clamp (dense layers and the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection (mHC) around one sub-block.

    The residual is `hc_mult` streams per token ([T, N, D]). `pre` collapses them into the
    sub-block input, `post` spreads the sub-block output back over the streams and `comb`
    (made doubly stochastic by Sinkhorn iterations) mixes the old streams into the new ones.
    """

    def __init__(self, hc_mult: int, hidden: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, D])."""
        t, n = streams.shape[0], self.n
        flat = unweighted_rms_norm(streams.reshape(t, -1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())  # [T, (2+N)*N]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out [T, D], residual [T, N, D] -> new streams [T, N, D]."""
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual
        )
