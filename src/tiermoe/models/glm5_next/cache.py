"""Per-sequence state of a glm5_next model: KDA slot states and MLA latent rows.

A serving engine gives each running sequence a slot; one forward may mix slots in any state
(prefill chunks, single-token decode, speculative verification). Two kinds of state:

| layer kind        | state                               | where                               |
|-------------------|-------------------------------------|-------------------------------------|
| KDA               | short-conv window [3C, K-1]          | `KDAStates`, per slot (any int id)  |
| KDA               | delta-rule state [H, dk, dv] fp32    | `KDAStates`, per slot               |
| MLA               | normalized kv_a latent [r] per token | rows: `Glm5NextCache` or paged KV   |
| MLA, full indexer | indexer key + k-pool gate [2d]/token | rows, like the latent               |

Layers talk to a "cache" object with two members: `kda` (a `KDAStates`) and
`mla_rows(name, layer, batch, b, rows) -> all rows of that sequence`. `Glm5NextCache` is the
self-contained version (contiguous rows per slot, also for the MTP layer); the engine adapter
(engine.py) provides the same over the engine's paged KV cache. KDA state cannot be rebuilt
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
    the new tokens (speculative verification); `keep[b]` is the per-sequence flag."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    keep_states: bool | list[bool] = False
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


@dataclass
class _Slot:
    length: int = 0
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [3C, K-1]
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H, dk, dv] fp32
    # keep_states forward: layer -> (start, states [n+1, H, dk, dv], window [3C, K-1+n])
    hist: dict[int, list] = field(default_factory=dict)


class KDAStates:
    """KDA conv windows and recurrent states keyed by slot id (created on a slot's first token)."""

    def __init__(self, cfg: Glm5NextConfig, device: torch.device | str, dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.kda_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda(i)]
        self.slots: dict[int, _Slot] = {}

    def _fresh(self) -> _Slot:
        c = self.cfg
        s = _Slot()
        for i in self.kda_layers:
            s.conv[i] = torch.zeros(3 * c.linear_qkv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype,
                                    device=self.device)
            h, d = c.linear_num_heads, c.linear_head_dim
            s.ssm[i] = torch.zeros(h, d, d, dtype=torch.float32, device=self.device)
        return s

    def length(self, slot: int) -> int:
        s = self.slots.get(slot)
        return 0 if s is None else s.length

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def begin(self, batch: SeqBatch) -> None:
        """Check continuity and set up the batch's slots; fresh state for sequences at 0."""
        for slot, start in zip(batch.slots, batch.starts):
            if start == 0:
                s = self.slots.get(slot)
                if s is None:
                    self.slots[slot] = self._fresh()
                else:
                    for t in s.conv.values():
                        t.zero_()
                    for t in s.ssm.values():
                        t.zero_()
                    s.length, s.hist = 0, {}
            elif self.length(slot) != start:
                raise UserError(
                    f"glm5_next: slot {slot} holds KDA state for {self.length(slot)} tokens but the batch "
                    f"continues at {start} (recurrent state cannot resume from cached pages; "
                    "disable prefix caching for this model)")
            else:
                self.slots[slot].hist = {}

    def commit(self, batch: SeqBatch) -> None:
        for slot, start, n in zip(batch.slots, batch.starts, batch.lens):
            self.slots[slot].length = start + n

    def conv(self, layer: int, slot: int) -> torch.Tensor:
        return self.slots[slot].conv[layer]

    def ssm(self, layer: int, slot: int) -> torch.Tensor:
        return self.slots[slot].ssm[layer]

    def set_conv(self, layer: int, batch: SeqBatch, b: int, window: torch.Tensor) -> None:
        """window [3C, K-1+n]: the cached columns followed by this forward's pre-conv rows."""
        s = self.slots[batch.slots[b]]
        km1 = s.conv[layer].shape[-1]
        if batch.keep[b]:
            s.hist.setdefault(layer, [batch.starts[b], None, None])[2] = window.clone()
        s.conv[layer].copy_(window[:, window.shape[-1] - km1:])

    def set_ssm(self, layer: int, batch: SeqBatch, b: int, state: torch.Tensor,
                steps: torch.Tensor | None = None) -> None:
        """state [H, dk, dv]; steps [n+1, H, dk, dv] (keep_states only): before/after each token."""
        s = self.slots[batch.slots[b]]
        if steps is not None:
            s.hist.setdefault(layer, [batch.starts[b], None, None])[1] = steps
        s.ssm[layer].copy_(state)

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens; they must lie inside the slot's last keep_states forward."""
        s = self.slots[slot]
        if length == s.length:
            return
        for layer, (start, steps, window) in s.hist.items():
            j = length - start
            if steps is None or not 0 <= j < steps.shape[0]:
                raise RuntimeError(f"slot {slot}: rollback to {length} is outside the recorded span")
            s.ssm[layer].copy_(steps[j])
            km1 = s.conv[layer].shape[-1]
            s.conv[layer].copy_(window[:, j:j + km1])
        if not s.hist and self.kda_layers:
            raise RuntimeError(f"slot {slot}: rollback needs a keep_states forward")
        s.length, s.hist = length, {}


class Glm5NextCache:
    """Self-contained state for `num_slots` sequences of up to `max_len` tokens.

    MLA rows are stored contiguously per slot ([num_slots, max_len, W] per layer and kind);
    rows past a slot's length are stale and never read, so dropping tokens is a length change.
    With `mtp`, the MTP layer (key num_hidden_layers) gets rows too, with its own lengths."""

    def __init__(
        self, cfg: Glm5NextConfig, num_slots: int, max_len: int,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, mtp: bool = False,
    ):
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.kda = KDAStates(cfg, device, dtype)
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

    def mla_rows(self, name: str, layer: int, batch: SeqBatch, b: int, rows: torch.Tensor) -> torch.Tensor:
        """Store rows [n, W] at the sequence's new positions; return all its rows [start+n, W]."""
        buf = self.rows[name, layer][batch.slots[b]]
        start = batch.starts[b]
        buf[start:start + rows.shape[0]].copy_(rows)
        return buf[: start + rows.shape[0]]
