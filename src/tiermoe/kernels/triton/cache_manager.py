"""Device-side expert cache of one MoE layer: lookup, CLOCK admission, pointer tables, gather.

A decode step must not wait for the host, or it cannot be captured in a CUDA graph. So the
whole cache decision for one layer is one single-program kernel (`_cache_step_kernel`) that
reads the router's picks on the device and:

  1. dedups the batch's picks (first-pick order) and looks each expert up (expert_slot);
  2. marks hits: their slots get the reference bit and are pinned for this step;
  3. updates each expert's decayed pick frequency (integer, so the twin matches bit for bit);
  4. chooses victims for up to `admit_max` misses with a CLOCK sweep from the hand (first
     sweep takes clear-bit slots and clears set bits it passes; a second sweep if needed);
     a miss is admitted only if it is picked more often than the victim's expert (a
     TinyLFU-style filter: under steady popularity plain CLOCK churns, admitting every miss
     and evicting experts that come back; the filter converges to the popular set);
  5. rewrites the pointer table: evicted experts point back at their pinned host copy, the
     admitted ones at their new slot; fills the (src, dst) copy list;
  6. stages the misses it did not admit into shared scratch rows for this step only (when a
     scratch area is configured) and writes `step_table` = ptr_table with those rows;
  fast mode (`cache_step(..., lane=True)` with lane_max > 0): of the misses step 4 did not
     admit, the n coldest (lowest decayed frequency) go to the CPU lane instead of 6., n =
     min(lane_max, round(misses * lane_share / 1024)) (the cost model's split, moe/lane_cost.py):
     listed in lane_ids, not staged, their step_table rows at an all-zero record (they add
     exactly 0 on the device). Admissions are those of exact mode: the cache adapts alike;

then `_gather_kernel` copies the admitted (and staged) records host -> GPU (the loads cross PCIe, the
stores stay in HBM), sized by the device-side count, so no host round trip happens anywhere.
The MoE kernel that follows reads admitted experts from their slot and any miss that was not
admitted (more misses than free slots) in place from host memory.

Every host-resident expert always stays in pinned host memory (the RAM tier is inclusive of
the GPU slots here), so an eviction never copies: only the table entry changes. Because only
addresses change, outputs are bit-identical for any cache size.

Contract of the tables (`ExpertCache` owns them, one per layer):
  ptr_table   int64 [E_total]  row e = device-visible address of expert e's record; rows
                               >= num_experts (e.g. shared experts) are never touched here
  host_addr   int64 [E]        pinned host record address of each routed expert
  slot_addr   int64 [S]        GPU slot addresses (4096-aligned; adjacent or not)
  slot_expert int32 [S]        expert held by each slot, -1 = empty
  expert_slot int32 [E]        slot of each expert, -1 = not resident
  ref         int32 [S]        CLOCK reference bits
  clock       int32 [2]        (hand, step stamp)
  emark       int32 [E]        stamp of the step that last picked the expert (scratch)
  victims     int32 [S]        victim slots in sweep order (scratch)
  copy_src/copy_dst int64 [M], n_copy int32 [1]   the gather list of the last step
  stats       int64 [5]        cumulative (lookups, hits, misses, admitted), unique experts, and the
                               4-byte words of the misses' own records (what they move over PCIe)
  freq        int32 [E]        decayed pick counts (1024 per pick, decay 1 - 2^-shift per step)
  step_table  int64 [E_total]  the table the MoE kernel reads this step (ptr_table + scratch rows)
  smark/saddr int32/int64 [E]  scratch staging marks of the last step (scratch)
  lane_ids    int32 [L]        fast mode: the experts the CPU lane computes this step, -1 padded
  lmark       int32 [E]        fast mode: stamp of the step that last sent the expert to the lane
  lane_share  int32 [1]        fast mode: the lane's share of a step's misses, 1/1024 units (1024: all)

The scratch area (scratch_base, scratch_slots records) may be shared by all layers of a
stack: stream order puts each layer's gather after the previous layer's MoE kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.cache_policy import DECAY_SHIFT

LANE_SHARE_ONE = 1024  # lane_share of 1: every miss not admitted may go to the lane (up to lane_max)


@triton.jit(do_not_specialize=["P"])  # a step's pick count: one compile for every step (kernels README)
def _cache_step_kernel(
    ids_ptr, P, ptr_table_ptr, host_addr_ptr, slot_addr_ptr, slot_expert_ptr, expert_slot_ptr,
    ref_ptr, clock_ptr, emark_ptr, victims_ptr, copy_src_ptr, copy_dst_ptr, n_copy_ptr, stats_ptr, freq_ptr,
    step_table_ptr, smark_ptr, saddr_ptr, scratch_base, SCRATCH, R,
    S, E, E_TOTAL, ADMIT_MAX, lane_ids_ptr, lmark_ptr, lane_share_ptr, LANE_MAX, LANE_CAP, zero_addr,
    rec_words_ptr, copy_len_ptr, VARLEN: tl.constexpr,
    FILTER: tl.constexpr, SHIFT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, LANE: tl.constexpr, BLOCK_L: tl.constexpr,
):
    # ---- picks: dedup in first-pick order, lookup
    offs_p = tl.arange(0, BLOCK_P)
    ok_p = offs_p < P
    ids = tl.load(ids_ptr + offs_p, mask=ok_p, other=-1)
    same = (ids[:, None] == ids[None, :]) & ok_p[:, None] & ok_p[None, :]
    earlier = offs_p[None, :] < offs_p[:, None]
    first = ok_p & (tl.sum((same & earlier).to(tl.int32), axis=1) == 0)
    slot = tl.load(expert_slot_ptr + ids, mask=first, other=-1)
    hit = first & (slot >= 0)
    miss = first & (slot < 0)
    n_first = tl.sum(first.to(tl.int32), axis=0)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    hand = tl.load(clock_ptr)
    stamp = tl.load(clock_ptr + 1) + 1
    tl.store(emark_ptr + ids, stamp, mask=first)
    tl.debug_barrier()
    # ---- pick frequencies: f <- f - f / 2^SHIFT + 1024 * picked (integer: exact, reproducible)
    offs_e = tl.arange(0, BLOCK_E)
    ok_e = offs_e < E
    f = tl.load(freq_ptr + offs_e, mask=ok_e, other=0)
    picked = tl.load(emark_ptr + offs_e, mask=ok_e, other=0, cache_modifier=".cg") == stamp
    tl.store(freq_ptr + offs_e, f - (f >> SHIFT) + tl.where(picked, 1024, 0), mask=ok_e)
    miss_rank = tl.sum((miss[None, :] & earlier).to(tl.int32), axis=1)  # misses before me
    # ---- slots: in use this step (hit), CLOCK sweep
    offs_s = tl.arange(0, BLOCK_S)
    ok_s = offs_s < S
    old = tl.load(slot_expert_ptr + offs_s, mask=ok_s, other=-1)  # [BS]
    mark = tl.load(emark_ptr + old, mask=ok_s & (old >= 0), other=0, cache_modifier=".cg")
    inuse = ok_s & (old >= 0) & (mark == stamp)
    refv = tl.load(ref_ptr + offs_s, mask=ok_s, other=0)
    cand1 = ok_s & (inuse == 0) & (refv == 0)
    cand2 = ok_s & (inuse == 0) & (refv != 0)
    n1 = tl.sum(cand1.to(tl.int32), axis=0)
    n_free = tl.sum((ok_s & (inuse == 0)).to(tl.int32), axis=0)
    a = tl.minimum(tl.minimum(n_miss, n_free), ADMIT_MAX)
    s_safe = tl.maximum(S, 1)
    rot = (offs_s - hand + s_safe) % s_safe  # sweep position of each slot
    # rank in sweep order = exclusive prefix count, rotated to start at the hand
    c1 = tl.cumsum(cand1.to(tl.int32), axis=0) - cand1.to(tl.int32)
    c2 = tl.cumsum(cand2.to(tl.int32), axis=0) - cand2.to(tl.int32)
    b1 = tl.sum((cand1 & (offs_s < hand)).to(tl.int32), axis=0)
    b2 = tl.sum((cand2 & (offs_s < hand)).to(tl.int32), axis=0)
    n2 = tl.sum(cand2.to(tl.int32), axis=0)
    rank1 = tl.where(offs_s >= hand, c1 - b1, c1 + n1 - b1)
    rank2 = tl.where(offs_s >= hand, c2 - b2, c2 + n2 - b2)
    need2 = a - tl.minimum(a, n1)
    vic1 = cand1 & (rank1 < a)
    vic2 = cand2 & (rank2 < need2)
    is_vic = vic1 | vic2
    vrank = tl.where(vic1, rank1, n1 + rank2)
    last1 = tl.max(tl.where(vic1, rot, -1), axis=0)
    last2 = tl.max(tl.where(vic2, rot, -1), axis=0)
    cleared = cand2 & ((need2 > 0) | (rot < last1))
    new_ref = tl.where(inuse, 1, tl.where(cleared | is_vic, 0, refv))  # admitted victims get 1 below
    new_hand = tl.where(need2 > 0, (hand + last2 + 1) % s_safe, tl.where(a > 0, (hand + last1 + 1) % s_safe, hand))
    tl.store(ref_ptr + offs_s, new_ref, mask=ok_s)
    tl.store(victims_ptr + vrank, offs_s, mask=is_vic)
    tl.debug_barrier()
    # ---- admissions: miss j (first-pick order) meets victim j (sweep order); with FILTER it
    # enters only if it is picked more often than the victim's expert (empty slots always)
    cand = miss & (miss_rank < a)
    v = tl.load(victims_ptr + miss_rank, mask=cand, other=0, cache_modifier=".cg")
    old_e = tl.load(slot_expert_ptr + v, mask=cand, other=-1)
    if FILTER:
        f_new = tl.load(freq_ptr + ids, mask=cand, other=0, cache_modifier=".cg")
        f_old = tl.load(freq_ptr + old_e, mask=cand & (old_e >= 0), other=-1, cache_modifier=".cg")
        adm = cand & (f_new > f_old)
    else:
        adm = cand
    pos = tl.sum((adm[None, :] & earlier).to(tl.int32), axis=1)  # compact copy-list position
    n_adm = tl.sum(adm.to(tl.int32), axis=0)
    evict = adm & (old_e >= 0)
    tl.store(expert_slot_ptr + old_e, -1, mask=evict)  # the old expert goes back to its host copy
    tl.store(ptr_table_ptr + old_e, tl.load(host_addr_ptr + old_e, mask=evict, other=0), mask=evict)
    sa = tl.load(slot_addr_ptr + v, mask=adm, other=0)
    ha = tl.load(host_addr_ptr + ids, mask=adm, other=0)
    tl.store(slot_expert_ptr + v, ids, mask=adm)
    tl.store(expert_slot_ptr + ids, v, mask=adm)
    tl.store(ptr_table_ptr + ids, sa, mask=adm)
    tl.store(ref_ptr + v, 1, mask=adm)
    tl.store(copy_src_ptr + pos, ha, mask=adm)
    tl.store(copy_dst_ptr + pos, sa, mask=adm)
    if VARLEN:  # a mixed store: each copy moves its own record's words, not the tier entry's
        tl.store(copy_len_ptr + pos, tl.load(rec_words_ptr + ids, mask=adm, other=0), mask=adm)
    # misses not admitted: staged for this step only in the scratch rows (the gather kernel
    # reads host memory faster than the MoE kernel's in-place reads), else read in place
    rej = miss & (adm == 0)
    if LANE:  # ---- CPU lane (fast mode): the n_lane coldest misses not admitted, ties in first-pick order,
        # n_lane = the cost model's share of this step's misses (1/1024 units, rounded), at most LANE_MAX
        n_lane = tl.minimum(LANE_MAX, (n_miss * tl.load(lane_share_ptr) + 512) >> 10)
        fl = tl.load(freq_ptr + ids, mask=rej, other=0, cache_modifier=".cg")
        colder = rej[None, :] & ((fl[None, :] < fl[:, None]) | ((fl[None, :] == fl[:, None]) & earlier))
        lane = rej & (tl.sum(colder.to(tl.int32), axis=1) < n_lane)
        offs_l = tl.arange(0, BLOCK_L)
        tl.store(lane_ids_ptr + offs_l, -1, mask=offs_l < LANE_CAP)
        tl.debug_barrier()
        tl.store(lane_ids_ptr + tl.sum((lane[None, :] & earlier).to(tl.int32), axis=1), ids, mask=lane)
        tl.store(lmark_ptr + ids, stamp, mask=lane)
        rej = rej & (lane == 0)  # the lane's experts are not staged either: no PCIe bytes for them
    q = tl.sum((rej[None, :] & earlier).to(tl.int32), axis=1)
    stg = rej & (q < SCRATCH)
    n_stg = tl.sum(stg.to(tl.int32), axis=0)
    scr = scratch_base + q.to(tl.int64) * R
    tl.store(copy_src_ptr + n_adm + q, tl.load(host_addr_ptr + ids, mask=stg, other=0), mask=stg)
    tl.store(copy_dst_ptr + n_adm + q, scr, mask=stg)
    if VARLEN:
        tl.store(copy_len_ptr + n_adm + q, tl.load(rec_words_ptr + ids, mask=stg, other=0), mask=stg)
    tl.store(smark_ptr + ids, stamp, mask=stg)
    tl.store(saddr_ptr + ids, scr, mask=stg)
    tl.store(n_copy_ptr, n_adm + n_stg)
    tl.debug_barrier()
    # ---- this step's table: the canonical one with the scratch rows of staged misses
    offs_t = tl.arange(0, BLOCK_T)
    ok_t = offs_t < E_TOTAL
    canon = tl.load(ptr_table_ptr + offs_t, mask=ok_t, other=0, cache_modifier=".cg")
    staged = tl.load(smark_ptr + offs_t, mask=offs_t < E, other=0, cache_modifier=".cg") == stamp
    s_addr = tl.load(saddr_ptr + offs_t, mask=staged, other=0, cache_modifier=".cg")
    row = tl.where(staged, s_addr, canon)
    if LANE:  # lane experts read the all-zero record: they add exactly 0 on the device
        on_lane = tl.load(lmark_ptr + offs_t, mask=offs_t < E, other=0, cache_modifier=".cg") == stamp
        row = tl.where(on_lane, zero_addr, row)
    tl.store(step_table_ptr + offs_t, row, mask=ok_t)
    tl.store(clock_ptr, new_hand)
    tl.store(clock_ptr + 1, stamp)
    tl.store(stats_ptr, tl.load(stats_ptr) + n_first.to(tl.int64))
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + n_hit.to(tl.int64))
    tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + n_miss.to(tl.int64))
    tl.store(stats_ptr + 3, tl.load(stats_ptr + 3) + n_adm.to(tl.int64))
    if VARLEN:
        miss_words = tl.sum(tl.load(rec_words_ptr + ids, mask=miss, other=0).to(tl.int64), axis=0)
    else:
        miss_words = n_miss.to(tl.int64) * (R // 4)
    tl.store(stats_ptr + 4, tl.load(stats_ptr + 4) + miss_words)


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, n_ptr, len_ptr, NPROG, WORDS: tl.constexpr, CHUNK: tl.constexpr,
                   VARLEN: tl.constexpr):
    """Copy n records (WORDS int32 words each, or with VARLEN the first len[j] of them) src[j] -> dst[j];
    work spread over NPROG programs."""
    pid = tl.program_id(0)
    n = tl.load(n_ptr)
    per_rec: tl.constexpr = WORDS // CHUNK
    offs = tl.arange(0, CHUNK)
    for c in range(pid, n * per_rec, NPROG):
        j = c // per_rec
        off = (c % per_rec) * CHUNK
        s = tl.multiple_of(tl.load(src_ptr + j).to(tl.pointer_type(tl.int32)), 16)
        d = tl.multiple_of(tl.load(dst_ptr + j).to(tl.pointer_type(tl.int32)), 16)
        if VARLEN:
            inside = off + offs < tl.load(len_ptr + j)
            tl.store(d + off + offs, tl.load(s + off + offs, mask=inside), mask=inside)
        else:
            tl.store(d + off + offs, tl.load(s + off + offs))


def gather_records(
    copy_src: torch.Tensor,
    copy_dst: torch.Tensor,
    n_copy: torch.Tensor,
    record_bytes: int,
    *,
    copy_len: torch.Tensor | None = None,
    chunk_bytes: int = 16384,
    programs: int = 264,
    num_warps: int = 8,
) -> None:
    """Copy `n_copy[0]` records of `record_bytes` from copy_src[j] to copy_dst[j] (int64 addresses).

    The count stays on the device; the grid is fixed, so this is graph-capturable. Sources
    may be pinned host memory (read over PCIe in place), destinations GPU memory. copy_len:
    int32 [M] words of copy j (at most record_bytes / 4; a mixed store's shorter records), the
    rest of its destination row left as it was.
    """
    if record_bytes % chunk_bytes:
        chunk_bytes = 4096
    if record_bytes % chunk_bytes:
        raise ValueError(f"record length {record_bytes} is not a multiple of 4096")
    _gather_kernel[(programs,)](
        copy_src, copy_dst, n_copy, copy_len if copy_len is not None else n_copy, programs,
        WORDS=record_bytes // 4, CHUNK=chunk_bytes // 4, VARLEN=copy_len is not None, num_warps=num_warps
    )


class ExpertCache:
    """The device-side cache state of one MoE layer (see the module docstring for the tables).

    host_addr: int64 [E] pinned host record addresses; slot_base: address of S * record_bytes
    bytes of GPU memory, or an int64 [S] tensor of each slot's address (kept alive by the
    caller); extra_ptrs: table rows after the routed
    experts (shared experts), fixed. `admit_max` bounds the misses admitted per step.
    """

    def __init__(
        self,
        host_addr: torch.Tensor,
        slot_base: int | torch.Tensor,
        num_slots: int,
        record_bytes: int,
        *,
        extra_ptrs: torch.Tensor | None = None,
        admit_max: int | None = None,
        max_picks: int = 128,
        admission_filter: bool = True,
        decay_shift: int = DECAY_SHIFT,
        scratch_base: int = 0,
        scratch_slots: int = 0,
        lane_max: int = 0,
        record_words: torch.Tensor | None = None,
    ) -> None:
        dev = host_addr.device
        e = host_addr.numel()
        self.num_experts, self.num_slots, self.record_bytes = e, int(num_slots), int(record_bytes)
        self.admit_max = int(self.num_slots if admit_max is None else admit_max)
        extra = extra_ptrs if extra_ptrs is not None else torch.empty(0, dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.host_addr = host_addr.to(torch.int64).contiguous()
        self.ptr_table = torch.cat([self.host_addr, extra.to(torch.int64)])
        if isinstance(slot_base, torch.Tensor):  # each slot's own address (slots need not be adjacent)
            self.slot_addr = slot_base.to(device=dev, dtype=torch.int64).contiguous()
            if self.slot_addr.numel() != self.num_slots:
                raise ValueError(f"{self.slot_addr.numel()} slot addresses for {self.num_slots} slots")
        else:
            self.slot_addr = slot_base + torch.arange(self.num_slots, **i64) * self.record_bytes
        self.slot_expert = torch.full((self.num_slots,), -1, **i32)
        self.expert_slot = torch.full((e,), -1, **i32)
        self.ref = torch.zeros(self.num_slots, **i32)
        self.clock = torch.zeros(2, **i32)
        self.emark = torch.zeros(e, **i32)
        self.victims = torch.zeros(max(self.num_slots, 1), **i32)
        self.copy_src = torch.zeros(max_picks, **i64)
        self.copy_dst = torch.zeros(max_picks, **i64)
        self.n_copy = torch.zeros(1, **i32)
        # a mixed store: int32 [E] words of each expert's own record, and of each copy (None: all whole)
        self.record_words = None if record_words is None else record_words.to(device=dev, dtype=torch.int32)
        self.copy_len = torch.zeros(max_picks, **i32) if record_words is not None else None
        self.stats = torch.zeros(5, **i64)
        self.freq = torch.zeros(e, **i32)  # decayed pick counts, 1024 per pick
        self.admission_filter, self.decay_shift = bool(admission_filter), int(decay_shift)
        self.step_table = self.ptr_table.clone()  # what this step's MoE kernel reads
        self.smark = torch.zeros(e, **i32)
        self.saddr = torch.zeros(e, **i64)
        self.scratch_base, self.scratch_slots = int(scratch_base), int(scratch_slots)
        self.max_picks = max_picks
        # fast mode: steps run with lane=True send up to lane_max (<= lane_cap) misses to the CPU lane
        self.lane_cap = max(0, int(lane_max))
        self.lane_max = 0  # the owner turns it on (DeviceCacheExperts.set_lane) with a zero record
        self.lane_ids = torch.full((max(1, self.lane_cap),), -1, **i32)
        self.lmark = torch.zeros(e, **i32)
        # the cost model's share of a step's misses for the lane, in 1/LANE_SHARE_ONE (moe/lane_cost.py);
        # a device tensor, so a captured decode graph reads the current value
        self.lane_share = torch.full((1,), LANE_SHARE_ONE, **i32)
        self.zero_addr = 0  # the all-zero record lane rows point at (set by the owner with lane_max)
        # gather kernel launch (2 programs per SM of an H100/H200 by default; the bench tunes it)
        self.gather_programs, self.gather_chunk, self.gather_warps = 264, 16384, 8

    def state(self) -> dict[str, torch.Tensor]:
        names = ("ptr_table", "host_addr", "slot_addr", "slot_expert", "expert_slot", "ref", "clock", "copy_src",
                 "copy_dst", "n_copy", "stats", "freq", "step_table", "lane_ids", "lmark", "lane_share")
        varlen = {"record_words": self.record_words, "copy_len": self.copy_len} if self.copy_len is not None else {}
        return {**{n: getattr(self, n) for n in names}, **varlen}

    def warm_start(self, experts: list[int]) -> list[tuple[int, int]]:
        """Place `experts` (e.g. the most popular) into slots 0.. ; returns (expert, slot) pairs.

        Host-side setup, not for the decode path: the caller copies the records in (e.g. with
        gather_records over copy lists) before the first step.
        """
        experts = [int(e) for e in experts][: self.num_slots]
        if experts:
            idx = torch.tensor(experts, dtype=torch.int64, device=self.slot_expert.device)
            n = len(experts)
            self.slot_expert[:n] = idx.to(torch.int32)
            self.expert_slot[idx] = torch.arange(n, dtype=torch.int32, device=idx.device)
            self.ptr_table[idx] = self.slot_addr[:n]
        return [(e, s) for s, e in enumerate(experts)]

    def warm_frequencies(self, picks_per_step: torch.Tensor) -> None:
        """Seed the pick-frequency estimates with expected picks per step [E] (e.g. from stats).

        The steady state of f <- f - f / 2^shift + 1024 * picked is 1024 * 2^shift * rate.
        """
        f = picks_per_step.to(torch.float64).clamp(min=0) * (1024 << self.decay_shift)
        self.freq.copy_(f.round().to(torch.int32))

    def reset_stats(self) -> None:
        self.stats.zero_()

    def lend_slots(self, start: int) -> torch.Tensor:
        """Empty slots start.. for another use (prefill staging): their experts point back at
        their pinned host copies. Returns the experts they held, int32 [S - start] (-1: none), for
        `restore_slots`. Device-side tensor ops only (no host sync), so it queues like a kernel.
        """
        held = self.slot_expert[start:].clone()  # [n]
        self._set_rows(held, torch.full_like(held, -1), self.host_addr[held.clamp(min=0).long()])
        self.slot_expert[start:] = -1  # reference bits stay: no cache step runs before restore_slots
        return held

    def restore_slots(self, start: int, held: torch.Tensor) -> None:
        """Undo `lend_slots(start)`: the experts in `held` [S - start] go back into the same
        slots, tables first, then their records are copied in by the gather kernel (a device-side
        count; empty slots copy onto themselves), so nothing waits for the host. Valid while the
        cache made no decision in between (prefill steps leave it alone)."""
        n = held.numel()
        if not n:
            return
        slot_addr = self.slot_addr[start:]  # [n]
        self._set_rows(held, torch.arange(start, start + n, dtype=torch.int32, device=held.device), slot_addr)
        self.slot_expert[start:] = held
        src = torch.where(held >= 0, self.host_addr[held.clamp(min=0).long()], slot_addr)  # [n]
        count = torch.full((1,), n, dtype=torch.int32, device=held.device)
        gather_records(
            src,
            slot_addr.clone(),
            count,
            self.record_bytes,
            chunk_bytes=self.gather_chunk,
            programs=self.gather_programs,
            num_warps=self.gather_warps,
        )

    def _set_rows(self, experts: torch.Tensor, slots: torch.Tensor, addrs: torch.Tensor) -> None:
        """expert_slot[e] = slots[i] and ptr_table[e] = addrs[i] for each e = experts[i] >= 0
        (all [n]). Entries with e < 0 write to a spare row past the end, never read, so no
        boolean indexing (which would wait for the device)."""
        e_n = self.num_experts
        idx = torch.where(experts >= 0, experts, e_n).long()  # [n], -1 -> the spare row
        es = torch.cat([self.expert_slot, self.expert_slot.new_full((1,), -1)])  # [E + 1]
        es[idx] = slots.to(es.dtype)
        self.expert_slot.copy_(es[:e_n])
        pt = torch.cat([self.ptr_table[:e_n], self.ptr_table.new_zeros(1)])  # [E + 1]
        pt[idx] = addrs.to(pt.dtype)
        self.ptr_table[:e_n].copy_(pt[:e_n])

    def step(self, topk_ids: torch.Tensor, *, gather: bool = True, lane: bool = False) -> None:
        """One decode step: cache decisions for the routed picks topk_ids [T, K], then gather;
        lane: this step hands up to lane_max misses to the CPU lane (fast mode)."""
        cache_step(self, topk_ids, lane=lane)
        if gather:
            self.gather()

    def gather(self) -> None:
        """Copy the last step's admitted and staged records host -> GPU (sized on the device)."""
        if self.num_slots or self.scratch_slots:
            gather_records(
                self.copy_src,
                self.copy_dst,
                self.n_copy,
                self.record_bytes,
                copy_len=self.copy_len,
                chunk_bytes=self.gather_chunk,
                programs=self.gather_programs,
                num_warps=self.gather_warps,
            )


