"""Prefill staging for the device cache: each layer's non-resident experts copied into HBM rows.

A prefill chunk touches many experts, and the MoE kernel would read an in-place host record once per
block of tokens, through launch configurations tuned for HBM; one copy per record is cheaper from a
few tokens on (STAGE_TOKENS). Two ways to decide which records to copy (prefill never changes the slot cache):

- per layer (chunks of STAGE_TOKENS to STAGE_ALL_TOKENS - 1 tokens): the layer's picked experts
  that are not in slots, read back to the host when the layer runs (one host sync per layer);
- planned once per chunk (chunks of STAGE_ALL_TOKENS tokens or more, which pick nearly every
  expert anyway): every non-resident expert of every layer, from one host read of all layers'
  residency at the start of the step. No host sync per layer, so the host queues the whole
  forward ahead of the GPU. With two staging buffers (`--prefill-staging-gb` large enough for
  two layers) the copies run one layer ahead on a side stream, overlapping the previous
  layer's compute; with one buffer they queue on the compute stream right before their layer.
  The second buffer may be lent by the slot cache instead of allocated (`SlotLender`, sized by
  `lend_share`): a few slots of every layer, given back before the next cache decision.

Experts beyond the rows of a buffer keep their host address (read in place by the kernel).
Exactness: the kernel reads the same bytes from a staging row as from the host record.
"""

from __future__ import annotations

import torch

# Non-decode chunks from this size copy their misses to staging rows instead of reading them in place: a few new
# tokens behind a cached prefix are such a chunk. Above fused_moe's decode bucket (16 tokens) the kernel's prefill
# configuration reads host records in place at a fraction of the copy engine's rate, and from 4 tokens the copy is
# already the cheaper of the two (scripts/short_prefill_probe.py, docs/results.md).
STAGE_TOKENS = 4
STAGE_ALL_TOKENS = 1024  # from this size: every non-resident expert, planned once per chunk


