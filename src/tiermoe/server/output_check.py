"""After a structured request finishes: does its output satisfy its response format? (a metric)

Under the engine's grammar the answer is yes by construction, unless the output was cut (stop
strings, stop token ids) or the sampler has no grammar support; the count of misses is
`tiermoe_structured_output_invalid_total`. The check must never cost what the request did not:
the old one ran jsonschema (Python's backtracking `re` for `pattern`) on the event loop, so a
backtracking pattern held the whole server for a time exponential in the output's length.

So the output is read by the same grammar engine the sampler uses (llguidance: a linear-time
lexer, bounded work per byte), fed one byte per token through a byte-level vocabulary, with
whitespace made free so a pretty-printed answer from an unconstrained sampler still counts as
valid. It runs on a worker thread, fire-and-forget, in chunks with a deadline; a schema too big
to compile cheaply, a full queue or a deadline passed leave the output unchecked (not counted).
The grammar engine's reading of a schema is stricter than JSON Schema in one way worth knowing:
object properties come in the schema's order.
"""

from __future__ import annotations

import logging
import threading
import time

from tiermoe.server.limits import loads
from tiermoe.server.structured import grammar_options

log = logging.getLogger("tiermoe.server")

CHECK_SECONDS = 1.0  # per output
MAX_PENDING = 8  # checks queued before new ones are skipped
MAX_CHECKED_SCHEMA_VALUES = 2_000  # compile cost grows faster than the schema; larger ones: JSON only
_CHUNK = 2048  # bytes fed between deadline checks
# the output is judged on its content, not on layout: the schema's own layout options are dropped
_LENIENT = {"whitespace_flexible": True, "whitespace_pattern": None, "json_allow_general_unicode_escapes": True}
_LAYOUT = {"whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator"}

_byte_tokenizer = None


def _bytes_vocabulary():
    """An llguidance tokenizer whose tokens are the 256 bytes (plus an end token), built once."""
    global _byte_tokenizer
    if _byte_tokenizer is None:
        import llguidance

        class Bytes:
            eos_token_id = 256
            bos_token_id = None
            tokens = [bytes([i]) for i in range(256)] + [b""]
            special_token_ids = [256]

            def __call__(self, text):
                return list(text if isinstance(text, (bytes, bytearray)) else text.encode())

        _byte_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()), slices=[])
    return _byte_tokenizer


def _values(schema, limit: int) -> int:
    count, stack = 0, [schema]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def output_satisfies(spec: dict | None, text: str, deadline_s: float = CHECK_SECONDS) -> bool | None:
    """True / False, or None when it was not checked (see the module docstring)."""
    if spec is None:
        return True
    try:
        value = loads(text)
    except ValueError:
        return False
    if spec["type"] == "json_object":
        return isinstance(value, dict)
    if spec["type"] != "json_schema":
        return True
    schema = spec["schema"]
    if _values(schema, MAX_CHECKED_SCHEMA_VALUES) > MAX_CHECKED_SCHEMA_VALUES:
        return None
    import llguidance

    deadline = time.monotonic() + deadline_s
    options = {k: v for k, v in grammar_options(schema).items() if k not in _LAYOUT}
    grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": options}, overrides=_LENIENT)
    matcher = llguidance.LLMatcher(_bytes_vocabulary(), grammar, log_level=0)
    if matcher.is_error():
        return None
    data = text.strip().encode("utf-8", "surrogatepass")
    for start in range(0, len(data), _CHUNK):
        if time.monotonic() > deadline:
            return None
        if not matcher.consume_tokens(list(data[start:start + _CHUNK])):
            return False
    return matcher.is_accepting()


class OutputChecker:
    """Queues output checks on a worker thread and counts the outputs that fail them."""

    def __init__(self, pool, counter):
        self._pool = pool  # a single-thread executor of its own
        self._counter = counter
        self._slots = threading.BoundedSemaphore(MAX_PENDING)  # released on the worker thread

    def submit(self, spec: dict | None, text: str, request_id: str) -> None:
        if spec is None:
            return
        if not self._slots.acquire(blocking=False):
            log.debug("request %s: output not checked (%d checks queued)", request_id, MAX_PENDING)
            return
        try:
            self._pool.submit(self._run, spec, text, request_id)
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._slots.release()

    def _run(self, spec: dict, text: str, request_id: str) -> None:
        try:
            ok = output_satisfies(spec, text)
        except Exception as exc:  # a schema the checker reads differently: leave it unchecked
            log.debug("request %s: output check failed: %s", request_id, exc)
            return
        finally:
            self._slots.release()
        if ok is False:
            self._counter.inc()
            log.warning("request %s: output does not satisfy its response_format", request_id)
