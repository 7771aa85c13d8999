"""Shared machinery for tool-call parsers: content/call state machine and delta bookkeeping.

A format only says how to read one call's body (the text between its start and end markers),
both when complete and while it is still arriving. This base class handles the rest:
finding the markers in a stream of text deltas (holding back a tail that may be the start of
a marker), emitting content outside calls, and turning each call's growing state into OpenAI
style deltas: the first delta of a call carries its id and name, later ones append to
`arguments`. A parser only ever reports arguments text that later text cannot change, in
order, so the streamed pieces concatenate to exactly the final arguments string.

Two rules for every format, as tool schemas come from clients and call bodies from the model:
schema values are read through `schema_object` (a JSON Schema may be `true` where an object is
expected; anything not an object reads as {}), and model text is parsed with `limits.loads`
(a deeply nested call is malformed output, not an exception).

A call may run to hundreds of kilobytes (an agent writing a file through one call) and arrives
a few characters per delta, on the event loop: any work per delta that grows with the call so
far makes the whole call cost O(n^2). So nothing here touches the whole call while it streams:
the body is kept as pieces (TextBuffer, joined once when the call closes), `parse_partial` is
given only the new piece with a per-call `scratch` dict holding what it needs to resume, and it
reports only the arguments text that became certain with that piece, which is sent as it is.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tiermoe.protocol import JSON_WHITESPACE
from tiermoe.server.limits import loads
from tiermoe.server.text_buffer import TextBuffer

# Calls one forced turn (tool_choice "required") may hold under its grammar: the grammar then
# ends, so a model that keeps starting new calls stops even when each call differs.
MAX_FORCED_CALLS = 16
# Whitespace a forced grammar allows around its markers: what templates write (a line break),
# with room to spare, but bounded, so a weak model cannot spend its whole budget on it.
FORCED_WS = "/[ \\t\\r\\n]{0,8}/"


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text

    def arguments_dict(self) -> dict:
        try:
            value = loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class _Open:
    index: int
    id: str
    body: TextBuffer = field(default_factory=TextBuffer)
    name: str | None = None  # once announced (the first delta)
    args_sent: TextBuffer = field(default_factory=TextBuffer)
    scratch: dict = field(default_factory=dict)  # the format's parse state, kept between deltas


@dataclass
class PartialCall:
    """What a new piece of a call body made certain: the call's name (once known, every time;
    it never changes after), and the arguments text that follows what was reported before."""

    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedBody:
    name: str
    arguments: str


def schema_object(value) -> dict:
    """A (sub)schema read as a mapping: JSON Schema allows `true`/`false` for a schema, and a
    client may send anything; whatever is not an object reads as {} (no constraints)."""
    return value if isinstance(value, dict) else {}


def _partial_suffix(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest tail of text[start:] that begins `marker` (held for the next delta)."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser:
    """Base parser; subclasses set the markers and implement parse_body / parse_partial."""

    name = "base"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def __init__(self, tools: list[dict] | None = None, *, id_prefix: str = "call_", max_calls: int | None = None,
                 unique_calls: bool = False):
        # tools: OpenAI function definitions ({"name", "parameters", ...}) by name
        self.tools = {t["name"]: t for t in (tools or []) if isinstance(t, dict) and "name" in t}
        self.id_prefix = id_prefix
        self.max_calls = max_calls  # parallel_tool_calls=false: 1; later calls are dropped
        # Forced turns: a call identical to an earlier one (name and arguments) ends the turn
        # instead of being returned (`repeated` turns True; the run stops generating). Under a
        # forced grammar a small model that would rather write text than call again can only
        # choose between another call and the end, and tends to repeat its call until the
        # token budget runs out. Calls after the first are then streamed only once complete,
        # so a repeat never reaches the client.
        self.unique_calls = unique_calls
        self.repeated = False
        self.calls: list[ToolCall] = []
        self._plain = TextBuffer()  # plain text outside calls (text_buffer.py: joined when read)
        self._buf = ""  # a tail that may begin a marker: shorter than the marker
        self._open: _Open | None = None
        self._pending_ws: list[str] = []  # whitespace held until we know it is not padding before a call
        self._content_started = False
        self._next_index = 0

    @property
    def content(self) -> str:
        """All plain text outside calls so far, padding trimmed."""
        return self._plain.value

    # ---- format-specific ---------------------------------------------------------------
    def parse_body(self, body: str) -> ParsedBody | None:
        """A complete call body -> name and arguments JSON text, or None if malformed."""
        raise NotImplementedError

    def parse_partial(self, piece: str, scratch: dict) -> PartialCall:
        """The body of an open call grew by `piece` -> what is certain now (see PartialCall).
        `scratch` starts empty and is kept for this call: the state to resume from, so that the
        work is proportional to the piece, not to the body so far. Arguments are reported only
        with or after a name: text reported before the name is not sent."""
        raise NotImplementedError

    def forced_prefix(self, name: str | None) -> str:
        """Text that, appended to the prompt, commits the model to a call (of `name`)."""
        raise NotImplementedError

    def forced_grammar(self, name: str | None, marker) -> str | None:
        """Lark grammar (llguidance) for what follows `forced_prefix(name)`: the rest of the
        call(s), argument types from the tools' schemas. `marker(text)` gives the Lark terminal
        for a marker string (its token when it is one token). None: no grammar for this format."""
        return None

    def _more_calls(self) -> int:
        """How many calls a forced grammar allows after the first (MAX_FORCED_CALLS in all)."""
        return min(self.max_calls or MAX_FORCED_CALLS, MAX_FORCED_CALLS) - 1

    def _parameters(self, name: str) -> dict:
        schema = schema_object(schema_object(self.tools.get(name)).get("parameters")) or {"type": "object"}
        options = schema_object(schema.get("x-guidance"))
        return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, **options}}

    # ---- streaming -----------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add a content delta; returns (plain content delta, tool-call deltas)."""
        buf, pos = self._buf + text, 0  # read from pos on: slicing off what was read copies the rest
        out, deltas = [], []
        while True:
            if self._open is None:
                i = buf.find(self.start_marker, pos)
                if i != -1:
                    out.append(self._content(buf[pos:i], before_call=True))
                    pos = i + len(self.start_marker)
                    self._open = _Open(self._next_index, f"{self.id_prefix}{uuid.uuid4().hex[:24]}")
                    self._next_index += 1
                    continue
                keep = len(buf) - _partial_suffix(buf, self.start_marker, pos)
                out.append(self._content(buf[pos:keep], before_call=False))
                self._buf = buf[keep:]
                break
            j = buf.find(self.end_marker, pos)
            if j != -1:
                self._open.body.append(buf[pos:j])
                pos = j + len(self.end_marker)
                out_text, d = self._close(self._open, complete=True)
                out.append(out_text)
                deltas += d
                self._open = None
                continue
            keep = len(buf) - _partial_suffix(buf, self.end_marker, pos)
            piece = buf[pos:keep]
            self._open.body.append(piece)
            self._buf = buf[keep:]
            deltas += self._progress(self._open, piece)
            break
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: an unterminated call is parsed as if closed (models often stop at eos)."""
        out, deltas = "", []
        if self._open is not None:
            self._open.body.append(self._buf)
            self._buf = ""
            out, deltas = self._close(self._open, complete=False)
            self._open = None
        else:
            out = self._content(self._held_text(), before_call=False)
            self._buf = ""
        self._pending_ws.clear()  # trailing whitespace of the answer is dropped
        return out, deltas

    def _held_text(self) -> str:
        """The text still held at the end, outside any call: a tail that may begin a start marker.

        When the output stops inside the marker itself (max_tokens cut "<tool_call>" after
        "<tool_call"), that tail is markup, not answer: it is dropped when it is more than one
        character of the marker, or when the turn already holds or was forced to make a call.
        A lone "<" closing a plain-text answer is kept (it may be the answer's own character)."""
        held = self._buf
        if not held or not self.start_marker.startswith(held):
            return held
        if len(held) > 1 or self._next_index > 0 or self.unique_calls:
            return ""
        return held

    # ---- internals -------------------------------------------------------------------------
    def _content(self, text: str, before_call: bool) -> str:
        if not self._content_started:
            text = text.lstrip()
        if not text or text.isspace():  # only held: a run of whitespace costs its length once
            if before_call:
                self._pending_ws.clear()
            elif text:
                self._pending_ws.append(text)
            return ""
        if self._pending_ws:
            text = "".join(self._pending_ws) + text
            self._pending_ws.clear()
        stripped = text.rstrip()
        if not before_call and len(stripped) < len(text):
            self._pending_ws.append(text[len(stripped) :])
        return self._append(stripped)

    def _append(self, text: str) -> str:
        if text:
            self._content_started = True
            self._plain.append(text)
        return text

    def _dropped(self, call: _Open) -> bool:
        return self.repeated or (self.max_calls is not None and call.index >= self.max_calls)

    def _repeats(self, parsed: ParsedBody) -> bool:
        new = ToolCall("", parsed.name, parsed.arguments).arguments_dict()
        return any(c.name == parsed.name and c.arguments_dict() == new for c in self.calls)

    def _progress(self, call: _Open, piece: str) -> list[ToolCallDelta]:
        if self._dropped(call) or (self.unique_calls and call.index > 0):
            return []
        part = self.parse_partial(piece, call.scratch)
        deltas = []
        if part.name and call.name is None:
            call.name = part.name
            deltas.append(ToolCallDelta(call.index, id=call.id, name=part.name, arguments=""))
        if call.name is not None and part.arguments:
            call.args_sent.append(part.arguments)
            deltas.append(ToolCallDelta(call.index, arguments=part.arguments))
        return deltas

    def _close(self, call: _Open, complete: bool) -> tuple[str, list[ToolCallDelta]]:
        body, sent = call.body.value, call.args_sent.value
        parsed = self.parse_body(body)
        if parsed is None:
            if call.name is not None:  # already announced: close it with what we have
                parsed = ParsedBody(call.name, sent or "{}")
            else:  # not a call after all: give the text back as content
                self._next_index -= 1
                raw = self.start_marker + body + (self.end_marker if complete else "")
                return self._append(raw), []
        if self._dropped(call):
            return "", []
        if self.unique_calls and self._repeats(parsed):
            self.repeated = True
            return "", []
        deltas = []
        if call.name is None:
            deltas.append(ToolCallDelta(call.index, id=call.id, name=parsed.name, arguments=""))
        rest = parsed.arguments[len(sent) :] if parsed.arguments.startswith(sent) else ""
        if rest:
            deltas.append(ToolCallDelta(call.index, arguments=rest))
        self.calls.append(ToolCall(call.id, parsed.name, sent + rest))
        return "", deltas
