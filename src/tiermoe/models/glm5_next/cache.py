"""Per-sequence state of a glm5_next model: KDA slot states and MLA latent rows.

A serving engine gives each running sequence a slot; one forward may mix slots in any state
(prefill chunks, single-token decode, speculative verification). Two kinds of state:

| layer kind        | state                               | where                               |
|-------------------|-------------------------------------|-------------------------------------|
| KDA               | short-conv window [3C, K-1]          | `KDAStates`: [num_slots, ...] rows  |
| KDA               | delta-rule state [H, dk, dv] fp32    | `KDAStates`: [num_slots, ...] rows  |
| MLA               | normalized kv_a latent [r] per token | rows: `Glm5NextCache` or paged KV   |
| MLA, full indexer | indexer key + k-pool gate [2d]/token | rows, like the latent               |

Layers talk to a "cache" object: `kda` (a `KDAStates`) and `attention_step(batch) -> (step,
row store)`, what an MLA attention core reads; the row store answers `segments(step)` (per
sequence: first row, tokens held, new tokens) and `mla_rows(name, layer, step, b, rows) -> all
rows of that sequence`. `Glm5NextCache` is the self-contained version (contiguous rows per
slot, also for the MTP layer; the step is the SeqBatch); the engine adapter (engine.py)
provides the same over the engine's paged KV cache, with the engine's ForwardBatch as the step
(a decode graph replays the core with each step's ForwardBatch and the same row store). KDA state cannot be rebuilt
from a prefix of pages, so a sequence must start at token 0 or continue exactly where its
slot stopped; anything else (e.g. a prefix-cache hit) raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiermoe.errors import UserError

from .config import Glm5NextConfig


@dataclass
class SeqBatch:
    """Flat token layout of one forward: sequence b owns rows [cu[b], cu[b] + lens[b]).

    `starts[b]` is how many tokens slot `slots[b]` already holds (0 = fresh sequence). With
    `keep_states` (True for all sequences, or one flag per sequence), KDA layers record every
    intermediate state of those sequences so their slots can be rolled back to any prefix of
    the new tokens (speculative verification); `keep[b]` is the per-sequence flag.

    `slot_ids` [B] long on the model's device holds `slots` for the device work (KDA reads and
    writes its state rows by it); under a decode graph it is the static tensor refilled before
    each replay, so the recorded work never reads the host list. None: the model uploads it."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    keep_states: bool | list[bool] = False
    slot_ids: torch.Tensor | None = None
    cu: list[int] = field(init=False)
    keep: list[bool] = field(init=False)

    def __post_init__(self):
        if not (len(self.slots) == len(self.starts) == len(self.lens)):
            raise ValueError("SeqBatch: slots, starts and lens differ in length")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError("SeqBatch: a slot appears twice")
        self.cu = [0]
        for n in self.lens:
            if n < 1:
                raise ValueError("SeqBatch: every sequence needs at least one new token")
            self.cu.append(self.cu[-1] + n)
        if isinstance(self.keep_states, bool):
            self.keep = [self.keep_states] * len(self.lens)
        else:
            self.keep = [bool(k) for k in self.keep_states]
            if len(self.keep) != len(self.lens):
                raise ValueError("SeqBatch: keep_states needs one flag per sequence")

    @property
    def num_tokens(self) -> int:
        return self.cu[-1]

    def last_rows(self) -> list[int]:
        """Row of each sequence's last new token (where next-token logits come from)."""
        return [self.cu[b + 1] - 1 for b in range(len(self.lens))]


