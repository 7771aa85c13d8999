"""The sigmoid "noaux_tc" MoE routing (DeepSeek-V3, GLM) after the gate's projection, one launch per layer.

`models/blocks/router.py` turns each token's fp32 gate logits [E] into its top-k expert ids and combine
weights: sigmoid, + e_score_correction_bias, the group pre-selection (n_group > 1), top-k, gather, sum,
divide, scale. In torch that is ~12 tiny kernels per MoE layer (glm5_next: 43 MoE layers per token with its
MTP layer), each a launch of a few microseconds even replayed from a CUDA graph, far more than the
arithmetic. Here one program per token does it all in registers; the projection stays a cuBLAS F.linear.

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

Weights are the plain sigmoid scores of the chosen ids (read again from the logits: the same
function of the same value, the same bits as in the selection), renormalised as w / (sum + 1e-20) when
norm_topk_prob, the sum taken in pick order, then times routed_scaling_factor. Numerics as mhc.py:
sigmoid 1 / (1 + exp(-x)) with libdevice's accurate expf compiled (numpy's exp under the interpreter),
IEEE division (tl.div_rn), no FMA contraction (enable_fp_fusion=False).

Twin: kernels.reference_router.sigmoid_topk_route_ref (the torch code, also the CPU path). No host
synchronisation, no data-dependent shapes: the launch is captured in a decode step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.triton.precise import PRECISE, precise_sigmoid

NONE_KEY: tl.constexpr = tl.constexpr(-(2**63))  # below every real key: retired or padded candidates


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
                  NORM: tl.constexpr, REPLAY: tl.constexpr, PRECISE: tl.constexpr):
    """One program per token: its logits row [E] -> ids [K] (descending biased score), weights [K].

    The row is laid out [BG, BGS] (group, member; one group of all experts when G == 1), padded to powers
    of two; padded candidates hold NONE_KEY and never win (K <= E)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BG)  # [BG]
    ok = (g[:, None] < G) & (tl.arange(0, BGS)[None, :] < GS)  # [BG, BGS]
    eid = g[:, None] * GS + tl.arange(0, BGS)[None, :]  # [BG, BGS] expert ids
    row = logits_ptr + t * E
    x = tl.load(row + eid, mask=ok, other=0.0)  # [BG, BGS]
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

    w = precise_sigmoid(tl.load(row + ids, mask=kr < K, other=0.0), PRECISE)  # [BK] the scores of the picks
    if NORM:
        s = tl.sum(tl.where(kr == 0, w, 0.0), axis=0)
        for i in tl.static_range(1, K):  # in pick order
            s = s + tl.sum(tl.where(kr == i, w, 0.0), axis=0)
        w = tl.div_rn(w, s + 1e-20)
    w = w * scale
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kr < K)
    tl.store(w_ptr + t * K + kr, w, mask=kr < K)


def sigmoid_topk_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       norm_topk_prob: bool, routed_scaling_factor: float,
                       replay_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E], bias [E] (e_score_correction_bias, on the device) -> (ids int64 [T, k] in
    descending biased-score order, ties to the lower expert id; weights fp32 [T, k]), one launch; twin:
    sigmoid_topk_route_ref (the same id set, the same weight per id up to float32 rounding).

    replay_ids [T, k] integer (routing replay): the ids returned, with this router's weights for them.
    Allocates outputs of fixed shape for T and reads nothing back to the host: safe in CUDA graph capture."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    if bias.numel() != e:
        raise ValueError(f"bias must hold {e} values, got {bias.numel()}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} must lie in 1..{e}")
    if n_group > 1 and (e % n_group or e // n_group < 2 or not 1 <= topk_group <= n_group):
        raise ValueError(f"{n_group} groups of {e} experts, keeping {topk_group}: groups must be equal, of at "
                         f"least 2 experts, and 1 <= topk_group <= n_group")
    if replay_ids is not None and tuple(replay_ids.shape) != (t, top_k):
        raise ValueError(f"replay_ids must be [{t}, {top_k}], got {tuple(replay_ids.shape)}")
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        g = max(1, n_group)
        gs = e // g
        width = triton.next_power_of_2(g) * triton.next_power_of_2(gs)
        _route_kernel[(t,)](logits.contiguous(), bias.contiguous(), ids if replay_ids is None else
                            replay_ids.contiguous(), ids, weights, float(routed_scaling_factor),
                            E=e, K=top_k, G=g, GS=gs, TOPK_GROUP=topk_group if g > 1 else 1,
                            BG=triton.next_power_of_2(g), BGS=triton.next_power_of_2(gs),
                            BK=triton.next_power_of_2(top_k), NORM=bool(norm_topk_prob),
                            REPLAY=replay_ids is not None, PRECISE=PRECISE,
                            num_warps=1 if width <= 1024 else 4, enable_fp_fusion=False)
    return ids, weights
