"""Manifold-constrained hyper-connections (mHC): a widened residual of several streams.

Instead of one residual vector per token the model carries `hc_mult` streams ([T, N, D]). Around
each sub-block (attention, FFN) learned per-token weights collapse the streams into the
sub-block input, spread its output back over them and mix the old streams into the new ones
through a matrix made doubly stochastic by Sinkhorn iterations, which keeps the residual's
scale bounded however deep the stack. Any family with mHC residuals (glm5_next: 4 streams,
20 iterations) builds it from plain sizes.

Dtype handling mirrors transformers' `glm5_next`: mixing weights are computed in fp32 from the
fp32 `base`/`scale` parameters, then cast to the residual's dtype for the mix. On a CUDA device
the mixing weights come from one Triton kernel (kernels/triton/mhc.py: the Sinkhorn loop is
otherwise ~130 launches per sub-block), elsewhere from its plain-torch twin
(kernels.reference.mhc_mix_ref: the code of transformers' glm5_next, unchanged).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiermoe.kernels.reference import mhc_mix_ref


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / rms(x) without a weight: the norm in front of the mHC mixing projection."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


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
        # on CUDA one fused launch instead of ~130 tiny ones; the kernel carries no gradient, so
        # anything that trains through here (mix needs a gradient) takes the twin
        if mix.is_cuda and not mix.requires_grad:
            from tiermoe.kernels.triton.mhc import mhc_mix
        else:
            mhc_mix = mhc_mix_ref
        pre, post, comb = mhc_mix(mix, self.base, self.scale, n, self.iters, self.hc_eps)  # [T,N] [T,N] [T,N,N]
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out [T, D], residual [T, N, D] -> new streams [T, N, D]."""
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual
        )
