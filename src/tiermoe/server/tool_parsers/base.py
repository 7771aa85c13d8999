"""Shared machinery for tool-call parsers: content/call state machine and delta bookkeeping.

A format only says how to read one call's body (the text between its start and end markers),
both when complete and while it is still arriving. This base class handles the rest:
finding the markers in a stream of text deltas (holding back a tail that may be the start of
a marker), emitting content outside calls, and turning each call's growing state into OpenAI
style deltas: the first delta of a call carries its id and name, later ones append to
`arguments`. A parser only ever reports an arguments *prefix* that later text cannot change,
so the streamed pieces concatenate to exactly the final arguments string.

Two rules for every format, as tool schemas come from clients and call bodies from the model:
schema values are read through `schema_object` (a JSON Schema may be `true` where an object is
expected; anything not an object reads as {}), and model text is parsed with `limits.loads`
(a deeply nested call is malformed output, not an exception). `parse_partial` runs once per
text delta of a call, so it gets a per-call `scratch` dict to resume from instead of rescanning
the whole body each time (that is quadratic in the call's length, on the event loop).
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
    body: str = ""
    name_sent: bool = False
    args_sent: str = ""
    scratch: dict = field(default_factory=dict)  # the format's parse state, kept between deltas


@dataclass
class PartialCall:
    """What can be said about a call body so far: its name and a stable arguments prefix."""

    name: str | None = None
    arguments_prefix: str = ""


@dataclass
class ParsedBody:
    name: str
    arguments: str


def schema_object(value) -> dict:
    """A (sub)schema read as a mapping: JSON Schema allows `true`/`false` for a schema, and a
    client may send anything; whatever is not an object reads as {} (no constraints)."""
    return value if isinstance(value, dict) else {}


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
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
        self._buf = ""
        self._open: _Open | None = None
        self._pending_ws = ""  # whitespace held until we know it is not padding before a call
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

    def parse_partial(self, body: str, scratch: dict | None = None) -> PartialCall:
        """An incomplete body -> what is already certain. `scratch`: a dict kept for this call
        across calls (the body only grows), for resuming a scan; None: start afresh."""
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
        self._buf += text
        out, deltas = "", []
        while True:
            if self._open is None:
                i = self._buf.find(self.start_marker)
                if i != -1:
                    out += self._content(self._buf[:i], before_call=True)
                    self._buf = self._buf[i + len(self.start_marker) :]
                    self._open = _Open(self._next_index, f"{self.id_prefix}{uuid.uuid4().hex[:24]}")
                    self._next_index += 1
                    continue
                hold = _partial_suffix(self._buf, self.start_marker)
                out += self._content(self._buf[: len(self._buf) - hold], before_call=False)
                self._buf = self._buf[len(self._buf) - hold :] if hold else ""
                break
            j = self._buf.find(self.end_marker)
            if j != -1:
                self._open.body += self._buf[:j]
                self._buf = self._buf[j + len(self.end_marker) :]
                out_text, d = self._close(self._open, complete=True)
                out += out_text
                deltas += d
                self._open = None
                continue
            hold = _partial_suffix(self._buf, self.end_marker)
            self._open.body += self._buf[: len(self._buf) - hold]
            self._buf = self._buf[len(self._buf) - hold :] if hold else ""
            deltas += self._progress(self._open)
            break
        return out, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: an unterminated call is parsed as if closed (models often stop at eos)."""
        out, deltas = "", []
        if self._open is not None:
            self._open.body += self._buf
            self._buf = ""
            out, deltas = self._close(self._open, complete=False)
            self._open = None
        else:
            out = self._content(self._held_text(), before_call=False)
            self._buf = ""
        self._pending_ws = ""  # trailing whitespace of the answer is dropped
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
        text = self._pending_ws + text
        self._pending_ws = ""
        if not self._content_started:
            text = text.lstrip()
        if before_call:
            return self._append(text.rstrip())
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped) :]
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

    def _progress(self, call: _Open) -> list[ToolCallDelta]:
        if self._dropped(call) or (self.unique_calls and call.index > 0):
            return []
        part = self.parse_partial(call.body, call.scratch)
        deltas = []
        if part.name and not call.name_sent:
            call.name_sent = True
            deltas.append(ToolCallDelta(call.index, id=call.id, name=part.name, arguments=""))
        prefix = part.arguments_prefix
        if call.name_sent and len(prefix) > len(call.args_sent) and prefix.startswith(call.args_sent):
            deltas.append(ToolCallDelta(call.index, arguments=part.arguments_prefix[len(call.args_sent) :]))
            call.args_sent = part.arguments_prefix
        return deltas

    def _close(self, call: _Open, complete: bool) -> tuple[str, list[ToolCallDelta]]:
        parsed = self.parse_body(call.body)
        if parsed is None:
            if call.name_sent:  # already announced: close it with what we have
                parsed = ParsedBody(self.parse_partial(call.body).name or "", call.args_sent or "{}")
            else:  # not a call after all: give the text back as content
                self._next_index -= 1
                raw = self.start_marker + call.body + (self.end_marker if complete else "")
                return self._append(raw), []
        if self._dropped(call):
            return "", []
        if self.unique_calls and self._repeats(parsed):
            self.repeated = True
            return "", []
        deltas = []
        if not call.name_sent:
            deltas.append(ToolCallDelta(call.index, id=call.id, name=parsed.name, arguments=""))
        rest = parsed.arguments[len(call.args_sent) :] if parsed.arguments.startswith(call.args_sent) else ""
        if rest:
            deltas.append(ToolCallDelta(call.index, arguments=rest))
        final_args = call.args_sent + rest
        self.calls.append(ToolCall(call.id, parsed.name, final_args))
        return "", deltas
