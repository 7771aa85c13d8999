"""Async bridge between the HTTP server's event loop and a synchronous EngineCore.

One dedicated thread owns the core: it applies queued commands (add, abort, stats, expert heat, stop)
between steps and calls `core.step()` while work remains. The core is therefore never touched
by two threads at once and needs no locks. Each step's outputs go back to the event loop in
ONE `loop.call_soon_threadsafe` call, which fans them out to per-request asyncio queues; a
consumer that falls behind gets several step outputs merged into one, so a slow client costs
the loop nothing extra.

When (cores whose forward runs asynchronously, `queues_device_work`: LLMEngine on CUDA): a
step's outputs are held until the next step has queued its forward and is about to wait for it
(the core calls `device_wait_hook`: ModelRunner.execute's on_queued), or until the thread has
nothing else to do; other cores' outputs go out as soon as their step returns. The loop's
per-token work (detokenizing, JSON, socket writes) then runs while the GPU computes, instead of
taking the GIL from the engine thread in the middle of building and launching the next step
(every torch call releases the GIL, and the loop keeps it until its callbacks are done)
(scripts/server_overhead_check.py emulates both).

Failure containment: an exception from `add_request` fails that request only; an exception
from `step()` fails the requests it names through an `request_ids` attribute, or else every
request the core was running (they are aborted in the core so their pages are freed). Either
way the thread keeps serving; affected streams end with finish_reason "error". An output whose
error is a record failing its checksum (error_code STORE_CORRUPT) also sets `store_fault`,
which stays: the files under the server are damaged, so /health reports it until a restart.

Shutdown drains: new requests are refused (`EngineShutdown`), in-flight ones run to the end
(or until the drain timeout, after which they are aborted), then the thread stops.

The server builds its core on the engine thread itself (`AsyncEngine.build_in_thread`): torch's
CPU kernels run on an OpenMP team owned by the thread that first used them, and a core built on
the main thread but stepped on another pays for a second team competing with the first (GNU
OpenMP then stops spinning and every parallel region waits on a futex): decode on a CPU was
3.3x slower per token stepped from a second thread than from the building thread
(scripts/engine_thread_check.py).
No torch import: the server process imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from tiermoe.errors import StoreError, StoreIntegrityError
from tiermoe.protocol import STORE_CORRUPT, STORE_ERROR, InvalidRequest, RequestOutput, SamplingParams

log = logging.getLogger("tiermoe.engine")


class EngineShutdown(RuntimeError):
    """The engine is draining or stopped and takes no new requests."""


class EngineDead(RuntimeError):
    """The engine thread is gone; nothing can be served."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stats:
    future: asyncio.Future


@dataclass
class _Heat:
    future: asyncio.Future


@dataclass
class _Stop:
    pass


@dataclass
class RequestStream:
    """The per-request end of the bridge: an async iterator of RequestOutput."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    created: float = field(default_factory=time.monotonic)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        out: RequestOutput = await self.queue.get()
        # Merge whatever else is already waiting: one larger delta instead of many small ones.
        while not out.finished and not self.queue.empty():
            out = _merge(out, self.queue.get_nowait())
        if out.finished:
            self.finished = True
        return out


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(
        request_id=a.request_id,
        new_token_ids=list(a.new_token_ids) + list(b.new_token_ids),
        finished=b.finished,
        finish_reason=b.finish_reason,
        logprobs=logprobs,
        prompt_tokens=b.prompt_tokens or a.prompt_tokens,
        completion_tokens=max(a.completion_tokens, b.completion_tokens),
        cached_tokens=b.cached_tokens or a.cached_tokens,
        error=b.error,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        error_code=b.error_code,
    )


class _CoreOwner:
    """A thread that builds a core and later runs the engine loop on it (see module doc)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._built = threading.Event()
        self._go = threading.Event()
        self._body: Callable[[], None] | None = None
        self.core: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="tiermoe-engine", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.core = self._factory()
        except BaseException as exc:  # handed to the caller of wait_built()
            self.error = exc
            self._built.set()
            return
        self._built.set()
        self._go.wait()
        if self._body is not None:
            self._body()

    def wait_built(self) -> Any:
        """The built core; re-raises here whatever the factory raised."""
        self._built.wait()
        if self.error is not None:
            raise self.error
        return self.core

    def run(self, body: Callable[[], None] | None) -> None:
        """Let the thread run `body` (None: let it end)."""
        self._body = body
        self._go.set()


