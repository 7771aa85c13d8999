"""Incremental detokenization and stop strings, token by token, on the real byte-level BPE."""

from tiermoe.server.detokenize import IncrementalDetokenizer, TokenTexts, hidden_token_ids
from tiermoe.server.stop_strings import StopStringMatcher

TEXT = "héllo wörld 世界 🚀 naïve café — done"


def _stream(tok, ids, hidden=None):
    d = IncrementalDetokenizer(tok, hidden if hidden is not None else hidden_token_ids(tok))
    pieces = [d.push([t]) for t in ids]
    pieces.append(d.flush())
    return pieces


def test_multibyte_characters_never_split(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) // 3  # byte-level: many characters span tokens
    pieces = _stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_batches_of_tokens_give_same_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, hidden_token_ids(tokenizer))
    out = "".join(d.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + d.flush()
    assert out == TEXT


def test_special_tokens_hidden_but_parser_markers_kept(tokenizer):
    text = "<think>hm</think>ok<tool_call>x</tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(_stream(tokenizer, ids)) == text


def test_invalid_bytes_released_at_flush(tokenizer):
    vocab = tokenizer.get_vocab()
    lone = vocab["ä"]  # first byte of a 3-byte character, never completed
    pieces = _stream(tokenizer, tokenizer.encode("ab", add_special_tokens=False) + [lone])
    assert pieces[-1] == "\ufffd"  # only at the end, once no more bytes can come


def test_stop_string_split_across_pushes():
    m = StopStringMatcher(["<|END|>"])
    out = []
    for piece in ["alpha <", "|E", "N", "D|> gamma"]:
        text, matched = m.push(piece)
        out.append(text)
    assert "".join(out) == "alpha "
    assert matched == "<|END|>"


def test_stop_prefix_that_does_not_complete_is_released():
    m = StopStringMatcher(["STOP"])
    a, _ = m.push("ST")
    b, _ = m.push("ART")
    assert a == "" and b == "START"
    m2 = StopStringMatcher(["STOP"])
    m2.push("x S")
    assert m2.flush() == "S"


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(["beta", "alp"])
    text, matched = m.push("xx alpha beta")
    assert (text, matched) == ("xx ", "alp")


def test_token_texts_bytes_of_partial_characters(tokenizer):
    ids = tokenizer.encode("世", add_special_tokens=False)
    texts = TokenTexts(tokenizer)
    assert b"".join(texts.bytes(t) for t in ids) == "世".encode()
