"""Tool calls stream at linear cost, and resuming from scratch reads what reading afresh reads.

A call of n characters arrives as about n/4 deltas; work per delta that grows with the call so
far (copying the body, rescanning it, rebuilding the arguments prefix) costs O(n^2) on the event
loop, which a 400 KB file written through one call makes real. The work is counted, never timed:
a profile hook adds up the characters held by the string locals (and string results) of every
function of the tool parsers and of TextBuffer when it returns. That is a stand-in for the
characters they copy or scan that needs no knowledge of how the parsers are written: one that
copies or rescans the body so far on each delta holds it in some local while it does.
"""

import json
import random
import re
import sys
from pathlib import Path

import pytest

from tiermoe.server import text_buffer, tool_parsers
from tiermoe.server.tool_parsers import GlmToolParser, HermesToolParser

TOOLS = [{"name": "f",
          "parameters": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}]
_COUNTED = (str(Path(tool_parsers.__file__).parent), text_buffer.__file__)  # whose functions count


def _stream(parser, pieces, count_work=False):
    """Feed the pieces, then finish: (content, {index: [name, arguments]}, calls, work, deltas),
    where deltas lists each feed's (index, name, arguments) deltas."""
    work, content, calls, log = 0, [], {}, []

    def profile(frame, event, result):
        nonlocal work
        if event == "return" and frame.f_code.co_filename.startswith(_COUNTED):
            work += sum(len(v) for v in frame.f_locals.values() if isinstance(v, str))
            work += len(result) if isinstance(result, str) else 0

    previous = sys.getprofile()
    if count_work:
        sys.setprofile(profile)
    try:
        for piece in pieces + [None]:
            text, deltas = parser.finish() if piece is None else parser.feed(piece)
            content.append(text)
            log.append([(d.index, d.name, d.arguments) for d in deltas])
            for d in deltas:
                entry = calls.setdefault(d.index, [None, ""])
                if d.id is not None:
                    assert entry[0] is None and d.name is not None, "id and name are sent once, first"
                    entry[0] = d.name
                entry[1] += d.arguments
    finally:
        sys.setprofile(previous)
    final = [(c.name, c.arguments) for c in parser.calls]
    return "".join(content), calls, final, work, log


def _small_pieces(text):
    """One or two characters at a time, as a tokenizer cuts a long run of text."""
    pieces, i = [], 0
    while i < len(text):
        step = 1 + (len(pieces) % 2)
        pieces.append(text[i : i + step])
        i += step
    return pieces


