"""Plain-torch twins of the DSA decode selection kernels (kernels/triton/dsa_decode.py).

This is `DSAIndexer.select_decode`'s torch code (models/blocks/attention.py), split where the pool scores
are complete: `dsa_pool_scores_ref` scores every pool of each sequence's block table, `dsa_select_ref`
turns the scores into the index list. The operations are the model's own, unchanged, so the CPU path (and
anything that needs a gradient) gives bit for bit what it gave before the kernels existed; the selection
is discrete, so a different rounding anywhere could flip a pick against `DSAIndexer.select`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dsa_pool_scores_ref(q: torch.Tensor, w: torch.Tensor, idx_rows: torch.Tensor, table_rows: torch.Tensor,
                        seq_lens: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """q [B, nh, d], w [B, nh] fp32, idx_rows [S, 2d] (the layer's indexer rows: key | k-pool gate per token),
    table_rows [B, Lmax] long (the row of each position of each sequence's block table), seq_lens [B] (the
    query's included), ape [P, d] -> scores [B, Lmax // P] fp32.

    Pool j of sequence b: softmax over its P tokens of gate + ape (per channel), cast to the key dtype, the
    weighted sum of the keys, then sum_h w_h * relu(q_h . key / sqrt(d)); pools not complete by the query
    (last token past seq_len - 1) hold float32's lowest value."""
    rows = idx_rows[table_rows]  # [B, Lmax, 2d]
    b, d, p = q.shape[0], q.shape[-1], kpool
    dev = q.device
    pos = seq_lens.long() - 1  # [B] the query's position
    npools = rows.shape[1] // p
    keys = rows[:, : npools * p, :d].view(b, npools, p, d)
    gates = rows[:, : npools * p, d:].view(b, npools, p, d)
    prob = (gates.float() + ape.float()[None, None]).softmax(dim=2).to(keys.dtype)
    pool_keys = (prob * keys).sum(dim=2)  # [B, np, d]
    scores = torch.matmul(q.float()[:, None], pool_keys.transpose(-1, -2).float().unsqueeze(1))  # [B,1,nh,np]
    scores = F.relu(scores * (d ** -0.5))
    index_scores = torch.matmul(w[:, None].unsqueeze(-2), scores).squeeze(-2)  # [B, 1, np]
    pool_end = torch.arange(npools, device=dev) * p + (p - 1)
    valid = pool_end[None, None, :] <= pos[:, None, None]  # [B, 1, np]
    index_scores = index_scores.masked_fill(~valid, torch.finfo(index_scores.dtype).min)
    return index_scores[:, 0]  # [B, np]


def dsa_select_ref(scores: torch.Tensor, seq_lens: torch.Tensor, topk_pools: int, kpool: int, tail: bool,
                   width: int) -> torch.Tensor:
    """scores [B, np] fp32 (dsa_pool_scores_ref's), seq_lens [B] -> token indices [B, width] long, -1 padded.

    The min(topk_pools, np) best pools by a stable descending sort (equal scores: the lower pool first, so
    the masked pools come after every real one), each expanded to its P tokens (-1 for a chosen pool not
    complete by the query); with `tail` (and P > 1) the tokens of the query's incomplete pool go right
    after the sequence's own min(k, seq_len // P) pool slots, where `DSAIndexer.select` puts them."""
    b, npools, p = scores.shape[0], scores.shape[1], kpool
    dev = scores.device
    seen = seq_lens.long()  # [B] tokens of each sequence, the query's included
    pos = seen - 1
    k = min(topk_pools, npools)
    if npools > 0:
        pool_end = torch.arange(npools, device=dev) * p + (p - 1)
        valid = pool_end[None, :] <= pos[:, None]  # [B, np]
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]  # [B, k]
        chosen_ok = valid.gather(-1, chosen)
        tokens = chosen[..., None] * p + torch.arange(p, device=dev)  # [B, k, P]
        idx = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)  # [B, k*P]
    else:
        idx = torch.empty(b, 0, dtype=torch.long, device=dev)
    if tail and p > 1:
        count = seen.remainder(p)
        offs = torch.arange(p - 1, device=dev)
        tail_idx = (seen - count)[:, None] + offs  # [B, P-1]
        tail_idx = tail_idx.masked_fill(~(offs[None, :] < count[:, None]), -1)
        at = (torch.clamp(seen // p, max=k) * p)[:, None] + offs  # [B, P-1] columns `select` gives it
        pad = torch.full((b, p - 1), -1, dtype=torch.long, device=dev)
        idx = torch.cat([idx, pad], dim=-1).scatter(1, at, tail_idx)
    return F.pad(idx, (0, width - idx.shape[-1]), value=-1)[:, :width]
