"""Disk-only experts under the device cache: the device asks the host for the records it cannot find
in host RAM, with no host synchronisation (so a decode step stays capturable in a CUDA graph).

When host RAM holds only some of the routed experts, a decode step's cache decision
(`cache_manager.cache_step`) may meet a miss whose record is on disk only: its `host_addr` row is 0.
Before the cache step, per MoE layer:

  device (compute stream)                               host (the disk tier's server thread)
  need(layer, topk_ids):  the picks that are neither
      in a slot nor in RAM -> request (mapped)
      seq += 1 and posted = seq, only if there are any  polls posted; reads the records with
  wait:  one warp spins until done >= seq                O_DIRECT into free host entries (evicting
         (bounded; a step with no request does not      other layers' entries), writes answers
         wait at all)                                   (layer row, expert, address) -- the loads
  apply: each answer's host_addr row, and its           and the evictions (address 0) -- then
         ptr_table row where the expert is not in a     done = posted
         slot (a device kernel: the tables stay in
         device memory)

so the cache step that follows finds every pick in a slot or in RAM. An eviction answered here
is of another layer's expert: every kernel of the earlier layers is done in stream order, and
later layers ask again. A wait that runs out of polls, or an answer the host marks failed, points
the requested experts at `zero_addr` (an all-zero record: the step computes zeros for them instead
of reading address 0) and leaves the error mark, so the owner fails the step and repairs the
tables (moe/disk_tier.py); a failed read is answered that way by the host itself, beside the
changes it did make.

Layer-ahead reads (`hint_next`, no wait): after its own request, a decode layer posts the predicted
picks of the next MoE layers (moe/device_cache.py: LAYERS_AHEAD of them; each one's router on this
layer's input) that are on disk only; the host starts reading them into free entries and announces
them when that layer asks (a short answer, no disk wait). The host keeps that many steps' worth of
entries free by evicting within its answers, so a hinted read never needs an eviction the device has
not applied. Hints go into a ring of HINT_SLOTS areas (hint seq s in area (s - 1) % HINT_SLOTS), so
several posted in one layer all reach the host; one the host did not read before the ring came round
to it again is dropped (`read_hints`).

The control words reuse the CPU lane mailbox's layout (kernels/triton/mailbox.py: POSTED, NTOK,
DONE, ERR, POLLS in one int64 [16] row, pinned and mapped) and its wait kernel; NANS holds the
answer count. Requests are int32 [1 + max_picks] (the layer row, then the picks in pick order,
repeats included: the host dedups); answers int64 [3 * max_answers] triples. Twins:
`kernels.reference.residency_need_ref`, `residency_apply_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiermoe.kernels.reference import MAILBOX_CTRL, MAILBOX_DONE, MAILBOX_ERR, MAILBOX_NTOK, MAILBOX_POLLS
from tiermoe.kernels.reference import MAILBOX_POSTED, RESIDENCY_NANS
from tiermoe.kernels.triton.mailbox import DEFAULT_MAX_SPINS, _INTERPRET, _release_store, _wait_kernel

HINT_SLOTS = 8  # hint areas in the ring: hints the device may post before the host reads the oldest


@triton.jit
def _list_on_disk(ids_ptr, P, host_addr_ptr, expert_slot_ptr, out, BLOCK_P: tl.constexpr):
    """The picks (P of them at ids_ptr) neither in a slot nor in RAM -> out[0..n), in pick order; returns n."""
    offs = tl.arange(0, BLOCK_P)
    m = offs < P
    e = tl.load(ids_ptr + offs, mask=m, other=0)
    in_slot = tl.load(expert_slot_ptr + e, mask=m, other=0) >= 0
    in_ram = tl.load(host_addr_ptr + e, mask=m, other=1) != 0
    need = m & (~in_slot) & (~in_ram)
    flag = need.to(tl.int32)
    tl.store(out + tl.cumsum(flag, axis=0) - 1, e, mask=need)
    return tl.sum(flag, axis=0)


@triton.jit(do_not_specialize=["P", "row"])
def _need_kernel(ids_ptr, P, host_addr_ptr, expert_slot_ptr, seq_ptr, posted_now_ptr, row, ctrl_addr, req_addr,
                 POSTED: tl.constexpr, NTOK: tl.constexpr, BLOCK_P: tl.constexpr, ASM: tl.constexpr):
    """One program: the picks neither in a slot nor in RAM -> request; post only if there are any."""
    ctrl = ctrl_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    req = req_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    n = _list_on_disk(ids_ptr, P, host_addr_ptr, expert_slot_ptr, req + 1, BLOCK_P)
    tl.store(req, row)
    posting = (n > 0).to(tl.int64)
    s = tl.load(seq_ptr) + posting
    tl.store(seq_ptr, s)
    tl.store(posted_now_ptr, posting.to(tl.int32))
    tl.store(ctrl + NTOK, n.to(tl.int64))
    tl.debug_barrier()  # the request's stores happen before the release below
    _release_store(ctrl + POSTED, s, ASM)  # unchanged when nothing was asked: the host sees no new request


@triton.jit(do_not_specialize=["P", "row"])
def _hint_kernel(ids_ptr, P, host_addr_ptr, expert_slot_ptr, hint_seq_ptr, row, hctrl_addr, hint_addr, stride,
                 POSTED: tl.constexpr, SLOTS: tl.constexpr, BLOCK_P: tl.constexpr, ASM: tl.constexpr):
    """One program: predicted picks of layer row `row` neither in a slot nor in RAM -> the ring's next hint
    area (row, count, ids; `stride` int32 words an area), hint seq += 1, released; nothing waits."""
    hctrl = hctrl_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    s = tl.load(hint_seq_ptr) + 1
    hint = hint_addr.to(tl.int64).to(tl.pointer_type(tl.int32)) + ((s - 1) % SLOTS) * stride
    n = _list_on_disk(ids_ptr, P, host_addr_ptr, expert_slot_ptr, hint + 2, BLOCK_P)
    tl.store(hint, row)
    tl.store(hint + 1, n)
    tl.store(hint_seq_ptr, s)
    tl.debug_barrier()
    _release_store(hctrl + POSTED, s, ASM)


@triton.jit
def _apply_kernel(posted_now_ptr, ok_ptr, ctrl_addr, ans_addr, req_addr, host_ptrs, table_ptrs, slot_ptrs,
                  zero_addr, NANS: tl.constexpr, NTOK: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the host's answers into the tables (a request of this step, answered); after a
    wait that ran out of polls the requested experts point at the zero record instead."""
    ctrl = ctrl_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    ans = ans_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    req = req_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    posted = tl.load(posted_now_ptr) != 0
    ok = tl.load(ok_ptr) != 0  # answered in time (a failed answer still lists every change the host made)
    n_ans = tl.where(posted & ok, tl.load(ctrl + NANS, volatile=True), 0)
    for off in range(0, n_ans, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        m = offs < n_ans
        row = tl.load(ans + 3 * offs, mask=m, other=0, cache_modifier=".cv")
        e = tl.load(ans + 3 * offs + 1, mask=m, other=0, cache_modifier=".cv")
        addr = tl.load(ans + 3 * offs + 2, mask=m, other=0, cache_modifier=".cv")
        _set_rows(row, e, addr, m, host_ptrs, table_ptrs, slot_ptrs)
    # no answer in time: every requested expert of this step's layer reads the zero record (the owner repairs)
    n_bad = tl.where(posted & (~ok), tl.load(ctrl + NTOK), 0)
    row0 = tl.load(req)
    for off in range(0, n_bad, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        m = offs < n_bad
        e = tl.load(req + 1 + offs, mask=m, other=0)
        _set_rows(tl.zeros_like(e) + row0, e, tl.zeros_like(e).to(tl.int64) + zero_addr, m, host_ptrs,
                  table_ptrs, slot_ptrs)


@triton.jit
def _set_rows(row, e, addr, m, host_ptrs, table_ptrs, slot_ptrs):
    """host_addr[row][e] = addr, and ptr_table[row][e] = addr where expert_slot[row][e] < 0."""
    host = tl.load(host_ptrs + row, mask=m, other=0).to(tl.pointer_type(tl.int64))
    table = tl.load(table_ptrs + row, mask=m, other=0).to(tl.pointer_type(tl.int64))
    slots = tl.load(slot_ptrs + row, mask=m, other=0).to(tl.pointer_type(tl.int32))
    tl.store(host + e, addr, mask=m)
    in_slot = tl.load(slots + e, mask=m, other=0) >= 0
    tl.store(table + e, addr, mask=m & (~in_slot))


class ResidencyMailbox:
    """The device's side of the disk tier: control, request and answer areas in mapped pinned memory,
    the sequence counter and flags on the device, and each layer row's table addresses.

    tables: per layer row (host_addr int64 [E], ptr_table int64 [>= E], expert_slot int32 [E]), the
    device cache's own tensors (written in place, never reallocated); max_picks: the most picks a
    cache step takes; zero_addr: an all-zero record the failure path points experts at."""

    def __init__(self, tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], max_picks: int,
                 max_answers: int, zero_addr: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.max_picks, self.max_answers, self.zero_addr = int(max_picks), int(max_answers), int(zero_addr)
        self.ctrl = torch.zeros(MAILBOX_CTRL, dtype=torch.int64, pin_memory=pin)  # [16] control words
        self.request = torch.zeros(1 + self.max_picks, dtype=torch.int32, pin_memory=pin)  # row | picks
        self.answers = torch.zeros(3 * self.max_answers, dtype=torch.int64, pin_memory=pin)  # (row, e, addr)...
        self.hint_ctrl = torch.zeros(MAILBOX_CTRL, dtype=torch.int64, pin_memory=pin)  # [16] POSTED: hint seq
        # [HINT_SLOTS, 2 + max_picks] areas: row | count | ids
        self.hint = torch.zeros(HINT_SLOTS, 2 + self.max_picks, dtype=torch.int32, pin_memory=pin)
        self.hint_seq = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.seq = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.ok = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.posted_now = torch.zeros(1, dtype=torch.int32, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.tables = tables
        self.host_ptrs = torch.tensor([h.data_ptr() for h, _, _ in tables], **i64)  # [L]
        self.table_ptrs = torch.tensor([t.data_ptr() for _, t, _ in tables], **i64)  # [L]
        self.slot_ptrs = torch.tensor([s.data_ptr() for _, _, s in tables], **i64)  # [L]
        self._asm = pin and not _INTERPRET

    # raw addresses handed to the kernels (host address == device address under UVA)
    def _ctrl_addr(self) -> int:
        return self.ctrl.data_ptr()

    def _req_addr(self) -> int:
        return self.request.data_ptr()

    def _ans_addr(self) -> int:
        return self.answers.data_ptr()

    def _hctrl_addr(self) -> int:
        return self.hint_ctrl.data_ptr()

    def _hint_addr(self) -> int:
        return self.hint.data_ptr()

    def hint_next(self, row: int, predicted_ids: torch.Tensor) -> None:
        """Queue a hint (no wait): layer row `row` will likely pick predicted_ids [T, k]; the host may
        start reading those on disk only into free entries (announced when the row asks for them)."""
        host, _, slots = self.tables[row]
        ids = predicted_ids.reshape(-1).to(torch.int32)
        p = min(ids.numel(), self.max_picks)
        _hint_kernel[(1,)](ids, p, host, slots, self.hint_seq, row, self._hctrl_addr(), self._hint_addr(),
                           self.hint.shape[1], POSTED=MAILBOX_POSTED, SLOTS=HINT_SLOTS,
                           BLOCK_P=max(16, triton.next_power_of_2(p)), ASM=self._asm, num_warps=4)

    def ensure(self, row: int, topk_ids: torch.Tensor, max_spins: int = DEFAULT_MAX_SPINS) -> None:
        """Queue, for layer row `row`, the request for its picks topk_ids [T, k] that are on disk
        only, the wait for the answer and the tables' update (no host sync; nothing waits when every
        pick is in a slot or in RAM)."""
        host, _, slots = self.tables[row]
        ids = topk_ids.reshape(-1).to(torch.int32)
        p = ids.numel()
        if p > self.max_picks:
            raise ValueError(f"{p} picks exceed max_picks={self.max_picks}")
        _need_kernel[(1,)](ids, p, host, slots, self.seq, self.posted_now, row, self._ctrl_addr(),
                           self._req_addr(), POSTED=MAILBOX_POSTED, NTOK=MAILBOX_NTOK,
                           BLOCK_P=max(16, triton.next_power_of_2(p)), ASM=self._asm, num_warps=4)
        _wait_kernel[(1,)](self.seq, 0, self.ok, self._ctrl_addr(), int(max_spins), self.seq, self.seq,  # untimed
                           DONE=MAILBOX_DONE, ERR=MAILBOX_ERR, POLLS=MAILBOX_POLLS, ASM=self._asm, num_warps=1)
        _apply_kernel[(1,)](self.posted_now, self.ok, self._ctrl_addr(), self._ans_addr(),
                            self._req_addr(), self.host_ptrs, self.table_ptrs, self.slot_ptrs,
                            self.zero_addr, NANS=RESIDENCY_NANS, NTOK=MAILBOX_NTOK, BLOCK=64,
                            num_warps=1)

    # ---------------------------------------------------------------- the host's side
    def pending(self) -> int:
        """The sequence number of an unanswered request, else 0 (host polling, no sync)."""
        posted, done = int(self.ctrl[MAILBOX_POSTED]), int(self.ctrl[MAILBOX_DONE])
        return posted if posted > done else 0

    def read_request(self) -> tuple[int, list[int]]:
        """(layer row, picks on disk only, deduplicated in pick order) of the pending request."""
        n = int(self.ctrl[MAILBOX_NTOK])
        words = self.request[: 1 + n].tolist()
        return words[0], list(dict.fromkeys(words[1:]))

    def read_hints(self, last: int) -> tuple[int, list[tuple[int, list[int]]]]:
        """(newest hint seq, [(layer row, predicted picks on disk only, deduplicated in pick order)] of the
        hints after `last`, oldest first). Hints the ring came round to before they were read are left out,
        and so is any the device may be writing over while this reads (the area of the next post)."""
        seq = int(self.hint_ctrl[MAILBOX_POSTED])
        if seq == last:
            return last, []
        first = max(last + 1, seq - HINT_SLOTS + 1)
        areas = self.hint.tolist()  # [HINT_SLOTS][2 + max_picks]
        after = int(self.hint_ctrl[MAILBOX_POSTED])
        hints = []
        for s in range(max(first, after + 2 - HINT_SLOTS), seq + 1):  # areas no post since could touch
            words = areas[(s - 1) % HINT_SLOTS]
            n = min(max(0, words[1]), self.max_picks)
            hints.append((words[0], list(dict.fromkeys(words[2 : 2 + n]))))
        return seq, hints

    def answer(self, seq: int, updates: list[tuple[int, int, int]], failed: bool = False) -> None:
        """Publish (row, expert, address) updates for request `seq`: every load and eviction the host
        made (failed: also the error mark; the host then answers its failed experts with the zero
        record, and the owner fails the step and repairs)."""
        if len(updates) > self.max_answers:
            raise RuntimeError(f"{len(updates)} answers exceed max_answers={self.max_answers}")
        if updates:
            self.answers[: 3 * len(updates)] = torch.tensor(updates, dtype=torch.int64).reshape(-1)
        self.ctrl[RESIDENCY_NANS] = len(updates)
        if failed:
            self.ctrl[MAILBOX_ERR] = -seq
        self.ctrl[MAILBOX_DONE] = seq  # after the answers (x86 stores are not reordered)

    def error(self) -> int:
        """0: fine; > 0 the device gave up waiting for that number; < 0 the host failed that request."""
        return int(self.ctrl[MAILBOX_ERR])

    def clear_error(self) -> None:
        self.ctrl[MAILBOX_ERR] = 0

    def wait_polls(self) -> int:
        return int(self.ctrl[MAILBOX_POLLS])
