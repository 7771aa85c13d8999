"""Token ids -> text, one step at a time (stop strings: stop_strings.py).

Two problems make streaming text harder than `tokenizer.decode(all_ids)` at the end:

* Byte-level BPE splits a multi-byte UTF-8 character across tokens ("é" is two byte tokens,
  "世" three). Decoding a window that ends mid-character yields U+FFFD. `IncrementalDetokenizer`
  keeps a small window (`prefix_offset:read_offset`) and holds text back while the window ends
  in U+FFFD, so a client never sees a replacement character for a character that is still
  arriving. The window also gives sentencepiece-style tokenizers the left context they need
  to render a leading space.
* A stop string can be split across tokens ("<|EN" + "D|>") and must never reach the client:
  `stop_strings.StopStringMatcher` withholds the longest tail that could still grow into one
  and truncates at the earliest full match.

Special tokens: the chat markers (<|im_end|>, eos, pad, role tokens) never appear in returned
text, but the markers that the reasoning and tool-call parsers read (<think>, <tool_call>,
<arg_key>, ...) must survive decoding even where a tokenizer flags them as special. So ids are
filtered against `hidden_token_ids(...)` and decoded with skip_special_tokens=False.

No torch here: this runs in the server process, whose per-request generation loop is its only
user (the engine thread hands out token ids, never text).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from tiermoe.server.text_buffer import TextBuffer

# Markers the server's parsers need to see in the text stream.
PARSER_MARKERS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)

# A UTF-8 character spans at most 4 bytes; a window still ending in U+FFFD after this many
# held-back tokens holds genuinely invalid bytes and is released as is.
_MAX_HELD_TOKENS = 6
# Prompt tokens used as left context for the first generated tokens.
_PROMPT_CONTEXT = 6


def hidden_token_ids(tokenizer, extra: Iterable[int] = ()) -> frozenset[int]:
    """Ids whose text never appears in output: special tokens except the parser markers."""
    hidden = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            hidden.add(int(tid))
    vocab = tokenizer.get_vocab()
    for marker in PARSER_MARKERS:
        tid = vocab.get(marker)
        if tid is not None:
            hidden.discard(tid)
    hidden.update(int(t) for t in extra)
    return frozenset(hidden)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, tokenizer, hidden_ids: frozenset[int], prompt_token_ids: Iterable[int] = ()):
        self._tok = tokenizer
        self._hidden = hidden_ids
        context = [t for t in prompt_token_ids if t not in hidden_ids][-_PROMPT_CONTEXT:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = TextBuffer()  # all text emitted so far

    @property
    def text(self) -> str:
        """All text emitted so far (text_buffer.py: appended per step, joined when read)."""
        return self._text.value

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add newly generated ids; return the text that is now safe to emit (may be "")."""
        added = False
        for t in token_ids:
            if t not in self._hidden:
                self._ids.append(t)
                added = True
        if not added:
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        """The request finished: release whatever is still held back, replacement chars included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        held = len(self._ids) - self._read_offset
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final and held < _MAX_HELD_TOKENS:
            return ""  # the last character's bytes are still arriving
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window small: the ids before prefix_offset are never decoded again.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._text.append(delta)
        return delta


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in char -> original byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


class TokenTexts:
    """Text and raw bytes of single tokens, for logprobs (cached per id).

    For byte-level BPE a token may hold part of a character; its `bytes` are the exact bytes
    (OpenAI's `bytes` field) while its `text` decodes them with replacement.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self._tok.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")
