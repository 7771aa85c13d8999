"""Grammar-constrained decoding (response_format json_object / json_schema, regex) via llguidance.

Each constrained request owns one `llguidance.LLMatcher`, built when the request is added
(so a grammar that does not compile is refused up front, as a 400). Every step, before
sampling, the matcher is brought up to date with the request's `output_ids` and asked for
the set of tokens that keep the output inside the grammar; the sampler sets every other
logit to -inf before greedy or random choice. After the engine appends the chosen token,
`ModelRunner.advance_grammar` feeds it to the matcher and reports whether the grammar is
complete (the engine then ends the request with "stop") or broken.

Why the matcher is synced from `output_ids` instead of trusting a push per sampled token:
the scheduler may preempt a request and recompute it, and a failed step may drop a token;
`output_ids` is the one record of what the client has been sent, so the matcher is made to
reflect exactly that list (consuming what it has not seen, rolling back what it saw but the
list no longer holds).

Host work, no device sync: masks are computed on the CPU from host-side token lists while the
step's forward pass is still running on the GPU; the packed bitmask [G, V/32] int32 goes to the
device from pinned memory without blocking and is unpacked there. Rows without a grammar cost
nothing. EOS: the llguidance tokenizer is told every engine EOS id, so EOS is
allowed exactly when the grammar accepts and is the only choice once the grammar has stopped.
"""

from __future__ import annotations

import json
import re
import threading

import torch

from tiermoe.protocol import JSON_WHITESPACE, InvalidRequest

# Bounded JSON whitespace (see protocol.JSON_WHITESPACE); a schema's own "x-guidance" options win.
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


class RequestGrammar:
    """One request's matcher plus the exact token list it has consumed."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.tokens: list[int] = []  # what the matcher has consumed, in order

    def sync(self, output_ids: list[int]) -> None:
        """Make the matcher reflect exactly `output_ids` (the engine only appends, so this is
        normally a consume of the newest token; anything else is repaired by rollback)."""
        n = len(self.tokens)
        if n <= len(output_ids) and (n == 0 or output_ids[n - 1] == self.tokens[-1]):
            new = output_ids[n:]
        else:  # the list changed under us: roll back to the common prefix
            common = 0
            for a, b in zip(self.tokens, output_ids):
                if a != b:
                    break
                common += 1
            if not self.matcher.rollback(n - common):
                self.matcher.reset()
                common = 0
            del self.tokens[common:]
            new = output_ids[common:]
        if new:
            self.matcher.consume_tokens(list(new))
            self.tokens.extend(new)

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "a token was rejected by the grammar"


class GrammarBackend:
    """Compiles structured specs to llguidance matchers for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self._ll_tokenizer = None
        self._init_error: str | None = None
        self._lock = threading.Lock()
        self._executor = None

    def _llg(self):
        """The llguidance tokenizer, built on first use (about a second for a large vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None and self._init_error is None:
                try:
                    import llguidance.hf

                    n_vocab = max(self.vocab_size, len(self.tokenizer))
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab,
                                                                       eos_token=self.eos_ids)
                except Exception as exc:  # no llguidance, or a tokenizer it cannot read
                    self._init_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self._ll_tokenizer is None:
                raise InvalidRequest(f"structured output is not available for this model ({self._init_error})",
                                     "response_format")
            return self._ll_tokenizer

    def marker(self, text: str) -> str:
        """A Lark terminal for `text`: the token itself when it is one token (special tokens
        can only be matched that way), else the literal string."""
        ids = self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer is not None else []
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)

    def grammar_text(self, spec: dict) -> str:
        """A structured spec -> Lark grammar text for llguidance; InvalidRequest if malformed.

        spec["reasoning"] ("open": the prompt opened a think block; "optional": the model may
        open one) lets free reasoning text up to </think> come before the constrained answer.
        """
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "json_object":
            body = "%json " + json.dumps({"type": "object", "x-guidance": JSON_OPTIONS})
        elif kind == "json_schema":
            schema = spec.get("schema")
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise InvalidRequest("json_schema needs a schema object", "response_format")
            # the schema's own x-guidance options (if any) win over ours
            options = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
            body = "%json " + json.dumps({**schema, "x-guidance": options})
        elif kind == "regex":
            pattern = spec.get("pattern")
            if not isinstance(pattern, str):
                raise InvalidRequest("regex needs a pattern string", "response_format")
            import llguidance

            body = "/" + llguidance.regex_to_lark(pattern, "") + "/"
        elif kind == "lark":
            grammar = spec.get("grammar")
            if not isinstance(grammar, str):
                raise InvalidRequest("lark needs a grammar string", "response_format")
            body = "tiermoe_answer"
        else:
            raise InvalidRequest(f"unsupported structured output type {kind!r}", "response_format")
        lines = []
        reasoning = spec.get("reasoning")
        if reasoning in ("open", "optional"):
            think = f'/(?s:.*)/ {self.marker("</think>")} /[ \\t\\r\\n]*/'
            lines.append(f"start: ({self.marker('<think>')} {think})? tiermoe_body" if reasoning == "optional"
                         else f"start: {think} tiermoe_body")
        else:
            lines.append("start: tiermoe_body")
        lines.append(f"tiermoe_body: {body}")
        if kind == "lark":  # the caller's grammar, its start rule renamed so ours stays the root
            lines.append(re.sub(r"^start(\s*:)", r"tiermoe_answer\1", spec["grammar"], flags=re.M))
        return "\n".join(lines) + "\n"

    def build(self, spec: dict) -> RequestGrammar:
        """A fresh matcher for `spec`; InvalidRequest when the grammar does not compile."""
        import llguidance

        tok = self._llg()
        grammar = llguidance.LLMatcher.grammar_from_lark(self.grammar_text(spec))
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            message = matcher.get_error().strip().splitlines()[0]
            raise InvalidRequest(f"the response format cannot be compiled to a grammar: {message}", "response_format")
        return RequestGrammar(matcher)

    def allowed_masks(self, grammars: list[RequestGrammar], output_ids: list[list[int]],
                      device: torch.device | str) -> torch.Tensor:
        """Bring each matcher up to `output_ids`, then the allowed tokens: bool [G, V] on device.

        A matcher in an error state allows every token (the engine fails that request when it
        reads the error after the step, so its one extra token is never shown as valid).
        """
        import llguidance
        import llguidance.numpy as lnp

        for g, ids in zip(grammars, output_ids):
            g.sync(ids)
        shape = lnp.get_bitmask_shape(len(grammars), self._llg().vocab_size)
        pinned = torch.device(device).type == "cuda"  # so the copy below need not wait for the GPU
        bits = torch.full(shape, -1, dtype=torch.int32, pin_memory=pinned)  # [G, W] packed, little-endian bits
        live = [(g.matcher, i) for i, g in enumerate(grammars) if not g.matcher.is_error()]
        if live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, bits.data_ptr(), shape[1] * 4, shape[0])
        return unpack_bitmask(bits.to(device, non_blocking=pinned), self.vocab_size)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bits int32 [G, W] (bit j of word w = token 32*w + j) -> bool [G, vocab_size]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)  # [G, 32*W]
    if allowed.shape[1] < vocab_size:  # the tokenizer knows fewer ids than the model head
        pad = torch.zeros(bits.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed[:, :vocab_size]
