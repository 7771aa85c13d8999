"""The sigmoid "noaux_tc" MoE routing (DeepSeek-V3, GLM) from the hidden states, two launches per layer.

`models/blocks/router.py` turns each token's hidden state x [H] into its top-k expert ids and combine
weights: the fp32 gate projection (logits [E] = x.float() @ weight.float().T), sigmoid,
+ e_score_correction_bias, the group pre-selection (n_group > 1), top-k, gather, sum, divide, scale. In torch
that is ~12 tiny kernels per MoE layer after the projection and three for it at decode (x's fp32 copy, cuBLAS's
fp32 GEMV as a dot and a reduce kernel); glm5_next runs 43 MoE layers per token with its MTP layer, each launch
a few microseconds even replayed from a CUDA graph, far more than the arithmetic. Here:

  sigmoid_topk_route_from_hidden(x, weight, bias, ...)   projection + routing, 2 launches
  sigmoid_topk_route(logits, bias, ...)                   routing of logits computed elsewhere, 1 launch

The projection is split over experts and K: GLM-5.3's fp32 weight is 288 x 4096 (4.7 MB) and one program per
token would read it from one SM. Each program takes a block of BLOCK_E experts and a slice of the token's H
values (grid T x E / BLOCK_E x S; S = 16 at H = 4096: 144 programs for one token), reads x in its own dtype
(each value widened exactly, as x.float() does) and writes its partial dot products to a fp32 workspace
[T, S, E]. The routing kernel (a constexpr switch, SPLITS) first adds a token's S partials in index order,
then runs as on logits. The logits are not cuBLAS's bit for bit (another summation order, FMA contraction
allowed in the dots), they match it to fp32 rounding, so picks agree wherever biased scores are not within
that rounding of each other. What cuBLAS cannot give is kept instead: slices and blocks depend on E and H
alone, so a token's logits, ids and weights do not depend on T or the other tokens (cuBLAS's fp32 GEMV rounds
differently for one row and for two): a draft token verified in a batch routes as it does decoded alone.
The price is at prefill: every token's programs read the whole weight (from L2 once it is there), where a
GEMM would share each weight tile between tokens.

Selection. Every candidate gets one int64 key: its biased score's bits mapped to an integer of the same
order (high half) and 2**31 - 1 - its expert id (low half). Keys are distinct, so a top-k is k rounds of
"take the largest key, retire it" (one reduction a round), and among equal scores the lower expert id has
the larger key: ties go to the lower index. torch promises no tie rule; its CUDA topk fills its last slots
with the values equal to the k-th in index order (the same choice), its CPU topk (the twin's) may take
others. Every NaN ranks above +inf, as in torch.topk; -0 ties +0.
  - n_group > 1: the experts form n_group equal groups of consecutive ids; a group's score is the sum of
    its two best biased scores (the two largest keys of the group: a tied best counts twice, as with
    torch's topk(2)), the topk_group best groups stay (ties: lower group index) and the others' experts
    compete at -inf, as the twin's masked_fill leaves them.
  - Ids come out in descending biased-score order. torch.topk(sorted=False) on CUDA has an order of its own
    (for rows this short: the larger values in index order, then the ties), the twin's CPU topk another.
    The set is what routing means; the order reaches only summation and bookkeeping: fused_moe adds the
    top-k in pick order (fp32: the last bits of an output may differ from another order's), cache_step
    dedups picks in first-pick order (which miss meets which victim slot), routing recording stores the
    ids as given. Nothing assumes sorted ids or torch's order; combine_experts and the CPU lane visit
    experts in ascending id whatever the order.
  - replay_ids (routing replay): the token's ids are those, with the weights this router gives them. The
    selection still runs, as Router.forward promises (the router's cost stays in the step): a replayed id
    outside [0, E) would fall back to the router's own pick (replay tables are checked against the expert
    count, so none is), which also keeps the compiler from dropping the selection as dead code.

Weights are the plain sigmoid scores of the chosen ids (the logit read again, from the logits or from the
row summed from the partials: the same function of the same value, the same bits as in the selection),
renormalised as w / (sum + 1e-20) when norm_topk_prob, the sum taken in pick order, then times
routed_scaling_factor. The routing kernel's numerics as mhc.py's: sigmoid 1 / (1 + exp(-x)) with libdevice's
accurate expf compiled (numpy's exp under the interpreter), IEEE division (tl.div_rn), no FMA contraction
(enable_fp_fusion=False).

Twins: kernels.reference_router.sigmoid_topk_route_ref and sigmoid_topk_route_from_hidden_ref (the torch
code, also the CPU path). No host synchronisation, no data-dependent shapes (workspace and outputs of fixed
shape for T): the launches are captured in a decode step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.norm import check_dtype
from tiermoe.kernels.triton.precise import PRECISE, precise_sigmoid

NONE_KEY: tl.constexpr = tl.constexpr(-(2**63))  # below every real key: retired or padded candidates
PROJ_SPLITS = 16  # most K slices per token: with 9 blocks of 32 experts GLM-5.3's weight is read by 144 SMs
PROJ_MIN_SLICE = 64  # fewest values of a token per projection program (narrow hidden sizes take fewer slices)
PROJ_BLOCK = 128  # values per step of a projection program: a [32, 128] fp32 weight tile over 4 warps
PROJ_BLOCK_E = 32  # experts per projection program (288 = 9 x 32)


@triton.jit
def _proj_partials_kernel(x_ptr, w_ptr, ws_ptr, E: tl.constexpr, H: tl.constexpr, BLOCK_E: tl.constexpr,
                          SPLITS: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, block of BLOCK_E experts, slice k of SLICE hidden values): the dot products of
    x[t, slice] with the same columns of those experts' weight rows ([E, H]) -> ws[t, k, block] fp32.

    The products accumulate in a [BLOCK_E, BLOCK] tile over the slice's steps, then one reduction tree along
    the columns: the same order for every token whatever T is. Launched with FMA contraction (named, not
    left to Triton's changing default): the dots need not round as cuBLAS does, only the same for every T."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E] expert ids
    k = tl.program_id(2)
    live = rows < E
    acc = tl.zeros([BLOCK_E, BLOCK], tl.float32)
    for start in tl.static_range(0, SLICE, BLOCK):
        cols = k * SLICE + start + tl.arange(0, BLOCK)  # [BLOCK]
        ok = cols < H
        x = tl.load(x_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], mask=live[:, None] & ok[None, :],
                    other=0.0)  # [BLOCK_E, BLOCK]
        acc += w.to(tl.float32) * x[None, :]
    tl.store(ws_ptr + (t * SPLITS + k) * E + rows, tl.sum(acc, axis=1), mask=live)


@triton.jit
def _order_key(v, idx):
    """fp32 v, int32 idx (same shape) -> int64 keys ordered by v, then by lower idx: sorting integers instead of
    (value, index) pairs makes a top-k step one max reduction. Negative floats get their magnitude bits
    flipped so that signed integer order is float order; NaN maps to the largest value, -0 to +0."""
    b = v.to(tl.int32, bitcast=True)
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    o = tl.where(v != v, 0x7FFFFFFF, o)
    o = tl.where(v == 0.0, 0, o)
    return (o.to(tl.int64) << 32) + (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _order_key_value(key):
    """The fp32 value of a key (the inverse of _order_key's high half; exact)."""
    o = (key >> 32).to(tl.int32)
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _order_key_index(key):
    """The index of a key (its low half)."""
    return 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, replay_ptr, ids_ptr, w_ptr, scale,
                  E: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  BG: tl.constexpr, BGS: tl.constexpr, BK: tl.constexpr,
                  NORM: tl.constexpr, REPLAY: tl.constexpr, SPLITS: tl.constexpr, PRECISE: tl.constexpr):
    """One program per token: its logits row [E] -> ids [K] (descending biased score), weights [K].

    SPLITS == 0: logits_ptr holds the logits [T, E]. SPLITS > 0: it holds the projection's partials
    [T, SPLITS, E] (sigmoid_topk_route_from_hidden), added here in index order ((p0 + p1) + p2) + ...: an
    order set by SPLITS alone, not by T.

    The row is laid out [BG, BGS] (group, member; one group of all experts when G == 1), padded to powers
    of two; padded candidates hold NONE_KEY and never win (K <= E)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BG)  # [BG]
    ok = (g[:, None] < G) & (tl.arange(0, BGS)[None, :] < GS)  # [BG, BGS]
    eid = g[:, None] * GS + tl.arange(0, BGS)[None, :]  # [BG, BGS] expert ids
    if SPLITS == 0:
        row = logits_ptr + t * E
        x = tl.load(row + eid, mask=ok, other=0.0)  # [BG, BGS]
    else:
        row = logits_ptr + t * (SPLITS * E)
        x = tl.load(row + eid, mask=ok, other=0.0)  # [BG, BGS] slice 0
        for s in tl.static_range(1, SPLITS):
            x = x + tl.load(row + s * E + eid, mask=ok, other=0.0)
    bias = tl.load(bias_ptr + eid, mask=ok, other=0.0).to(tl.float32)
    choice = precise_sigmoid(x, PRECISE) + bias  # [BG, BGS]
    key = tl.where(ok, _order_key(choice, eid), NONE_KEY)  # [BG, BGS]

    if G > 1:  # group pre-selection: a group's score is the sum of its two best
        k1 = tl.max(key, axis=1)  # [BG]
        k2 = tl.max(tl.where(key == k1[:, None], NONE_KEY, key), axis=1)  # [BG] (GS >= 2)
        gkey = tl.where(g < G, _order_key(_order_key_value(k1) + _order_key_value(k2), g), NONE_KEY)  # [BG]
        keep = g < 0  # [BG] no group yet
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gkey, axis=0)
            keep = keep | (gkey == best)
            gkey = tl.where(gkey == best, NONE_KEY, gkey)
        dropped = ok & ~keep[:, None]  # [BG, BGS]
        key = tl.where(dropped, _order_key(tl.full(choice.shape, float("-inf"), tl.float32), eid), key)

    kr = tl.arange(0, BK)  # [BK] pick slots
    ids = tl.zeros([BK], dtype=tl.int32)  # [BK]
    for i in tl.static_range(K):  # top-k: the largest key, K times
        best = tl.max(tl.max(key, axis=1), axis=0)
        ids = tl.where(kr == i, _order_key_index(best), ids)
        key = tl.where(key == best, NONE_KEY, key)
    if REPLAY:
        rep = tl.load(replay_ptr + t * K + kr, mask=kr < K, other=0)  # [BK]
        ids = tl.where((rep >= 0) & (rep < E), rep, ids).to(tl.int32)

    if SPLITS == 0:
        picked = tl.load(row + ids, mask=kr < K, other=0.0)  # [BK] the logits of the picks
    else:  # no logits row in memory: each pick's value out of x, exactly (one value plus zeros)
        picked = tl.zeros([BK], dtype=tl.float32)
        for i in tl.static_range(K):
            pid = tl.sum(tl.where(kr == i, ids, 0), axis=0)
            v = tl.sum(tl.sum(tl.where(ok & (eid == pid), x, 0.0), axis=1), axis=0)
            picked = tl.where(kr == i, v, picked)
    w = precise_sigmoid(picked, PRECISE)  # [BK] the scores of the picks
    if NORM:
        s = tl.sum(tl.where(kr == 0, w, 0.0), axis=0)
        for i in tl.static_range(1, K):  # in pick order
            s = s + tl.sum(tl.where(kr == i, w, 0.0), axis=0)
        w = tl.div_rn(w, s + 1e-20)
    w = w * scale
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kr < K)
    tl.store(w_ptr + t * K + kr, w, mask=kr < K)


def _check_route(t: int, e: int, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 replay_ids: torch.Tensor | None) -> None:
    if bias.numel() != e:
        raise ValueError(f"bias must hold {e} values, got {bias.numel()}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} must lie in 1..{e}")
    if n_group > 1 and (e % n_group or e // n_group < 2 or not 1 <= topk_group <= n_group):
        raise ValueError(f"{n_group} groups of {e} experts, keeping {topk_group}: groups must be equal, of at "
                         f"least 2 experts, and 1 <= topk_group <= n_group")
    if replay_ids is not None and tuple(replay_ids.shape) != (t, top_k):
        raise ValueError(f"replay_ids must be [{t}, {top_k}], got {tuple(replay_ids.shape)}")


def _route(src: torch.Tensor, splits: int, t: int, e: int, bias: torch.Tensor, top_k: int, n_group: int,
           topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
           replay_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """src: logits [T, E] (splits 0) or the projection's partials [T, splits, E] -> (ids, weights)."""
    ids = torch.empty(t, top_k, dtype=torch.int64, device=src.device)  # [T, k]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=src.device)  # [T, k]
    if t:
        g = max(1, n_group)
        gs = e // g
        width = triton.next_power_of_2(g) * triton.next_power_of_2(gs)
        _route_kernel[(t,)](src.contiguous(), bias.contiguous(), ids if replay_ids is None else
                            replay_ids.contiguous(), ids, weights, float(routed_scaling_factor),
                            E=e, K=top_k, G=g, GS=gs, TOPK_GROUP=topk_group if g > 1 else 1,
                            BG=triton.next_power_of_2(g), BGS=triton.next_power_of_2(gs),
                            BK=triton.next_power_of_2(top_k), NORM=bool(norm_topk_prob),
                            REPLAY=replay_ids is not None, SPLITS=splits, PRECISE=PRECISE,
                            num_warps=1 if width <= 1024 else 4, enable_fp_fusion=False)
    return ids, weights


