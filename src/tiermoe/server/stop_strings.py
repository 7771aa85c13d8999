"""Stop strings over streamed text: withhold what could still become one, cut at the earliest.

A stop string can be split across tokens ("<|EN" + "D|>") and must never reach the client. So
`StopStringMatcher` withholds the longest tail of the text that is still a proper prefix of some
stop string, and truncates at the earliest complete match (the one that starts first; of two
starting at the same place, the one listed first).

Why automata: the matcher runs on the event loop once per generated token, and the client picks
the stop strings (up to 16, each up to 4,096 characters: limits.py). Searching the withheld tail
again on every token and trying each of its suffixes against each stop string costs time
quadratic in the tail per token: with a stop string of 100k characters whose prefix the output
keeps repeating (what the body allowed before that length limit), every token would stall every
stream for seconds, and at the limit it would still cost millions of character comparisons a
token per stop string. Here each stop string has a Knuth-Morris-Pratt automaton whose state is the length
of the longest suffix of the text so far that begins that string. A new piece of text moves each
state by its own characters only: one piece costs at most 3 * (len(piece) + len(stop)) steps per
stop string, and a whole generation at most 3 steps per character plus 2 per stop string
character. The withheld tail is never searched again; a piece that just continues a partial match
is one C comparison, and while a state is 0 the automaton skips to the next occurrence of its
string's first character with str.find. The failure table is built only as far as the text has
matched, so a long stop string the output never approaches costs nothing to set up, and the
withheld text is a queue of pieces, so releasing its front copies only what is released.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class _StopAutomaton:
    """KMP matcher of one stop string over a stream, fed piece by piece."""

    __slots__ = ("stop", "n", "_border", "state", "steps")

    def __init__(self, stop: str):
        self.stop = stop
        self.n = len(stop)
        # _border[i]: length of the longest proper border (prefix that is also a suffix) of stop[:i + 1]
        self._border = [0]
        self.state = 0  # length of the longest suffix of the text so far that is a prefix of stop
        self.steps = 0  # characters examined and failure links followed, table building included

    def _fallback(self, q: int) -> int:
        """The state after a mismatch in state q >= 1: the longest proper border of stop[:q]."""
        border = self._border
        if q > len(border):
            s = self.stop
            k = border[-1]
            for i in range(len(border), q):
                c = s[i]
                while k and s[k] != c:
                    k = border[k - 1]
                    self.steps += 1
                if s[k] == c:
                    k += 1
                border.append(k)
                self.steps += 1
        return border[q - 1]

    def feed(self, text: str) -> int:
        """Advance over `text`; the index in `text` just past the first complete match, else -1."""
        s, n, q = self.stop, self.n, self.state
        first = s[0]
        i, end, steps = 0, len(text), 0
        if q:
            if s.startswith(text, q):  # the piece goes on with the stop string: one C comparison
                q += end
                self.state, self.steps = q, self.steps + end
                return end if q == n else -1
            steps += min(end, n - q)  # what that comparison read
        while i < end:
            if q == 0:
                j = text.find(first, i)
                if j < 0:
                    steps += end - i
                    break
                steps += j - i + 1
                q, i = 1, j + 1
            else:
                c = text[i]
                while q and s[q] != c:
                    q = self._fallback(q)
                    steps += 1
                if s[q] == c:
                    q += 1
                i += 1
                steps += 1
            if q == n:
                self.state = q
                self.steps += steps
                return i
        self.state = q
        self.steps += steps
        return -1


class StopStringMatcher:
    """Withholds text that might begin a stop string; reports the earliest complete match.

    `push(text)` returns (text safe to emit, matched stop string or None). After a match the
    caller finishes the request; the matched string and everything after it are dropped.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._automata = [_StopAutomaton(s) for s in self.stops]
        self._held: deque[str] = deque()  # the withheld tail, in pieces
        self._skip = 0  # characters of _held[0] already released
        self._held_len = 0
        self.matched: str | None = None

    @property
    def steps(self) -> int:
        """Work done so far (characters examined over all stop strings), so tests can bound it."""
        return sum(a.steps for a in self._automata)

    def push(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self._automata:
            return text, None
        best: tuple[int, str] | None = None
        for a in self._automata:
            end = a.feed(text)
            if end >= 0:
                # every state was at most the withheld length, so the match starts inside it or in text
                start = self._held_len + end - a.n
                if best is None or start < best[0]:
                    best = (start, a.stop)
        if best is not None:
            self.matched = best[1]
            out = self._release(best[0], text)
            self._held.clear()
            self._skip = self._held_len = 0
            return out, best[1]
        keep = max(a.state for a in self._automata)
        if keep == 0 and not self._held:
            return text, None
        return self._release(self._held_len + len(text) - keep, text), None

    def flush(self) -> str:
        """No more text will come: the withheld tail was not a stop string after all."""
        out = self._release(self._held_len, "")
        return out if self.matched is None else ""

    def _release(self, k: int, text: str) -> str:
        """Append `text` to the withheld pieces, then remove and return their first k characters."""
        held = self._held
        if text:
            held.append(text)
            self._held_len += len(text)
        self._held_len -= k
        out = []
        while k:
            piece, skip = held[0], self._skip
            left = len(piece) - skip
            if left <= k:
                out.append(piece[skip:] if skip else piece)
                held.popleft()
                self._skip = 0
                k -= left
            else:
                out.append(piece[skip : skip + k])
                self._skip = skip + k
                k = 0
        return "".join(out)
