"""Running texts grow at linear cost: pieces are joined when read, not copied on every token.

`self.text += piece` on an attribute copies all the text so far on every token (CPython's
in-place shortcut is for local variables only), O(n^2) characters over a generation. The work is
counted here (joins done, characters they produced), never timed.
"""

import asyncio
import random
from types import SimpleNamespace

from tiermoe.server.detokenize import IncrementalDetokenizer, hidden_token_ids
from tiermoe.server.generation import ChoiceRun, Delta
from tiermoe.server.reasoning import ReasoningParser
from tiermoe.server.text_buffer import TextBuffer
from tiermoe.server.tool_parsers.hermes import HermesToolParser


def test_pieces_are_joined_once_when_read_and_the_text_is_the_same():
    rng = random.Random(7)
    buf, plain, n = TextBuffer(), "", 20_000
    for _ in range(n):
        piece = rng.choice(["", "a", "bc", "é世", "🚀 "])
        buf.append(piece)
        plain += piece
    assert buf.joins == 0  # appending built nothing
    assert buf.value == plain and (buf.joins, buf.joined_chars) == (1, len(plain))
    assert buf.value == plain and buf.joins == 1  # read again: nothing to join
    buf.append("tail")
    assert buf.value == plain + "tail" and buf.joins == 2
    assert TextBuffer().value == "" and TextBuffer("x").value == "x"


def test_reads_between_appends_see_every_piece():
    buf, plain = TextBuffer("start "), "start "
    for i in range(50):
        buf.append(str(i))
        plain += str(i)
        if i % 7 == 0:
            assert buf.value == plain
    assert buf.value == plain and buf.joins == 8


def test_detokenizer_text_is_built_once(tokenizer):
    text = "héllo wörld 世界 🚀 " * 300
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, hidden_token_ids(tokenizer))
    emitted = [d.push([t]) for t in ids] + [d.flush()]
    assert d._text.joins == 0
    assert d.text == "".join(emitted) == text and d._text.joins == 1 and d._text.joined_chars == len(text)


def _run(tokenizer, **kwargs) -> ChoiceRun:
    ctx = SimpleNamespace(tokenizer=tokenizer, hidden_ids=hidden_token_ids(tokenizer),
                          config=SimpleNamespace(request_timeout_s=None))

    async def make():  # a run reads the event loop's clock when made
        return ChoiceRun(ctx, "r", [], None, **kwargs)

    return asyncio.run(make())


def test_a_long_generation_copies_each_text_once(tokenizer):
    """Token by token through detokenizer, stop strings, reasoning and tool parser: no running
    text is built while the tokens stream, each is built once when read, and the texts read are
    what the deltas added up to."""
    text = "<think>" + "why so? " * 400 + "</think>" + "the answer is " * 400 + "<|END|> never"
    ids = tokenizer.encode(text, add_special_tokens=False)
    run = _run(tokenizer, stop=["<|END|>"], reasoning=ReasoningParser(), tools=HermesToolParser([]))
    reasoning, content = [], []
    for t in ids:
        delta = Delta()
        run._accept([t], None, delta)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    buffers = [run._detok._text, run._visible, run.reasoning._reasoning, run.reasoning._content, run.tools._plain]
    assert [b.joins for b in buffers] == [0] * 5
    visible = text[: text.index("<|END|>")]
    assert run._detok.text == text and run.text == visible and run.stop_matched == "<|END|>"
    assert run.reasoning_text == "".join(reasoning) == ("why so? " * 400).strip()
    assert run.reasoning.content_text == "the answer is " * 400  # the tool parser still holds the last space
    assert run.content == "".join(content) == ("the answer is " * 400).strip()
    assert [b.joins for b in buffers] == [1] * 5
    # each text was copied once, so at most len(text) characters; before, each token copied the
    # text so far: about len(ids) / 2 times that, over a hundred times here
    assert len(ids) > 200 and all(b.joined_chars <= len(text) for b in buffers)
