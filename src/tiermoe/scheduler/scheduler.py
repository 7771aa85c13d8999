"""Token-budget scheduler: which requests get how many tokens this step.

Scheduling is in tokens, not phases: a running decode asks for 1 token, a prompt asks for
what is left of it, and a per-step budget cuts prompts into chunks (chunked prefill), so
decodes and prefills mix in one step. When KV pages run out, the most recently admitted
running request is preempted (its pages freed, its tokens recomputed later, nothing lost).

Speculative decoding: with a `lookahead(req) -> k` callback, a running request in decode is
given 1 + k tokens when the budget and free pages allow it (drafts to verify; never at the
cost of a preemption), and `commit` is told how many of them were accepted.

`chunk_multiple`: a prompt cut by the budget is cut at a multiple of this many tokens (a
family whose prefill kernel works in fixed blocks, e.g. KDA's 64-token chunks, computes the
same arithmetic as an uncut prompt only when cuts fall on block edges; otherwise its bf16
results would depend on what else shared the step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tiermoe.scheduler.kv_pages import KVPages
from tiermoe.scheduler.request import Request, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, kv: KVPages, max_num_seqs: int, max_batched_tokens: int,
                 lookahead: Callable[[Request], int] | None = None, chunk_multiple: int = 1):
        self.kv, self.max_num_seqs, self.max_batched_tokens = kv, max_num_seqs, max_batched_tokens
        self.lookahead = lookahead
        # A budget smaller than one block could never cut a prompt: fall back to plain cuts.
        self.chunk_multiple = chunk_multiple if 1 < chunk_multiple <= max_batched_tokens else 1
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:  # the budget left cannot hold a whole block: next step
                i += 1
                continue
            while not self.kv.allocate(req.pages, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.items.append((req, n))
                budget -= n
                i += 1
        if self.lookahead is not None:  # drafts only from what is left, never by preempting
            for j, (req, n) in enumerate(out.items):
                extra = self._extra(req, n, budget)
                out.items[j] = (req, n + extra)
                budget -= extra
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if req.num_computed == 0 and not req.pages:
                req.pages = self.kv.match_prefix(req.all_ids) if req.reuse_prefix else []
                req.num_computed = len(req.pages) * self.kv.page_size
                if not req.output_ids:
                    req.cached_tokens = req.num_computed
            n = self._chunk(req, budget)  # 0: no whole block fits the budget left (running requests hold it)
            if n == 0 or not self.kv.allocate(req.pages, req.num_computed + n):
                if not self.running:  # nothing to wait for: the request can never fit
                    raise MemoryError("prompt does not fit in the KV cache")
                self.kv.release(req.pages)
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.slot = self.free_slots.pop()
            self.running.append(req)
            out.items.append((req, n))
            budget -= n
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of req to compute this step: all that is left if it fits, else up to the last
        multiple of `chunk_multiple` (0 when none fits)."""
        left = req.num_tokens - req.num_computed
        if left <= budget:
            return left
        m = self.chunk_multiple
        return (req.num_computed + budget) // m * m - req.num_computed if m > 1 else budget

    def _extra(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens to add to req's decode step of n tokens, within the `budget` left
        (pages taken only if free)."""
        if req.num_tokens - req.num_computed != 1 or budget <= 0:
            return 0
        k = min(self.lookahead(req), budget)
        while k > 0 and not self.kv.allocate(req.pages, req.num_computed + n + k):
            k -= 1
        return max(k, 0)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.kv.release(req.pages)
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def commit(self, req: Request, n: int) -> None:
        """After the forward pass computed n new tokens of req (with drafts: the accepted ones,
        which the engine appends to the output just after)."""
        req.num_computed += n
        self.kv.commit(req.pages, req.all_ids, min(req.num_computed, req.num_tokens), chain=req.page_hashes)
