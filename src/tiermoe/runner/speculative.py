"""Speculative decoding in the engine: a model's MTP head drafts, one trunk forward verifies.

Only for models with an MTP draft head (`ServingModel.draft_head_unsupported()` is None; glm5_next:
`mtp_cache_shapes`, `mtp_forward`, `mtp_logits`, `verify_forward`, `rollback`), and only for requests
whose next token is a plain argmax of the model's logits (greedy, no penalties, bias, grammar
or logprobs; past `min_tokens`). Everything else decodes one token per step as before.

Per step, for a request in decode that the scheduler gave `1 + k` tokens (k = `lookahead`):

    catch-up: MTP over the entries (h_i, t_{i+1}) it has not consumed yet -> d1 from the last
    chain:    MTP over (its own hidden, d1) at the next entry -> d2        (k = 2)
    verify:   trunk over [last, d1, .., dk] (KDA states kept per token) -> greedy g0..gk
    accept:   a = longest prefix with d_{j+1} == g_j; emit d1..da, g_a; num_computed += a + 1
    repair:   KDA state rolled back to the accepted length; MLA pages need nothing (rows past
              a sequence's length are never read; the next forward overwrites them)

Every emitted token is the trunk's argmax given the tokens before it, so the output is the
drafting-off output; drafts only change how many trunk forwards it takes.

MTP bookkeeping per tracked request: `mtp_len` entries are in the MTP layer's own paged rows
(same page table and positions as the trunk's: entry i sits at position i), and the trunk's
hidden states of entries [mtp_len, num_computed) wait in `pending` until their next tokens are
known, which is always the case at the start of the next step. Prefill chunks feed the MTP
rows too, so a request can draft from its first decode step on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tiermoe.errors import UserError
from tiermoe.models.batch import build_forward_batch
from tiermoe.models.serving import ServingModel
from tiermoe.scheduler.request import Request

log = logging.getLogger("tiermoe.runner")

MAX_SPECULATIVE_TOKENS = 2


@dataclass
class _Track:
    mtp_len: int = 0  # MTP entries held in the MTP rows
    pending: list[torch.Tensor] = field(default_factory=list)  # trunk hidden [n, H] of later entries

    @property
    def pending_rows(self) -> int:
        return sum(int(h.shape[0]) for h in self.pending)


def draftable(params) -> bool:
    """A request whose every token is the argmax of the raw logits (the drafts' criterion)."""
    return (params.greedy and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty and not params.logit_bias and params.structured is None
            and params.logprobs is None)


def _checked(num_speculative_tokens) -> int:
    k = int(num_speculative_tokens or 0)
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise UserError(f"--num-speculative-tokens {k}: must be 0 (off), 1 or 2")
    return k


def draft_cache_shapes(model: ServingModel, num_speculative_tokens: int) -> dict[str, tuple[int, ...]]:
    """Per-token shapes of the MTP rows the drafter will allocate ({} when it will not draft).

    The KV budget is split into pages before the runner exists, so sizing has to know now
    whether drafting will really be on: this loads the MTP layer (once; `make_drafter` then
    finds it loaded) exactly as `make_drafter` would, but logs nothing."""
    if _checked(num_speculative_tokens) == 0 or model.draft_head_unsupported() is not None:
        return {}
    return dict(model.mtp_cache_shapes())


def make_drafter(model: ServingModel, num_pages: int, page_size: int, num_speculative_tokens: int):
    """The MTP drafter for this model, or None (off, or the model cannot draft: logged)."""
    k = _checked(num_speculative_tokens)
    if k == 0:
        return None
    why = model.draft_head_unsupported()
    if why is not None:
        log.warning("speculative decoding off: %s", why)
        return None
    return MTPDrafter(model, num_pages, page_size, k)


class MTPDrafter:
    """Drafting, verification and MTP state for the engine's runner (see module docstring)."""

    def __init__(self, model, num_pages: int, page_size: int, num_draft: int):
        self.model, self.page_size, self.k = model, page_size, num_draft
        self.kv = {name: torch.zeros(num_pages, page_size, *shp, dtype=model.dtype, device=model.device)
                   for name, shp in model.mtp_cache_shapes().items()}  # MTP rows, paged by position
        self.tracks: dict[str, _Track] = {}
        self.drafted = self.accepted = self.verified = self.emitted = 0
        self.accepted_per_position = [0] * num_draft  # [j]: verifications that accepted draft j+1

    # -- scheduler side ------------------------------------------------------------------
    def lookahead(self, req: Request) -> int:
        """Draft tokens to schedule after req's next token this step (0: decode normally)."""
        if req.num_tokens - req.num_computed != 1 or not req.output_ids or not draftable(req.params):
            return 0  # (the first token comes from the prefill step, with any prompt logprobs)
        if len(req.output_ids) < req.params.min_tokens:
            return 0  # the sampler still masks EOS/stop tokens for this request
        tr = self.tracks.get(req.request_id)
        if tr is None or tr.mtp_len + tr.pending_rows != req.num_computed or not tr.pending:
            return 0
        return max(0, min(self.k, req.max_tokens - len(req.output_ids) - 1))

    def release(self, request_id: str) -> None:
        self.tracks.pop(request_id, None)

    def stats(self) -> dict:
        return {"num_speculative_tokens": self.k, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "verify_steps": self.verified, "emitted": self.emitted,
                "tokens_per_verify": round(self.emitted / self.verified, 4) if self.verified else 0.0,
                "accepted_per_position": list(self.accepted_per_position)}

    def kv_bytes(self) -> int:
        """Bytes of the MTP rows (counted in the KV budget, see `draft_cache_shapes`)."""
        return sum(t.numel() * t.element_size() for t in self.kv.values())

    # -- runner side ----------------------------------------------------------------------
    def prepare(self, items: list[tuple[Request, int]]) -> dict[int, list[int]]:
        """Before the trunk forward: feed pending entries to the MTP layer and draft.

        Returns {item index: drafts} for the items scheduled with more tokens than they have
        (their extra tokens are these drafts, in order)."""
        want: dict[int, int] = {}
        catch: list[int] = []
        for i, (req, n) in enumerate(items):
            if not draftable(req.params):
                continue
            if req.num_computed == 0:  # fresh, or restarting after preemption
                self.tracks[req.request_id] = _Track()
            tr = self.tracks.get(req.request_id)
            if tr is None:
                continue
            k = n - (req.num_tokens - req.num_computed)  # drafts the scheduler made room for
            whole = tr.mtp_len + tr.pending_rows == req.num_computed
            if k > 0 and not (whole and tr.pending):  # lookahead() checked this; a bug otherwise
                raise RuntimeError(f"request {req.request_id}: scheduled drafts without MTP state")
            if not whole:  # never drafts again (lookahead needs the track)
                self.tracks.pop(req.request_id)
                continue
            if k > 0:
                want[i] = k
            if tr.pending:
                catch.append(i)
        if not catch:
            return {}
        chunks, prev = [], []
        for i in catch:
            req = items[i][0]
            tr = self.tracks[req.request_id]
            m = req.num_computed
            chunks.append((req.all_ids[tr.mtp_len + 1: m + 1], tr.mtp_len, req.pages, req.slot))
            prev.extend(tr.pending)
        fb = build_forward_batch(chunks, self.page_size, self.model.device)
        h = self.model.mtp_forward(fb, self.kv, torch.cat(prev))  # [T, H]
        for i in catch:
            tr = self.tracks[items[i][0].request_id]
            tr.mtp_len, tr.pending = items[i][0].num_computed, []
        if not want:
            return {}
        where = {i: b for b, i in enumerate(catch)}
        order = [i for i in catch if i in want]
        last = h[[fb.seqs[where[i]].q_start + fb.seqs[where[i]].q_len - 1 for i in order]]  # [B, H]
        drafts = {i: [t] for i, t in zip(order, self.model.mtp_logits(last).argmax(-1).tolist())}
        for j in range(1, max(want.values())):  # chain: the MTP layer on its own output
            keep = [b for b, i in enumerate(order) if want[i] > j]
            order = [order[b] for b in keep]
            last = last[torch.tensor(keep, device=last.device)]
            # entry (MTP hidden, d_j) at position num_computed + j - 1; the next catch-up
            # overwrites its rows with the trunk's own entry
            chunks = [([drafts[i][-1]], items[i][0].num_computed + j - 1, items[i][0].pages, items[i][0].slot)
                      for i in order]
            fb = build_forward_batch(chunks, self.page_size, self.model.device)
            last = self.model.mtp_forward(fb, self.kv, last)
            for i, t in zip(order, self.model.mtp_logits(last).argmax(-1).tolist()):
                drafts[i].append(t)
        return drafts

    def verify(self, items: list[tuple[Request, int]], seqs, hidden: torch.Tensor,
               drafts: dict[int, list[int]]) -> dict[str, list[int]]:
        """After the trunk forward: accept drafts, roll back, queue new MTP entries.

        seqs: the forward batch's SeqSlices (item order); hidden [T, H]. Returns
        {request id: emitted tokens} for the verified items (a + 1 tokens each)."""
        emitted: dict[str, list[int]] = {}
        accepted: dict[int, int] = {}
        if drafts:
            order = list(drafts)
            rows = torch.cat([torch.arange(seqs[i].q_start, seqs[i].q_start + seqs[i].q_len) for i in order])
            greedy = self.model.logits(hidden[rows.to(hidden.device)]).argmax(-1).tolist()  # one host sync
            pos = 0
            for i in order:
                req, d = items[i][0], drafts[i]
                g = greedy[pos: pos + len(d) + 1]
                pos += len(d) + 1
                a = 0
                while a < len(d) and d[a] == g[a]:
                    a += 1
                self.model.rollback(req.slot, req.num_computed + a + 1)
                emitted[req.request_id] = d[:a] + [g[a]]
                accepted[i] = a
                self.drafted += len(d)
                self.accepted += a
                for j in range(a):
                    self.accepted_per_position[j] += 1
                self.verified += 1
                self.emitted += a + 1
        for i, (req, n) in enumerate(items):
            tr = self.tracks.get(req.request_id)
            if tr is None:
                continue
            keep = accepted[i] + 1 if i in accepted else n
            s = seqs[i]
            tr.pending.append(hidden[s.q_start: s.q_start + keep].clone())
        return emitted
