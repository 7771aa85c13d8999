"""Completions with echo and stream, which the OpenAI API and vLLM both serve: each choice's
stream starts with its prompt (and the prompt's logprobs, when asked), so the concatenated
stream equals the non-streamed text. The server refused the pair with a 400.
"""

from __future__ import annotations

import openai
import pytest

PROMPTS = ["hello there", "one more"]


def _joined(chunks):
    text, tokens, offsets = {}, {}, {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    return text, tokens, offsets


def test_echo_stream_matches_non_stream(client):
    plain = client.completions.create(model="scripted", prompt=PROMPTS, n=2, echo=True, max_tokens=4)
    chunks = list(client.completions.create(model="scripted", prompt=PROMPTS, n=2, echo=True, max_tokens=4,
                                            stream=True))
    text, _, _ = _joined(chunks)
    assert text == {c.index: c.text for c in plain.choices}
    assert all(text[i].startswith(PROMPTS[i // 2]) for i in text)


def test_echo_stream_with_logprobs_starts_with_the_prompt_tokens(client):
    plain = client.completions.create(model="scripted", prompt="hello there", echo=True, logprobs=1, max_tokens=4)
    chunks = list(client.completions.create(model="scripted", prompt="hello there", echo=True, logprobs=1,
                                            max_tokens=4, stream=True))
    _, tokens, offsets = _joined(chunks)
    assert tokens[0] == plain.choices[0].logprobs.tokens
    assert offsets[0] == plain.choices[0].logprobs.text_offset


def test_echo_stream_scoring_only_is_still_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as info:
        list(client.completions.create(model="scripted", prompt="hi", echo=True, max_tokens=0, stream=True))
    assert info.value.body["param"] == "echo"
