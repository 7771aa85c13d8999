"""ScriptedEngineCore: the EngineCore contract, on its own step loop."""

from tiermoe.engine.scripted import ScriptedEngineCore, ScriptedReply, default_script
from tiermoe.protocol import SamplingParams


def _run(core, rid, ids, params):
    core.add_request(rid, ids, params)
    outs = []
    while core.has_unfinished_requests():
        outs += [o for o in core.step() if o.request_id == rid]
    return outs


def _chat(tok, text, **kw):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                                       **kw)
    return tok.encode(rendered, add_special_tokens=False)


def test_contract_counts_and_eos(tokenizer):
    core = ScriptedEngineCore(lambda p: "Hello there", tokenizer=tokenizer)
    outs = _run(core, "a", _chat(tokenizer, "hi"), SamplingParams())
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids[-1] in core.eos_token_ids and outs[-1].finish_reason == "stop"
    assert [o.completion_tokens for o in outs] == list(range(1, len(outs) + 1))
    assert tokenizer.decode(ids[:-1]) == "Hello there"


def test_max_tokens_ignore_eos_min_tokens_stop_ids(tokenizer):
    core = ScriptedEngineCore(lambda p: "ab", tokenizer=tokenizer)
    prompt = _chat(tokenizer, "x")
    assert _run(core, "a", prompt, SamplingParams(max_tokens=1))[-1].finish_reason == "length"
    long = _run(core, "b", prompt, SamplingParams(ignore_eos=True, max_tokens=9))
    assert long[-1].completion_tokens == 9 and long[-1].finish_reason == "length"
    first = tokenizer.encode("ab", add_special_tokens=False)[0]
    stopped = _run(core, "c", prompt, SamplingParams(stop_token_ids=[first]))
    assert stopped[-1].finish_reason == "stop" and stopped[-1].completion_tokens == 1


def test_running_set_is_bounded_and_fifo(tokenizer):
    core = ScriptedEngineCore(lambda p: "one two three", tokenizer=tokenizer, max_num_seqs=2)
    for i in range(4):
        core.add_request(str(i), _chat(tokenizer, str(i)), SamplingParams())
    core.step()
    assert core.stats()["running"] == 2 and core.stats()["waiting"] == 2
    core.abort_request("0")
    assert core.stats()["running"] == 1 and core.stats()["aborted"] == 1


def test_prefix_cache_reports_cached_tokens(tokenizer):
    core = ScriptedEngineCore(lambda p: "ok", tokenizer=tokenizer)
    history = "a long shared history " * 10
    first = _run(core, "a", _chat(tokenizer, history + "first"), SamplingParams())
    second = _run(core, "b", _chat(tokenizer, history + "second"), SamplingParams())
    assert first[-1].cached_tokens == 0 and second[-1].cached_tokens >= 32


def test_logprobs_are_normalised(tokenizer):
    import math

    core = ScriptedEngineCore(lambda p: "abc", tokenizer=tokenizer)
    outs = _run(core, "a", _chat(tokenizer, "x"), SamplingParams(logprobs=4))
    lp = outs[0].logprobs[0]
    assert lp.top[0][0] == lp.token_id and len(lp.top) == 4
    assert abs(sum(math.exp(v) for _, v in lp.top) - 1.0) < 1e-9


def test_default_script_gates(tokenizer):
    assert default_script("<|im_start|>user\nWhat is 17 * 23? Reply with only the number.<|im_end|>\n").content == "391"
    reply = default_script('... "get_weather" ...<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n')
    assert reply.tool_calls == [("get_weather", {"city": "Paris"})]
    code = default_script("<|im_start|>user\nfiller. The vault code is 7Q-42. filler. "
                          "What is the vault code?<|im_end|>\n")
    assert "7Q-42" in code.content


def test_thinking_disabled_prompt_skips_reasoning(tokenizer):
    core = ScriptedEngineCore(lambda p: ScriptedReply(content="391", reasoning="17 * 23 = 391"), tokenizer=tokenizer)
    outs = _run(core, "a", _chat(tokenizer, "q", enable_thinking=False), SamplingParams())
    assert tokenizer.decode([t for o in outs for t in o.new_token_ids][:-1]) == "391"