def cache_step(cache: ExpertCache, topk_ids: torch.Tensor, *, lane: bool = False) -> None:
    """Launch the cache-decision kernel for one layer (no gather). Graph-capturable. lane: also
    choose the CPU lane's experts (fast mode; lane_ids, lmark, zero-record rows)."""
    p = topk_ids.numel()
    if p > cache.max_picks:
        raise ValueError(f"{p} picks exceed the cache's max_picks={cache.max_picks}")
    if not 0 <= cache.lane_max <= cache.lane_cap:
        raise ValueError(f"lane_max={cache.lane_max} outside 0..lane_cap={cache.lane_cap}")
    lane = lane and cache.lane_max > 0
    ids = topk_ids.reshape(-1).to(torch.int32)
    bp = max(16, triton.next_power_of_2(p))
    bs = max(16, triton.next_power_of_2(max(cache.num_slots, 1)))
    _cache_step_kernel[(1,)](
        ids,
        p,
        cache.ptr_table,
        cache.host_addr,
        cache.slot_addr,
        cache.slot_expert,
        cache.expert_slot,
        cache.ref,
        cache.clock,
        cache.emark,
        cache.victims,
        cache.copy_src,
        cache.copy_dst,
        cache.n_copy,
        cache.stats,
        cache.freq,
        cache.step_table,
        cache.smark,
        cache.saddr,
        cache.scratch_base,
        cache.scratch_slots,
        cache.record_bytes,
        cache.num_slots,
        cache.num_experts,
        cache.ptr_table.numel(),
        cache.admit_max,
        cache.lane_ids,
        cache.lmark,
        cache.lane_share,
        cache.lane_max,
        cache.lane_cap,
        cache.zero_addr,
        cache.record_words if cache.record_words is not None else cache.n_copy,
        cache.copy_len if cache.copy_len is not None else cache.n_copy,
        VARLEN=cache.record_words is not None,
        FILTER=cache.admission_filter,
        SHIFT=cache.decay_shift,
        BLOCK_P=bp,
        BLOCK_S=bs,
        LANE=lane,
        BLOCK_L=max(16, triton.next_power_of_2(cache.lane_cap)),
        BLOCK_E=max(16, triton.next_power_of_2(cache.num_experts)),
        BLOCK_T=max(16, triton.next_power_of_2(cache.ptr_table.numel())),
        num_warps=4 if bp * bp <= 8192 else 8,
    )
