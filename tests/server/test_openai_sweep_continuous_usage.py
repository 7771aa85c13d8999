"""stream_options.continuous_usage_stats (vLLM's extension, which this server declares): with
include_usage, every chunk carries the usage so far, not null, as vLLM sends it. The option was
accepted and then ignored, so a client reading the running count saw null on every chunk.
"""

from __future__ import annotations

import pytest

MSG = [{"role": "user", "content": "Tell me a story"}]
OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def _check_running(chunks):
    body = [c for c in chunks if c.choices]
    assert body and all(c.usage is not None for c in body)
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and counts[-1] > 0
    for c in body:
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == counts[-1]


def test_chat_chunks_carry_running_usage(client):
    chunks = list(client.chat.completions.create(model="scripted", messages=MSG, max_tokens=12, stream=True,
                                                 stream_options=OPTIONS))
    _check_running(chunks)


def test_completions_chunks_carry_running_usage(client):
    chunks = list(client.completions.create(model="scripted", prompt=["Tell me a story", "hi"], max_tokens=12,
                                            stream=True, stream_options=OPTIONS))
    _check_running(chunks)
    assert chunks[0].usage.prompt_tokens == chunks[-1].usage.prompt_tokens


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True}, {"include_usage": True}])
def test_without_both_flags_chunks_carry_no_running_usage(client, options):
    chunks = list(client.chat.completions.create(model="scripted", messages=MSG, max_tokens=6, stream=True,
                                                 stream_options=options))
    assert all(c.usage is None for c in chunks if c.choices)
