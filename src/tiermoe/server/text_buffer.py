"""Text that grows a piece at a time and is read now and then, at a cost linear in its length.

Every generated token appends a few characters to several running texts (the detokenizer's
output, a choice's visible text, its reasoning and answer, the tool parser's plain content).
`self.text += piece` on an attribute copies the whole text so far on every token: CPython's
in-place concatenation shortcut applies only to a local variable the string is not shared with,
never to an attribute, so a generation of n tokens copied O(n^2) characters on the event loop.
`TextBuffer` keeps the pieces in a list and joins them only when the text is read; the joined
string replaces the pieces, so a second read without appends in between costs nothing. The
routes read these texts once, when a choice is finished, so a whole generation copies each
character a bounded number of times. (A reader that read after every append would pay a join
each time, which is what every append cost before.)
"""

from __future__ import annotations


class TextBuffer:
    """Append pieces; `value` is their concatenation, built when read and kept until the next append.

    `joins` and `joined_chars` count the joins done and the characters they produced, so tests can
    check that accumulating costs linear work without timing it.
    """

    __slots__ = ("_pieces", "joins", "joined_chars")

    def __init__(self, text: str = ""):
        self._pieces: list[str] = [text] if text else []
        self.joins = 0
        self.joined_chars = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)

    @property
    def value(self) -> str:
        pieces = self._pieces
        if len(pieces) > 1:
            text = "".join(pieces)
            pieces[:] = [text]
            self.joins += 1
            self.joined_chars += len(text)
        return pieces[0] if pieces else ""
