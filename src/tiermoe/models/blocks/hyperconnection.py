"""Manifold-constrained hyper-connections (mHC): a widened residual of several streams.

Instead of one residual vector per token the model carries `hc_mult` streams ([T, N, D]). Around
each sub-block (attention, FFN) learned per-token weights collapse the streams into the
sub-block input, spread its output back over them and mix the old streams into the new ones
through a matrix made doubly stochastic by Sinkhorn iterations, which keeps the residual's
scale bounded however deep the stack. Any family with mHC residuals (glm5_next: 4 streams,
20 iterations) builds it from plain sizes.

Dtype handling mirrors transformers' `glm5_next`: mixing weights are computed in fp32 from the
fp32 `base`/`scale` parameters, then cast to the residual's dtype for the mix. On a CUDA device
(with no gradient to carry) each sub-block's connection is four Triton launches. Two give the mixing
weights (kernels/triton/mhc_fused.py's hc_mix_coefficients): the first splits each token's flattened
streams into slices over many programs, each reading its columns of the fp32 projection weight and
writing partial dot products and a partial sum of squares; the second (kernels/triton/mhc.py) adds the
partials in a fixed order, applies the flat RMS norm's scale and runs the gates, softmax and Sinkhorn
loop (~130 launches in torch). Not a flat norm kernel then cuBLAS: that is two launches more, and
cuBLAS's fp32 GEMV rounds differently for different row counts, whereas here a token's coefficients do
not depend on the batch around it, so speculative decoding's verify steps compute the coefficients plain
decoding does. The other two launches
(mhc_fused.py) are the collapse + the sub-block's RMSNorm, and the spread + mix. Eager torch would issue
~150 tiny kernels per sub-block, each a few microseconds at decode even replayed from a CUDA graph.
Elsewhere the plain-torch twins run (kernels/reference_mhc.py: the code of transformers' glm5_next,
unchanged, so CPU results are bit for bit the reference's).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tiermoe.kernels.reference_mhc import hc_collapse_norm_ref, hc_mix_coefficients_ref, hc_post_ref
from tiermoe.models.blocks.common import device_kernels



class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection (mHC) around one sub-block.

    The residual is `hc_mult` streams per token ([T, N, D]). `pre_norm` collapses them into the
    sub-block input (and applies the sub-block's input RMSNorm), `post` spreads the sub-block
    output back over the streams and `comb` (made doubly stochastic by Sinkhorn iterations)
    mixes the old streams into the new ones.
    """

    def __init__(self, hc_mult: int, hidden: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self._fn32: tuple[tuple, torch.Tensor] | None = None  # (fn's identity, fn in fp32)

    def _fn_fp32(self) -> torch.Tensor:
        """fn [(2+N)*N, N*D] in fp32 for the twin's projection. In a bf16 model on a CPU the exact cast is kept
        between calls while fn is unchanged (same storage, same version): recast, it would be one more launch and
        a 3 MB write in each of glm5_next's 90 sub-blocks a token. On a CUDA device the kernels read fn as it
        is (each value widened exactly) and the twin runs only for prefill chunks (reference_ops), where a cast
        per call is small beside the chunk's work, so no copy is kept (270 MB of HBM at full width)."""
        fn = self.fn
        if fn.dtype == torch.float32 or fn.is_cuda or (torch.is_grad_enabled() and fn.requires_grad):
            return fn.float()
        key = (fn.device, fn.data_ptr(), fn._version)
        if self._fn32 is None or self._fn32[0] != key:
            self._fn32 = (key, fn.detach().float())
        return self._fn32[1]

    def coefficients(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (pre [T, N], post [T, N], comb [T, N, N]), all fp32: the flat RMS norm of the
        streams, its projection by fn in fp32 and the gates + Sinkhorn mix (two launches on CUDA, reading fn in
        its own dtype: half the bytes of an fp32 copy in a bf16 model, the same products)."""
        args = (self.norm_eps, self.base, self.scale, self.n, self.iters, self.hc_eps)
        if device_kernels(streams, self.fn, self.base, self.scale):
            from tiermoe.kernels.triton.mhc_fused import hc_mix_coefficients
            return hc_mix_coefficients(streams, self.fn, *args)
        return hc_mix_coefficients_ref(streams, self._fn_fp32(), *args)

    def pre_norm(self, streams: torch.Tensor, norm_weight: torch.Tensor,
                 norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D], the sub-block's input RMSNorm (weight [D], eps) -> (post [T, N] fp32,
        comb [T, N, N] fp32, normed [T, D]): the collapsed streams, already normalised, in one launch on CUDA."""
        pre, post, comb = self.coefficients(streams)
        if device_kernels(streams, pre, norm_weight):
            from tiermoe.kernels.triton.mhc_fused import hc_collapse_norm
        else:
            hc_collapse_norm = hc_collapse_norm_ref
        return post, comb, hc_collapse_norm(streams, pre, norm_weight, norm_eps)

    @staticmethod
    def post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out [T, D], residual [T, N, D] -> new streams [T, N, D] (the kernel needs out in the residual's dtype)."""
        if device_kernels(out, residual, post, comb) and out.dtype == residual.dtype:
            from tiermoe.kernels.triton.mhc_fused import hc_post
        else:
            hc_post = hc_post_ref
        return hc_post(out, residual, post, comb)