class KDAStates:
    """KDA conv windows and recurrent states of slots [0, num_slots) in static tensors.

    Per KDA layer one conv tensor [num_slots, 3C, K-1] and one delta-state tensor
    [num_slots, H, dk, dv] fp32, allocated once: a decode step reads and writes its sequences'
    rows by a device tensor of slot ids (on CUDA the fused decode kernels read and write the rows in
    place, kernels/triton/kda_decode.py; elsewhere `index_select` / `index_copy_`), with no per-slot
    Python and no host sync, so a CUDA graph can record it and replay it for any slots. Host-side
    bookkeeping (tokens held per slot, the recorded states of a verification) stays in lists.

    Until `reserve` fixes the slot count, a slot beyond it grows the tensors (tests and tools
    that drive the model directly); afterwards the addresses never change and such a slot raises.
    """

    def __init__(self, cfg: Glm5NextConfig, num_slots: int, device: torch.device | str, dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.kda_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda(i)]
        self.fixed = False
        self.conv_rows: dict[int, torch.Tensor] = {}  # layer -> [num_slots, 3C, K-1]
        self.ssm_rows: dict[int, torch.Tensor] = {}  # layer -> [num_slots, H, dk, dv] fp32
        self.lengths: list[int] = []  # tokens whose state each slot holds
        # keep_states forward: slot -> layer -> [start, states [n+1, H, dk, dv], window [3C, K-1+n]]
        self.hist: dict[int, dict[int, list]] = {}
        self._grow(num_slots)

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @staticmethod
    def bytes_per_slot(cfg: Glm5NextConfig, dtype: torch.dtype) -> int:
        """What `_grow` allocates per slot: every KDA layer's conv window (model dtype) and delta state (fp32)."""
        conv = 3 * cfg.linear_qkv_dim * (cfg.linear_conv_kernel_dim - 1) * torch.empty((), dtype=dtype).element_size()
        ssm = cfg.linear_num_heads * cfg.linear_head_dim**2 * 4
        return sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_kda(i)) * (conv + ssm)

    def allocated_bytes(self) -> int:
        """Bytes of the state tensors held now (every slot, every KDA layer)."""
        return sum(t.numel() * t.element_size() for rows in (self.conv_rows, self.ssm_rows) for t in rows.values())

    def _grow(self, num_slots: int) -> None:
        """Tensors for `num_slots` slots, the rows of the current ones copied over."""
        c, old = self.cfg, self.num_slots
        for i in self.kda_layers:
            conv = torch.zeros(num_slots, 3 * c.linear_qkv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype,
                               device=self.device)
            h, d = c.linear_num_heads, c.linear_head_dim
            ssm = torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=self.device)
            if old:
                conv[:old].copy_(self.conv_rows[i])
                ssm[:old].copy_(self.ssm_rows[i])
            self.conv_rows[i], self.ssm_rows[i] = conv, ssm
        self.lengths += [0] * (num_slots - old)

    def reserve(self, num_slots: int) -> None:
        """Fix the slot count (the engine's max_num_seqs): fresh tensors whose addresses stay."""
        self.lengths, self.hist, self.fixed = [], {}, False
        self._grow(num_slots)
        self.fixed = True

    def length(self, slot: int) -> int:
        return self.lengths[slot] if 0 <= slot < self.num_slots else 0

    def release(self, slot: int) -> None:
        if 0 <= slot < self.num_slots:
            self.lengths[slot] = 0
        self.hist.pop(slot, None)

    def begin(self, batch: SeqBatch) -> None:
        """Check continuity; zero the state of the batch's sequences that start at token 0."""
        top = max(batch.slots) + 1
        if min(batch.slots) < 0 or (top > self.num_slots and self.fixed):
            raise UserError(f"glm5_next: slot ids {batch.slots} outside the {self.num_slots} reserved slots")
        if top > self.num_slots:
            self._grow(top)
        fresh = []
        for slot, start in zip(batch.slots, batch.starts):
            if start == 0:
                fresh.append(slot)
            elif self.lengths[slot] != start:
                raise UserError(
                    f"glm5_next: slot {slot} holds KDA state for {self.lengths[slot]} tokens but the batch "
                    f"continues at {start} (recurrent state cannot resume from cached pages; "
                    "disable prefix caching for this model)")
            self.hist.pop(slot, None)
        if fresh and self.kda_layers:  # one index upload, then per layer one fill of those rows
            idx = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for i in self.kda_layers:
                self.conv_rows[i].index_fill_(0, idx, 0)
                self.ssm_rows[i].index_fill_(0, idx, 0)

    def commit(self, batch: SeqBatch) -> None:
        for slot, start, n in zip(batch.slots, batch.starts, batch.lens):
            self.lengths[slot] = start + n

    def conv(self, layer: int, slot: int) -> torch.Tensor:
        """[3C, K-1] view of one slot's window (per-sequence prefill path)."""
        return self.conv_rows[layer][slot]

    def ssm(self, layer: int, slot: int) -> torch.Tensor:
        """[H, dk, dv] fp32 view of one slot's delta state."""
        return self.ssm_rows[layer][slot]

    def set_conv(self, layer: int, batch: SeqBatch, b: int, window: torch.Tensor) -> None:
        """window [3C, K-1+n]: the cached columns followed by this forward's pre-conv rows."""
        slot = batch.slots[b]
        row = self.conv_rows[layer][slot]
        if batch.keep[b]:
            self.hist.setdefault(slot, {}).setdefault(layer, [batch.starts[b], None, None])[2] = window.clone()
        row.copy_(window[:, window.shape[-1] - row.shape[-1]:])

    def set_ssm(self, layer: int, batch: SeqBatch, b: int, state: torch.Tensor,
                steps: torch.Tensor | None = None) -> None:
        """state [H, dk, dv]; steps [n+1, H, dk, dv] (keep_states only): before/after each token."""
        slot = batch.slots[b]
        if steps is not None:
            self.hist.setdefault(slot, {}).setdefault(layer, [batch.starts[b], None, None])[1] = steps
        self.ssm_rows[layer][slot].copy_(state)

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens; they must lie inside the slot's last keep_states forward."""
        if length == self.length(slot):
            return
        hist = self.hist.get(slot, {})
        for layer, (start, steps, window) in hist.items():
            j = length - start
            if steps is None or not 0 <= j < steps.shape[0]:
                raise RuntimeError(f"slot {slot}: rollback to {length} is outside the recorded span")
            self.ssm_rows[layer][slot].copy_(steps[j])
            km1 = self.conv_rows[layer].shape[-1]
            self.conv_rows[layer][slot].copy_(window[:, j:j + km1])
        if not hist and self.kda_layers:
            raise RuntimeError(f"slot {slot}: rollback needs a keep_states forward")
        self.lengths[slot] = length
        self.hist.pop(slot, None)


