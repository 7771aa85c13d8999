"""Plain-torch twins of the mHC hyper-connection kernels (kernels/triton/mhc.py, kernels/triton/mhc_fused.py).

They are also the CPU path of models/blocks/hyperconnection.py and are written exactly as transformers'
glm5_next computes the hyper-connection (same operations, same order, same dtype casts), so CPU results
stay bit for bit what the reference computes; the kernels are judged against this code. Around one
sub-block the pieces run in this order:

  pre, post, comb = hc_mix_coefficients_ref(streams, fn, ...)   the mixing coefficients, fp32:
      flat = hc_flat_norm_ref(streams)                          fp32 [T, N*D], unweighted RMS norm
      mix  = F.linear(flat, fn.float())                         fp32 [T, (2+N)*N]
      mhc_mix_ref(mix, base, scale, ...)                        sigmoid gates, Sinkhorn-normalised mix
  h     = hc_collapse_norm_ref(streams, pre, w, eps)            collapse to [T, D], then the weighted RMSNorm
  out   = sub_block(h)
  new   = hc_post_ref(out, streams, post, comb)                 spread out over the streams + mix the old ones
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiermoe.kernels.reference_norm import rms_norm_ref


def mhc_mix_ref(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of kernels/triton/mhc.py: mix fp32 [T, (2+N)*N], base fp32 [(2+N)*N], scale fp32 [3] ->
    (pre [T, N], post [T, N], comb [T, N, N]).

    pre and post are sigmoid gates; comb is a softmax made doubly stochastic by `iters` Sinkhorn
    normalisations (the first one columns only), each sum offset by hc_eps."""
    t = mix.shape[0]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_flat_norm_ref(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D] -> fp32 [T, N*D], each token's N*D values in fp32 divided by their root mean square
    (no weight): the input of the mixing projection in hc_mix_coefficients_ref."""
    x = streams.reshape(streams.shape[0], -1).float()  # [T, N*D]
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_mix_coefficients_ref(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float, base: torch.Tensor,
                            scale: torch.Tensor, n: int, iters: int,
                            hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of mhc_fused.hc_mix_coefficients: streams [T, N, D], fn [(2+N)*N, N*D], base fp32 [(2+N)*N],
    scale fp32 [3] -> (pre [T, N], post [T, N], comb [T, N, N]), all fp32.

    The flat norm of the streams, its projection by fn in fp32 (cuBLAS on a GPU, which the kernels replace;
    fn.float() is fn itself when it is fp32 already) and mhc_mix_ref."""
    mix = F.linear(hc_flat_norm_ref(streams, norm_eps), fn.float())  # [T, (2+N)*N]
    return mhc_mix_ref(mix, base, scale, n, iters, hc_eps)


def hc_collapse_norm_ref(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """Twin of mhc_fused.hc_collapse_norm: streams [T, N, D], pre fp32 [T, N], weight [D] -> [T, D].

    The collapse sum_n pre[n] * streams[n] in fp32 (streams index order), rounded to the streams'
    dtype, then the sub-block's weighted RMSNorm (reference_norm.rms_norm_ref)."""
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # [T, D]
    return rms_norm_ref(collapsed, weight, eps)


def hc_post_ref(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Twin of mhc_fused.hc_post: out [T, D], residual [T, N, D], post fp32 [T, N], comb fp32 [T, N, N]
    -> new streams [T, N, D] in the residual's dtype.

    new[i] = post[i] * out + sum_k comb[k, i] * residual[k], with post and comb rounded to the
    residual's dtype first, each product and the mix (fp32 accumulation) rounded, then the sum rounded."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual
    )
