"""AsyncEngine: the background step thread, per-request streams, abort, faults, drain."""

import asyncio

import pytest

from tiermoe.engine.async_engine import AsyncEngine, EngineShutdown
from tiermoe.engine.scripted import ScriptedEngineCore, ScriptedReply
from tiermoe.protocol import InvalidRequest, SamplingParams


def _core(tokenizer, **kw):
    def script(prompt):
        if "FAULT" in prompt:
            return ScriptedReply(content="x " * 20, fail_after=2)
        return ScriptedReply(content="one two three four five six seven eight nine ten")

    return ScriptedEngineCore(script, tokenizer=tokenizer, **kw)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


async def _collect(engine, rid, ids, params=None):
    outs = [o async for o in engine.generate(rid, ids, params or SamplingParams())]
    return outs


def test_generate_and_counts(tokenizer):
    async def main():
        core = _core(tokenizer)
        engine = AsyncEngine(core)
        engine.start()
        outs = await _collect(engine, "a", _ids(tokenizer, "hello"))
        await engine.shutdown()
        return core, outs

    core, outs = asyncio.run(main())
    ids = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert outs[-1].completion_tokens == len(ids)
    assert tokenizer.decode(ids[:-1]) == "one two three four five six seven eight nine ten"


def test_abort_frees_the_sequence(tokenizer):
    async def main():
        core = _core(tokenizer, step_delay_s=0.01)
        engine = AsyncEngine(core)
        engine.start()
        outs = []
        async for o in engine.generate("a", _ids(tokenizer, "hi"), SamplingParams(ignore_eos=True, max_tokens=1000)):
            outs.append(o)
            if len(outs) == 2:
                break  # leaving the iterator aborts the request
        for _ in range(100):
            stats = await engine.stats()
            if stats["running"] == 0:
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats["running"] == 0 and stats["aborted"] == 1


def test_fault_fails_only_the_affected_request(tokenizer):
    async def main():
        engine = AsyncEngine(_core(tokenizer, step_delay_s=0.002))
        engine.start()
        good, bad = await asyncio.gather(
            _collect(engine, "good", _ids(tokenizer, "fine")), _collect(engine, "bad", _ids(tokenizer, "FAULT"))
        )
        after = await _collect(engine, "after", _ids(tokenizer, "still alive?"))
        await engine.shutdown()
        return good, bad, after, engine

    good, bad, after, engine = asyncio.run(main())
    assert bad[-1].finish_reason == "error" and "scripted fault" in bad[-1].error
    assert good[-1].finish_reason == "stop" and after[-1].finish_reason == "stop"
    assert engine.step_errors == 1


def test_unnamed_step_exception_fails_running_requests_and_thread_survives(tokenizer):
    class Flaky(ScriptedEngineCore):
        boom = True

        def step(self):
            if self.boom and self._running:
                self.boom = False
                raise RuntimeError("kernel exploded")
            return super().step()

    async def main():
        engine = AsyncEngine(Flaky(tokenizer=tokenizer))
        engine.start()
        first = await _collect(engine, "x", _ids(tokenizer, "a"))  # running when the step raises
        second = await _collect(engine, "y", _ids(tokenizer, "b"))
        stats = await engine.stats()
        await engine.shutdown()
        return first, second, stats

    first, second, stats = asyncio.run(main())
    assert first[-1].finish_reason == "error" and "kernel exploded" in first[-1].error
    assert second[-1].finish_reason == "stop"
    assert stats["running"] == 0 and stats["engine_step_errors"] == 1


def test_invalid_request_raises_before_streaming(tokenizer):
    async def main():
        engine = AsyncEngine(_core(tokenizer, max_model_len=16))
        engine.start()
        try:
            with pytest.raises(InvalidRequest):
                await engine.add_request("long", list(range(20, 60)), SamplingParams())
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_shutdown_drains_in_flight_requests(tokenizer):
    async def main():
        engine = AsyncEngine(_core(tokenizer, step_delay_s=0.005))
        engine.start()
        task = asyncio.ensure_future(_collect(engine, "a", _ids(tokenizer, "x")))
        await asyncio.sleep(0.02)
        await engine.shutdown(drain_timeout=10)
        with pytest.raises(EngineShutdown):
            await engine.add_request("late", _ids(tokenizer, "y"), SamplingParams())
        return await task, engine

    outs, engine = asyncio.run(main())
    assert outs[-1].finish_reason == "stop"  # finished normally, not aborted
    assert not engine.alive


