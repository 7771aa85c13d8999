"""ModelRunner: owns the KV cache tensors, turns scheduled requests into a ForwardBatch,
runs the model and samples.

The KV cache is one set of tensors per layer, [pages, page_size, *per-token shape], sized once
at start-up; pages are handed out by the scheduler's KVPages. With drafting on, the MTP layer's
rows have the same page count and are part of the same byte budget (`kv_bytes_per_token`).

Per-request sampling state lives here too, keyed by request id and dropped by `release`:
seeded generators, prepared logit_bias tensors, grammar matchers (structured output) and
prompt logprobs being collected. Prompt logprobs: while a request that asked for them is
prefilling, the logits of every prompt position of its chunk are computed (in slices of
PROMPT_LOGITS_ROWS rows, so a long chunk never materialises [T, V] at once) and the logprob of
the next prompt token plus the top-k are stored by position; chunked prefill fills the list
over several steps, and a preempted prefill simply overwrites the same positions.

Speculative decoding (`num_speculative_tokens` > 0, models with an MTP head): `self.spec` (see
runner/speculative.py) drafts before the forward and verifies after it; `execute` then also
returns the tokens each verified request emits (several per step).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tiermoe import env
from tiermoe.protocol import TokenLogprob
from tiermoe.models.batch import ForwardBatch, build_forward_batch
from tiermoe.models.serving import ServingModel
from tiermoe.moe.experts import ExpertBackend
from tiermoe.runner.sampler import SampleResult, SampleRow, bias_tensors, sample
from tiermoe.runner.speculative import draft_cache_shapes, make_drafter
from tiermoe.runner.structured import GrammarBackend, RequestGrammar
from tiermoe.scheduler.request import Request

PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at a time


def kv_bytes_per_token(model, dtype: torch.dtype, num_speculative_tokens: int = 0) -> int:
    """Bytes of paged cache one token position costs: every trunk layer's rows, plus the MTP
    layer's rows when drafting will be on (they are paged with the same page count, so a
    budget that left them out would be overrun by their whole size). With
    num_speculative_tokens > 0 this loads the model's MTP layer if it has one (see
    `draft_cache_shapes`)."""
    layers = [*model.cache_shapes(), draft_cache_shapes(model, num_speculative_tokens)]
    per = sum(math.prod(shp) for shapes in layers for shp in shapes.values())
    return per * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: ServingModel, num_pages: int, page_size: int, *, max_num_seqs: int,
                 seed: int | None = None, tokenizer=None, eos_ids: list[int] | None = None,
                 num_speculative_tokens: int = 0):
        self.model, self.page_size = model, page_size
        self.device, self.dtype = model.device, model.dtype
        self.experts: ExpertBackend = model.expert_backend  # the routed experts' seam (moe/experts.py)
        self.kv_caches = [
            {name: torch.zeros(num_pages, page_size, *shp, dtype=self.dtype, device=self.device)
             for name, shp in s.items()}
            for s in model.cache_shapes()
        ]
        self.max_num_seqs = max_num_seqs
        model.reserve_slots(max_num_seqs)  # per-sequence state beside the KV cache (recurrent families)
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(seed if seed is not None else torch.seed())
        vocab = model.spec.vocab_size
        self.grammar_backend = GrammarBackend(tokenizer, vocab, list(eos_ids or [])) if tokenizer is not None else None
        self.grammars: dict[str, RequestGrammar] = {}
        self.biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # request id -> per prompt position (None at 0 and until computed)
        self.prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.spec = make_drafter(model, num_pages, page_size, num_speculative_tokens)
        self.graphs = None  # DecodeGraphs once enable_decode_graphs() found the model capturable
        self.table_blocks = 0  # > 0: pure decode steps attend through block tables this wide
        self.routing = None  # moe/replay.RoutingHooks: routing replay/recording (benchmark flags), else None
        # wait_for_device: asleep when the expert backend computes on the host's cores (None), or as set here
        self.sleep_while_waiting: bool | None = None
        self._step_done = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None

    def enable_decode_graphs(self, max_batch: int) -> str | None:
        """Replay pure decode steps of up to max_batch sequences from CUDA graphs (see
        runner/decode_graph.py). Returns None when enabled, else why not (logged by the caller)."""
        from tiermoe.runner.decode_graph import DecodeGraphs, decode_graphs_unsupported

        why = decode_graphs_unsupported(self.model, self.device)
        if why is None:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch)
        return why

    def use_paged_decode_attention(self, max_model_len: int) -> str | None:
        """Attend pure decode steps through block tables (grouped-query attention: the paged decode
        kernel, kernels/triton/paged_attention.py; glm5_next's MLA: batched static torch ops):
        static shapes, so a decode step needs no eager attention between graph pieces. Returns
        None when switched on, else why the model cannot."""
        why = self.model.paged_decode_attention_unsupported(max_model_len)
        if why is not None:
            return why
        if self.page_size < 16 or self.page_size & (self.page_size - 1):
            return f"the kernel needs a power-of-two page size >= 16, not {self.page_size}"
        if self.device.type != "cuda" and not env.TRITON_INTERPRET.get():
            return "the kernel needs a CUDA device (on a CPU only Triton's interpreter runs it: TRITON_INTERPRET=1)"
        self.table_blocks = -(-max_model_len // self.page_size)
        return None

    @torch.inference_mode()
    def warm_up(self, max_batch: int, max_chunk: int) -> int:
        """Run the step shapes serving will meet before any request does; returns how many.

        The first step of a new shape compiles Triton kernels (specialised by token counts) and,
        for decode, the second records its CUDA graph: seconds during which every request waits.
        Here one dummy sequence prefills chunks of 1, 2,
        4, ... max_chunk tokens, then decode steps of 1..max_batch sequences run twice each. The
        KV rows go to pages at the end of the pool, which no request holds yet (call before
        serving); results do not change (tests/runner/test_warm_up.py). Expert-cache counters
        include these steps, but the expert backend's decisions are put back as they were
        (`save_decisions`): fast mode's tokens depend on them (which misses the CPU lane takes).
        Each step is checked as a served one is (a failed lane answer fails the start-up, not the
        first request).
        """
        saved = self.experts.save_decisions()
        # KV pages (the first layer with paged rows: a hybrid's first layers may hold none)
        pool = next(t for layer in self.kv_caches for t in layer.values()).shape[0]
        steps = 0
        n = 1
        while n <= max_chunk:
            need = -(-n // self.page_size)
            if need > pool:
                break
            self._forward_chunks([([0] * n, 0, list(range(pool - need, pool)), 0)], decode=False)
            self.check_step()
            steps, n = steps + 1, n * 2
        for b in range(1, min(max_batch, pool) + 1):
            for _ in range(2):  # the first compiles (and is seen), the second records its graph
                self._forward_chunks([([0], 0, [pool - 1 - i], i) for i in range(b)], decode=True)
                self.check_step()
                steps += 1
        self.experts.restore_decisions(saved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.routing is not None:  # a replayed trace starts at its first row with the first request
            self.routing.reset_replay()
        return steps

    def kv_cache_bytes(self) -> int:
        """Bytes of every paged cache tensor this runner allocated (trunk layers and MTP rows)."""
        total = sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer.values())
        return total + (self.spec.kv_bytes() if self.spec is not None else 0)

    def slot_state_bytes(self) -> int:
        """Bytes of the per-sequence state reserved beside the pages (every slot; recurrent families)."""
        return self.model.slot_state_bytes() * self.max_num_seqs

    def generator_for(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None or req.params.greedy:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            self.generators[req.request_id] = gen
        return gen

    def add_request(self, request_id: str, params, prompt_len: int, grammar: RequestGrammar | None = None) -> None:
        """Per-request state that must exist before the first step (called by the engine)."""
        if grammar is not None:
            self.grammars[request_id] = grammar
        if params.logit_bias:
            self.biases[request_id] = bias_tensors(params.logit_bias, self.device)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[request_id] = [None] * prompt_len

    def build_grammar(self, spec: dict) -> RequestGrammar:
        """A matcher for a structured spec; InvalidRequest when it cannot be served."""
        if self.grammar_backend is None:
            from tiermoe.protocol import InvalidRequest

            raise InvalidRequest("structured output needs the model's tokenizer", "response_format")
        return self.grammar_backend.build(spec)

    def release(self, req: Request) -> None:
        rid = req.request_id
        self.generators.pop(rid, None)
        self.grammars.pop(rid, None)
        self.biases.pop(rid, None)
        self.prompt_logprobs.pop(rid, None)
        if self.spec is not None:
            self.spec.release(rid)

    def take_prompt_logprobs(self, req: Request) -> list[TokenLogprob | None] | None:
        """The finished prompt logprobs of `req` (once; None if it did not ask)."""
        return self.prompt_logprobs.pop(req.request_id, None)

    def advance_grammar(self, req: Request) -> tuple[bool, str | None]:
        """After tokens were appended to req.output_ids: (grammar complete, error message or None)."""
        g = self.grammars.get(req.request_id)
        if g is None:
            return False, None
        g.sync(req.output_ids)
        err = g.error
        return (err is None and g.stopped), err

    def _run(self, items: list[tuple[Request, int]], all_logits: bool = False,
             drafts: dict[int, list[int]] | None = None):
        """drafts: {item index: draft tokens} appended after that item's known token."""
        drafts = drafts or {}
        chunks = []
        for i, (req, n) in enumerate(items):
            d = drafts.get(i, [])
            chunks.append((req.all_ids[req.num_computed : req.num_computed + n - len(d)] + d, req.num_computed,
                           req.pages, req.slot))
        decode = all(n - len(drafts.get(i, ())) == 1 for i, (_, n) in enumerate(items))  # one known token each
        flags = None
        if self.routing is not None:  # per token, for a routing record: decode (a generated token's successor)?
            flags = [f for i, (req, n) in enumerate(items)
                     for f in [n - len(drafts.get(i, ())) == 1 and bool(req.output_ids)] * n]
        if drafts:  # verified sequences keep per-token recurrent state for the rollback
            batch = build_forward_batch(chunks, self.page_size, self.device, all_logits=all_logits)
            self._begin_step(batch, decode, flags)
            return batch, self.model.verify_forward(batch, self.kv_caches, [i in drafts for i in range(len(items))])
        return self._forward_chunks(chunks, decode, all_logits, flags)

    def wait_for_device(self) -> None:
        """Return once the device has done every step queued so far; asleep meanwhile while the expert
        backend computes on the host's cores (fast mode), else spinning as CUDA does by default.

        Why asleep then: fast mode's CPU lane computes on every core but one, and while the engine's
        thread waits for a step, that core is what the server's event loop, its HTTP threads and the
        client's streams share; a spinning waiter pushes them onto the lane's cores, and each lane step
        ends with its slowest thread. Why not always: waking a sleeping thread costs time (on the GPU
        machine's virtual CPUs about a millisecond a step), which exact mode does not need to pay.
        `sleep_while_waiting` True or False overrides the choice (benchmarks compare the two)."""
        sleep = self.sleep_while_waiting
        if sleep is None:
            sleep = self.experts.host_cores_busy()
        if self._step_done is not None and sleep:
            self._step_done.record()
            self._step_done.synchronize()

    def check_step(self) -> None:
        """After execute() queued a step's device work: let the expert backend raise for work of
        this step that failed off the stream (fast mode's CPU lane), before its tokens are used."""
        self.experts.end_step()

    def _begin_step(self, batch: ForwardBatch, decode: bool, flags: list[bool] | None = None) -> None:
        """flags: per token, decode or not, for a routing record (None: the forward is not recorded)."""
        self.experts.begin_step(batch.num_tokens, decode=decode)
        if self.routing is not None:
            self.routing.begin_forward(batch.num_tokens, flags)

    def _forward_chunks(self, chunks: list, decode: bool, all_logits: bool = False,
                        flags: list[bool] | None = None) -> tuple[ForwardBatch, torch.Tensor]:
        """One forward without drafts: a pure decode step through its block tables and graphs
        when those are on, anything else eagerly. Returns (batch, hidden [T, H])."""
        batch = build_forward_batch(chunks, self.page_size, self.device, all_logits=all_logits,
                                    table_blocks=self.table_blocks if decode else 0)
        self._begin_step(batch, decode, flags)
        if decode and self.graphs is not None:
            hidden = self.graphs.run(batch)
            if hidden is not None:
                return batch, hidden
        return batch, self.model(batch, self.kv_caches)  # hidden [T, H]

    def forward(self, items: list[tuple[Request, int]], all_logits: bool = False) -> torch.Tensor:
        """Run the model over the scheduled tokens; logits [N, V] fp32 at the requested rows."""
        batch, hidden = self._run(items, all_logits)
        return self.model.logits(hidden[batch.logits_index])

    def execute(self, items: list[tuple[Request, int]], eos_ids: tuple[int, ...],
                on_queued: Callable[[], None] | None = None,
                ) -> tuple[list[Request], SampleResult | None, dict[str, list[int]]]:
        """Forward + sample for the requests whose every known token is computed after this step.

        Returns (those requests, their sampled tokens, {request id: tokens} of the requests
        that verified drafts this step: those are not in the first two). on_queued: called
        once the forward is queued on the device, before anything below waits for it (index
        and mask uploads, prompt logprobs, draft verification, reading the tokens)."""
        drafts = self.spec.prepare(items) if self.spec is not None else {}
        batch, hidden = self._run(items, drafts=drafts)
        if on_queued is not None:
            on_queued()
        if self.prompt_logprobs:
            self._collect_prompt_logprobs(items, batch, hidden)
        emitted = self.spec.verify(items, batch.seqs, hidden, drafts) if self.spec is not None else {}
        logits = self.model.logits(hidden[batch.logits_index])  # [N, V]
        done = [i for i, (req, n) in enumerate(items) if req.num_computed + n == req.num_tokens]
        if not done:
            return [], None, emitted
        reqs = [items[i][0] for i in done]
        rows = [SampleRow(r.params, r.prompt_ids, r.output_ids, self.generator_for(r), eos_ids,
                          bias=self.biases.get(r.request_id)) for r in reqs]
        constrained = [i for i, r in enumerate(reqs) if r.request_id in self.grammars]
        if constrained:  # host work from host-side token lists; one small copy to the device
            masks = self.grammar_backend.allowed_masks([self.grammars[reqs[i].request_id] for i in constrained],
                                                       [reqs[i].output_ids for i in constrained], logits.device)
            for j, i in enumerate(constrained):
                rows[i].allowed = masks[j]
        if len(done) == logits.shape[0]:  # every row (a decode step): no index to upload
            return reqs, sample(logits, rows, self.default_generator), emitted
        # a pageable host->device copy would wait for the whole forward here, before the sampler
        # is even queued (a large share of the engine thread's time); a pinned one is queued like
        # the rest
        cuda = logits.device.type == "cuda"
        idx = torch.tensor(done, dtype=torch.long, pin_memory=cuda).to(logits.device, non_blocking=cuda)
        return reqs, sample(logits.index_select(0, idx), rows, self.default_generator), emitted

    def _collect_prompt_logprobs(self, items, batch, hidden: torch.Tensor) -> None:
        """Logprob of each next prompt token (and the top-k) at every prompt position computed now.

        Syncs with the host, but only for requests that asked for prompt logprobs.
        """
        for (req, n), seq in zip(items, batch.seqs):
            store = self.prompt_logprobs.get(req.request_id)
            if store is None or req.output_ids:
                continue
            k = req.params.prompt_logprobs or 0
            start = req.num_computed  # prompt position of the chunk's first token
            # positions p in [start, start + n) predict prompt token p + 1 (the last one, if it
            # is the prompt's last, predicts the first output token: not a prompt logprob)
            last = min(start + n, len(req.prompt_ids) - 1)
            for p0 in range(start, last, PROMPT_LOGITS_ROWS):
                p1 = min(p0 + PROMPT_LOGITS_ROWS, last)
                rows = hidden[seq.q_start + (p0 - start) : seq.q_start + (p1 - start)]  # [R, H]
                lp = torch.log_softmax(self.model.logits(rows), dim=-1)  # [R, V]
                target = torch.tensor(req.prompt_ids[p0 + 1 : p1 + 1], dtype=torch.long, device=lp.device)
                chosen = lp.gather(1, target[:, None])[:, 0].tolist()
                if k:
                    top_vals, top_ids = torch.topk(lp, k, dim=-1)
                    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
                for j, p in enumerate(range(p0, p1)):
                    top = list(zip(top_ids[j], top_vals[j])) if k else []
                    store[p + 1] = TokenLogprob(req.prompt_ids[p + 1], chosen[j], top)