def sigmoid_topk_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       norm_topk_prob: bool, routed_scaling_factor: float,
                       replay_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E], bias [E] (e_score_correction_bias, on the device) -> (ids int64 [T, k] in
    descending biased-score order, ties to the lower expert id; weights fp32 [T, k]), one launch; twin:
    sigmoid_topk_route_ref (the same id set, the same weight per id up to float32 rounding).

    For logits computed elsewhere; models/blocks/router.py takes sigmoid_topk_route_from_hidden, which hands
    this kernel the projection's partials instead. replay_ids [T, k] integer (routing replay): the ids
    returned, with this router's weights for them. Allocates outputs of fixed shape for T and reads nothing
    back to the host: safe in CUDA graph capture."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    _check_route(t, e, bias, top_k, n_group, topk_group, replay_ids)
    return _route(logits, 0, t, e, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                  replay_ids)


def sigmoid_topk_route_from_hidden(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                                   n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                                   replay_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (bf16, fp16 or fp32), weight [E, H] (the gate; fp32 as the model holds it, bf16 or fp16 read as
    their exact fp32 values), bias [E] (on the device) -> (ids int64 [T, k], weights fp32 [T, k]) as
    sigmoid_topk_route of logits = x.float() @ weight.float().T, two launches; twin:
    reference_router.sigmoid_topk_route_from_hidden_ref (the same id set where biased scores are not within
    fp32 rounding of each other, the same weight per id up to float32 rounding).

    Launch 1 splits each token's H values into S slices and the experts into blocks, one program each, and
    writes the partial dot products (a fp32 workspace [T, S, E]); launch 2 adds the slices in a fixed order
    and routes. Slices and blocks depend on E and H alone: a token's result does not depend on T. The
    workspace has a fixed shape for T and nothing is read back on the host: CUDA-graph capturable."""
    check_dtype("x", x)
    check_dtype("weight", weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not weight.shape[1]:
        raise ValueError(f"x [T, H] and weight [E, H] must share H >= 1, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    (t, h), e = x.shape, weight.shape[0]
    _check_route(t, e, bias, top_k, n_group, topk_group, replay_ids)
    piece = max(PROJ_MIN_SLICE, triton.next_power_of_2(triton.cdiv(h, PROJ_SPLITS)))
    splits = triton.cdiv(h, piece)
    ws = torch.empty(t, splits, e, dtype=torch.float32, device=x.device)  # [T, S, E]
    if t:
        block_e = PROJ_BLOCK_E
        _proj_partials_kernel[(t, triton.cdiv(e, block_e), splits)](
            x.contiguous(), weight.contiguous(), ws, E=e, H=h, BLOCK_E=block_e, SPLITS=splits, SLICE=piece,
            BLOCK=min(piece, PROJ_BLOCK), num_warps=4, enable_fp_fusion=True)
    return _route(ws, splits, t, e, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                  replay_ids)
