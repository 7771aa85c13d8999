"""Per-sequence-slot state of a glm5_next model: KDA states and MLA latent rows.

A serving engine gives each running sequence a slot; one forward call may mix slots in any
state (prefill chunks, single-token decode, speculative verification). Layout per layer:

| layer kind          | tensor                         | shape                         |
|---------------------|--------------------------------|-------------------------------|
| KDA                 | `conv[l]` short-conv window    | [slots, 3*C, K-1] model dtype |
| KDA                 | `ssm[l]` delta-rule state      | [slots, H, dk, dv] fp32       |
| MLA                 | `latent[l]` normalized kv_a    | [slots, max_len, kv_lora]     |
| MLA, full indexer   | `index[l]` indexer key | gate  | [slots, max_len, 2*d_index]   |

The MTP layer (key `cfg.num_hidden_layers`) has its own latent/index rows and its own length.
Rows past a slot's length are garbage and never read, so rollback of MLA rows is just a
length change; KDA rollback needs the per-token states recorded by a `keep_states` forward.
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
    `keep_states`, KDA layers record every intermediate state so `Glm5NextCache.rollback`
    can keep any prefix of the new tokens (speculative verification)."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    keep_states: bool = False
    cu: list[int] = field(init=False)

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

    @property
    def num_tokens(self) -> int:
        return self.cu[-1]

    def last_rows(self) -> list[int]:
        """Row of each sequence's last new token (where next-token logits come from)."""
        return [self.cu[b + 1] - 1 for b in range(len(self.lens))]


class Glm5NextCache:
    """Slot-indexed KDA states and MLA latent/indexer rows for `num_slots` sequences."""

    def __init__(
        self, cfg: Glm5NextConfig, num_slots: int, max_len: int,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, mtp: bool = False,
    ):
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.device, self.dtype = torch.device(device), dtype
        c3, km1 = 3 * cfg.linear_qkv_dim, cfg.linear_conv_kernel_dim - 1
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        self.latent: dict[int, torch.Tensor] = {}
        self.index: dict[int, torch.Tensor] = {}
        mla_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda(i)]
        if mtp and cfg.num_nextn_predict_layers:
            mla_layers.append(cfg.mtp_layer_idx)
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda(i):
                self.conv[i] = torch.zeros(num_slots, c3, km1, dtype=dtype, device=self.device)
                self.ssm[i] = torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=self.device)
        for i in mla_layers:
            self.latent[i] = torch.zeros(num_slots, max_len, cfg.kv_lora_rank, dtype=dtype, device=self.device)
            if not cfg.shares_topk(i):
                self.index[i] = torch.zeros(
                    num_slots, max_len, 2 * cfg.index_head_dim, dtype=dtype, device=self.device
                )
        self.lengths = [0] * num_slots  # tokens held by the trunk per slot
        self.mtp_lengths = [0] * num_slots  # MTP entries held per slot
        self._hist: dict[int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]] = {}

    # ---- slot lifecycle ------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Forget a slot's sequence (a fresh `starts=0` forward overwrites it anyway)."""
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0
        for i in self.conv:
            self.conv[i][slot].zero_()
            self.ssm[i][slot].zero_()
        self._hist.pop(slot, None)

    def check(self, batch: SeqBatch, mtp: bool = False) -> None:
        """Validate a batch against slot lengths and capacity before any state is touched."""
        lengths = self.mtp_lengths if mtp else self.lengths
        for s, st, n in zip(batch.slots, batch.starts, batch.lens):
            if not 0 <= s < self.num_slots:
                raise UserError(f"cache: slot {s} out of range (num_slots={self.num_slots})")
            if st != lengths[s] and not (st == 0):
                raise UserError(f"cache: slot {s} holds {lengths[s]} tokens, batch starts at {st}")
            if st + n > self.max_len:
                raise UserError(f"cache: slot {s} would hold {st + n} tokens, max_len={self.max_len}")

    def commit(self, batch: SeqBatch, mtp: bool = False) -> None:
        lengths = self.mtp_lengths if mtp else self.lengths
        for s, st, n in zip(batch.slots, batch.starts, batch.lens):
            lengths[s] = st + n

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first `length` trunk tokens of `slot`; tokens beyond must come from the
        last `keep_states` forward of that slot."""
        hist = self._hist.get(slot)
        if length == self.lengths[slot]:
            return
        if hist is None:
            raise RuntimeError(f"slot {slot}: rollback needs a keep_states forward")
        for i, (start, states, window) in hist.items():
            j = length - start
            if not 0 <= j < states.shape[0]:
                raise RuntimeError(f"slot {slot}: rollback to {length} outside the recorded span")
            self.ssm[i][slot].copy_(states[j])
            km1 = self.conv[i].shape[-1]
            self.conv[i][slot].copy_(window[:, j:j + km1])
        self.lengths[slot] = length
        self._hist.pop(slot, None)

    def rollback_mtp(self, slot: int, length: int) -> None:
        """MTP rows are attention-only: dropping entries is a length change."""
        self.mtp_lengths[slot] = min(self.mtp_lengths[slot], length)

    # ---- KDA state access (used by kda.KDAttention) -------------------------------------
    def kda_conv_in(self, layer: int, batch: SeqBatch, b: int) -> torch.Tensor:
        st = self.conv[layer][batch.slots[b]]
        return torch.zeros_like(st) if batch.starts[b] == 0 else st

    def kda_conv_out(self, layer: int, batch: SeqBatch, b: int, window: torch.Tensor) -> None:
        """window [3C, K-1+n]: cached columns followed by this forward's pre-conv rows."""
        slot = batch.slots[b]
        km1 = self.conv[layer].shape[-1]
        if batch.keep_states:
            start, states, _ = self._hist.setdefault(slot, {}).get(layer, (batch.starts[b], None, None))
            self._hist[slot][layer] = (batch.starts[b], states, window.clone())
        self.conv[layer][slot].copy_(window[:, window.shape[-1] - km1:])

    def kda_state_in(self, layer: int, batch: SeqBatch, b: int) -> torch.Tensor:
        st = self.ssm[layer][batch.slots[b]]
        return torch.zeros_like(st) if batch.starts[b] == 0 else st

    def kda_state_out(self, layer: int, batch: SeqBatch, b: int, state: torch.Tensor) -> None:
        self.ssm[layer][batch.slots[b]].copy_(state)

    def kda_record_history(self, layer: int, batch: SeqBatch, b: int, states: torch.Tensor) -> None:
        """states [n+1, H, dk, dv]: the state before and after each new token."""
        slot = batch.slots[b]
        _, _, window = self._hist.setdefault(slot, {}).get(layer, (None, None, None))
        self._hist[slot][layer] = (batch.starts[b], states, window)

    def begin(self, batch: SeqBatch) -> None:
        """Drop stale rollback history of the batch's slots before a new trunk forward."""
        for s in batch.slots:
            self._hist.pop(s, None)

    # ---- MLA rows ------------------------------------------------------------------------
    def write_rows(self, table: dict[int, torch.Tensor], layer: int, slot: int, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Store rows [n, W] at positions start.. and return all rows [start+n, W] of the slot."""
        buf = table[layer][slot]
        buf[start:start + rows.shape[0]].copy_(rows)
        return buf[: start + rows.shape[0]]