LONG_CALLS = {  # a call of about n characters
    "hermes": (HermesToolParser,
               lambda n: '<tool_call>\n{"name": "f", "arguments": {"s": "' + "x" * n + '"}}\n</tool_call>'),
    "glm": (GlmToolParser,
            lambda n: "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>" + "x" * n + "</arg_value>\n</tool_call>"),
    "glm many pairs": (GlmToolParser, lambda n: "<tool_call>f\n" + "".join(
        f"<arg_key>k{i}</arg_key>\n<arg_value>v{i % 10}</arg_value>\n" for i in range(n // 40)) + "</tool_call>"),
}


@pytest.mark.parametrize("kind", list(LONG_CALLS))
def test_a_long_call_streams_at_linear_work(kind):
    """Doubling the call doubles the work (the body rescanned per delta: four times); what the
    deltas add up to is the final arguments, and the same as reading the output in one piece."""
    cls, render = LONG_CALLS[kind]
    work = {}
    for n in (20_000, 40_000):
        text = render(n)
        content, calls, final, work[n], _ = _stream(cls(TOOLS), _small_pieces(text), count_work=True)
        assert content == "" and len(final) == 1 and calls[0] == list(final[0])
        whole_content, _, whole_final, _, _ = _stream(cls(TOOLS), [text])
        assert (content, final) == (whole_content, whole_final)
        assert json.loads(final[0][1])  # a whole object, not a prefix
    assert work[40_000] < 2.5 * work[20_000], work


# ---- however the text is cut into deltas: the same deltas as rereading, the same result ----

def _hermes_call(rng):
    values = [1, "x}", 'q"\\', [1, {"z": "}"}], None, "é世 ", ""]
    args = {k: rng.choice(values) for k in rng.sample("nsab", rng.randint(0, 3))}
    body = json.dumps({"name": rng.choice(["f", "g", ""]), rng.choice(["arguments", "parameters"]): args},
                      ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
    return "<tool_call>\n" + body + "\n</tool_call>"


def _glm_call(rng):
    keys = rng.sample("nsab", rng.randint(0, 3))
    pairs = "".join(f"<arg_key>{k}</arg_key>{rng.choice(['', chr(10), '  '])}<arg_value>"
                    f"{rng.choice(['1', 'x', '[1, 2', 'é}', ''])}</arg_value>\n" for k in keys)
    return "<tool_call>" + rng.choice(["f", "g", " f ", "", "a b"]) + rng.choice(["\n", ""]) + pairs + "</tool_call>"


FIXED = [
    "Just an answer.", "  padded answer \n\n", "compare a < b", "ends in a marker part <tool_c", "<tool_call",
    "<tool_call> not json </tool_call> then text",
    '<tool_call>\n{"name": "f\\x", "arguments": {}}\n</tool_call>',  # a badly escaped name
    '<tool_call>\n{"name": "f", "arguments": "{\\"n\\": 2}"}\n</tool_call>',  # double-encoded arguments
    '<tool_call>\n{"name": "f", "arguments": {"s": "cut off',  # unterminated
    '<tool_call>\n{"arguments": {"n": 1}, "name": "f"}\n</tool_call>',  # arguments first: nothing streams
    "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>a</arg_value>b</arg_value>\n</tool_call>",
    "<tool_call>f\n<arg_key>a</arg_key>x<arg_key>s</arg_key> <arg_value>v</arg_value></tool_call>",
    "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>never closed",
]


def _outputs(rng, count):
    """Plain text, calls of both formats, malformed and cut-off ones, with text around them."""
    outputs = [(text, fmt) for text in FIXED for fmt in ("hermes", "glm")]
    noise = ["<", ">", "/", "\\", '"', "{", "}", "\n", " ", "<arg_", "</arg_value>", "<tool_call>", "</tool", "é"]
    while len(outputs) < count:
        fmt = rng.choice(["hermes", "glm"])
        call = _hermes_call if fmt == "hermes" else _glm_call
        calls = [call(rng) for _ in range(rng.randint(1, 3))]
        text = rng.choice(["", "Sure. ", "  \n"]) + rng.choice(["\n", " x "]).join(calls)
        if rng.random() < 0.5:  # malformed: a character or a marker part dropped in or taken out
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice(noise) + text[i + rng.randint(0, 1) :]
        if rng.random() < 0.3:  # cut off
            text = text[: rng.randrange(len(text))]
        outputs.append((text, fmt))
    return outputs


def _random_pieces(rng, text):
    pieces, i = [], 0
    while i < len(text):
        step = rng.choice([1, 1, 2, 3, 5, 8, 20])
        pieces.append(text[i : i + step])
        i += step
    return pieces


def _rescanning(cls):
    """The format read the simple way: each piece re-reads the whole body so far from an empty
    scratch, and the arguments past those reported before are reported (quadratic, exact)."""

    class Rescanning(cls):
        def parse_partial(self, piece, scratch):
            scratch["body"] = body = scratch.get("body", "") + piece
            part, sent = cls.parse_partial(self, body, {}), scratch.get("sent", "")
            assert part.arguments.startswith(sent), "a reported prefix changed"
            scratch["sent"] = part.arguments
            part.arguments = part.arguments[len(sent) :]
            return part

    return Rescanning


def test_how_the_output_is_cut_into_deltas_changes_nothing():
    """Resuming from scratch gives exactly the deltas of re-reading the body afresh, however the
    text is cut. And the result is that of the text read in one piece, except where a call was
    announced (its name sent) before its body turned out malformed: such a call keeps what was
    streamed (base.py, _close), so it depends on where the deltas fell. That is so exactly when
    reading one character at a time differs from reading the whole."""
    rng = random.Random(20240611)
    options = [{}, {"max_calls": 1}, {"unique_calls": True}]
    kept = 0
    for text, fmt in _outputs(rng, 60):
        cls = HermesToolParser if fmt == "hermes" else GlmToolParser
        for kwargs in options:
            whole = _stream(cls(TOOLS, **kwargs), [text])[:3]
            by_char = _stream(cls(TOOLS, **kwargs), list(text))
            assert [tuple(c) for c in by_char[1].values()] == by_char[2], text  # the deltas add up to the calls
            same = by_char[:3] == whole
            kept += same
            cuts = [_random_pieces(rng, text) for _ in range(3)]
            cuts += [[text[:i], text[i:]] for i in range(1, len(text))]  # every marker split everywhere
            for pieces in cuts:
                got = _stream(cls(TOOLS, **kwargs), pieces)
                assert got == _stream(_rescanning(cls)(TOOLS, **kwargs), pieces), (text, pieces, kwargs)
                assert [tuple(c) for c in got[1].values()] == got[2], (text, pieces, kwargs)
                if same:
                    assert got[:3] == whole, (text, pieces, kwargs)
    assert kept > 150  # most outputs, malformed ones included, read the same however they are cut


def test_glm_pairs_read_piece_by_piece_are_the_pattern_matches():
    """The pair reader resumes across pieces; it reads the pairs `_PAIR.finditer` finds in the
    whole text, including where a key runs on past a </arg_key> that no <arg_value> follows."""
    from tiermoe.server.tool_parsers.glm import _PAIR, _new_reader, _read_pairs

    rng = random.Random(5)
    parts = ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<arg_", "</arg_k", "<arg_val", "\n", " ", "a",
             "<"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 16)))
        expected = [m.groups() for m in _PAIR.finditer(text)]
        assert _read_pairs(text, _new_reader()) == expected, text
        state, got = _new_reader(), []
        for piece in _random_pieces(rng, text):
            got += _read_pairs(piece, state)
        assert got == expected, text


def test_hermes_head_read_piece_by_piece_is_the_pattern_match():
    """The head (`{"name": "f", "arguments": `) is read a piece at a time: the name is known when
    the pattern up to the name's closing quote matches, and the arguments begin where `_HEAD`
    ends, when a "{" is there."""
    from tiermoe.server.tool_parsers.hermes import _HEAD, HermesToolParser

    name_only = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)
    rng = random.Random(11)
    parts = ["{", "}", '"name"', '"nam', '"', ":", ",", " ", "\n", '"arguments"', '"parameters"', '"argu', "f", "\\",
             '\\"', "\\n", "é", "x"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))
        m, n = _HEAD.match(text), name_only.match(text)
        name = json.loads(f'"{n.group(1)}"') if n and _valid_json_string(n.group(1)) else None
        args = text[m.end() :] if m and text.startswith("{", m.end()) else ""
        parser, scratch, got, known = HermesToolParser(), {}, "", None
        for piece in _random_pieces(rng, text):
            part = parser.parse_partial(piece, scratch)
            got, known = got + part.arguments, part.name
        assert (known, got) == (name, _object_prefix(args)), text


def _valid_json_string(body):
    try:
        json.loads(f'"{body}"')
        return True
    except ValueError:
        return False


def _object_prefix(text):
    """text up to the bracket that closes the JSON value it begins with (all of it if none does)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return text
