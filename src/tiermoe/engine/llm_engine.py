"""LLMEngine: the synchronous step loop (implements protocol.EngineCore).

add_request / abort_request may be called from another thread (the async bridge); they only
enqueue. step() drains the queues, schedules, runs one forward pass and returns the new
tokens of every request that produced one. A failure inside a forward pass fails the requests
of that step (finish_reason "error") and the engine keeps serving the rest. A store that fails
(StoreError: a record's checksum, an I/O error) is logged as one line, not a traceback (the
message names the record), and its outputs carry STORE_CORRUPT or STORE_ERROR.

Structured output: a request with `params.structured` gets a grammar matcher when it is added
(a grammar that does not compile is an InvalidRequest); the runner masks its logits each step
and the engine ends it with "stop" as soon as the grammar is complete. Prompt logprobs: the
runner collects them during prefill and they go out with the request's first output; such a
request does not take pages from the prefix cache (cached positions have no logits).

Speculative decoding (`num_speculative_tokens` 1 or 2, models with an MTP head): greedy
requests in decode verify drafts and may get several tokens in one step; they are appended
one by one with the usual stop checks (EOS, stop tokens, max_tokens), cut at the first stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from tiermoe.protocol import (GRAMMAR_ERROR, STORE_CORRUPT, STORE_ERROR, InvalidRequest, RequestOutput, SamplingParams,
                              TokenLogprob)
from tiermoe.errors import StoreError, StoreIntegrityError, UserError
from tiermoe.engine import gc_pauses, jit_compiles
from tiermoe.engine.ranks import RankGroup, StepInputs
from tiermoe.runner.model_runner import ModelRunner
from tiermoe.scheduler.kv_pages import KVPages
from tiermoe.scheduler.request import Request
from tiermoe.scheduler.scheduler import Scheduler

log = logging.getLogger("tiermoe.engine")
# one line a step at DEBUG (`serve --log-level debug`): what ran, and for how long, so that a slow first token
# or a gap between steps can be placed without a profiler
step_log = logging.getLogger("tiermoe.engine.steps")


class LLMEngine:
    def __init__(self, model, tokenizer, *, max_model_len: int, max_num_seqs: int, max_batched_tokens: int,
                 num_pages: int, page_size: int = 16, model_info: dict | None = None, seed: int | None = None,
                 num_speculative_tokens: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.warm_up_done: dict | None = None  # {"steps", "seconds"} once warm_up() ran
        self.vocab_size = model.spec.vocab_size
        eos = set(model.spec.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.model_info = model_info or {"arch": model.spec.arch}
        # Recurrent-state families cannot resume from a cached prefix: their state is per slot.
        self.kv = KVPages(num_pages, page_size, prefix_caching=not model.spec.recurrent_state)
        self.runner = ModelRunner(model, num_pages, page_size, max_num_seqs=max_num_seqs, seed=seed,
                                  tokenizer=tokenizer, eos_ids=self.eos_token_ids,
                                  num_speculative_tokens=num_speculative_tokens)
        spec = self.runner.spec
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_batched_tokens,
                                   lookahead=spec.lookahead if spec is not None else None,
                                   chunk_multiple=model.spec.prefill_chunk_multiple)
        self._lock = threading.Lock()
        self._incoming: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._live: dict[str, Request] = {}
        self._last_step_end: float | None = None  # perf_counter at the end of the last step (the step log)
        self.gc_pauses = gc_pauses.watch()  # the collector's pauses, process-wide (a cause of stalled steps)
        # Triton compiles, process-wide: one inside a served step stalls it (engine/jit_compiles.py)
        self.jit = jit_compiles.watch() if self.runner.device.type == "cuda" else None
        self.counters = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "decode_steps": 0, "errors": 0, "aborted": 0, "step_seconds": 0.0}
        # called once a step's forward is queued on the device, before anything waits for it
        # (ModelRunner.execute's on_queued): AsyncEngine hands the previous step's outputs to
        # the event loop there. Only where the forward runs asynchronously (CUDA): on a CPU
        # "queued" means computed, and holding the outputs would delay every token by a step.
        self.device_wait_hook: Callable[[], None] | None = None
        self.queues_device_work = str(self.runner.device).startswith("cuda")
        self.ranks: RankGroup | None = None  # an expert-parallel group's engines kept in step (engine/ranks.py)

    # -- EngineCore API -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt is {n} tokens; this model's context is {self.max_model_len} tokens "
                f"(prompt plus at least one generated token)", "messages")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
        room = self.max_model_len - n
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(
                f"max_tokens={max_tokens} is too large: the prompt is {n} tokens and the context is "
                f"{self.max_model_len}, so at most {room} tokens can be generated", "max_tokens")
        if params.logit_bias and any(t >= self.vocab_size for t in params.logit_bias):
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {self.vocab_size})", "logit_bias")
        grammar = None
        if params.structured is not None:
            try:
                grammar = self.runner.build_grammar(params.structured)
            except InvalidRequest as exc:
                if not params.structured.get("best_effort"):
                    raise
                log.warning("request %s: serving without its grammar (%s)", request_id, exc)
        req = Request(request_id, list(prompt_token_ids), params, max_tokens)
        with self._lock:
            if request_id in self._live:
                raise InvalidRequest(f"duplicate request id {request_id!r}", "request_id")
            self.runner.add_request(request_id, params, n, grammar)
            # Prompt logprobs need every prompt position computed: no prefix-cache reuse until
            # they are delivered.
            req.reuse_prefix = params.prompt_logprobs is None
            self._live[request_id] = req
            self._incoming.append(req)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def warm_up(self) -> int:
        """Compile and record every step shape before serving (ModelRunner.warm_up); steps run."""
        t0 = time.perf_counter()
        steps = self.runner.warm_up(self.max_num_seqs, min(self.scheduler.max_batched_tokens, self.max_model_len))
        self.warm_up_done = {"steps": steps, "seconds": round(time.perf_counter() - t0, 3)}
        if self.jit is not None:
            self.jit.mark_warm_up()
        return steps

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live or self._incoming or self._aborts)

    def step(self) -> list[RequestOutput]:
        if self.ranks is None:
            return self._step()
        try:
            return self._step()
        except Exception as exc:  # the ranks' engines cannot stay in step past a failure they did not agree on
            self.ranks.abandon(exc)
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._drain_queues()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        self.counters["steps"] += 1
        decode = sum(req.num_tokens - req.num_computed == 1 for req, _ in batch.items)  # sequences in decode
        if decode == len(batch.items):
            self.counters["decode_steps"] += 1
        try:
            # device_wait_hook runs once the forward is queued, before execute waits for it
            try:
                done, result, verified = self.runner.execute(batch.items, tuple(self.eos_token_ids),
                                                             on_queued=self.device_wait_hook)
            except Exception as exc:
                if self.ranks is not None:  # the ranks agree on failures at check_step only (engine/ranks.py)
                    self.ranks.abandon(exc)
                raise
            self.runner.check_step()
        except Exception as exc:  # fail this step's requests, keep serving the others
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            code = store_error_code(exc)
            if code:
                log.error("forward pass failed: %s", message)
            else:
                log.exception("forward pass failed")
            self.counters["errors"] += 1
            for req, _ in batch.items:
                outputs.append(self._finish(req, "error", error=message, error_code=code))
            return outputs
        for req, n in batch.items:
            self.scheduler.commit(req, len(verified[req.request_id]) if req.request_id in verified else n)
        if result is not None:
            outputs.extend(self._append_tokens(done, result))
        if verified:
            outputs.extend(self._append_verified(batch.items, verified))
        if self.runner.routing is not None:  # a routing record copies out and writes periodically
            self.runner.routing.step_done()
        t1 = time.perf_counter()
        self.counters["step_seconds"] += t1 - t0
        if step_log.isEnabledFor(logging.DEBUG):
            self._log_step(batch.items, decode, t0, t1)
        return outputs

    def _log_step(self, items: list[tuple[Request, int]], decode: int, t0: float, t1: float) -> None:
        """One step-log line: its kind (decode: one known token for each of its sequences, `decode` of them),
        sequences, tokens, wall time and the idle time since the last step ended (the engine waiting for
        requests or for the event loop)."""
        kind = "decode" if decode == len(items) else ("prefill" if decode == 0 else "mixed")
        idle = "" if self._last_step_end is None else f", {1e3 * (t0 - self._last_step_end):.1f} ms after the last"
        step_log.debug("step %d: %s, %d sequences, %d tokens, %.1f ms%s", self.counters["steps"], kind, len(items),
                       sum(n for _, n in items), 1e3 * (t1 - t0), idle)
        self._last_step_end = t1

    def stats(self) -> dict:
        kv = self.kv
        out = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": kv.num_pages,
            "kv_pages_free": kv.num_free,
            "kv_usage": round(kv.usage(), 4),
            "slot_state_bytes": self.runner.slot_state_bytes(),
            "prefix_cache_hit_tokens": kv.hits,
            "prefix_cache_query_tokens": kv.queries,
            "preemptions": self.scheduler.num_preemptions,
            **self.counters,
            "gc": self.gc_pauses.counters(),
        }
        if self.jit is not None:
            out["jit"] = self.jit.counters()
        out["decode_attention"] = "paged" if self.runner.table_blocks else "sdpa"
        # whose routing the experts served: the model's own, or --routing-replay's (benchmarks)
        out["routing"] = self.runner.routing.counters() if self.runner.routing is not None else {"source": "model"}
        if self.runner.graphs is not None:
            out["decode_graphs"] = self.runner.graphs.counters()
        if self.warm_up_done is not None:
            out["warm_up"] = dict(self.warm_up_done)
        experts = self.runner.experts.counters()
        if experts is not None:
            out["experts"] = experts
            # beside the slot counters it qualifies (bench sweep reads it there): the replayed file or None
            out["experts"]["routing_replay"] = (out["routing"].get("replay") or {}).get("file")
        if self.runner.spec is not None:
            out["speculative"] = self.runner.spec.stats()
        return out

    def expert_heat(self) -> dict | None:
        """Per-layer expert counts for the web dashboard's heat map (moe/heat.py); None with
        resident experts. Between steps only: it may wait for the queued device work."""
        return self.runner.experts.heat()

    # -- internals -----------------------------------------------------------------------
    def _drain_queues(self) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            aborts, self._aborts = list(self._aborts), deque()
        if self.ranks is not None:
            self.ranks.publish(StepInputs([(r.request_id, r.prompt_ids, r.params) for r in incoming], aborts))
        for req in incoming:
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(req.prompt_ids)
            self.scheduler.add(req)
        for rid in aborts:
            req = self._live.get(rid)
            if req is not None:
                self.counters["aborted"] += 1
                outputs.append(self._finish(req, "abort"))
        return outputs

    def _finish(self, req: Request, reason: str, new_ids=None, logprobs=None, error: str | None = None,
                prompt_logprobs=None, error_code: str | None = None) -> RequestOutput:
        self.scheduler.finish(req, reason)
        self._prompt_logprobs_done(req)
        self.runner.release(req)
        with self._lock:
            self._live.pop(req.request_id, None)
        out = self._output(req, new_ids or [], logprobs, True, reason, error, prompt_logprobs)
        out.error_code = error_code
        return out

    def _output(self, req, new_ids, logprobs, finished, reason, error=None, prompt_logprobs=None) -> RequestOutput:
        return RequestOutput(req.request_id, new_ids, finished, reason, logprobs, len(req.prompt_ids),
                             len(req.output_ids), req.cached_tokens, error, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs_done(self, req: Request) -> list | None:
        """The request's prompt logprobs (once); afterwards its prefix may come from the cache."""
        if req.params.prompt_logprobs is None or req.request_id not in self.runner.prompt_logprobs:
            return None
        req.reuse_prefix = True
        return self.runner.take_prompt_logprobs(req)

    def _append_tokens(self, reqs: list[Request], result) -> list[RequestOutput]:
        self.runner.wait_for_device()  # asleep, not spinning a core the CPU lane or the server needs
        tokens = result.tokens.tolist()  # the one host sync of the step
        if self.ranks is not None:
            tokens = self.ranks.agree_tokens(tokens)
        chosen = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_vals = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        outputs = []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_ids.append(tok)
            self.counters["generation_tokens"] += 1
            lp = None
            if req.params.logprobs is not None and chosen is not None:
                k = req.params.logprobs
                top = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids is not None else []
                lp = [TokenLogprob(tok, chosen[i], top)]
            plp = self._prompt_logprobs_done(req) if len(req.output_ids) == 1 else None
            reason, error, code = self._stop_reason(req, tok), None, None
            if reason in (None, "length") and req.request_id in self.runner.grammars:
                complete, error = self.runner.advance_grammar(req)
                if error is not None:  # its first line: the rest is the grammar engine's internal state
                    reason, code = "error", GRAMMAR_ERROR
                    error = f"structured output: {(error.strip().splitlines() or ['grammar error'])[0]}"
                elif complete:
                    reason = "stop"
            if reason:
                outputs.append(self._finish(req, reason, [tok], lp, error, plp, error_code=code))
            else:
                outputs.append(self._output(req, [tok], lp, False, None, None, plp))
        return outputs

    def _append_verified(self, items, verified: dict[str, list[int]]) -> list[RequestOutput]:
        """Tokens of requests that verified drafts (no logprobs or grammar: see
        runner/speculative.draftable), appended one by one and cut at the first stop."""
        outputs = []
        for req, _ in items:
            tokens = verified.get(req.request_id)
            if tokens is None:
                continue
            new, reason = [], None
            for tok in tokens:
                req.output_ids.append(tok)
                new.append(tok)
                self.counters["generation_tokens"] += 1
                reason = self._stop_reason(req, tok)
                if reason:
                    break
            outputs.append(self._finish(req, reason, new) if reason else self._output(req, new, None, False, None))
        return outputs

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if len(req.output_ids) >= p.min_tokens:
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                return "stop"
        if len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None


def store_error_code(exc: BaseException) -> str | None:
    """The RequestOutput.error_code of a failure in the expert store (protocol.py), else None."""
    if isinstance(exc, StoreIntegrityError):
        return STORE_CORRUPT
    return STORE_ERROR if isinstance(exc, StoreError) else None


def generate_ids(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Run prompts to completion through the engine (offline use: CLI, eval, tests)."""
    results: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
        results[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
            if out.finish_reason == "error":
                raise UserError(f"generation failed: {out.error}")
    return [results[str(i)] for i in range(len(prompts))]
