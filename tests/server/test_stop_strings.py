"""Stop strings: the same output as a plain search of the withheld text, at linear cost.

`_Rescan` is the straightforward matcher (search the withheld tail plus the new piece for every
stop string, then try each suffix of it as a stop string's start). Its output is the definition of
correct here; `StopStringMatcher` must give the same pieces, the same match and the same flushed
tail for any text cut any way, while examining each character a bounded number of times.
"""

import random

import anthropic
import openai
import pytest

from tiermoe.server.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tiermoe.server.stop_strings import StopStringMatcher


class _Rescan:
    """The reference: quadratic in the withheld tail on every push."""

    def __init__(self, stops):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._max = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched = None

    def push(self, text):
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            return text, None
        buf = self._held + text
        best = None
        for stop in self.stops:
            i = buf.find(stop)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            self._held, self.matched = "", best[1]
            return buf[: best[0]], best[1]
        hold = next((k for k in range(min(self._max - 1, len(buf)), 0, -1)
                     if any(s.startswith(buf[-k:]) for s in self.stops)), 0)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self):
        out, self._held = self._held, ""
        return out if self.matched is None else ""


def _run(matcher, pieces):
    """Every push's result, then the flush, as the generation loop drives it."""
    out = [matcher.push(p) for p in pieces]
    return out, matcher.flush(), matcher.matched


def _same(stops, pieces):
    got = _run(StopStringMatcher(stops), pieces)
    assert got == _run(_Rescan(stops), pieces), (stops, pieces)
    return got


@pytest.mark.parametrize("stops,pieces,emitted,matched", [
    (["<|END|>"], ["alpha <", "|E", "N", "D|> gamma"], "alpha ", "<|END|>"),  # split across tokens
    (["<|END|>"], ["<", "|", "E", "N", "D", "|", ">"], "", "<|END|>"),  # one character a token
    (["STOP"], ["STOP and more"], "", "STOP"),  # at the very start
    (["STOP"], ["S", "TOP"], "", "STOP"),  # at the very start, split
    (["abcd", "bc"], ["abcd"], "", "abcd"),  # overlapping, one piece: the earlier start wins
    (["abcd", "bc"], ["abc", "d"], "a", "bc"),  # ... but "bc" is complete before "d" arrives
    (["bc", "abcd"], ["xabcdx"], "x", "abcd"),
    (["ab", "abc"], ["xabc"], "x", "ab"),  # same start: the one listed first
    (["abc", "ab"], ["xabc"], "x", "abc"),
    (["aab"], ["a", "a", "a", "a", "b"], "aa", "aab"),  # self-overlapping prefix: "aaa" keeps "aa"
    (["abab"], ["ab", "a", "bab"], "", "abab"),
    (["beta", "alp"], ["xx alpha beta"], "xx ", "alp"),
    (["世界"], ["héllo 世", "界 done"], "héllo ", "世界"),
    (["x", "", "x"], ["ax", "yy"], "a", "x"),  # empty and repeated stop strings are ignored
    (["STOP"], ["ST", "", "ART"], "START", None),  # a prefix that does not complete is released
    (["STOP"], ["x S"], "x S", None),  # ... and a withheld tail comes back at flush
])
def test_tricky_cases_match_the_plain_search(stops, pieces, emitted, matched):
    out, tail, got = _same(stops, pieces)
    assert "".join(text for text, _ in out) + tail == emitted and got == matched


def test_nothing_is_emitted_after_a_match():
    m = StopStringMatcher(["END"])
    assert m.push("aEN") == ("a", None)
    assert m.push("Dzz") == ("", "END")
    assert m.push("more") == ("", "END") and m.flush() == ""


