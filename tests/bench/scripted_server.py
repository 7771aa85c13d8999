"""A small scripted OpenAI-compatible server for testing the bench commands end to end.

It speaks the parts of the API the benchmarks use (/v1/models, /tokenize, /v1/completions with
logprobs and echo, /v1/chat/completions with streaming, reasoning and tools) over real HTTP, so
the bench code is exercised exactly as against a real server. Behaviour is scripted:

- A toy language model: tokens are whitespace-led words (`\\s*\\S+`), the next-token logits are
  a hash of the last two tokens over a fixed vocabulary, greedy decoding is deterministic.
  `noise` perturbs the logits (a "different" model for panel scoring).
- Gate prompts get scripted answers: `Behaviour.right=True` answers every gate correctly,
  `right=False` answers every gate wrongly (and /v1/models fails), so each checker must flip.
- Pacing: `prefill_s_per_token` before the first token, `decode_s_per_token` between tokens;
  `burst=True` delivers at half speed and flushes the rest at the end (the stream defect).
- `llama_server=True` speaks llama-server's dialects where they differ from vLLM's: /tokenize
  reads {"content"} (answering {"tokens": []} without it), /v1/completions answers logprobs
  in the chat shape (`logprobs.content[j] = {id, token, bytes, logprob, top_logprobs}`), takes
  list-of-int prompts, ignores `return_tokens_as_token_ids` and refuses `echo`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TOKEN_RE = re.compile(r"\s*\S+|\s+")
VOCAB = [
    " the", " a", " cat", " dog", " sat", " ran", " on", " under", " mat", " tree", " and", " then",
    " quietly", " river", " stone", " bright", " small", " old", " house", " garden", " moon", " over",
    " hill", " wind", " sang", " slept", " blue", " red", " green", " light", " .", " ,", " it", " was",
    " very", " warm", " cold", " day", " night", " again",
]
EOS = "<eos>"


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


class Vocab:
    """Token string <-> id, growing as new words are seen (ids are stable within a server)."""

    def __init__(self):
        self.words: list[str] = []
        self.ids: dict[str, int] = {}

    def id(self, tok: str) -> int:
        if tok not in self.ids:
            self.ids[tok] = len(self.words)
            self.words.append(tok)
        return self.ids[tok]


@dataclass
class Behaviour:
    right: bool = True
    noise: float = 0.0  # logit perturbation of the toy LM
    natural_len: int = 24  # tokens before the toy LM emits EOS
    max_model_len: int = 4096
    prefill_s_per_token: float = 2e-5
    decode_s_per_token: float = 0.002
    burst: bool = False
    model: str = "scripted-tiny"
    has_tokenize: bool = True
    has_completions: bool = True
    has_echo: bool = True
    report_window: bool = True  # max_model_len in /v1/models
    reject_stream_options: bool = False  # 400 on stream_options (some servers do)
    has_token_ids: bool = False  # honour return_tokens_as_token_ids and list-of-int prompts
    llama_server: bool = False  # llama-server's /tokenize and logprobs dialects (module docstring)
    tier_rates: tuple[int, int] | None = None  # /stats: (slot hits, misses) per generated chat token
    static_bound: float | None = None  # /stats slots.static_bound (a server given routing statistics)


def _h(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest(), "little")


def next_logprobs(context: list[str], b: Behaviour, produced: int) -> list[tuple[str, float]]:
    """Log-softmax over VOCAB + EOS given the last two tokens; sorted best first."""
    padded = ["", ""] + context
    a, c = padded[-2], padded[-1]
    logits = []
    for tok in VOCAB:
        x = (_h(a, c, tok) % 10_000) / 1000.0  # 0..10
        if b.noise:
            x += b.noise * ((_h("noise", a, c, tok) % 2000) / 1000.0 - 1.0)
        logits.append((tok, x))
    logits.append((EOS, 100.0 if produced >= b.natural_len else -100.0))
    m = max(x for _, x in logits)
    z = m + math.log(sum(math.exp(x - m) for _, x in logits))
    return sorted(((t, x - z) for t, x in logits), key=lambda p: -p[1])


def generate(prompt_tokens: list[str], b: Behaviour, max_tokens: int) -> list[tuple[str, list[tuple[str, float]]]]:
    """Greedy continuation: [(token, its distribution)], stopping at EOS or max_tokens."""
    ctx, out = list(prompt_tokens), []
    while len(out) < max_tokens:
        dist = next_logprobs(ctx, b, len(out))
        tok = dist[0][0]
        if tok == EOS:
            break
        out.append((tok, dist))
        ctx.append(tok)
    return out


def teacher_forced_oracle(panel: dict, b: Behaviour) -> tuple[float, float]:
    """Teacher-forced top-1 agreement and mean KL of the toy model `b` against a panel, computed
    straight from the model (what `bench panel score` must arrive at over HTTP)."""
    from tiermoe.bench.panel import kl_over_reference

    agree = n = 0
    kls = []
    for it in panel["items"]:
        ctx = tokenize(it["prompt"])
        for i, tok in enumerate(it["tokens"]):
            dist = next_logprobs(ctx, b, i)
            agree += dist[0][0] == it["top"][i][0][0]
            kls.append(kl_over_reference(it["top"][i], [list(x) for x in dist[:20]]))
            n += 1
            ctx.append(tok)
    return agree / n, sum(kls) / len(kls)


def _script_chat(messages: list[dict], tools: list | None, b: Behaviour) -> dict | None:
    """A scripted answer for a gate prompt: {content, reasoning, tool_calls, finish}; None otherwise."""
    last = messages[-1]
    text = last.get("content") or ""
    if tools:
        if last.get("role") == "tool":
            ok = '"temp_c":17' in text.replace(" ", "")
            answer = "It is 17 °C in Paris right now." if (b.right and ok) else "Sorry, I could not get the weather."
            return {"content": answer, "finish": "stop"}
        city = "Paris" if b.right else "London"
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        return {"content": "", "tool_calls": [call], "finish": "tool_calls"}
    if "Name three primary colors" in text:
        return {"content": "Red, yellow, blue", "finish": "stop"} if b.right else {"content": "", "finish": "length"}
    if "17 * 23" in text:
        if b.right:
            return {"reasoning": "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391.", "content": "391", "finish": "stop"}
        return {"content": "<think>17 * 23 is about 392</think>392", "finish": "stop"}
    if "vault code" in text and "Reply with the code only" in text:
        m = re.search(r"the vault code is (\S+?)\. ", text)
        code = m.group(1) if m else "?"
        return {"content": code if b.right else "I do not remember a code.", "finish": "stop"}
    return None


def build_app(b: Behaviour, vocab: Vocab | None = None) -> FastAPI:
    """The scripted server; pass one `vocab` to several apps to give them the same token ids."""
    app = FastAPI()
    state = {"requests": 0, "decode_tokens": 0}
    vocab = vocab or Vocab()
    for t in VOCAB:
        vocab.id(t)

    def err(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=status)

    @app.get("/v1/models")
    async def models():
        if not b.right:
            return err(503, "model still loading")
        card = {"id": b.model, "object": "model"}
        if b.report_window:
            card["max_model_len"] = b.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/stats")
    async def stats():
        if b.tier_rates is None:
            return err(404, "Not Found")
        n, (hit, miss) = state["decode_tokens"], b.tier_rates
        slots = {"hits": hit * n, "misses": miss * n}
        if b.static_bound is not None:
            slots["static_bound"] = b.static_bound
        experts = {"decode_tokens": n, "slots": slots, "cpu_lane": {"experts": 0}}
        return {"engine": {"experts": experts}}

    @app.post("/tokenize")
    async def tok(req: Request):
        if not b.has_tokenize:
            return err(404, "Not Found")
        body = await req.json()
        if b.llama_server:
            return {"tokens": [vocab.id(t) for t in tokenize(body["content"])] if "content" in body else []}
        toks = tokenize(body.get("prompt", ""))
        return {"count": len(toks), "tokens": [vocab.id(t) for t in toks], "max_model_len": b.max_model_len}

    def budget(n_prompt: int, max_tokens) -> int | JSONResponse:
        if n_prompt >= b.max_model_len:
            return err(400, f"prompt has {n_prompt} tokens, more than the {b.max_model_len}-token window")
        return min(max_tokens or 10**9, b.max_model_len - n_prompt)

    @app.middleware("http")
    async def no_stream_options(request: Request, call_next):
        if b.reject_stream_options and request.method == "POST":
            body = await request.body()
            if b"stream_options" in body:
                return err(400, "unknown field: stream_options")
        return await call_next(request)

    @app.post("/v1/completions")
    async def completions(req: Request):
        if not b.has_completions:
            return err(404, "Not Found")
        body = await req.json()
        state["requests"] += 1
        if body.get("echo") and b.llama_server:
            return JSONResponse(
                {"error": {"code": 500, "message": "Only no echo is supported", "type": "server_error"}},
                status_code=500,
            )
        if body.get("echo") and not b.has_echo:
            return err(400, "echo is not supported")
        prompt = body["prompt"]
        as_ids = b.has_token_ids and body.get("return_tokens_as_token_ids") and not b.llama_server
        if isinstance(prompt, list):
            if not (b.has_token_ids or b.llama_server):
                return err(400, "prompt must be a string")
            ptoks = [vocab.words[i] for i in prompt]
            prompt = "".join(ptoks)
        else:
            ptoks = tokenize(prompt)
        limit = budget(len(ptoks), body.get("max_tokens", 16))
        if isinstance(limit, JSONResponse):
            return limit
        k = body.get("logprobs")
        gen = generate(ptoks, b, limit)
        if body.get("stream"):
            return StreamingResponse(_stream_completion(gen, len(ptoks), body, b), media_type="text/event-stream")
        await asyncio.sleep(len(ptoks) * b.prefill_s_per_token)
        text = "".join(t for t, _ in gen)
        choice = {"index": 0, "text": text, "finish_reason": "stop" if len(gen) < limit else "length", "logprobs": None}
        if k and b.llama_server:
            choice["logprobs"] = (
                {"content": [_llama_entry(t, dict(dist)[t], dist[:k], vocab) for t, dist in gen]} if gen else None
            )
        elif k is not None:
            name = (lambda t: f"token_id:{vocab.id(t)}") if as_ids else (lambda t: t)
            toks, offs, lps, tops = [], [], [], []
            off = 0
            if body.get("echo"):
                choice["text"] = prompt + text
                for i, t in enumerate(ptoks):
                    toks.append(name(t))
                    offs.append(off)
                    off += len(t)
                    if i == 0:
                        lps.append(None)
                        tops.append(None)
                        continue
                    dist = next_logprobs(ptoks[:i], b, 0)
                    lps.append(dict(dist).get(t, -30.0))
                    tops.append({name(x): lp for x, lp in dist[: max(k, 1)]})
            else:
                off = len(prompt)
            for t, dist in gen:
                toks.append(name(t))
                offs.append(off)
                off += len(t)
                lps.append(dict(dist)[t])
                tops.append({name(x): lp for x, lp in dist[: max(k, 1)]})
            choice["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}
        usage = {"prompt_tokens": len(ptoks), "completion_tokens": len(gen), "total_tokens": len(ptoks) + len(gen)}
        return {
            "id": f"cmpl-{state['requests']}",
            "object": "text_completion",
            "model": b.model,
            "choices": [choice],
            "usage": usage,
        }

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        body = await req.json()
        state["requests"] += 1
        messages = body["messages"]
        prompt_text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        ptoks = tokenize(prompt_text)
        limit = budget(len(ptoks), body.get("max_tokens"))
        if isinstance(limit, JSONResponse):
            return limit
        scripted = _script_chat(messages, body.get("tools"), b)
        if scripted is None:
            gen = generate(ptoks, b, limit)
            scripted = {"content": "".join(t for t, _ in gen), "pieces": [t for t, _ in gen]}
            scripted["finish"] = "stop" if len(gen) < limit else "length"
        state["decode_tokens"] += len(scripted.get("pieces") or tokenize(scripted.get("content") or ""))
        if body.get("stream"):
            return StreamingResponse(_stream_chat(scripted, len(ptoks), body, b), media_type="text/event-stream")
        await asyncio.sleep(len(ptoks) * b.prefill_s_per_token)
        msg = {"role": "assistant", "content": scripted.get("content") or None}
        if scripted.get("reasoning"):
            msg["reasoning_content"] = scripted["reasoning"]
        if scripted.get("tool_calls"):
            msg["tool_calls"] = scripted["tool_calls"]
        n = len(scripted.get("pieces") or tokenize(scripted.get("content") or ""))
        return {
            "id": f"chatcmpl-{state['requests']}",
            "object": "chat.completion",
            "model": b.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": scripted["finish"]}],
            "usage": {"prompt_tokens": len(ptoks), "completion_tokens": n, "total_tokens": len(ptoks) + n},
        }

    return app


def _llama_entry(tok: str, logprob: float, top: list[tuple[str, float]], vocab: Vocab) -> dict:
    """One position of llama-server's chat-shaped logprobs (its `probs_to_json`)."""

    def one(t: str, lp: float) -> dict:
        return {"id": vocab.id(t), "token": t, "bytes": list(t.encode()), "logprob": lp}

    return dict(one(tok, logprob), top_logprobs=[one(t, lp) for t, lp in top])


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _paced(pieces: list[str], b: Behaviour):
    """Yield pieces at the decode pace; in burst mode at half pace, then the rest at once."""
    if b.burst:
        half = len(pieces) // 2
        for p in pieces[:half]:
            await asyncio.sleep(2 * b.decode_s_per_token)
            yield p
        for p in pieces[half:]:
            yield p
        return
    for p in pieces:
        await asyncio.sleep(b.decode_s_per_token)
        yield p


