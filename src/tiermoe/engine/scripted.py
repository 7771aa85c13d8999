"""A deterministic EngineCore that answers from a script instead of a model.

Server behaviour that needs a capable model (tool-call round trips, reasoning, stop strings,
long streamed answers, 16 concurrent clients) is tested against this core: it has a real
tokenizer (`tiny_tokenizer.build_tokenizer()`: byte-level BPE, ChatML template with hermes
tool calls and <think>), a real continuous-batching step loop (a bounded running set, FIFO
waiting queue, one token per running request per step, prefix cache accounting in 16-token
pages) and honours max_tokens, stop_token_ids, eos, ignore_eos, min_tokens and logprobs.

A script maps the prompt text to a `ScriptedReply` (or a plain string). The reply is rendered
in the model family's own format (hermes JSON or GLM arg_key/arg_value tool calls, <think>
reasoning), and the part the prompt already contains is skipped, so a server that forces a
tool call by pre-filling "<tool_call>" still sees a coherent continuation.

`default_script` answers the acceptance-gate prompts (colours, 17 * 23 with reasoning, the
get_weather round trip, vault-code recall, a long story) and echoes anything else, which makes
`tiermoe serve --scripted` usable for gate and stream-delivery tests without a model.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from tiermoe.protocol import InvalidRequest, RequestOutput, SamplingParams, TokenLogprob

_ASSISTANT = "<|im_start|>assistant\n"
_PAGE = 16  # prefix-cache page size in tokens


class ScriptedFault(RuntimeError):
    """Raised from step() by a reply with fail_after set; names the request it breaks."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class ScriptedReply:
    """What the scripted model says. Tool calls are (name, arguments dict) pairs."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[tuple[str, dict]] = field(default_factory=list)
    fail_after: int | None = None  # raise from step() after this many tokens (fault tests)


Script = Callable[[str], "ScriptedReply | str"]


def render_reply(reply: ScriptedReply, tool_format: str = "hermes", thinking: bool = True) -> str:
    """The reply as the model would write it (reasoning, content, then tool calls)."""
    parts = []
    if reply.reasoning is not None and thinking:
        parts.append(f"<think>\n{reply.reasoning}\n</think>\n\n")
    parts.append(reply.content)
    for name, args in reply.tool_calls:
        if tool_format == "glm":
            kv = "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                for k, v in args.items()
            )
            parts.append(f"<tool_call>{name}\n{kv}</tool_call>")
        else:
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            parts.append(f"\n<tool_call>\n{body}\n</tool_call>")
    return "".join(parts)


# ---- the default script --------------------------------------------------------------------

STORY = (
    "Once upon a time there was a small robot who loved to read stories about the sea, the "
    "stars and the mountains. Every night it climbed to the roof of the old library and counted "
    "the lights of the ships far away. "
)


def _last_turn(prompt: str) -> tuple[str, str]:
    """(role, text) of the last non-assistant turn in a ChatML prompt (raw text if not chat)."""
    turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", prompt, flags=re.S)
    for role, text in reversed(turns):
        if role != "assistant":
            return role, text
    return "user", prompt


def default_script(prompt: str) -> ScriptedReply:
    """Answers for the acceptance-gate prompts; echoes everything else."""
    role, text = _last_turn(prompt)
    low = text.lower()
    has_weather_tool = '"get_weather"' in prompt
    if "<tool_response>" in text:
        m = re.search(r'"temp_c"\s*:\s*(-?\d+(?:\.\d+)?)', text)
        temp = m.group(1) if m else "unknown"
        return ScriptedReply(content=f"It is {temp} degrees Celsius in Paris right now.")
    if has_weather_tool and "weather" in low:
        city = re.search(r"\b(?:in|for)\s+([A-Z][a-zA-Z]+)", text)
        return ScriptedReply(
            content="", reasoning="The user wants the weather; I should call get_weather.",
            tool_calls=[("get_weather", {"city": city.group(1) if city else "Paris"})],
        )
    if "primary colors" in low or "primary colours" in low:
        return ScriptedReply(
            content="Red, yellow, blue", reasoning="The three primary colors are red, yellow and blue."
        )
    m = re.search(r"(\d+)\s*\*\s*(\d+)", text)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        return ScriptedReply(content=str(a * b), reasoning=f"{a} * {b} = {a * b}.")
    m = re.search(r"vault code is ([A-Za-z0-9-]+)", prompt)
    if m and "vault" in low:
        return ScriptedReply(content=f"The vault code is {m.group(1)}.")
    if "story" in low:
        return ScriptedReply(content=STORY * 40)
    if "json" in low:
        return ScriptedReply(content='{"answer": "Paris", "confidence": 0.9}')
    return ScriptedReply(content=f"You said: {text.strip()}")


# ---- the core ------------------------------------------------------------------------------


@dataclass
class _Seq:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    script_ids: list[int]
    cached_tokens: int
    fail_after: int | None
    generated: int = 0
    prefilled: bool = False


class ScriptedEngineCore:
    """EngineCore (see protocol.py) whose "model" is a script; deterministic and fast.

    step_delay_s: wall time each step() sleeps, to give streams a realistic pace.
    tool_format: "hermes" or "glm", the family whose tool-call syntax the replies use.
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        tokenizer=None,
        max_model_len: int = 8192,
        max_num_seqs: int = 16,
        step_delay_s: float = 0.0,
        tool_format: str = "hermes",
        name: str = "scripted",
    ):
        if tool_format not in ("hermes", "glm"):
            raise ValueError(f"tool_format must be 'hermes' or 'glm', not {tool_format!r}")
        if tokenizer is None:
            from tiermoe.models.tiny_tokenizer import build_tokenizer

            tokenizer = build_tokenizer()
        self.tokenizer = tokenizer
        self.script = script or default_script
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay_s = step_delay_s
        self.tool_format = tool_format
        self.model_info = {"arch": "scripted", "name": name, "tool_format": tool_format}
        self.device_wait_hook = None  # as LLMEngine: called where a real step would wait for the GPU
        self.queues_device_work = True
        vocab = tokenizer.get_vocab()
        self.eos_token_ids = [vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab]
        self._vocab_size = len(tokenizer)
        self._waiting: deque[_Seq] = deque()
        self._running: OrderedDict[str, _Seq] = OrderedDict()
        self._pages: OrderedDict[tuple, None] = OrderedDict()  # prefix-cache page keys, LRU
        self._max_pages = 4096
        self.counters = {
            "added": 0,
            "finished": 0,
            "aborted": 0,
            "steps": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "cached_tokens": 0,
        }

    # ---- EngineCore interface ----------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequest(f"prompt has {n} tokens; the context holds {self.max_model_len}", "prompt")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the context ({self.max_model_len})",
                "max_tokens",
            )
        if request_id in self._running or any(s.request_id == request_id for s in self._waiting):
            raise InvalidRequest(f"duplicate request id {request_id!r}", "request_id")
        prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        reply = self.script(prompt)
        if isinstance(reply, str):
            reply = ScriptedReply(content=reply)
        text = self._continuation(prompt, reply)
        script_ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        seq = _Seq(
            request_id,
            list(prompt_token_ids),
            params,
            script_ids,
            self._cache_lookup(prompt_token_ids),
            reply.fail_after,
        )
        self._waiting.append(seq)
        self.counters["added"] += 1

    def abort_request(self, request_id: str) -> None:
        if self._running.pop(request_id, None) is not None:
            self.counters["aborted"] += 1
            return
        for seq in list(self._waiting):
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                self.counters["aborted"] += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[RequestOutput]:
        if self.device_wait_hook is not None:
            self.device_wait_hook()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.counters["steps"] += 1
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting.popleft()
            self._running[seq.request_id] = seq
        outputs = []
        for seq in list(self._running.values()):
            if seq.fail_after is not None and seq.generated >= seq.fail_after:
                del self._running[seq.request_id]
                raise ScriptedFault(f"scripted fault in {seq.request_id}", [seq.request_id])
            if not seq.prefilled:
                seq.prefilled = True
                self.counters["prompt_tokens"] += len(seq.prompt_ids)
                self.counters["cached_tokens"] += seq.cached_tokens
                self._cache_insert(seq.prompt_ids)
            outputs.append(self._next_token(seq))
        return outputs

    def stats(self) -> dict:
        used = sum(len(s.prompt_ids) + s.generated for s in self._running.values())
        capacity = self.max_model_len * self.max_num_seqs
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "kv_usage": used / capacity if capacity else 0.0,
            "prefix_cache_pages": len(self._pages),
            **self.counters,
        }

    def expert_heat(self) -> None:
        """No routed experts here: the dashboard's heat map says so."""
        return None

    # ---- internals -----------------------------------------------------------------------
    def _continuation(self, prompt: str, reply: ScriptedReply) -> str:
        """The rendered reply minus what the prompt's open assistant turn already holds.

        A closed think block in the prompt (thinking disabled, or a budget that closed it)
        means no reasoning; any other pre-filled text (a forced "<tool_call>") means the model
        is past its reasoning and continues that text.
        """
        already = prompt.rsplit(_ASSISTANT, 1)[1] if _ASSISTANT in prompt else ""
        if "</think>" in already:
            already = already.split("</think>", 1)[1]
            thinking = False
        else:
            thinking = not already.strip() or already.lstrip().startswith("<think>")
        text = render_reply(reply, self.tool_format, thinking=thinking)
        head = already.lstrip()
        if head and text.lstrip().startswith(head):
            return text.lstrip()[len(head) :]
        return text if not already.strip() else text.lstrip()

    def _next_token(self, seq: _Seq) -> RequestOutput:
        p = seq.params
        i = seq.generated
        eos = self.eos_token_ids[0]
        if i < len(seq.script_ids):
            token = seq.script_ids[i]
        elif p.ignore_eos or i < p.min_tokens:
            token = seq.script_ids[i % len(seq.script_ids)] if seq.script_ids else self._filler()
        else:
            token = eos
        seq.generated += 1
        self.counters["generated_tokens"] += 1
        finish = None
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos and i >= p.min_tokens):
            finish = "stop"
        elif p.max_tokens is not None and seq.generated >= p.max_tokens:
            finish = "length"
        elif len(seq.prompt_ids) + seq.generated >= self.max_model_len:
            finish = "length"
        logprobs = [self._logprob(token, p.logprobs)] if p.logprobs is not None else None
        if finish:
            del self._running[seq.request_id]
            self.counters["finished"] += 1
        return RequestOutput(
            seq.request_id,
            [token],
            finished=finish is not None,
            finish_reason=finish,
            logprobs=logprobs,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.generated,
            cached_tokens=seq.cached_tokens,
        )

    def _filler(self) -> int:
        return self.tokenizer.get_vocab().get("Ġ", 0)

    def _logprob(self, token: int, top_n: int) -> TokenLogprob:
        """A fixed, normalised distribution: the chosen token gets 0.9, alternatives share 0.1."""
        alts = [(token + k) % self._vocab_size for k in range(1, max(top_n, 1))]
        chosen = math.log(0.9)
        top = [(token, chosen)] + [(a, math.log(0.1 / max(len(alts), 1))) for a in alts]
        return TokenLogprob(token, chosen, top[:top_n])

    def _page_keys(self, ids: list[int]) -> list[tuple]:
        return [tuple(ids[: (k + 1) * _PAGE]) for k in range(len(ids) // _PAGE)]

    def _cache_lookup(self, ids: list[int]) -> int:
        hit = 0
        for key in self._page_keys(ids[:-1]):  # the last prompt token is always computed
            if key not in self._pages:
                break
            hit = len(key)
        return hit

    def _cache_insert(self, ids: list[int]) -> None:
        for key in self._page_keys(ids):
            self._pages[key] = None
            self._pages.move_to_end(key)
        while len(self._pages) > self._max_pages:
            self._pages.popitem(last=False)
