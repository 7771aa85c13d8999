"""Top-level fields of /v1/messages typed by the Anthropic API: metadata.user_id is a string or null."""

import anthropic
import pytest

Q = [{"role": "user", "content": "What is 2 * 3?"}]


@pytest.mark.parametrize("metadata", [{"user_id": "user-1"}, {"user_id": None}, {}, None])
def test_metadata_as_the_api_types_it_is_accepted(anthropic_client, metadata):
    kwargs = {} if metadata is None else {"metadata": metadata}
    m = anthropic_client.messages.create(model="scripted", max_tokens=50, messages=Q, **kwargs)
    assert m.content[-1].text == "6"


@pytest.mark.parametrize("user_id", [5, {"id": "x"}, ["u"], True])
def test_a_user_id_that_is_not_a_string_is_a_400_naming_it(anthropic_client, user_id):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=50, messages=Q, metadata={"user_id": user_id})
    assert "metadata.user_id" in e.value.body["error"]["message"]


def test_temperature_above_one_is_a_400_as_in_the_anthropic_api(anthropic_client):
    """Anthropic's range is [0, 1] (the OpenAI routes allow 2): above it the request is refused, naming it."""
    import anthropic

    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="scripted", max_tokens=4, messages=msgs, extra_body={"temperature": 1.5})
    assert "temperature" in e.value.body["error"]["message"]
    r = anthropic_client.messages.create(model="scripted", max_tokens=4, messages=msgs, extra_body={"temperature": 1})
    assert r.role == "assistant"
