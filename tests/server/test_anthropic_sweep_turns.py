"""Turn structure on /v1/messages: consecutive messages of one role are one turn, as the Anthropic
API combines them, so a chat template that insists on alternating roles still renders them."""

import anthropic
import pytest


@pytest.fixture
def alternating_template(server, monkeypatch):
    """The model's template, refusing two turns of one role in a row (as many templates do)."""
    tok = server.app.state.ctx.tokenizer
    render = tok.apply_chat_template

    def strict(messages, *args, **kwargs):
        roles = [m["role"] for m in messages if m["role"] in ("user", "assistant")]
        if any(a == b for a, b in zip(roles, roles[1:])):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return render(messages, *args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", strict)


def test_consecutive_user_messages_are_one_turn(anthropic_client, alternating_template):
    split = [{"role": "user", "content": "Remember: be brief."}, {"role": "user", "content": "What is 17 * 23?"}]
    joined = [{"role": "user", "content": [{"type": "text", "text": "Remember: be brief."},
                                           {"type": "text", "text": "What is 17 * 23?"}]}]
    m = anthropic_client.messages.create(model="scripted", max_tokens=100, messages=split)
    assert m.content[-1].text == "391" and m.stop_reason == "end_turn"
    count = anthropic_client.messages.count_tokens
    assert count(model="scripted", messages=split).input_tokens == \
        count(model="scripted", messages=joined).input_tokens


def test_consecutive_assistant_messages_and_a_follow_up_after_tool_results(anthropic_client, alternating_template):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        {"role": "user", "content": "Thanks. What is 2 * 3?"},
    ]
    m = anthropic_client.messages.create(model="scripted", max_tokens=100, messages=messages)
    assert m.content[-1].text == "6"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": []}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "2 * 3?"}],
])
def test_an_empty_message_is_a_clear_400(anthropic_client, messages):
    """As the Anthropic API: every message but a final assistant one must say something (an empty one
    was dropped without a word, or reached the template as an empty conversation)."""
    for call in (anthropic_client.messages.create, anthropic_client.messages.count_tokens):
        kwargs = {"max_tokens": 20} if call == anthropic_client.messages.create else {}
        with pytest.raises(anthropic.BadRequestError) as e:
            call(model="scripted", messages=messages, **kwargs)
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert "non-empty content" in e.value.body["error"]["message"], e.value.body


@pytest.mark.parametrize("empty", ["", []])
def test_a_final_empty_assistant_message_is_still_a_new_turn(anthropic_client, empty):
    m = anthropic_client.messages.create(model="scripted", max_tokens=100, messages=[
        {"role": "user", "content": "What is 2 * 3?"}, {"role": "assistant", "content": empty}])
    assert m.content[-1].text == "6"
