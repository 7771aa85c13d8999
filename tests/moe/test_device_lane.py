"""Fast mode on the device cache (moe/device_lane.py): the CPU lane's part of a decode layer handed over
through the mapped-memory mailbox and added on the device, bit for bit against the device part plus the lane's
twin computation, answered by the native server thread (kernels/cpu/lane_server.h) and by the Python one; a
failed answer reported once, the next one served in full.

On CPU (CI) the kernels run through Triton's interpreter; TIERMOE_KERNEL_TESTS_ON_GPU=1 runs them compiled on
CUDA (the device clock's timings then count too).
"""

from __future__ import annotations

# kernel_stores first: on CPU it switches Triton to its interpreter before anything imports Triton
from kernel_stores import GIB, N_EXPERTS, ON_GPU, kernel_bf16, moe_batch, open_store, tiny_glm4_stores

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.moe.device_cache import DeviceCacheExperts  # noqa: E402


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    return tiny_glm4_stores(tiny_dir, tmp_path_factory, "devlane")


def _host_store(path, rec: int):
    """Every expert in the host tier, no slots: what the device cache runs over."""
    return open_store(path, gpu_expert_gb=0, host_expert_gb=N_EXPERTS * rec / GIB)


def _native_lane_kernel() -> bool:
    from tiermoe.moe.lane_kernel import native_library

    return native_library() is not None


@pytest.mark.parametrize("native", [True, False], ids=["native-server", "python-server"])
def test_lane_forward_adds_the_lanes_part_through_the_mailbox(stores, native):
    """Fast mode on the device (DeviceLane): the cache step sends up to lane_max of the step's
    misses to the CPU lane (never admitted: no PCIe bytes for them); the device part reads zeros
    for them and the mailbox adds the lane's fp32 partial. Bit for bit: the device part with
    their routing weights zeroed, plus CpuLane.compute of the same experts, rounded once; with
    the native mailbox server (no Python in the answer) and with the Python one. The device part stays fp32
    until the lane's part is added: exact mode rounds its one sum once, and so does fast mode."""
    from tiermoe.moe.cpu_lane import CpuLane
    from tiermoe.moe.device_lane import DeviceLane

    if native and not _native_lane_kernel():
        pytest.skip("no C++ compiler here: the lane has no compiled kernel, so no native server")
    path, rec = stores["int4"]
    with _host_store(path, rec) as st, _host_store(path, rec) as ref_st:
        dc = DeviceCacheExperts(st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=3, lane_cap=2)
        ref = DeviceCacheExperts(ref_st, 2 * 2 + 2, rates={}, top_k=2, max_tokens=3)
        lane = CpuLane([st.layout], max_experts=2, max_tokens=3, threads=1, act_dtype=torch.bfloat16)
        ref_lane = CpuLane([st.layout], max_experts=2, max_tokens=3, threads=1, act_dtype=torch.bfloat16)
        dev_lane = DeviceLane(dc, lane, max_tokens=3, native=native)
        assert dev_lane.native == native and dev_lane.counters()["server"] == ("native" if native else "python")
        try:
            dev_lane.begin()  # the server polls (a step that may post has started)
            dc.set_lane(1)
            sent, n_sent = set(), 0
            for step in range(8):
                if step == 4:
                    dc.set_lane(2)
                x, ids, w = moe_batch(1 + step % 3, seed=step)
                partial = step % 2 == 1  # an expert-parallel rank's call: both parts' fp32 sum, unrounded
                out = dev_lane.forward(1, x, ids, w, partial=partial)
                assert out.dtype == (torch.float32 if partial else torch.bfloat16)
                cache = dc.caches[1]
                on_lane = [e for e in cache.lane_ids[: cache.lane_max].tolist() if e >= 0]
                assert len(on_lane) <= cache.lane_max
                assert all(int(cache.expert_slot[e]) < 0 for e in on_lane)  # misses, not admitted
                mask = torch.isin(ids, torch.tensor(on_lane, dtype=ids.dtype, device=ids.device))
                device_part = ref.forward(1, x, ids, w.masked_fill(mask, 0), partial=True)  # fp32, unrounded
                entries = st.host_entries(1)
                part = ref_lane.compute(1, x.cpu(), ids.cpu().int(), w.cpu(), {e: entries[e] for e in on_lane})
                total = device_part + part.to(device_part.device)  # fp32 [T, H]
                if partial:
                    assert torch.equal(out, total), step
                else:
                    assert torch.equal(out, total.to(x.dtype)), step  # the two parts rounded once
                sent.update(on_lane)
                n_sent += len(on_lane)
                # a plain decode step (more tokens than the lane takes) hands nothing to the lane
                x3, ids3, w3 = moe_batch(3, seed=50 + step)
                assert torch.equal(dc.forward(1, x3, ids3, w3), ref.forward(1, x3, ids3, w3))
            dev_lane.check()  # nothing failed, nothing timed out
            assert sent and dc.lane_calls == 8 and lane.c.experts == n_sent  # every lane expert, served once
            assert lane.c.layers == 8 and lane.c.weight_bytes == n_sent * lane.weight_bytes_of[0]
            assert not dev_lane.polling and dev_lane.server.alive  # parked between lane steps
            x, ids, w = moe_batch(1, seed=7)
            out = dev_lane.forward(1, x, ids, w)  # a post while parked is still answered (within 50 ms)
            if ON_GPU:  # forward only queued the step: its answer is counted once the device got past it
                torch.cuda.synchronize()
            assert out.shape == x.shape and dev_lane.server.served == dc.lane_calls == 9  # one post a lane step
            counts = dev_lane.counters()
            assert {k: counts[k] for k in ("posts", "served", "unanswered", "timeouts", "failed")} == {
                "posts": 9, "served": 9, "unanswered": 0, "timeouts": 0, "failed": 0}
            assert counts["serve_s"] > 0 and counts["device_wait_polls"] >= 0
            own_s, lane_s = counts["device_own_s"], dev_lane.balance()[0]
            assert lane_s == dev_lane.server.serve_s > 0 and (own_s > 0) == ON_GPU  # the device clock: CUDA only
            assert dc.cache_counters()["mailbox"]["posts"] == 9  # what /stats reports
            dc.set_lane(0)  # exact mode again: the plain path, no lane picks
            x, ids, w = moe_batch(2, seed=99)
            assert torch.equal(dev_lane.forward(1, x, ids, w), ref.forward(1, x, ids, w))
            part = dev_lane.forward(1, x, ids, w, partial=True)  # [T, H]
            assert part.dtype == torch.float32 and torch.equal(kernel_bf16(part), ref.forward(1, x, ids, w))
            with pytest.raises(ValueError, match="lane_cap"):
                dc.set_lane(3)
        finally:
            dev_lane.close()
            lane.close()


