"""temperature on the OpenAI routes is bounded as in the OpenAI API: [0, 2]. Above 2 the OpenAI
API answers 400; this server sampled at any temperature, so a client's typo (20 for 0.2) gave
noise with a 200 instead of an error naming the field. (vLLM has no upper bound; the OpenAI
API's rule is followed on its routes.)
"""

from __future__ import annotations

import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", [2.5, 20])
def test_temperature_above_two_is_a_400_naming_it(client, value):
    calls = [
        lambda: client.chat.completions.create(model="scripted", messages=MSG, max_tokens=2, temperature=value),
        lambda: client.completions.create(model="scripted", prompt="hi", max_tokens=2, temperature=value),
        lambda: client.responses.create(model="scripted", input="hi", max_output_tokens=2, temperature=value),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == "temperature" and "2" in info.value.body["message"]


@pytest.mark.parametrize("value", [0, 0.0, 1, 2, 2.0])
def test_temperature_in_range_is_served(client, value):
    assert client.chat.completions.create(model="scripted", messages=MSG, max_tokens=2, temperature=value).choices
    assert client.completions.create(model="scripted", prompt="hi", max_tokens=2, temperature=value).choices
    assert client.responses.create(model="scripted", input="hi", max_output_tokens=2, temperature=value).output