class AsyncEngine:
    """Drives `core` from a background thread; call `start()` inside the serving event loop."""

    @classmethod
    def build_in_thread(cls, factory: Callable[[], Any], *, idle_poll_s: float = 0.5) -> "AsyncEngine":
        """An engine whose core is built by `factory()` on the thread that will step it.

        Blocks until the core is built; raises what `factory` raised (the thread then ends).
        """
        owner = _CoreOwner(factory)
        try:
            engine = cls(owner.wait_built(), idle_poll_s=idle_poll_s)
        except Exception:
            owner.run(None)  # let a thread that built a core nobody will step end
            raise
        engine._owner = owner
        return engine

    def __init__(self, core: Any, *, idle_poll_s: float = 0.5):
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len: int = int(core.max_model_len)
        self.eos_token_ids: list[int] = list(getattr(core, "eos_token_ids", []) or [])
        self.model_info: dict = dict(getattr(core, "model_info", {}) or {})
        # How many requests the core runs at once; requests beyond it are "waiting".
        self.capacity: int = int(getattr(core, "max_num_seqs", 0) or 0)
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._owner: _CoreOwner | None = None
        self._draining = False
        self._stopped = threading.Event()
        self._last_stats: dict = {}
        self._held: list[RequestOutput] = []  # the last step's outputs, not yet handed to the loop
        # hold outputs for the hook only where the core's forward runs asynchronously (CUDA)
        self._hold = hasattr(core, "device_wait_hook") and bool(getattr(core, "queues_device_work", False))
        if self._hold:
            core.device_wait_hook = self._release_held
        self.steps = 0
        self.step_errors = 0
        self.store_fault: str | None = None  # the first expert-store failure seen (module doc)

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Bind to the running event loop and start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._owner is not None:  # the thread that built the core steps it
            self._thread = self._owner.thread
            self._owner.run(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="tiermoe-engine", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let a building thread that never started serving end (the server did not start)."""
        if self._owner is not None and self._thread is None:
            self._owner.run(None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (running or waiting)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        if not self.capacity:
            return 0
        return max(0, len(self._streams) - self.capacity)

    async def shutdown(self, drain_timeout: float | None = 30.0) -> None:
        """Refuse new work, let in-flight requests finish (up to drain_timeout), then stop."""
        self._draining = True
        if self._thread is None:
            return
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        while self._streams and self.alive and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self.abort(rid)
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # ---- requests ----------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Hand a request to the engine; returns its stream once the core has accepted it.

        Raises InvalidRequest (the core rejected it), EngineShutdown, or EngineDead.
        """
        if self._draining:
            raise EngineShutdown("server is shutting down")
        if not self.alive:
            raise EngineDead("engine is not running")
        if request_id in self._streams:
            raise InvalidRequest(f"duplicate request id {request_id!r}", "request_id")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        future = self._loop.create_future()
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, future))
        try:
            await future
        except BaseException:
            self._streams.pop(request_id, None)
            if not future.done() or future.cancelled():
                self.abort(request_id)  # caller went away while the core was accepting
            raise
        return stream

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving early aborts the request."""
        stream = await self.add_request(request_id, prompt_token_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now: its stream ends with "abort"; the core frees it within one step.

        Safe to call from the event loop at any time, repeatedly, or for a finished request.
        """
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.queue.put_nowait(RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        if self.alive:
            self._commands.put(_Abort(request_id))

    async def stats(self, timeout: float = 2.0) -> dict:
        """The core's stats(), taken between steps; the last snapshot if the core is busy."""
        if not self.alive:
            return dict(self._last_stats)
        future = self._loop.create_future()
        self._commands.put(_Stats(future))
        try:
            self._last_stats = await asyncio.wait_for(future, timeout)
        except (asyncio.TimeoutError, Exception) as exc:  # a slow step or a failing stats()
            snap = dict(self._last_stats)
            snap["stale"] = True
            snap["stats_error"] = str(exc) or type(exc).__name__
            return snap
        return dict(self._last_stats)

    async def expert_heat(self, timeout: float = 5.0) -> dict | None:
        """The core's expert_heat() (per-layer expert counts for the dashboard's heat map), taken
        between steps; None when the core has none, is busy past `timeout`, or fails."""
        if not self.alive:
            return None
        future = self._loop.create_future()
        self._commands.put(_Heat(future))
        try:
            return await asyncio.wait_for(future, timeout)
        except (asyncio.TimeoutError, Exception):
            return None

    # ---- event-loop side of the thread -------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error_code == STORE_CORRUPT and self.store_fault is None:
                self.store_fault = out.error or "a record of the expert store failed its checksum"
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.queue.put_nowait(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    @staticmethod
    def _resolve(future: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        live: set[str] = set()  # ids the core holds, as seen from this thread
        try:
            while True:
                # step whenever the core has work, even with no live request: a core may
                # only release an aborted sequence's pages inside step()
                busy = self._has_work()
                if not busy:
                    self._release_held()  # nothing to overlap with: deliver now
                try:
                    cmd = self._commands.get_nowait() if busy else self._commands.get(timeout=self._idle_poll_s)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if isinstance(cmd, _Stop):
                        self._release_held()
                        return
                    self._apply(cmd, live)
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self._has_work():
                    self._step(live)
        except BaseException:  # pragma: no cover - a bug in this loop itself
            log.exception("engine thread crashed")
            self._release_held()
            err = [RequestOutput(rid, [], finished=True, finish_reason="error", error="engine stopped") for rid in live]
            self._post(self._deliver, err)
        finally:
            self._stopped.set()

    def _has_work(self) -> bool:
        try:
            return bool(self.core.has_unfinished_requests())
        except Exception:
            log.exception("has_unfinished_requests failed")
            return False

    def _apply(self, cmd: Any, live: set[str]) -> None:
        if isinstance(cmd, _Add):
            if cmd.future.cancelled():
                return
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
            except InvalidRequest as exc:
                self._post(self._resolve, cmd.future, None, exc)
                return
            except Exception as exc:
                log.exception("add_request failed for %s", cmd.request_id)
                self._post(self._resolve, cmd.future, None, InvalidRequest(f"engine rejected the request: {exc}"))
                return
            live.add(cmd.request_id)
            self._post(self._resolve, cmd.future, True)
        elif isinstance(cmd, _Abort):
            if cmd.request_id in live:
                live.discard(cmd.request_id)
                try:
                    self.core.abort_request(cmd.request_id)
                except Exception:
                    log.exception("abort_request failed for %s", cmd.request_id)
        elif isinstance(cmd, _Stats):
            try:
                snap = dict(self.core.stats())
            except Exception as exc:
                log.exception("stats() failed")
                self._post(self._resolve, cmd.future, None, exc)
                return
            snap.setdefault("engine_steps", self.steps)
            snap.setdefault("engine_step_errors", self.step_errors)
            self._post(self._resolve, cmd.future, snap)
        elif isinstance(cmd, _Heat):
            try:
                heat = self.core.expert_heat()
            except Exception as exc:
                log.exception("expert_heat() failed")
                self._post(self._resolve, cmd.future, None, exc)
                return
            self._post(self._resolve, cmd.future, heat)

    def _release_held(self) -> None:
        """Hand the held outputs to the event loop (engine thread; also the core's hook)."""
        if self._held:
            held, self._held = self._held, []
            self._post(self._deliver, held)

    def _step(self, live: set[str]) -> None:
        try:
            outputs = self.core.step()  # releases the previous step's outputs (hook) when it waits
        except Exception as exc:
            self._release_held()
            self.step_errors += 1
            named = getattr(exc, "request_ids", None)
            victims = [r for r in (named if named is not None else list(live)) if r in live]
            log.exception("engine step failed; failing %d request(s)", len(victims))
            for rid in victims:
                live.discard(rid)
                try:
                    self.core.abort_request(rid)
                except Exception:
                    log.exception("abort after failed step failed for %s", rid)
            msg = f"engine error: {exc}" if str(exc) else f"engine error: {type(exc).__name__}"
            code = (STORE_CORRUPT if isinstance(exc, StoreIntegrityError)
                    else STORE_ERROR if isinstance(exc, StoreError) else None)
            failed = [RequestOutput(r, [], finished=True, finish_reason="error", error=msg, error_code=code)
                      for r in victims]
            self._post(self._deliver, failed)
            return
        self._release_held()  # the hook did not run (no device wait in that step)
        self.steps += 1
        if not outputs:
            return
        kept = []
        for out in outputs:
            if out.request_id not in live:
                continue  # aborted between the abort command and this step
            if out.finished:
                live.discard(out.request_id)
            kept.append(out)
        if self._hold:
            self._held = kept
        elif kept:
            self._post(self._deliver, kept)
