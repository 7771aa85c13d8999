"""The six acceptance gates a served model must pass, each judged PASS/FAIL with its evidence.

Gates (as the reference lab runs them):
1. load      - /v1/models answers with at least one model.
2. chat      - "Name three primary colors, comma separated." -> non-empty content, finish "stop".
3. reasoning - "What is 17 * 23? Reply with only the number." (thinking on) -> reasoning_content
               non-empty, "391" in content, no "<think>" in content.
4. tools     - get_weather(city) offered, "weather in Paris?" -> a get_weather call with city
               Paris; then the tool result {"temp_c":17} -> an answer that uses 17.
5. context   - filler to 85 % of the context window with a vault code in it -> the code recalled.
6. speed     - >= 15 tok/s over the first 30 s of a streamed story (from its first token).

A gate never raises: HTTP errors and malformed answers become FAIL with the reason, so one
broken feature does not hide the verdicts of the others. Thresholds, durations and the window
are configurable so the same checkers run in seconds against a scripted test server.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from tiermoe.bench import client as http
from tiermoe.bench.prompts import needle_prompt, story_request
from tiermoe.bench.results import envelope

GATE_NAMES = ("load", "chat", "reasoning", "tools", "context", "speed")
CHAT_PROMPT = "Name three primary colors, comma separated."
REASONING_PROMPT = "What is 17 * 23? Reply with only the number."
TOOLS_PROMPT = "What is the weather in Paris right now? Use the get_weather tool."
TOOL_RESULT = '{"temp_c":17}'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"],
        },
    },
}


@dataclass
class GatesConfig:
    url: str
    model: str | None = None
    context: int | None = None  # window in tokens; None: max_model_len from /v1/models
    context_fraction: float = 0.85
    needle_depth: float = 0.0  # where the vault code sits in the filler: 0 start .. 1 end
    speed_window_s: float = 30.0
    speed_min_tok_s: float = 15.0
    max_tokens: int | None = None  # cap on every answer (None: the server's default)
    load_wait_s: float = 0.0  # keep polling /v1/models this long before failing load
    only: tuple[str, ...] = GATE_NAMES
    seed: int | None = None
    timeout: float = http.DEFAULT_TIMEOUT_S
    api_key: str | None = None


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _gate(name: str, ok: bool, reason: str, evidence: dict) -> dict:
    return {"name": name, "verdict": "PASS" if ok else "FAIL", "pass": ok, "reason": reason, "evidence": evidence}


async def gate_load(c: httpx.AsyncClient, cfg: GatesConfig) -> tuple[dict, dict | None]:
    deadline = time.monotonic() + cfg.load_wait_s
    while True:
        t0 = time.perf_counter()
        try:
            models = await http.list_models(c)
            err = None if models else "/v1/models lists no model"
        except http.BenchHTTPError as exc:
            models, err = [], str(exc)
        if err is None or time.monotonic() >= deadline:
            break
        await asyncio.sleep(1.0)
    ev = {"models": [m.get("id") for m in models], "latency_s": time.perf_counter() - t0}
    if err:
        ev["error"] = err
        return _gate("load", False, err, ev), None
    return _gate("load", True, f"{len(models)} model(s) listed", ev), models[0]


async def gate_chat(c: httpx.AsyncClient, model: str, cfg: GatesConfig) -> dict:
    body = http.chat_payload(model, [{"role": "user", "content": CHAT_PROMPT}], cfg.max_tokens)
    resp = await http.post_json(c, "/v1/chat/completions", body)
    content, _reasoning, finish, _tc = http.message_text(resp)
    ev = {"content": _clip(content), "finish_reason": finish}
    problems = []
    if not content.strip():
        problems.append("empty content")
    if finish != "stop":
        problems.append(f"finish_reason {finish!r}, want 'stop'")
    return _gate("chat", not problems, "; ".join(problems) or "non-empty answer, finish stop", ev)


async def gate_reasoning(c: httpx.AsyncClient, model: str, cfg: GatesConfig) -> dict:
    body = http.chat_payload(
        model,
        [{"role": "user", "content": REASONING_PROMPT}],
        cfg.max_tokens,
        chat_template_kwargs={"enable_thinking": True},
    )
    resp = await http.post_json(c, "/v1/chat/completions", body)
    content, reasoning, finish, _tc = http.message_text(resp)
    ev = {
        "content": _clip(content),
        "reasoning_chars": len(reasoning),
        "reasoning_head": _clip(reasoning, 200),
        "finish_reason": finish,
        "think_close_tag_in_content": "</think>" in content,
    }
    problems = []
    if not reasoning.strip():
        problems.append("reasoning_content is empty")
    if "391" not in content:
        problems.append("'391' not in content")
    if "<think>" in content:
        problems.append("'<think>' leaked into content")
    return _gate("reasoning", not problems, "; ".join(problems) or "reasoning separated, 391 in answer", ev)


def _weather_call(tool_calls: list[dict]) -> tuple[dict | None, str | None, str]:
    """(the get_weather call, its city, a reason when there is no usable call)."""
    for call in tool_calls:
        fn = call.get("function") or {}
        if fn.get("name") != "get_weather":
            continue
        args = fn.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else dict(args or {})
        except (ValueError, TypeError):
            return call, None, f"arguments are not JSON: {_clip(str(args), 80)!r}"
        city = parsed.get("city") if isinstance(parsed, dict) else None
        return call, city if isinstance(city, str) else None, "" if isinstance(city, str) else "no 'city' argument"
    names = [(c.get("function") or {}).get("name") for c in tool_calls]
    return None, None, f"no get_weather call (calls: {names})" if names else "no tool call"


async def gate_tools(c: httpx.AsyncClient, model: str, cfg: GatesConfig) -> dict:
    messages: list[dict] = [{"role": "user", "content": TOOLS_PROMPT}]
    body = http.chat_payload(model, messages, cfg.max_tokens, tools=[WEATHER_TOOL])
    resp = await http.post_json(c, "/v1/chat/completions", body)
    content, _r, finish, tool_calls = http.message_text(resp)
    call, city, why = _weather_call(tool_calls)
    ev: dict = {"first_finish_reason": finish, "tool_calls": tool_calls, "first_content": _clip(content, 200)}
    if call is None or city is None:
        return _gate("tools", False, why, ev)
    ev["city"] = city
    if "paris" not in city.lower():
        return _gate("tools", False, f"get_weather called with city {city!r}, want Paris", ev)
    call_id = call.get("id") or "call_0"
    messages.append(
        {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [{"id": call_id, "type": "function", "function": call["function"]}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT})
    body = http.chat_payload(model, messages, cfg.max_tokens, tools=[WEATHER_TOOL])
    resp2 = await http.post_json(c, "/v1/chat/completions", body)
    answer, _r2, finish2, calls2 = http.message_text(resp2)
    ev.update({"answer": _clip(answer), "answer_finish_reason": finish2, "answer_tool_calls": calls2})
    if "17" not in answer:
        return _gate("tools", False, "the answer does not use the tool result (no '17')", ev)
    return _gate("tools", True, "get_weather(city=Paris) called and 17 used in the answer", ev)


async def gate_context(
    c: httpx.AsyncClient, model: str, card: dict | None, cfg: GatesConfig, rng: random.Random
) -> dict:
    window = cfg.context or http.max_model_len(card or {})
    if not window:
        return _gate("context", False, "context window unknown: /v1/models has no max_model_len; pass --context", {})
    target = int(window * cfg.context_fraction)

    async def count(text: str) -> int | None:
        return await http.count_tokens(c, model, text)

    prompt, code, counted, source = await needle_prompt(rng, target, count, cfg.needle_depth)
    body = http.chat_payload(model, [{"role": "user", "content": prompt}], cfg.max_tokens)
    t0 = time.perf_counter()
    resp = await http.post_json(c, "/v1/chat/completions", body)
    elapsed = time.perf_counter() - t0
    content, _r, finish, _tc = http.message_text(resp)
    usage = resp.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens", counted)
    ev = {
        "window": window,
        "target_tokens": target,
        "prompt_tokens": prompt_tokens,
        "token_count_source": "usage" if "prompt_tokens" in usage else source,
        "needle_depth": cfg.needle_depth,
        "code": code,
        "answer": _clip(content, 200),
        "finish_reason": finish,
        "request_s": elapsed,
        "prompt_tok_s": prompt_tokens / elapsed if prompt_tokens and elapsed > 0 else None,
    }
    ok = code in content
    reason = f"vault code recalled from a {prompt_tokens}-token prompt" if ok else f"code {code} not in the answer"
    return _gate("context", ok, reason, ev)


async def gate_speed(c: httpx.AsyncClient, model: str, cfg: GatesConfig) -> dict:
    body = http.chat_payload(model, [{"role": "user", "content": story_request(0, 800)}], cfg.max_tokens)
    res = await http.stream(c, "/v1/chat/completions", body, stop_after=cfg.speed_window_s)
    out = res.token_events
    if len(out) < 2:
        return _gate("speed", False, "fewer than two output events", {"events": len(out), "ttft_s": res.ttft})
    t_first = out[0].t
    in_window = [e for e in out if e.t - t_first <= cfg.speed_window_s]
    span = in_window[-1].t - t_first
    n, source = None, "usage"
    if not res.truncated and res.usage and isinstance(res.usage.get("completion_tokens"), int):
        n = round(len(in_window) * res.tokens_per_event())
    if n is None:
        n = await http.count_tokens(c, model, "".join(e.text for e in in_window))
        source = "tokenize"
    if n is None:
        n, source = len(in_window), "events"
    rate = (n - 1) / span if span > 0 and n > 1 else 0.0
    ev = {
        "tok_s": rate,
        "tokens": n,
        "token_count_source": source,
        "seconds": span,
        "window_s": cfg.speed_window_s,
        "stream_ended_in_window": not res.truncated,
        "ttft_s": res.ttft,
        "threshold_tok_s": cfg.speed_min_tok_s,
    }
    ok = rate >= cfg.speed_min_tok_s
    return _gate("speed", ok, f"{rate:.1f} tok/s over {span:.1f} s ({'>=' if ok else '<'} {cfg.speed_min_tok_s:g})", ev)


async def _guarded(name: str, fn: Callable[[], Awaitable[dict]]) -> dict:
    t0 = time.perf_counter()
    try:
        result = await fn()
    except (http.BenchHTTPError, httpx.HTTPError) as exc:
        result = _gate(name, False, f"request failed: {exc}", {})
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        result = _gate(name, False, f"malformed response: {type(exc).__name__}: {exc}", {})
    result["duration_s"] = time.perf_counter() - t0
    return result


async def run_gates(cfg: GatesConfig) -> dict:
    """Run the selected gates in order; returns the result dict (verdict PASS only if all pass)."""
    rng = random.Random(cfg.seed)
    gates: list[dict] = []
    async with http.make_client(cfg.url, cfg.timeout, cfg.api_key) as c:
        t0 = time.perf_counter()
        load, card = await gate_load(c, cfg)
        load["duration_s"] = time.perf_counter() - t0
        if "load" in cfg.only:
            gates.append(load)
        model = cfg.model or (str(card.get("id")) if card else "default")
        if cfg.model and card is not None and card.get("id") != cfg.model:
            try:
                card = next((m for m in await http.list_models(c) if m.get("id") == cfg.model), {})
            except http.BenchHTTPError:
                card = {}
        steps = {
            "chat": lambda: gate_chat(c, model, cfg),
            "reasoning": lambda: gate_reasoning(c, model, cfg),
            "tools": lambda: gate_tools(c, model, cfg),
            "context": lambda: gate_context(c, model, card, cfg, rng),
            "speed": lambda: gate_speed(c, model, cfg),
        }
        for name in GATE_NAMES[1:]:
            if name in cfg.only:
                gates.append(await _guarded(name, steps[name]))
    passed = sum(g["pass"] for g in gates)
    return envelope(
        "gates",
        url=cfg.url,
        model=model,
        config=http.settings(cfg),
        verdict="PASS" if passed == len(gates) else "FAIL",
        passed=passed,
        total=len(gates),
        gates=gates,
    )