def test_random_texts_and_cuts_match_the_plain_search():
    rng = random.Random(20240611)
    alphabet = "aab c"
    for _ in range(3000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        m = StopStringMatcher(stops)
        out, tail, matched = _run(m, pieces)
        assert (out, tail, matched) == _run(_Rescan(stops), pieces), (stops, pieces)
        assert ("".join(t for t, _ in out) + tail, matched) == _first_match(stops, pieces)
        assert m.steps <= sum(3 * len(text) + 2 * len(s) for s in stops)


def _first_match(stops, pieces):
    """What streaming must report, from whole-text searches: the first piece by whose end some
    stop string is complete, then of the stop strings complete by then the earliest start."""
    text = "".join(pieces)
    found = {s: text.find(s) for s in dict.fromkeys(stops) if s}
    ends = [i + len(s) for s, i in found.items() if i >= 0]
    if not ends:
        return text, None
    edge = 0
    for piece in pieces:
        edge += len(piece)
        if edge >= min(ends):
            break
    start, stop = min((i, k, s) for k, (s, i) in enumerate(found.items()) if 0 <= i <= edge - len(s))[::2]
    return text[:start], stop


def test_work_per_piece_is_bounded_by_the_piece_and_the_stop_strings():
    """Stop strings of 20k characters whose prefixes the output keeps repeating: the plain search
    re-reads up to 20k withheld characters per token and tries thousands of suffixes; here each
    piece costs at most 3 * (len(piece) + len(stop)) steps per stop string, and the whole stream
    at most 3 per character plus 2 per stop string character."""
    n = 20_000
    stops = ["a" * n + "d", "ab" * (n // 2) + "c", "a" * (n // 2) + "c" + "a" * (n // 2)]
    pieces = ["a"] * (2 * n) + ["ab"] * n + ["aa", "c"] + ["a"] * (n // 2) + ["c"] + ["a"] * (n // 2) + ["end"]
    m = StopStringMatcher(stops)
    total, emitted, matched = 0, [], None
    for piece in pieces:
        before = m.steps
        text, matched = m.push(piece)
        emitted.append(text)
        assert m.steps - before <= sum(3 * (len(piece) + len(s)) for s in stops)
        total += len(piece)
        if matched:
            break
    assert m.steps <= sum(3 * total + 2 * len(s) for s in stops)
    assert ("".join(emitted), matched) == _first_match(stops, pieces) and matched == stops[2]


def test_a_long_stop_string_the_text_never_approaches_costs_nothing_to_set_up():
    m = StopStringMatcher(["q" + "z" * 1_000_000])
    assert m.push("plain text " * 100) == ("plain text " * 100, None)
    assert m.steps <= 1100


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_through_the_server(client, stream):
    """The scripted model answers "You said: <prompt>", one token at a time: the earliest of
    overlapping stop strings cuts the text, and a long stop string whose prefix the text follows
    is withheld, then released when the text ends (the model stops on its own). The long one is
    as long as a stop string may be, so the length limit admits its own bound."""
    long = "abcd efg" + "h" * (MAX_STOP_CHARS - 8)
    cases = [(["d ef", "bcd e", "abcdX"], "You said: a", "stop"), ([long], "You said: abcd efg", "stop")]
    for stop, text, finish in cases:
        kwargs = dict(model="scripted", prompt="abcd efg", stop=stop, max_tokens=64)
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert (got, reason) == (text, [finish])
        else:
            r = client.completions.create(**kwargs)
            assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)


MSG = [{"role": "user", "content": "STOP_TEST"}]  # the scripted model answers "alpha beta <|END|> gamma delta"


def _refused(exc_type, fn, **kwargs):
    with pytest.raises(exc_type) as e:
        fn(**kwargs)
    assert e.value.status_code == 400
    return e.value.body


def test_openai_routes_refuse_too_many_or_too_long_stop_strings(client):
    """Both OpenAI routes: 16 stop strings of MAX_STOP_CHARS each pass; a 17th, or one character
    more in any of them (a list entry or a bare string), is a 400 naming the parameter."""
    most = ["<|END|>"] + ["z" * MAX_STOP_CHARS] * (MAX_STOP_STRINGS - 1)
    calls = [(client.chat.completions.create, dict(messages=MSG)), (client.completions.create, dict(prompt="x"))]
    for create, kwargs in calls:
        ok = create(model="scripted", max_tokens=32, stop=most, **kwargs)
        assert ok.choices[0].finish_reason == "stop"
        for stop, param, code in [(most + ["x"], "stop", "too_many_stop_sequences"),
                                  (["a", "y" * (MAX_STOP_CHARS + 1)], "stop[1]", "stop_sequence_too_long"),
                                  ("y" * (MAX_STOP_CHARS + 1), "stop", "stop_sequence_too_long")]:
            err = _refused(openai.BadRequestError, create, model="scripted", stop=stop, **kwargs)  # body["error"]
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
            assert param in err["message"] and str(MAX_STOP_STRINGS if code.startswith("too_many")
                                                       else MAX_STOP_CHARS) in err["message"]


def test_anthropic_stop_sequences_have_the_same_limits_in_anthropic_shape(anthropic_client):
    """/v1/messages had no count limit and no length limit: the same limits as the OpenAI routes,
    answered with Anthropic's error body like its other 400s."""
    create = anthropic_client.messages.create
    most = ["<|END|>"] + ["z" * MAX_STOP_CHARS] * (MAX_STOP_STRINGS - 1)
    ok = create(model="scripted", max_tokens=32, messages=MSG, stop_sequences=most)
    assert (ok.stop_reason, ok.stop_sequence, ok.content[-1].text) == ("stop_sequence", "<|END|>", "alpha beta ")
    for stop, named in [(most + ["x"], "stop_sequences"), (["a", "y" * (MAX_STOP_CHARS + 1)], "stop_sequences[1]")]:
        for stream in (False, True):
            body = _refused(anthropic.BadRequestError, create, model="scripted", max_tokens=32, messages=MSG,
                            stop_sequences=stop, stream=stream)
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            assert body["error"]["type"] == "invalid_request_error" and named in body["error"]["message"]
