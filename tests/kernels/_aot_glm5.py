"""The ahead-of-time compile scenarios of glm5_next's kernels (mhc_mix, kda_conv_step and kda_recurrent_step,
hc_mix_coefficients, hc_collapse_norm, hc_post, rms_norm, clamped_swiglu, sigmoid_topk_route and
sigmoid_topk_route_from_hidden, dsa_pool_scores and dsa_select), imported by _aot_compile.py: each calls the
package's wrappers under a `Recorder` tag (see there) with glm5_next's real sizes, so every launch configuration
those wrappers make is compiled for the targets without a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiermoe.kernels.triton.dsa_decode import dsa_pool_scores, dsa_select
from tiermoe.kernels.triton.kda_decode import kda_conv_step, kda_recurrent_step
from tiermoe.kernels.triton.mhc import mhc_mix
from tiermoe.kernels.triton.mhc_fused import hc_collapse_norm, hc_mix_coefficients, hc_post
from tiermoe.kernels.triton.norm import clamped_swiglu, rms_norm
from tiermoe.kernels.triton.router import sigmoid_topk_route, sigmoid_topk_route_from_hidden

if TYPE_CHECKING:
    from _aot_compile import Recorder


def mhc(rec: Recorder) -> None:
    """The mHC mixing coefficients (accurate exp, IEEE division: what a CUDA device compiles) for glm5_next's 4
    streams, the widest supported (8) and a padded width (3), 20 Sinkhorn iterations; the token count sets only
    the grid, so one token stands for every step."""
    for n in (4, 8, 3):
        width = (2 + n) * n
        with rec.tagged(f"mhc N{n}"):
            mhc_mix(torch.zeros(1, width), torch.zeros(width), torch.ones(3), n, 20, 1e-6)


def kda_decode(rec: Recorder) -> None:
    """The KDA decode step at glm5_next's size (3C = 24576 channels, K = 4; 64 heads of 128, bf16), both forget
    gate forms, and a padded head dim (24); the batch sets only the grid, so one token stands for every step."""
    for h, d in ((64, 128), (2, 24)):
        c = h * d
        ids = torch.zeros(1, dtype=torch.long)
        with rec.tagged(f"kda conv C{c}"):
            kda_conv_step(torch.zeros(1, 3 * c, dtype=torch.bfloat16), torch.zeros(1, 3 * c, 3, dtype=torch.bfloat16),
                          ids, torch.zeros(3 * c, 1, 4))
        q = torch.zeros(1, h, d, dtype=torch.bfloat16)
        for lower_bound in (-5.0, None):
            with rec.tagged(f"kda recurrent H{h} d{d} lower_bound {lower_bound}"):
                kda_recurrent_step(q, q, q, q.view(1, c), torch.zeros(c), torch.zeros(h), lower_bound,
                                   torch.zeros(1, h, dtype=torch.bfloat16), q.view(1, c), torch.zeros(1, h, d, d), ids,
                                   torch.ones(d, dtype=torch.bfloat16), 1e-5)


def mhc_fused(rec: Recorder) -> None:
    """The fused mHC kernels around each sub-block (the mixing coefficients from the streams: split-K projection
    partials + the mixing kernel reducing them, glm5_next's size with its bf16 fn only, the kernel's other form is
    mhc's; collapse + RMSNorm, spread + mix) and glm5_next's
    RMSNorm and clamped SwiGLU (accurate exp, IEEE division, libdevice rsqrt: what a CUDA device compiles): bf16
    at glm5_next's full width (4 streams of 4096), fp32 at a padded one (3 streams of 80); RMSNorm also on the
    strided 512-wide latent slice of kv_a_layernorm, 1536-wide q_a rows and with an fp32 weight. The token
    count sets only the grid, so two tokens stand for every step."""
    for dtype, n, d in ((torch.bfloat16, 4, 4096), (torch.float32, 3, 80)):
        streams = torch.zeros(2, n, d, dtype=dtype)  # [T, N, D]
        pre, post, comb = torch.ones(2, n), torch.ones(2, n), torch.ones(2, n, n)
        weight = torch.ones(d, dtype=dtype)
        with rec.tagged(f"mhc_fused {dtype} N{n} D{d}"):
            hc_collapse_norm(streams, pre, weight, 1e-6)
            hc_post(streams[:, 0].contiguous(), streams, post, comb)
            rms_norm(streams[:, 0].contiguous(), weight, 1e-6)
            clamped_swiglu(streams[:, 0].contiguous(), streams[:, 1].contiguous(), 10.0)
    with rec.tagged("mhc coefficients bf16 N4 D4096"):
        fn = torch.zeros(24, 4 * 4096, dtype=torch.bfloat16)  # [(2+N)*N, N*D] in the model's dtype
        hc_mix_coefficients(torch.zeros(2, 4, 4096, dtype=torch.bfloat16), fn, 1e-6, torch.zeros(24), torch.ones(3), 4,
                            20, 1e-6)
    with rec.tagged("rms_norm bf16 strided 512, 1536, fp32 weight"):
        latent = torch.zeros(2, 512 + 64, dtype=torch.bfloat16)
        rms_norm(latent[:, :512], torch.ones(512, dtype=torch.bfloat16), 1e-6)
        rms_norm(torch.zeros(2, 1536, dtype=torch.bfloat16), torch.ones(1536, dtype=torch.bfloat16), 1e-6)
        rms_norm(torch.zeros(2, 4096, dtype=torch.bfloat16), torch.ones(4096), 1e-6)


def router(rec: Recorder) -> None:
    """The sigmoid noaux_tc routing (accurate exp, IEEE division: what a CUDA device compiles), each switch of the
    routing kernel once: on logits, glm5_next's 288 experts top-8 in one group (renormalised), a DeepSeek-V3 layer
    (256 experts, 8 groups keeping 4; not renormalised) and a small grouped one (64 experts, 8 groups keeping 4,
    top-6) with replayed ids; from the hidden states (split-K projection partials, then the routing kernel adding
    them) at GLM-5.3's size: bf16 x [T, 4096], the fp32 gate [288, 4096]. The token count sets only the grid, so
    one token stands for every step."""
    ids = torch.zeros(1, 6, dtype=torch.long)
    for e, k, groups, keep, norm, replay in ((288, 8, 1, 1, True, None), (256, 8, 8, 4, False, None),
                                             (64, 6, 8, 4, True, ids)):
        with rec.tagged(f"router E{e} top{k} G{groups}/{keep}"):
            sigmoid_topk_route(torch.zeros(1, e), torch.zeros(e), k, groups, keep, norm, 2.5, replay)
    with rec.tagged("router from hidden bf16 H4096 E288 top8"):
        sigmoid_topk_route_from_hidden(torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(288, 4096),
                                       torch.zeros(288), 8, 1, 1, True, 2.5)


def dsa_decode(rec: Recorder) -> None:
    """The DSA indexer's decode selection (accurate exp, IEEE division: what a CUDA device compiles) at
    glm5_next's size (32 heads of 128, 16-token pools, the best 128 pools, bf16 rows, tail on) for a table of
    16384 positions (1024 pools: the serving default's context; a table's pool count is a constexpr, and the
    selection's sort network grows with it, so the 65536-position maximum is compiled where it runs, not here,
    where it costs minutes of compile time for the same code); a padded shape (3 heads of 24, 3-token pools, fp32
    rows, no tail) with fewer pools than k. The batch sets only the grid, so one sequence stands for every step."""
    for nh, d, p, k, lmax, dtype, tail in ((32, 128, 16, 128, 16384, torch.bfloat16, True),
                                           (3, 24, 3, 4, 9, torch.float32, False)):
        lens = torch.ones(1, dtype=torch.int32)
        with rec.tagged(f"dsa decode H{nh} d{d} P{p} k{k} L{lmax} {str(dtype)[6:]} tail {tail}"):
            scores = dsa_pool_scores(torch.zeros(1, nh, d, dtype=dtype), torch.zeros(1, nh),
                                     torch.zeros(64, 2 * d, dtype=dtype), torch.zeros(1, lmax, dtype=torch.long),
                                     lens, torch.zeros(p, d, dtype=dtype), p)
            dsa_select(scores, lens, k, p, tail, k * p + (p - 1 if tail else 0))
