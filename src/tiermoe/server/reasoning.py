"""Split a model's output into reasoning (<think>...</think>) and the answer, incrementally.

The parser sees text deltas, never token ids, so it works for any tokenizer (the markers may
be single special tokens or several ordinary ones split across steps). Three states:

  undecided -> the output has not yet shown whether it opens with <think>; text is held
  reasoning -> everything up to </think> is reasoning; a tail that may begin </think> is held
  content   -> the rest is the answer

A template that opens the think block itself (the prompt ends in "<think>") starts the parser
in `reasoning`. Whitespace that only pads the markers is dropped, so reasoning_content and
content come back trimmed, as a client would expect.
"""

from __future__ import annotations

from tiermoe.server.text_buffer import TextBuffer

UNDECIDED, REASONING, CONTENT = "undecided", "reasoning", "content"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, start: str = "<think>", end: str = "</think>", *, prompt_opens_reasoning: bool = False):
        self.start = start
        self.end = end
        self.state = REASONING if prompt_opens_reasoning else UNDECIDED
        self._buf = ""  # text not yet classified or withheld
        self._reasoning_started = False
        self._content_started = False
        self._reasoning = TextBuffer()  # all reasoning emitted (text_buffer.py: joined when read)
        self._content = TextBuffer()  # all answer text emitted

    @property
    def reasoning_text(self) -> str:
        return self._reasoning.value

    @property
    def content_text(self) -> str:
        return self._content.value

    @property
    def in_reasoning(self) -> bool:
        return self.state == REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; returns (reasoning delta, content delta)."""
        self._buf += text
        reasoning, content = "", ""
        while True:
            if self.state == UNDECIDED:
                head = self._buf.lstrip()
                if head.startswith(self.start):
                    self._buf = head[len(self.start) :]
                    self.state = REASONING
                    continue
                if head and not self.start.startswith(head):
                    self.state = CONTENT
                    continue
                break  # only whitespace or a prefix of the start marker so far
            if self.state == REASONING:
                i = self._buf.find(self.end)
                if i != -1:
                    reasoning += self._emit_reasoning(self._buf[:i], final=True)
                    self._buf = self._buf[i + len(self.end) :]
                    self.state = CONTENT
                    continue
                hold = _partial_suffix(self._buf, self.end)
                body = self._buf[: len(self._buf) - hold]
                # trailing whitespace might be the padding before </think>: hold it too
                stripped = body.rstrip()
                hold += len(body) - len(stripped)
                reasoning += self._emit_reasoning(stripped, final=False)
                self._buf = self._buf[len(self._buf) - hold :] if hold else ""
                break
            # CONTENT
            content += self._emit_content(self._buf)
            self._buf = ""
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of output: whatever is held belongs to the current section."""
        buf, self._buf = self._buf, ""
        if self.state == REASONING:
            return self._emit_reasoning(buf, final=True), ""
        return "", self._emit_content(buf)

    def _emit_reasoning(self, text: str, final: bool) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return ""
            self._reasoning_started = True
        if final:
            text = text.rstrip()
        self._reasoning.append(text)
        return text

    def _emit_content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return ""
            self._content_started = True
        self._content.append(text)
        return text