async def _stream_completion(gen, n_prompt: int, body: dict, b: Behaviour):
    await asyncio.sleep(n_prompt * b.prefill_s_per_token)
    async for tok in _paced([t for t, _ in gen], b):
        yield _sse({"object": "text_completion", "choices": [{"index": 0, "text": tok, "finish_reason": None}]})
    finish = "stop" if len(gen) < (body.get("max_tokens") or 16) else "length"
    yield _sse({"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": finish}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        yield _sse({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(gen)}})
    yield "data: [DONE]\n\n"


async def _stream_chat(scripted: dict, n_prompt: int, body: dict, b: Behaviour):
    def chunk(delta: dict, finish=None) -> str:
        return _sse(
            {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        )

    yield chunk({"role": "assistant", "content": ""})  # before prefill, like many servers
    await asyncio.sleep(n_prompt * b.prefill_s_per_token)
    pieces = scripted.get("pieces") or tokenize(scripted.get("content") or "")
    if scripted.get("reasoning"):
        for p in tokenize(scripted["reasoning"]):
            yield chunk({"reasoning_content": p})
    async for p in _paced(pieces, b):
        yield chunk({"content": p})
    for i, call in enumerate(scripted.get("tool_calls") or []):
        yield chunk({"tool_calls": [dict(call, index=i)]})
    yield chunk({}, scripted["finish"])
    if (body.get("stream_options") or {}).get("include_usage"):
        yield _sse({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(pieces)}})
    yield "data: [DONE]\n\n"


@contextmanager
def serve(behaviour: Behaviour | None = None, app: FastAPI | None = None, lifespan: str = "off"):
    """Run the scripted app (or any ASGI app) on a free local port; yields its base URL."""
    app = app or build_app(behaviour or Behaviour())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