def test_build_in_thread_steps_the_core_on_its_building_thread(tokenizer):
    """The server's path: the core is built and stepped by one thread, not the caller's."""
    import threading

    seen: dict[str, set] = {"build": set(), "step": set()}

    class Recording(ScriptedEngineCore):
        def step(self):
            seen["step"].add(threading.get_ident())
            return super().step()

    def factory():
        seen["build"].add(threading.get_ident())
        return Recording(lambda prompt: ScriptedReply(content="one two three"), tokenizer=tokenizer)

    engine = AsyncEngine.build_in_thread(factory)
    assert seen["build"] and threading.get_ident() not in seen["build"]

    async def main():
        engine.start()
        outs = await _collect(engine, "a", _ids(tokenizer, "hi"))
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "stop"
    assert tokenizer.decode([t for o in outs for t in o.new_token_ids][:-1]) == "one two three"
    assert seen["step"] == seen["build"]
    assert not engine.alive


def test_build_in_thread_reraises_and_release_ends_an_unstarted_thread(tokenizer):
    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build_in_thread(broken)

    engine = AsyncEngine.build_in_thread(lambda: _core(tokenizer))
    thread = engine._owner.thread
    engine.release()  # the server never started: the building thread must not linger
    thread.join(5)
    assert not thread.is_alive() and not engine.alive


def test_outputs_reach_the_loop_while_the_next_step_waits_on_the_device(tokenizer):
    """A step's outputs are held while the next step builds and launches its work, and handed
    to the event loop when it calls the core's device_wait_hook (its device work queued): the
    server's per-token work then overlaps the device instead of taking the GIL from the engine
    thread mid-launch. Here each step spends 50 ms before its hook (the last token must not be
    out yet) and then waits at its "device wait" until the consumer has it."""
    import time

    consumed = [0]
    before, waits = [], []

    def wait_consumed(n: int) -> bool:
        deadline = time.monotonic() + 10
        while consumed[0] < n and time.monotonic() < deadline:
            time.sleep(0.001)
        return consumed[0] >= n

    class WaitingCore(ScriptedEngineCore):
        def step(self):
            hook, self.device_wait_hook = self.device_wait_hook, None  # ScriptedEngineCore.step would call it too
            try:
                produced = self.counters["generated_tokens"]  # by the earlier steps
                if produced:
                    time.sleep(0.05)  # building and launching the step
                    before.append(consumed[0] >= produced)
                hook()
                if produced:
                    waits.append(wait_consumed(produced))
                return super().step()
            finally:
                self.device_wait_hook = hook

    async def main():
        engine = AsyncEngine(WaitingCore(tokenizer=tokenizer))
        engine.start()
        async for out in engine.generate("a", _ids(tokenizer, "hi"), SamplingParams(ignore_eos=True, max_tokens=8)):
            consumed[0] += len(out.new_token_ids)
        await engine.shutdown()
        return consumed[0]

    assert asyncio.run(main()) == 8
    assert len(waits) >= 6 and all(waits), waits  # delivered at the hook
    assert not any(before), before  # not before it


def test_cpu_cores_deliver_each_step_at_once(tokenizer):
    """A core whose forward is not asynchronous (LLMEngine on a CPU: queues_device_work False)
    gets no hook: holding its outputs would only delay every token by a step."""

    async def main():
        core = _core(tokenizer)
        core.queues_device_work = False
        engine = AsyncEngine(core)
        engine.start()
        outs = await _collect(engine, "a", _ids(tokenizer, "hello"))
        await engine.shutdown()
        return core, engine, outs

    core, engine, outs = asyncio.run(main())
    assert core.device_wait_hook is None and not engine._hold and outs[-1].finished
