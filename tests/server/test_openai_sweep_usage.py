"""Usage in a completions stream counts what the same request without streaming counts.

A completions request may carry several prompts; its usage counts every prompt once (n copies
of a prompt read it once). The final usage chunk of the stream counted the first prompt only,
so a client billing or budgeting by the streamed usage undercounted a batch of prompts.
"""

from __future__ import annotations

PROMPTS = ["hello there", "a much longer prompt with many more words in it than the first"]


def test_streamed_usage_of_several_prompts_matches_the_non_streamed(client):
    plain = client.completions.create(model="scripted", prompt=PROMPTS, n=2, max_tokens=4)
    chunks = list(client.completions.create(model="scripted", prompt=PROMPTS, n=2, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_prompt_tokens_count_each_prompt_once(client):
    each = [client.completions.create(model="scripted", prompt=p, max_tokens=1).usage.prompt_tokens for p in PROMPTS]
    chunks = list(client.completions.create(model="scripted", prompt=PROMPTS, max_tokens=1, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == sum(each)
