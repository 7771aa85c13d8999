"""Plain-torch twins of every kernel in `kernels/triton/` (the oracles for tests).

Each twin computes the same function as its kernel, written for clarity rather than speed and
on whatever device its inputs live. Kernels take raw pointer tables; a twin takes the same
records as uint8 tensors instead (torch cannot dereference an address), so tests build the
pointer table from the very tensors they hand to the twin.

Numerics contract shared with the kernels (bf16 compute):
  W' = bf16(float32(q) * float32(scale))          (int records; bf16 records are W' as stored)
  g, u = x @ Wg'^T, x @ Wu'^T                      (bf16 operands, fp32 accumulation)
  act  = bf16(silu(g) * u)                         (fp32 math, rounded once; with a SwiGLU
                                                    limit L: g = min(g, L), u = clamp(u, -L, L))
  y    = float32(w_k) * (act @ Wd'^T)              (fp32)
  out  = bf16(sum_k y_k)                           (k in pick order)
Kernels differ from the twins only in fp32 summation order, so comparisons use tolerances;
bit-exactness is a property of one kernel across memory tiers, not of kernel vs twin.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tiermoe.kernels.cache_policy import DECAY_SHIFT
from tiermoe.kernels.layout import ExpertLayout

# ----------------------------------------------------------------------------- records


def _section(rec: torch.Tensor, off: int, nbytes: int) -> torch.Tensor:
    return rec.reshape(-1)[off : off + nbytes]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (low nibble = even column, stored q + 8) -> int32 [N, K] in -8..7."""
    p = packed.to(torch.int32)
    return torch.stack(((p & 0xF) - 8, (p >> 4) - 8), dim=-1).reshape(packed.shape[0], -1)


