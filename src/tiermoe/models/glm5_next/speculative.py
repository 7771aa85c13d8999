"""Greedy speculative decoding with the glm5_next MTP layer: draft 1-2 tokens, verify with
the trunk in one forward, keep the longest agreeing prefix plus the trunk's own next token.

Bookkeeping per slot (m = tokens the trunk has processed, `last` = the newest emitted token,
not yet processed by the trunk). MTP entry i pairs the trunk hidden h_i with token t_{i+1};
entries whose h is known but that the MTP layer has not consumed yet are "pending".

    draft:   MTP over pending entries -> d1 = argmax; (2 drafts) MTP over (its own hidden, d1) -> d2
    verify:  trunk over [last, d1, .., dk] with keep_states -> greedy g0..gk
    accept:  a = length of the prefix where d_{j+1} == g_j; emit d1..da, g_a
    repair:  trunk rolls back to m+a+1 tokens, MTP to m entries (the 2nd-draft entry used an
             MTP hidden, not a trunk one); pending = (h_m..h_{m+a}, emitted tokens)

Every emitted token is the trunk's greedy choice given the tokens before it, so the output
equals plain greedy decoding; drafts only change how many trunk forwards it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import Glm5NextCache, SeqBatch
from .model import Glm5NextModel


@dataclass
class SpecStats:
    steps: int = 0  # verify forwards
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class _SlotState:
    length: int  # tokens processed by the trunk (m)
    last: int  # newest emitted token, next input of the trunk
    pending_hidden: torch.Tensor  # [n, D] trunk hiddens of MTP entries not yet consumed
    pending_tokens: list[int] = field(default_factory=list)  # their t_{i+1}


class MTPSpeculator:
    """Draft/verify driver over a batch of cache slots (greedy only)."""

    def __init__(self, model: Glm5NextModel, cache: Glm5NextCache, num_draft: int = 1):
        if model.mtp is None:
            raise ValueError("speculative decoding needs a model loaded with its MTP layer")
        if num_draft not in (1, 2):
            raise ValueError("num_draft must be 1 or 2")
        self.model, self.cache, self.num_draft = model, cache, num_draft
        self.slots: dict[int, _SlotState] = {}
        self.stats = SpecStats()

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        """Run the prompts through the trunk; returns each slot's first generated token."""
        dev = self.model.embed_tokens.weight.device
        for s in slots:
            self.cache.reset(s)
        batch = SeqBatch(slots, [0] * len(slots), [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        hidden = self.model(ids, batch, self.cache)
        firsts = self.model.logits(hidden[batch.last_rows()]).argmax(-1).tolist()
        for b, (s, p) in enumerate(zip(slots, prompts)):
            h = hidden[batch.cu[b]: batch.cu[b + 1]]
            self.slots[s] = _SlotState(len(p), firsts[b], h, p[1:] + [firsts[b]])
        return firsts

    @torch.no_grad()
    def draft(self, slots: list[int]) -> list[list[int]]:
        """Consume pending MTP entries and propose `num_draft` tokens per slot."""
        m, cache = self.model, self.cache
        states = [self.slots[s] for s in slots]
        batch = SeqBatch(slots, [cache.mtp_lengths[s] for s in slots], [len(st.pending_tokens) for st in states])
        dev = m.embed_tokens.weight.device
        toks = torch.tensor([t for st in states for t in st.pending_tokens], device=dev)
        h = m.mtp_forward(toks, torch.cat([st.pending_hidden for st in states]), batch, cache)
        last_h = h[batch.last_rows()]  # [B, D]
        d1 = m.mtp_logits(last_h).argmax(-1)
        drafts = [[t] for t in d1.tolist()]
        if self.num_draft == 2:
            b2 = SeqBatch(slots, [cache.mtp_lengths[s] for s in slots], [1] * len(slots))
            h2 = m.mtp_forward(d1, last_h, b2, cache)
            for lst, t in zip(drafts, m.mtp_logits(h2).argmax(-1).tolist()):
                lst.append(t)
        return drafts

    @torch.no_grad()
    def verify(self, slots: list[int], drafts: list[list[int]]) -> list[list[int]]:
        """Check drafts with one trunk forward; returns the tokens emitted per slot (>= 1)."""
        m, cache = self.model, self.cache
        states = [self.slots[s] for s in slots]
        inputs = [[st.last] + d for st, d in zip(states, drafts)]
        batch = SeqBatch(slots, [st.length for st in states], [len(x) for x in inputs], keep_states=True)
        ids = torch.tensor([t for x in inputs for t in x], device=m.embed_tokens.weight.device)
        hidden = m(ids, batch, cache)
        greedy = m.logits(hidden).argmax(-1).tolist()
        out = []
        self.stats.steps += 1
        for b, (s, st, d) in enumerate(zip(slots, states, drafts)):
            g = greedy[batch.cu[b]: batch.cu[b + 1]]
            a = 0
            while a < len(d) and d[a] == g[a]:
                a += 1
            emitted = d[:a] + [g[a]]
            self.stats.drafted += len(d)
            self.stats.accepted += a
            cache.rollback(s, st.length + a + 1)
            cache.rollback_mtp(s, st.length)
            st.pending_hidden = hidden[batch.cu[b]: batch.cu[b] + a + 1]
            st.pending_tokens = list(emitted)
            st.length += a + 1
            st.last = emitted[-1]
            out.append(emitted)
        return out

    def step(self, slots: list[int]) -> list[list[int]]:
        return self.verify(slots, self.draft(slots))


@torch.no_grad()
def greedy_generate(
    model: Glm5NextModel, prompts: list[list[int]], max_new_tokens: int, num_draft: int = 0,
    cache: Glm5NextCache | None = None,
) -> tuple[list[list[int]], SpecStats | None]:
    """Greedy continuation of each prompt (batched). num_draft=0: one trunk forward per token;
    1 or 2: MTP speculative decoding. Returns (exactly max_new_tokens tokens per prompt, stats)."""
    slots = list(range(len(prompts)))
    if cache is None:
        cache = model.new_cache(len(prompts), max(len(p) for p in prompts) + max_new_tokens + 2 + num_draft)
    dev = model.embed_tokens.weight.device
    if num_draft == 0:
        for s in slots:
            cache.reset(s)
        batch = SeqBatch(slots, [0] * len(slots), [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        nxt = model.logits(model(ids, batch, cache)[batch.last_rows()]).argmax(-1)
        outs = [[t] for t in nxt.tolist()]
        while len(outs[0]) < max_new_tokens:
            batch = SeqBatch(slots, [cache.lengths[s] for s in slots], [1] * len(slots))
            nxt = model.logits(model(nxt, batch, cache)).argmax(-1)
            for o, t in zip(outs, nxt.tolist()):
                o.append(t)
        return outs, None
    spec = MTPSpeculator(model, cache, num_draft)
    outs = [[t] for t in spec.prefill(slots, prompts)]
    while True:
        active = [s for s in slots if len(outs[s]) < max_new_tokens]  # finished slots stop growing
        if not active:
            break
        for s, new in zip(active, spec.step(active)):
            outs[s].extend(new)
    return [o[:max_new_tokens] for o in outs], spec.stats
