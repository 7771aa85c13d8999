"""Token-id prompts are bounded by their length before any id is read, and decoded off the event loop.

A 20 MB completions body holds 10 million token ids. Range-checking and decoding them on the
event loop stalled every open stream for about ten seconds before the same 400 came back, so
the length is checked first (O(1)); the range check (min and max of at most a context's ids)
runs in place and the decode on the tokenizer thread. The spies below count the work, not the time."""

import threading

import httpx
import openai
import pytest


@pytest.fixture
def decodes(tokenizer, monkeypatch):
    """(the ids, thread name) of every tokenizer.decode call while the test runs."""
    calls = []
    real = tokenizer.decode

    def spy(ids, *args, **kwargs):
        calls.append((list(ids) if isinstance(ids, list) else [ids], threading.current_thread().name))
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", spy)
    return calls


def test_an_over_long_id_prompt_is_refused_without_decoding_it(client, decodes):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="scripted", prompt=[5] * 1_000_000, max_tokens=1)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "the prompt has 1000000 tokens" in err["message"]
    assert not [n for n, _ in decodes if len(n) >= 4096]
    with pytest.raises(openai.BadRequestError) as e:  # one of several prompts: same answer
        client.completions.create(model="scripted", prompt=[[5, 6], [7] * 4096], max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    assert not [n for n, _ in decodes if len(n) >= 4096]


def test_id_prompts_are_checked_and_decoded_on_the_tokenizer_thread(client, decodes, tokenizer):
    text = "hello there, " + "a prompt of many words " * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    r = client.completions.create(model="scripted", prompt=ids, max_tokens=2, echo=True)
    assert r.choices[0].text.startswith(text)
    # the server decodes on its tokenizer thread (the scripted engine reads the prompt on its own)
    names = [name for n, name in decodes if n == ids]
    assert any(n.startswith("tiermoe-tokenize") for n in names)
    assert all(n.startswith(("tiermoe-tokenize", "tiermoe-engine")) for n in names), names
    with pytest.raises(openai.BadRequestError) as e:  # the range check still names the prompt
        client.completions.create(model="scripted", prompt=[[5], [6, len(tokenizer) + 3]], max_tokens=1)
    assert e.value.body["param"] == "prompt[1][1]" and "outside the vocabulary" in e.value.body["message"]


def test_detokenize_is_bounded_by_the_context_and_runs_off_the_loop(server, decodes, tokenizer):
    r = httpx.post(server.url + "/detokenize", json={"tokens": [5] * 1_000_000}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tokens" and err["code"] == "context_length_exceeded" and "4096" in err["message"]
    assert not decodes
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == "hello there"
    assert [name for _, name in decodes] and all(name.startswith("tiermoe-tokenize") for _, name in decodes)
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, 2, -4]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[2]"


def test_an_out_of_range_id_of_thousands_of_digits_is_named_briefly(server):
    """JSON integers have no length limit (pydantic reads up to 4300 digits): the 400 shows the id cut short."""
    for path, key in (("/v1/completions", "prompt"), ("/detokenize", "tokens")):
        body = ('{"model": "scripted", "%s": [1, %s]}' % (key, "9" * 4300)).encode()
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and "outside the vocabulary" in err["message"] and len(err["message"]) < 120, err
        assert err["param"] == ("prompt[0][1]" if key == "prompt" else "tokens[1]")
