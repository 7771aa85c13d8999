"""Anthropic error bodies carry no `param` field, so the message itself must say which field is
wrong (the Anthropic API writes "messages.1.content.0: ..."): one of many blocks or tools is
otherwise impossible to find."""

import anthropic
import pytest

Q = {"role": "user", "content": "q"}
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}


@pytest.mark.parametrize("messages, where", [
    ([Q, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "fine"},
        {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "image", "source": {}}]}]}],
     "messages[2].content[1].content[0]"),
    ([Q, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}], "messages[1].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": {}}]}],
     "messages[0].content[1]"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 7, "content": "x"}]}],
     "messages[0].content[0].tool_use_id"),
])
def test_the_message_names_the_offending_block(anthropic_client, messages, where):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=20, messages=messages)
    assert set(e.value.body) == {"type", "error"} and set(e.value.body["error"]) == {"type", "message"}
    assert where in e.value.body["error"]["message"], e.value.body


def test_a_message_that_names_its_field_is_not_prefixed_twice(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=20, messages=[Q], stop_sequences=["x"] * 100)
    message = e.value.body["error"]["message"]
    assert message.startswith("stop_sequences has 100 entries"), message


@pytest.mark.parametrize("block", [{"type": "text"}, {"type": "text", "text": None}])
def test_a_text_block_without_text_says_so(anthropic_client, block):
    """Not "content block of type 'text' is not supported (text only)", which contradicts itself."""
    for kwargs in ({"messages": [{"role": "user", "content": [block]}]},
                   {"messages": [Q], "system": [block]}):
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client.messages.create(model="scripted", max_tokens=20, **kwargs)
        message = e.value.body["error"]["message"]
        assert "needs a string 'text'" in message and "not supported" not in message, message
