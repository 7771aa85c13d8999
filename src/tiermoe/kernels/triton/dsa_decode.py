"""The DSA indexer's decode-step selection (glm5_next's MLA layers with their own indexer) in two launches.

`DSAIndexer.select_decode` (models/blocks/attention.py) picks, for one query a sequence, the cached tokens its
sparse attention reads: every pool of P tokens of the sequence's block table is scored, the best k pools are
taken by a stable descending sort and expanded to token indices, and the tokens of the query's incomplete
pool are added. In torch that is a [B, Lmax, 2d] row gather and ~60 tiny kernels per layer plus a radix sort
(~21 us): each tiny kernel costs ~1.3-2 us even replayed from a CUDA graph, over 1 ms of a 12 ms decode step
at glm5_next's 11 such layers a token. Here:

  dsa_pool_scores  grid (B, blocks of POOL_BLOCK pools): each program reads its pools' rows straight from the
                   layer's row cache through the block table (no gather copy) and scores them:
                   softmax over the P tokens of gate + ape per channel, cast to the key dtype, the weighted
                   sum of the keys (each product rounded to the key dtype, the sum accumulated in fp32 and
                   rounded once, as torch sums a bf16 tensor), then sum_h w_h * relu(q_h . key / sqrt(d)) in
                   fp32. Pools not complete by the query get float32's lowest value without being read, so
                   the work follows each sequence's length, not the table's.
  dsa_select       grid (B,): the k best pools of a sequence, expanded to the [B, W] index list with the tail
                   tokens at the columns `select_decode` gives them and -1 padding.

Selection order. Each pool gets one int64 key (router.py's `_order_key`): its score's bits mapped to an
integer of the same order (high half), 2**31 - 1 - its index (low half). Keys are distinct, and the
descending key order is torch.sort(descending=True, stable=True)'s order: higher score first, among equal
scores the lower pool first (the masked pools, all float32's lowest, come after every real one in pool order;
-0 ties +0; NaN ranks first, as in torch's sort). `tl.topk` (a bitonic top-k) gives the k largest keys in
order, so the integer result is the twin's exactly.

Numerics of the scores follow the twin's dtype steps (keys in the model dtype, prob cast to it before the
product, fp32 where torch is fp32) with CUDA's accurate expf and IEEE division (libdevice compiled, numpy
under the interpreter), no FMA contraction; the head dot products and the channel sums run in the kernel's
order, not cuBLAS's, so scores differ from the twin's by float32 rounding (a different rounding of one
product may move a bf16 pool key by an ulp): tests/kernels/test_dsa_decode.py compares them with tolerances.

Twins: kernels.reference_dsa.dsa_pool_scores_ref, dsa_select_ref (select_decode's torch code, also the CPU
path). No host synchronisation, no data-dependent shapes: both launches are captured in a decode CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.norm import round_to
from tiermoe.kernels.triton.precise import PRECISE, precise_exp
from tiermoe.kernels.triton.router import NONE_KEY, _order_key, _order_key_index

POOL_BLOCK = 16  # pools per scoring program: q [nh, d] is read once for them (glm5_next: 256 programs for a
# sequence of 65536 tokens, fewer the shorter it is: programs past its complete pools store and leave)
MAX_POOLS = 4096  # pools of one sequence the selection holds in registers (65536 tokens of 16-token pools)
# torch.finfo(torch.float32).min: the score of a pool not yet complete
FLOAT32_MIN: tl.constexpr = tl.constexpr(-3.4028234663852886e38)

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _pool_scores_kernel(q_ptr, w_ptr, rows_ptr, table_ptr, lens_ptr, ape_ptr, out_ptr,
                        row_stride, table_stride, scale, NP,
                        NH: tl.constexpr, D: tl.constexpr, P: tl.constexpr, KEY_DT: tl.constexpr,
                        BH: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, BJ: tl.constexpr,
                        PRECISE: tl.constexpr):
    """Sequence b, pools [j0, j0 + BJ): scores -> out[b, j0 : j0 + BJ] (float32's lowest where incomplete).

    A pool's P rows sit in registers as one [BP, BD] tile each of keys and gates (padded rows and channels
    masked: gates -inf, keys 0), so the softmax over tokens is a reduction over axis 0."""
    b = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BJ
    seen = tl.load(lens_ptr + b).to(tl.int32)  # tokens of the sequence, the query's included
    n_valid = tl.minimum(seen // P, NP)  # pools j with j*P + P - 1 <= seen - 1 (complete by the query)
    h = tl.arange(0, BH)
    c = tl.arange(0, BD)
    t = tl.arange(0, BP)
    jj = j0 + tl.arange(0, BJ)  # [BJ] this program's pools
    scores = tl.full([BJ], FLOAT32_MIN, tl.float32)
    if j0 < n_valid:
        hc = (h[:, None] < NH) & (c[None, :] < D)  # [BH, BD]
        tc = (t[:, None] < P) & (c[None, :] < D)  # [BP, BD]
        q = tl.load(q_ptr + b * (NH * D) + h[:, None] * D + c[None, :], mask=hc, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + b * NH + h, mask=h < NH, other=0.0)  # [BH] fp32
        ape = tl.load(ape_ptr + t[:, None] * D + c[None, :], mask=tc, other=0.0).to(tl.float32)  # [BP, BD]
        for j in range(j0, tl.minimum(n_valid, j0 + BJ)):  # the block's complete pools
            r = tl.load(table_ptr + b * table_stride + j * P + t, mask=t < P, other=0)  # [BP] rows of the pool
            row = rows_ptr + r.to(tl.int64)[:, None] * row_stride + c[None, :]  # [BP, BD]
            key = tl.load(row, mask=tc, other=0.0).to(tl.float32)  # values of KEY_DT
            gate = tl.load(row + D, mask=tc, other=0.0).to(tl.float32) + ape
            gate = tl.where(t[:, None] < P, gate, float("-inf"))
            mx = tl.max(gate, axis=0)  # [BD]
            e = precise_exp(gate - mx[None, :], PRECISE)  # [BP, BD]
            prob = round_to(tl.div_rn(e, tl.sum(e, axis=0)[None, :]), KEY_DT, PRECISE).to(tl.float32)
            prod = round_to(prob * key, KEY_DT, PRECISE).to(tl.float32)  # [BP, BD]
            pool_key = round_to(tl.sum(prod, axis=0), KEY_DT, PRECISE).to(tl.float32)  # [BD]
            s = tl.sum(q * pool_key[None, :], axis=1) * scale  # [BH]
            s = tl.where(s < 0.0, 0.0, s)  # relu
            scores = tl.where(jj == j, tl.sum(w * s, axis=0), scores)
    tl.store(out_ptr + b * NP + jj, scores, mask=jj < NP)


@triton.jit
def _tail_columns(val, col, m, count, base, P: tl.constexpr):
    """Output columns col (any shape) holding val: the query's incomplete-pool tokens base + o where
    o = col - m*P lies in [0, P-1) (-1 past the pool's count tokens), val elsewhere."""
    o = col - m * P
    return tl.where((o >= 0) & (o < P - 1), tl.where(o < count, base + o, -1), val)


@triton.jit
def _select_kernel(scores_ptr, lens_ptr, out_ptr, NP, W,
                   K: tl.constexpr, P: tl.constexpr, TAIL: tl.constexpr,
                   BNP: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr):
    """One program per sequence: scores [NP] -> out [W]. Pool slots r < K hold the r-th best pool's P tokens
    ([BK, BP] tile, column r*P + t); columns from K*P on are the tail or -1 (BR of them)."""
    b = tl.program_id(0).to(tl.int64)
    seen = tl.load(lens_ptr + b).to(tl.int32)  # tokens of the sequence, the query's included
    count = seen % P  # tokens of the query's incomplete pool
    base = seen - count  # its first token
    m = tl.minimum(seen // P, K)  # the pool slot where the tail starts
    if K > 0:
        j = tl.arange(0, BNP)
        v = tl.load(scores_ptr + b * NP + j, mask=j < NP, other=0.0)  # [BNP]
        key = tl.where(j < NP, _order_key(v, j), NONE_KEY)  # [BNP]
        pool = _order_key_index(tl.topk(key, BK))  # [BK] the BK best pools, best first
        r = tl.arange(0, BK)
        t = tl.arange(0, BP)
        col = r[:, None] * P + t[None, :]  # [BK, BP]
        val = tl.where(pool[:, None] < tl.minimum(seen // P, NP), pool[:, None] * P + t[None, :], -1)
        if TAIL:
            val = _tail_columns(val, col, m, count, base, P)
        ok = (r[:, None] < K) & (t[None, :] < P) & (col < W)
        tl.store(out_ptr + b * W + col, val.to(tl.int64), mask=ok)
    col = K * P + tl.arange(0, BR)  # [BR]
    val = tl.full([BR], -1, tl.int32)
    if TAIL:
        val = _tail_columns(val, col, m, count, base, P)
    tl.store(out_ptr + b * W + col, val.to(tl.int64), mask=col < W)


def dsa_pool_scores(q: torch.Tensor, w: torch.Tensor, idx_rows: torch.Tensor, table_rows: torch.Tensor,
                    seq_lens: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """q [B, nh, d], w [B, nh] fp32, idx_rows [S, 2d] (the layer's indexer rows, key | gate; rows of unit
    stride), table_rows [B, Lmax] integer (each position's row), seq_lens [B] (the query's included), ape
    [P, d] -> scores [B, Lmax // P] fp32, one launch; twin: dsa_pool_scores_ref (equal up to fp32 rounding).
    Reads only the rows of complete pools."""
    b, nh, d = q.shape
    if w.shape != (b, nh) or w.dtype != torch.float32:
        raise ValueError(f"w must be float32 [{b}, {nh}], got {w.dtype} {tuple(w.shape)}")
    if idx_rows.dim() != 2 or idx_rows.shape[1] != 2 * d or idx_rows.stride(1) != 1:
        raise ValueError(f"idx_rows must be [S, {2 * d}] with unit column stride, got {tuple(idx_rows.shape)}")
    if idx_rows.dtype not in _TL_DTYPE:
        raise ValueError(f"idx_rows dtype {idx_rows.dtype} is not float32, bfloat16 or float16")
    if table_rows.dim() != 2 or table_rows.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"table_rows must be [{b}, Lmax] and seq_lens [{b}], got {tuple(table_rows.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    if ape.shape != (kpool, d):
        raise ValueError(f"ape must be [{kpool}, {d}], got {tuple(ape.shape)}")
    npools = table_rows.shape[1] // kpool
    out = torch.empty(b, npools, dtype=torch.float32, device=q.device)
    if b and npools:
        table = table_rows if table_rows.stride(1) == 1 else table_rows.contiguous()
        bh, bd = triton.next_power_of_2(nh), triton.next_power_of_2(d)
        _pool_scores_kernel[(b, triton.cdiv(npools, POOL_BLOCK))](
            q.contiguous(), w.contiguous(), idx_rows, table, seq_lens.contiguous(), ape.contiguous(), out,
            idx_rows.stride(0), table.stride(0), d ** -0.5, npools,
            NH=nh, D=d, P=kpool, KEY_DT=_TL_DTYPE[idx_rows.dtype], BH=bh, BD=bd,
            BP=triton.next_power_of_2(kpool), BJ=POOL_BLOCK, PRECISE=PRECISE,
            num_warps=4 if bh * bd >= 2048 else 1, enable_fp_fusion=False)
    return out


def dsa_select(scores: torch.Tensor, seq_lens: torch.Tensor, topk_pools: int, kpool: int, tail: bool,
               width: int) -> torch.Tensor:
    """scores [B, np] fp32 (dsa_pool_scores'), seq_lens [B] -> token indices [B, width] long (-1 padded), one
    launch; twin: dsa_select_ref (bit for bit). The min(topk_pools, np) best pools (ties: the lower pool),
    each as its P tokens (-1 if not complete by the query), then with `tail` (P > 1) the query's
    incomplete-pool tokens right after the sequence's own min(k, seq_len // P) pool slots."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [B, np], got {scores.dtype} {tuple(scores.shape)}")
    b, npools = scores.shape
    if npools > MAX_POOLS:
        raise ValueError(f"{npools} pools: at most {MAX_POOLS} fit one program")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must be [{b}], got {tuple(seq_lens.shape)}")
    out = torch.empty(b, width, dtype=torch.long, device=scores.device)
    k = max(0, min(topk_pools, npools))
    tail = bool(tail) and kpool > 1
    if b and width:
        bnp = max(2, triton.next_power_of_2(npools))  # tl.topk wants two elements at least
        rest = max(1, width - k * kpool)  # columns after the pool slots
        _select_kernel[(b,)](scores.contiguous(), seq_lens.contiguous(), out, npools, width,
                             K=k, P=kpool, TAIL=tail, BNP=bnp, BK=max(2, triton.next_power_of_2(k)),
                             BP=triton.next_power_of_2(kpool), BR=triton.next_power_of_2(rest),
                             num_warps=4 if bnp >= 1024 else 1)
    return out