def test_device_lane_reports_a_failed_answer(stores):
    """A lane computation that raises cannot stop the device (its answer is zero); the next
    step's check() raises with the reason instead of serving wrong tokens silently."""
    from tiermoe.moe.cpu_lane import CpuLane
    from tiermoe.moe.device_lane import DeviceLane

    path, rec = stores["int4"]
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 2, rates={}, top_k=2, max_tokens=1, lane_cap=2)
        lane = CpuLane([st.layout], max_experts=2, max_tokens=1, threads=1)
        dev_lane = DeviceLane(dc, lane, max_tokens=1, native=False)
        try:
            dc.set_lane(2)

            def broken(*args):
                raise MemoryError("no room for the repack")

            lane.compute_posted = broken
            x, ids, w = moe_batch(1, seed=5)
            dev_lane.forward(1, x, ids, w)
            with pytest.raises(RuntimeError, match="CPU lane failed: no room for the repack"):
                dev_lane.check()
            dev_lane.check()  # reported once: the marks are cleared for the next step
            assert dev_lane.counters()["failed"] == 1 and dev_lane.counters()["unanswered"] == 0
        finally:
            dev_lane.close()
            lane.close()


def test_native_lane_server_reports_a_failed_answer(stores):
    """The native mailbox server's kernel refuses a post (here: a lane expert whose record address
    is gone): the answer is zero, the device goes on, check() raises once with the kernel's reason,
    and the next post is answered in full."""
    from tiermoe.moe.cpu_lane import CpuLane
    from tiermoe.moe.device_lane import DeviceLane

    if not _native_lane_kernel():
        pytest.skip("no C++ compiler here: the lane has no compiled kernel, so no native server")
    path, rec = stores["int4"]
    with _host_store(path, rec) as st:
        dc = DeviceCacheExperts(st, 2, rates={}, top_k=2, max_tokens=1, lane_cap=2)
        lane = CpuLane([st.layout], max_experts=2, max_tokens=1, threads=1)
        dev_lane = DeviceLane(dc, lane, max_tokens=1)
        try:
            assert dev_lane.native
            dc.set_lane(2)
            rec_of = dev_lane.records[1][0]  # the addresses the server reads at every post
            saved = rec_of.clone()
            rec_of.zero_()
            dev_lane.begin()
            x, ids, w = moe_batch(1, seed=5)
            out = dev_lane.forward(1, x, ids, w)
            with pytest.raises(RuntimeError, match="CPU lane failed: lane kernel failed: a record shape, expert id"):
                dev_lane.check()
            assert out.shape == x.shape and dev_lane.counters()["failed"] == 1
            dev_lane.check()  # reported once
            rec_of.copy_(saved)
            dev_lane.begin()
            dev_lane.forward(1, x, ids, w)
            dev_lane.check()  # answered in full again
            assert dev_lane.counters()["served"] == 2 and dev_lane.counters()["unanswered"] == 0
            counted = (lane.c.experts, lane.c.layers)
            assert counted[1] == 1  # the failed answer counts as no lane work
            dev_lane.close()  # stopped: the counters keep the thread's final figures
            assert not dev_lane.server.alive and dev_lane.counters()["served"] == 2
            assert (lane.c.experts, lane.c.layers) == counted
        finally:
            dev_lane.close()
            lane.close()
