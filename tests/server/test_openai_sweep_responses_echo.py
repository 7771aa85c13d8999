"""A Response object echoes the request's configuration, as the OpenAI API's does: `text` (the
format asked for, and verbosity) and `reasoning`. The server always said text.format was plain
text, so a client reading response.text to know how to parse output_text (or logging what was
asked) was told the wrong format; the created, streamed and final objects must all agree.
"""

from __future__ import annotations

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
TEXT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}, "verbosity": "low"}


def _check(response):
    fmt = response.text.format
    assert fmt.type == "json_schema" and fmt.name == "answer" and fmt.schema_ == SCHEMA and fmt.strict is True
    assert response.text.verbosity == "low"
    assert response.reasoning.effort == "low"


def test_non_streamed_response_echoes_text_and_reasoning(client):
    r = client.responses.create(model="scripted", input="give json", text=TEXT, reasoning={"effort": "low"},
                                max_output_tokens=40)
    _check(r)


def test_streamed_responses_echo_text_and_reasoning(client):
    events = list(client.responses.create(model="scripted", input="give json", text=TEXT, reasoning={"effort": "low"},
                                          max_output_tokens=40, stream=True))
    _check(events[0].response)
    _check(events[-1].response)


def test_without_text_the_format_is_plain_text(client):
    r = client.responses.create(model="scripted", input="hi", max_output_tokens=4)
    assert r.text.format.type == "text" and r.reasoning is None