class SequenceRows:
    """The row-store side of a cache whose MLA rows are kept per sequence (no block tables): the
    MLA layers always take their per-sequence cores (mla.py; the engine's paged store is
    engine._PagedRows)."""

    @staticmethod
    def segments(batch: SeqBatch) -> list[tuple[int, int, int]]:
        """Per sequence: (first row in the flat tokens, tokens already held, new tokens)."""
        return [(batch.cu[b], batch.starts[b], batch.lens[b]) for b in range(len(batch.lens))]

    @staticmethod
    def decode_tables(layer: int, batch: SeqBatch) -> None:
        return None

    def decode_rows(self, name: str, layer: int, batch: SeqBatch, rows: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a per-sequence row store has no block tables (decode_tables is None)")


class Glm5NextCache(SequenceRows):
    """Self-contained state for `num_slots` sequences of up to `max_len` tokens.

    MLA rows are stored contiguously per slot ([num_slots, max_len, W] per layer and kind);
    rows past a slot's length are stale and never read, so dropping tokens is a length change.
    With `mtp`, the MTP layer (key num_hidden_layers) gets rows too, with its own lengths."""

    def __init__(
        self, cfg: Glm5NextConfig, num_slots: int, max_len: int,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, mtp: bool = False,
    ):
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.kda = KDAStates(cfg, num_slots, device, dtype)
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda(i)]
        if mtp and cfg.num_nextn_predict_layers:
            mla.append(cfg.mtp_layer_idx)
        for i in mla:
            self.rows["latent", i] = torch.zeros(num_slots, max_len, cfg.kv_lora_rank, dtype=dtype, device=device)
            if not cfg.shares_topk(i):
                self.rows["index", i] = torch.zeros(num_slots, max_len, 2 * cfg.index_head_dim, dtype=dtype,
                                                    device=device)
        self.mla_lengths = [0] * num_slots
        self.mtp_lengths = [0] * num_slots

    @property
    def lengths(self) -> list[int]:
        """Tokens held by the trunk per slot."""
        return self.mla_lengths

    def reset(self, slot: int) -> None:
        self.mla_lengths[slot] = self.mtp_lengths[slot] = 0
        self.kda.release(slot)

    def check(self, batch: SeqBatch, mtp: bool = False) -> None:
        """Validate a batch against slot lengths and capacity before any state is touched."""
        lengths = self.mtp_lengths if mtp else self.mla_lengths
        for s, st, n in zip(batch.slots, batch.starts, batch.lens):
            if not 0 <= s < self.num_slots:
                raise UserError(f"cache: slot {s} out of range (num_slots={self.num_slots})")
            if st not in (0, lengths[s]):
                raise UserError(f"cache: slot {s} holds {lengths[s]} tokens, batch starts at {st}")
            if st + n > self.max_len:
                raise UserError(f"cache: slot {s} would hold {st + n} tokens, max_len={self.max_len}")

    def commit(self, batch: SeqBatch, mtp: bool = False) -> None:
        lengths = self.mtp_lengths if mtp else self.mla_lengths
        for s, st, n in zip(batch.slots, batch.starts, batch.lens):
            lengths[s] = st + n

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` trunk tokens of `slot` (see KDAStates.rollback)."""
        self.kda.rollback(slot, length)
        self.mla_lengths[slot] = length

    def rollback_mtp(self, slot: int, length: int) -> None:
        """MTP rows are attention-only: dropping entries is a length change."""
        self.mtp_lengths[slot] = min(self.mtp_lengths[slot], length)

    def attention_step(self, batch: SeqBatch) -> tuple[SeqBatch, "Glm5NextCache"]:
        """What an MLA attention core reads: the batch itself, and this cache as its row store."""
        return batch, self

    def mla_rows(self, name: str, layer: int, batch: SeqBatch, b: int, rows: torch.Tensor) -> torch.Tensor:
        """Store rows [n, W] at the sequence's new positions; return all its rows [start+n, W]."""
        buf = self.rows[name, layer][batch.slots[b]]
        start = batch.starts[b]
        buf[start:start + rows.shape[0]].copy_(rows)
        return buf[: start + rows.shape[0]]