def unpack_int3(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3K/8] (low-two-bit plane [N, K/4], then high-bit plane [N, K/8]; stored q + 4)
    -> int32 [N, K] in -4..3."""
    n, k = packed.shape[0], packed.shape[1] * 8 // 3
    p = packed.to(torch.int32)
    lo = torch.stack([(p[:, : k // 4] >> (2 * j)) & 3 for j in range(4)], dim=-1).reshape(n, k)
    hi = torch.stack([(p[:, k // 4 :] >> j) & 1 for j in range(8)], dim=-1).reshape(n, k)
    return lo + 4 * hi - 4


def dequant_matrix(rec: torch.Tensor, layout: ExpertLayout, which: str, dtype: torch.dtype = torch.bfloat16
                   ) -> torch.Tensor:
    """One weight matrix of a record, dequantized to `dtype` (bf16: W' of the kernels; fp32: the
    unrounded products): gate_up [2I, H] or down [H, I]."""
    h, i, g = layout.hidden, layout.inter, layout.group_size
    n, k = (2 * i, h) if which == "gate_up" else (h, i)
    q_off = layout.gate_up_q if which == "gate_up" else layout.down_q
    s_off = layout.gate_up_s if which == "gate_up" else layout.down_s
    if layout.kind == "bf16":
        return _section(rec, q_off, n * k * 2).view(torch.bfloat16).view(n, k)
    if layout.kind == "int4":
        q = unpack_int4(_section(rec, q_off, n * k // 2).view(n, k // 2))  # [N, K]
    elif layout.kind == "int3":
        q = unpack_int3(_section(rec, q_off, n * k * 3 // 8).view(n, k * 3 // 8))  # [N, K]
    else:
        q = _section(rec, q_off, n * k).view(torch.int8).view(n, k).to(torch.int32)
    s = _section(rec, s_off, n * (k // g) * 2).view(torch.bfloat16).view(n, k // g)  # [N, K/G]
    w = q.to(torch.float32).view(n, k // g, g) * s.to(torch.float32).unsqueeze(-1)
    return w.view(n, k).to(dtype)


def make_record(layout: ExpertLayout, gen: torch.Generator | None = None, scale: float | None = None) -> torch.Tensor:
    """A random but valid record (uint8 [layout.length]) for tests and benchmarks.

    Quantized: uniform codes (int3/int4/int8) with positive bf16 scales around `scale` (default chosen
    so a unit-variance input gives roughly unit-variance outputs). bf16: normal weights.
    """
    h, i, g = layout.hidden, layout.inter, layout.group_size
    rec = torch.zeros(layout.length, dtype=torch.uint8)
    for which, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
        q_off = layout.gate_up_q if which == "gate_up" else layout.down_q
        if layout.kind == "bf16":
            w = torch.randn(n, k, generator=gen) * (scale or k**-0.5)
            _section(rec, q_off, n * k * 2).view(torch.bfloat16).copy_(w.reshape(-1).to(torch.bfloat16))
            continue
        s_off = layout.gate_up_s if which == "gate_up" else layout.down_s
        qbytes = n * k * layout.bits // 8
        qstd = {"int3": 2.3, "int4": 4.6}.get(layout.kind, 73.0)  # std of uniform stored codes
        _section(rec, q_off, qbytes).copy_(torch.randint(0, 256, (qbytes,), dtype=torch.uint8, generator=gen))
        base = scale or 1.0 / (qstd * k**0.5)
        s = base * (0.5 + torch.rand(n * (k // g), generator=gen))
        _section(rec, s_off, s.numel() * 2).view(torch.bfloat16).copy_(s.to(torch.bfloat16))
    return rec


# ----------------------------------------------------------------------------- fused MoE


def expert_ref(x: torch.Tensor, rec: torch.Tensor, layout: ExpertLayout,
               swiglu_limit: float | None = None) -> torch.Tensor:
    """One SwiGLU expert on rows x [M, H] bf16 -> fp32 [M, H] (before routing weight)."""
    i = layout.inter
    gu = dequant_matrix(rec, layout, "gate_up").float()  # [2I, H]
    dn = dequant_matrix(rec, layout, "down").float()  # [H, I]
    h = x.float() @ gu.t()  # [M, 2I]
    g, u = h[:, :i], h[:, i:]
    if swiglu_limit is not None:
        g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
    act = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)  # [M, I]
    return act.float() @ dn.t()  # [M, H]


def fused_moe_ref(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, records,
    layout: ExpertLayout | Sequence[ExpertLayout], swiglu_limit: float | None = None, kinds=None,
) -> torch.Tensor:
    """Twin of triton.fused_moe.fused_moe.

    x [T, H] bf16; topk_ids [T, K] (indices into `records`); topk_weights [T, K] float;
    records: uint8 [E, R] tensor or a sequence of uint8 records. Returns bf16 [T, H].
    layout: the ExpertLayout of every record; for a mixed store a sequence of them, with kinds
    (int [E], the kernel's kind_table) the index of each record's layout, or without kinds one
    layout per record. A record may be longer than its layout (a shorter kind in a tier entry).
    """
    t, k = topk_ids.shape
    if isinstance(layout, ExpertLayout):
        layout_of = lambda e: layout  # noqa: E731
    elif kinds is not None:
        kinds = torch.as_tensor(kinds).tolist()
        layout_of = lambda e: layout[kinds[e]]  # noqa: E731
    else:
        layout_of = lambda e: layout[e]  # noqa: E731
    y = torch.zeros(t, k, layout_of(0).hidden, dtype=torch.float32, device=x.device)  # [T, K, H]
    ids = topk_ids.to(torch.int64)
    for e in torch.unique(ids).tolist():
        rows, cols = (ids == e).nonzero(as_tuple=True)
        y[rows, cols] = expert_ref(x[rows], records[e], layout_of(e), swiglu_limit) * topk_weights[
            rows, cols
        ].float().unsqueeze(-1)
    out = y[:, 0]
    for j in range(1, k):  # pick order, as the kernel sums
        out = out + y[:, j]
    return out.to(torch.bfloat16)


def rmsnorm(h: torch.Tensor) -> torch.Tensor:
    """bf16 RMS norm without weight (the synthetic stack's pre-MoE norm)."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)


def lane_experts_ref(x: torch.Tensor, records, tok_idx, tok_w, layout: ExpertLayout, round_bf16: bool = True,
                     swiglu_limit: float | None = None) -> torch.Tensor:
    """Twin of the CPU lane kernel (kernels/cpu/lane_kernel.cpp): the weighted sum fp32 [T, H] of
    experts computed from their records on the rows of x fp32 [T, H] routed to them.

    records[i]: uint8 record of the i-th expert; tok_idx[i]: int rows of x it serves; tok_w[i]:
    their fp32 routing weights. round_bf16 (a bf16 model): W' = bf16(q * scale) and act rounded to
    bf16 once, the GPU kernels' numerics; else fp32 products and act. Experts are added in the
    order given (the lane passes ascending ids), fp32 throughout.
    """
    i = layout.inter
    wdt = torch.bfloat16 if round_bf16 else torch.float32
    out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
    for rec, rows, w in zip(records, tok_idx, tok_w):
        rows = torch.as_tensor(rows, dtype=torch.int64)
        gu = dequant_matrix(rec, layout, "gate_up", wdt).float()  # [2I, H]
        dn = dequant_matrix(rec, layout, "down", wdt).float()  # [H, I]
        h = x[rows].float() @ gu.t()  # [n, 2I]
        g, u = h[:, :i], h[:, i:]
        if swiglu_limit is not None:
            g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
        act = torch.nn.functional.silu(g) * u  # [n, I]
        if round_bf16:
            act = act.to(torch.bfloat16).float()
        out.index_add_(0, rows, (act @ dn.t()) * torch.as_tensor(w, dtype=torch.float32)[:, None])
    return out


# ----------------------------------------------------------------------------- align


def moe_align_ref(topk_ids: torch.Tensor, block_m: int, nb_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of triton.fused_moe.moe_align: the canonical block plan.

    Pairs p = t * K + k of the flattened picks are grouped by expert; experts appear in order
    of their first pick, each expert's pairs ascending, cut into blocks of `block_m` rows.
    Returns sorted_pairs int32 [nb_max * block_m] (unused rows hold P) and block_expert int32
    [nb_max] (unused blocks hold -1).
    """
    ids = topk_ids.reshape(-1).tolist()
    p = len(ids)
    order, members = [], {}
    for pos, e in enumerate(ids):
        if e not in members:
            order.append(e)
            members[e] = []
        members[e].append(pos)
    sorted_pairs = [p] * (nb_max * block_m)
    block_expert = [-1] * nb_max
    b = 0
    for e in order:
        mem = members[e]
        for start in range(0, len(mem), block_m):
            block_expert[b] = e
            for r, pos in enumerate(mem[start : start + block_m]):
                sorted_pairs[b * block_m + r] = pos
            b += 1
    return torch.tensor(sorted_pairs, dtype=torch.int32), torch.tensor(block_expert, dtype=torch.int32)


# ----------------------------------------------------------------------------- cache


def cache_step_ref(
    state: dict[str, torch.Tensor],
    topk_ids: torch.Tensor,
    admit_max: int,
    admission_filter: bool = True,
    decay_shift: int = DECAY_SHIFT,
    scratch: tuple[int, int, int] = (0, 0, 0),
    lane: tuple[int, int] = (0, 0),
) -> dict[str, torch.Tensor]:
    """Twin of triton.cache_manager.cache_step, on a dict of CPU tensors (mutated and returned).

    state keys: ptr_table [E'] i64, host_addr [E] i64, slot_addr [S] i64, slot_expert [S] i32,
    expert_slot [E] i32, ref [S] i32, clock [2] i32 (hand, stamp), copy_src/copy_dst [M] i64,
    n_copy [1] i32, stats [5] i64 (lookups, hits, misses, admitted, miss words), freq [E] i32; a mixed store's
    record_words [E] i32 (each expert's record length in 4-byte words) and copy_len [M] i32 (each copy's).

    One decode step of one layer: the distinct routed experts of the batch, in first-pick
    order, are looked up; every expert's pick frequency decays and the picked ones gain 1024;
    hits set their slot's reference bit and are pinned for this step. A CLOCK sweep from the
    hand picks one victim for each of the first min(misses, free slots, admit_max) misses
    (first sweep: slots with a clear bit, clearing set bits as it passes; second sweep if
    needed). Miss j meets victim j; with the filter it is admitted only if its frequency
    exceeds the victim expert's (an empty slot always admits). An evicted expert's table
    entry goes back to its host address, an admitted one's to its slot; (src, dst) go to the
    copy list in admission order. Victims that were not taken keep their expert, bit clear.
    scratch = (base, rows, record_bytes): misses not admitted are staged, in first-pick order,
    into the first `rows` scratch rows for this step (appended to the copy list); step_table
    is ptr_table with those rows.
    lane = (lane_max, zero_addr), fast mode (state also holds lane_ids [L] i32, lmark [E] i32 and
    optionally lane_share [1] i32, the cost model's share of the misses in 1/1024, default 1024):
    of the misses not admitted, the n = min(lane_max, round(misses * share / 1024)) of lowest
    frequency (after this step's update; ties in first-pick order) go to the CPU lane: lane_ids
    lists them in first-pick order (-1 padded), they are not staged, and their step_table rows
    are zero_addr.
    """
    st = state
    ids = topk_ids.reshape(-1).tolist()
    uniq = list(dict.fromkeys(ids))
    s_n = st["slot_addr"].numel()
    st["clock"][1] += 1
    es, se, ref, freq = st["expert_slot"], st["slot_expert"], st["ref"], st["freq"]
    picked = torch.zeros_like(freq)
    picked[torch.tensor(uniq, dtype=torch.int64)] = 1024
    freq.copy_(freq - (freq >> decay_shift) + picked)
    hits = [e for e in uniq if int(es[e]) >= 0]
    misses = [e for e in uniq if int(es[e]) < 0]
    inuse = {int(es[e]) for e in hits}
    n_free = s_n - len(inuse)
    a = min(len(misses), n_free, admit_max)
    h = int(st["clock"][0])
    order = [(h + r) % s_n for r in range(s_n)]
    pass1 = [s for s in order if s not in inuse and int(ref[s]) == 0]
    pass2 = [s for s in order if s not in inuse and int(ref[s]) != 0]
    if a <= len(pass1):
        victims = pass1[:a]
        if a:
            last = order.index(victims[-1])
            for s in order[:last]:
                if s not in inuse:
                    ref[s] = 0
            st["clock"][0] = (h + last + 1) % s_n
    else:
        victims = pass1 + pass2[: a - len(pass1)]
        for s in order:
            if s not in inuse:
                ref[s] = 0
        st["clock"][0] = (h + order.index(victims[-1]) + 1) % s_n
    for s in inuse:
        ref[s] = 1
    n = 0
    for j, e in enumerate(misses[:a]):
        v = victims[j]
        ref[v] = 0
        old = int(se[v])
        if admission_filter and old >= 0 and int(freq[e]) <= int(freq[old]):
            continue
        if old >= 0:
            es[old] = -1
            st["ptr_table"][old] = st["host_addr"][old]
        se[v] = e
        es[e] = v
        ref[v] = 1
        st["ptr_table"][e] = st["slot_addr"][v]
        st["copy_src"][n] = st["host_addr"][e]
        st["copy_dst"][n] = st["slot_addr"][v]
        if "record_words" in st:
            st["copy_len"][n] = st["record_words"][e]
        n += 1
    base, rows, rec = scratch
    st["step_table"].copy_(st["ptr_table"])
    rejected = [e for e in misses if int(es[e]) < 0]  # not admitted
    lane_max, zero_addr = lane
    on_lane = []
    if lane_max > 0:
        share = int(st["lane_share"][0]) if "lane_share" in st else 1024
        n_lane = min(lane_max, (len(misses) * share + 512) >> 10)
        by_heat = sorted(range(len(rejected)), key=lambda j: (int(freq[rejected[j]]), j))
        on_lane = [rejected[j] for j in sorted(by_heat[:n_lane])]
        st["lane_ids"].fill_(-1)
        st["lane_ids"][: len(on_lane)] = torch.tensor(on_lane, dtype=st["lane_ids"].dtype)
        for e in on_lane:
            st["lmark"][e] = int(st["clock"][1])
        rejected = [e for e in rejected if e not in on_lane]
    for q, e in enumerate(rejected[:rows]):
        st["copy_src"][n + q] = st["host_addr"][e]
        st["copy_dst"][n + q] = base + q * rec
        if "record_words" in st:
            st["copy_len"][n + q] = st["record_words"][e]
        st["step_table"][e] = base + q * rec
    for e in on_lane:
        st["step_table"][e] = zero_addr
    st["n_copy"][0] = n + min(len(rejected), rows)
    words = sum(int(st["record_words"][e]) for e in misses) if "record_words" in st else len(misses) * (rec // 4)
    st["stats"] += torch.tensor([len(uniq), len(hits), len(misses), n, words][: st["stats"].numel()],
                                dtype=st["stats"].dtype)
    return st


def gather_records_ref(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Twin of triton.cache_manager.gather_records: dst[d] = src[s] for each (s, d) pair."""
    for s, d in pairs:
        dst[d].copy_(src[s])
    return dst


# ----------------------------------------------------------------------------- host mailbox

# ctrl row of one mailbox slot (int64 [16], 128 bytes): the device writes POSTED/NTOK, the host
# writes DONE on its own 64-byte line; ERR > 0: the device timed out waiting for that number,
# ERR < 0: the host's compute failed for -ERR. POLLS: the polls the device's waits made before their
# answer was there, summed (the device writes it after each wait; the host reads it without a sync).
# DEV_NS / WAIT_NS (CUDA only; 0 elsewhere): the device's nanoseconds from each post to the start of its wait
# (its own work on the layer meanwhile) and in the wait itself, summed over the slot's waits.
MAILBOX_CTRL, MAILBOX_POSTED, MAILBOX_NTOK, MAILBOX_DONE, MAILBOX_ERR, MAILBOX_POLLS = 16, 0, 1, 8, 9, 10
MAILBOX_DEV_NS, MAILBOX_WAIT_NS = 11, 12
RESIDENCY_NANS = 2  # the disk tier's control row (kernels/triton/residency.py): answers published


def mailbox_post_ref(
    x_host: torch.Tensor,
    ctrl: torch.Tensor,
    seq: torch.Tensor,
    slot: int,
    x: torch.Tensor,
    meta_host: torch.Tensor | None = None,
    meta: torch.Tensor | None = None,
) -> None:
    """Twin of Mailbox.post: x [T, H] -> x_host[slot, :T] (bf16), meta int32 [n] ->
    meta_host[slot, :n], seq[slot] += 1, ntok, posted."""
    t = x.shape[0]
    x_host[slot, :t].copy_(x.to(torch.bfloat16))
    if meta is not None:
        meta_host[slot, : meta.numel()].copy_(meta)
    seq[slot] += 1
    ctrl[slot, MAILBOX_NTOK] = t
    ctrl[slot, MAILBOX_POSTED] = seq[slot].to(ctrl.device)


def mailbox_wait_add_ref(
    result: torch.Tensor, ctrl: torch.Tensor, seq: torch.Tensor, slot: int, out: torch.Tensor, max_spins: int = 0
) -> bool:
    """Twin of Mailbox.wait_add, checked once instead of spun: if done >= seq[slot],
    out [T, H] = dtype(fp32(out) + result[slot, :T]) and True; else ERR = seq, POLLS += max_spins (the
    polls of a wait that ran out), out kept, False."""
    target = int(seq[slot])
    if int(ctrl[slot, MAILBOX_DONE]) < target:
        ctrl[slot, MAILBOX_ERR] = target
        ctrl[slot, MAILBOX_POLLS] += max_spins
        return False
    t = out.shape[0]
    out.copy_((out.float() + result[slot, :t].to(out.device)).to(out.dtype))
    return True


# ----------------------------------------------------------------------------- attention


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """Twin of kernels/triton/paged_attention.py: q [B, Hq, D] (one token per sequence),
    k/v_cache [slots, Hk, D], block_table [B, max_blocks], seq_lens [B] -> [B, Hq, D].

    Each sequence attends over its first seq_lens[b] cache rows in block-table order; fp32
    scores and softmax, output rounded to q's dtype.
    """
    bsz, hq, _ = q.shape
    g = hq // k_cache.shape[1]
    out = torch.empty_like(q)
    offsets = torch.arange(page_size, device=block_table.device)
    for b in range(bsz):
        n = int(seq_lens[b])
        pages = block_table[b, : -(-n // page_size)].long()
        rows = (pages[:, None] * page_size + offsets).reshape(-1)[:n]  # [n]
        k = k_cache[rows].float().repeat_interleave(g, dim=1)  # [n, Hq, D]
        v = v_cache[rows].float().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


def residency_need_ref(topk_ids: torch.Tensor, host_addr: torch.Tensor, expert_slot: torch.Tensor) -> list[int]:
    """Twin of residency._need_kernel's choice: the picks [T, k] (pick order, repeats kept) that are
    neither in a slot (expert_slot >= 0) nor in RAM (host_addr != 0)."""
    ids = topk_ids.reshape(-1).long().cpu()
    need = (expert_slot.cpu()[ids] < 0) & (host_addr.cpu()[ids] == 0)
    return ids[need].tolist()


def residency_apply_ref(updates: list[tuple[int, int, int]],
                        tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Twin of residency._apply_kernel on answered updates: host_addr[row][e] = addr, and
    ptr_table[row][e] = addr where expert_slot[row][e] < 0, in place."""
    for row, e, addr in updates:
        host, table, slots = tables[row]
        host[e] = addr
        if int(slots[e]) < 0:
            table[e] = addr