class PrefillStaging:
    """Staging rows and copy plans for the device cache's prefill chunks (see module doc).

    entries[layer]: the pinned host record of each routed expert; caches[layer]: its ExpertCache
    (expert_slot, ptr_table); rows: staging rows per buffer; buffers: 1 or 2.
    """

    def __init__(self, entries: dict[int, list[torch.Tensor]], caches: dict, record_bytes: int, rows: int,
                 buffers: int, device: torch.device, lender=None) -> None:
        self.entries, self.caches, self.record_bytes = entries, caches, record_bytes
        self.lender = lender  # SlotLender: buffer 1 is lent slots, only during planned chunks
        self.rows, self.num_buffers, self.device = max(0, int(rows)), max(1, int(buffers)), torch.device(device)
        self.layers = list(caches)
        self._bufs: list[torch.Tensor] = []  # allocated by the first chunk that stages
        self._plan: dict[int, tuple[int, list[int], torch.Tensor]] | None = None  # layer -> (buffer, experts, table)
        self._consumed: set[int] = set()  # planned layers whose table was handed out
        self._plan_bufs: list[torch.Tensor] = []
        self._tables_host: torch.Tensor | None = None
        cuda = self.device.type == "cuda" and self.num_buffers > 1
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._side_busy = False  # side-stream copies queued since the last begin()
        self._copied: dict[int, torch.cuda.Event] = {}
        self._freed: dict[int, torch.cuda.Event] = {}
        self.staged = 0  # records copied
        self.in_place = 0  # non-resident experts of planned chunks left to in-place reads (too few rows)
        self.planned_chunks = 0  # chunks planned once (no host sync per layer)

    def _buf(self, i: int) -> torch.Tensor:
        if i == 1 and self.lender is not None:  # only from begin(), on the compute stream
            return self.lender.borrow()  # [rows, R] of slots (emptied on the first call of a run of chunks)
        while len(self._bufs) <= i:  # a plain tensor even when the first user (warm-up) runs in inference mode
            with torch.inference_mode(False):
                buf = torch.empty(max(1, self.rows), self.record_bytes, dtype=torch.uint8, device=self.device)
            self._bufs.append(buf)
        return self._bufs[i]

    # -- per chunk ------------------------------------------------------------------------------
    def begin(self, tokens: int) -> None:
        """Start of a step of `tokens` prefill tokens (0 for decode): plan it when large enough.

        The plan (every layer's non-resident experts and its staged pointer table) comes from one
        read of all layers' residency and tables, and reaches the device in one copy.
        """
        self._plan = None
        self._wait_side()
        if tokens < STAGE_ALL_TOKENS or not self.rows or not self.layers:
            self.return_loan()  # lent slots refilled before any other step reads the cache
            return
        bufs = [self._buf(b) for b in range(self.num_buffers)]  # allocated (or lent) before the residency read
        self._plan_bufs = bufs  # the plan's copies go here, whatever happens to a loan meanwhile
        sizes = [len(self.caches[layer].ptr_table) for layer in self.layers]
        state = torch.cat([torch.cat((self.caches[layer].expert_slot.to(torch.int64), self.caches[layer].ptr_table))
                           for layer in self.layers]).cpu()  # the one host read: [sum(E + E_total)]
        tables, plan, off = [], {}, 0
        for i, layer in enumerate(self.layers):
            n = len(self.entries[layer])
            slots, table = state[off : off + n], state[off + n : off + n + sizes[i]].clone()  # [E], [E_total]
            off += n + sizes[i]
            b = i % self.num_buffers
            missing = torch.nonzero(slots < 0).flatten()  # ascending
            need = missing[: len(bufs[b])]
            self.in_place += len(missing) - len(need)  # read over PCIe by the kernel instead
            table[need] = torch.arange(len(need), dtype=torch.int64) * self.record_bytes + bufs[b].data_ptr()
            tables.append(table)
            plan[layer] = (b, need.tolist())
        flat = torch.cat(tables)
        if self.device.type == "cuda":
            flat = flat.pin_memory()
        self._tables_host = flat  # kept alive until the next plan (the copy below is asynchronous)
        dev_tables = flat.to(self.device, non_blocking=True).split(sizes)
        self._plan = {layer: (b, need, dev_tables[i]) for i, (layer, (b, need)) in enumerate(plan.items())}
        self._consumed: set[int] = set()
        self.planned_chunks += 1
        self._copied, self._freed = {}, {}
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            self._stage_ahead(0)

    def return_loan(self) -> None:
        """Give lent slots back (after any queued staging copy; a plan using them is dropped)."""
        if self.lender is None or not self.lender.lent:
            return
        self._wait_side()
        self._plan = None
        self.lender.give_back()

    def table(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The pointer table [E_total] the layer's MoE kernel reads, its staged rows in place."""
        if self._plan is None or layer not in self._plan or layer in self._consumed:
            if self._plan is not None and self._side is not None:
                # a layer run twice inside a plan whose side stream may already fill buffer 0 with
                # a later layer's records: read this layer's misses in place instead
                return self.caches[layer].ptr_table
            return self._table_for_picks(layer, topk_ids)  # a mid-size chunk, or a layer run twice
        self._consumed.add(layer)
        b, need, table = self._plan[layer]
        if self._side is None:  # one buffer (or no CUDA): copy on this stream, right before the layer
            self._copy(layer, need, self._plan_bufs[b])
        else:
            i = self.layers.index(layer)
            self._stage_ahead(i)  # already queued unless layers ran out of order
            torch.cuda.current_stream(self.device).wait_event(self._copied[layer])
            self._stage_ahead(i + 1)
        return table

    def done(self, layer: int) -> None:
        """The layer's MoE kernel is queued: its buffer may be refilled once that kernel ran."""
        if self._plan is None or layer not in self._plan:
            return
        if self._side is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._freed[layer] = ev
        if len(self._consumed) == len(self._plan):  # every planned layer ran: the plan is spent
            self._plan = None

    # -- internals ------------------------------------------------------------------------------
    def _table_for_picks(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The layer's picked non-resident experts, read back now (one host sync), staged in buffer 0."""
        self._wait_side()
        cache = self.caches[layer]
        used = torch.zeros(cache.num_experts, dtype=torch.bool, device=topk_ids.device)
        used[topk_ids.reshape(-1)] = True
        need = torch.nonzero(used & (cache.expert_slot < 0)).flatten().tolist()[: self.rows]  # ascending
        buf = self._buf(0)
        self._copy(layer, need, buf)
        table = cache.ptr_table.clone()
        if need:
            rows = torch.arange(len(need), dtype=torch.int64) * self.record_bytes + buf.data_ptr()
            table[torch.tensor(need, dtype=torch.int64)] = rows.to(table.device)
        return table

    def _wait_side(self) -> None:
        """The compute stream waits for side-stream copies still queued (a plan left unfinished)."""
        if self._side_busy:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._side_busy = False

    def _stage_ahead(self, i: int) -> None:
        """Queue layer i's copies on the side stream, after the kernel that last read its buffer."""
        if i >= len(self.layers) or self.layers[i] in self._copied or self.layers[i] in self._consumed:
            return
        layer = self.layers[i]
        b, need, _ = self._plan[layer]
        with torch.cuda.stream(self._side):
            if i >= self.num_buffers:
                prev = self.layers[i - self.num_buffers]
                if prev in self._freed:
                    self._side.wait_event(self._freed[prev])
            self._copy(layer, need, self._plan_bufs[b])
            ev = torch.cuda.Event()
            ev.record(self._side)
            self._copied[layer] = ev
        self._side_busy = True

    def _copy(self, layer: int, need: list[int], buf: torch.Tensor) -> None:
        """Records `need` (ascending) -> buf rows 0.., one copy per run of records adjacent in host memory."""
        entries, r = self.entries[layer], self.record_bytes
        row = 0
        while row < len(need):
            end = row + 1
            while end < len(need) and _adjacent(entries[need[end - 1]], entries[need[end]], r):
                end += 1
            src = torch.as_strided(entries[need[row]], (end - row, r), (r, 1))  # [n, R] view of the run
            buf[row:end].copy_(src, non_blocking=True)
            row = end
        self.staged += len(need)


def _adjacent(a: torch.Tensor, b: torch.Tensor, record_bytes: int) -> bool:
    """Is host entry b the record right after a, in the same allocation (one strided view)?"""
    return (b.data_ptr() == a.data_ptr() + record_bytes
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def lend_share(slots: list[int], rows: int) -> int:
    """Slots each layer lends (its last ones) so that the lent rows hold one planned layer's
    staging, which the loan itself grows by the share: sum(min(m, s)) >= rows + m. 0 where no
    share works (a single MoE layer, or too few slots)."""
    if len(slots) < 2 or rows <= 0:
        return 0
    for m in range(1, max(slots) + 1):
        if sum(min(m, s) for s in slots) >= rows + m:
            return m
    return 0


class SlotLender:
    """Lends the last slots of the layers (`lent[layer]` each, at most the share, side by side at
    the end of the slot arena of `cache`, a DeviceCacheExperts: one buffer's rows) to prefill
    staging as its second buffer.

    Two staging buffers let large prefill chunks copy one layer ahead, overlapping the previous
    layer's compute, but a buffer of dedicated memory is one more layer of non-resident experts
    in HBM that decode would rather spend on slots. A loan empties those
    slots (their experts point back at their host copies) for a run of planned prefill chunks;
    every layer lends only a few, so no layer's staging outgrows the buffers (sized for the most
    non-resident experts plus the share). `give_back` puts the same experts back (tables and one
    gather per layer, no host sync) before any cache decision. Outputs do not change: only where
    records are read from does (tests/moe/test_device_cache.py).
    """

    def __init__(self, cache, lent: dict[int, int]) -> None:
        self.cache, self.lent_slots = cache, {layer: n for layer, n in lent.items() if n}
        self.rows = cache.prefill_rows  # the buffer: the first rows of the lendable part
        self._held: dict[int, tuple[int, torch.Tensor]] | None = None  # layer -> (first slot, experts held)
        self.loans = 0

    @property
    def lent(self) -> bool:
        return self._held is not None

    def borrow(self) -> torch.Tensor:
        """Empty the lendable slots (once per run of planned chunks); returns the buffer [rows, R]."""
        if self._held is None:
            self._held = {}
            for layer, n in self.lent_slots.items():
                first = self.cache.slots_per_layer[layer] - n
                self._held[layer] = (first, self.cache.caches[layer].lend_slots(first))
            self.loans += 1
        return self.cache.arena[self.cache.lend_start : self.cache.lend_start + self.rows]

    def give_back(self) -> None:
        """Put the experts back into their slots (queued on the current stream)."""
        if self._held is None:
            return
        for layer, (first, held) in self._held.items():
            self.cache.caches[layer].restore_slots(first, held)
        self._held = None
