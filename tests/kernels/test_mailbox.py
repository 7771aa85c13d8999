"""Host mailbox: post -> host thread computes -> wait_add, through Triton's interpreter on CPU.

The interpreter runs the spinning wait kernel in Python on the calling thread; its loads read
the mailbox's raw addresses afresh on every poll, so the server thread's stores become visible
while it spins (the GIL is handed over every few milliseconds).
"""

import threading
import time

import numpy as np
import pytest
import torch

from tiermoe.kernels import reference as R
from tiermoe.kernels.triton.mailbox import Mailbox, MailboxServer

H, TMAX = 64, 4


def _sync(device) -> None:
    """The kernels are asynchronous on a GPU; the host-side mailbox is read only after them."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def _expert(slots: int, seed: int = 0):
    """A small SwiGLU-free stand-in for the CPU lane: fp32 matmul per slot, recording each answer."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(slots, H, H, generator=gen) / H**0.5  # [S, H, H]
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def fn(slot: int, x: torch.Tensor) -> torch.Tensor:
        y = x.float() @ w[slot]  # [T, H] fp32
        seen.append((slot, x.clone(), y.clone()))
        return y

    return fn, seen


def test_rounds_two_slots_with_server(device):
    mb = Mailbox(2, H, TMAX, device)
    fn, seen = _expert(2)
    gen = torch.Generator().manual_seed(1)
    with MailboxServer(mb, fn, threads=1, spin_s=0.0, max_sleep_s=2e-4) as server:
        for rnd in range(3):
            t = [1, 3, 4][rnd]
            xs = [torch.randn(t, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(2)]
            outs = [torch.randn(t, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(2)]
            base = [o.clone() for o in outs]
            n0 = len(seen)
            mb.post(0, xs[0])  # both slots in flight at once
            mb.post(1, xs[1])
            mb.wait_add(0, outs[0], max_spins=1 << 30)
            mb.wait_add(1, outs[1], max_spins=1 << 30)
            _sync(device)
            got = {s: (x, y) for s, x, y in seen[n0:]}
            assert sorted(got) == [0, 1]
            for s in range(2):
                x_srv, y_srv = got[s]
                assert torch.equal(x_srv, xs[s].cpu())  # the host saw exactly the posted rows
                want = (base[s].float() + y_srv.to(device)).to(torch.bfloat16)
                assert torch.equal(outs[s], want)  # and the device added exactly its answer
            assert mb.seq.tolist() == [rnd + 1, rnd + 1]
            assert mb.posted().tolist() == [rnd + 1] * 2 and mb.done().tolist() == [rnd + 1] * 2
        assert server.served == 6 and server.failure is None
    assert mb.errors().tolist() == [0, 0]


def test_fp32_out_and_late_server(device):
    """The waiter spins while the server starts only afterwards (a real wait, not a ready flag)."""
    mb = Mailbox(1, H, TMAX, device)
    fn, seen = _expert(1, seed=3)
    x = torch.randn(2, H).to(device)  # fp32 input is sent as bf16
    out = torch.zeros(2, H, device=device)
    mb.post(0, x)
    server = MailboxServer(mb, fn, spin_s=0.0)
    timer = threading.Timer(0.3, server.start)
    timer.start()
    try:
        mb.wait_add(0, out, max_spins=1 << 30)
        _sync(device)
    finally:
        timer.join()
        server.stop()
    assert len(seen) == 1 and torch.equal(seen[0][1], x.to(torch.bfloat16).cpu())
    assert torch.equal(out, seen[0][2].to(device))
    assert mb.errors().tolist() == [0]
    assert mb.wait_polls() > 0 and server.serve_s > 0  # the device waited 0.3 s: it polled, and counted it


def test_timeout_sets_error_instead_of_hanging(device):
    mb = Mailbox(2, H, TMAX, device)
    x = torch.ones(1, H, dtype=torch.bfloat16, device=device)
    out = torch.full((1, H), 2.0, dtype=torch.bfloat16, device=device)
    mb.post(1, x)
    mb.wait_add(1, out, max_spins=20)  # nobody answers
    _sync(device)
    assert mb.errors().tolist() == [0, 1]
    assert torch.equal(out, torch.full_like(out, 2.0))  # nothing added
    assert mb.ok.tolist() == [0, 0] and mb.seq.tolist() == [0, 1]
    mb.reset()
    _sync(device)
    assert mb.errors().tolist() == [0, 0] and mb.seq.tolist() == [0, 0]


def test_server_failure_releases_device(device):
    mb = Mailbox(1, H, TMAX, device)

    def bad(slot, x):
        raise RuntimeError("lane broke")

    out = torch.ones(1, H, dtype=torch.bfloat16, device=device)
    with MailboxServer(mb, bad, spin_s=0.0) as server:
        mb.post(0, torch.ones(1, H, device=device))
        mb.wait_add(0, out, max_spins=1 << 30)
        _sync(device)
    assert isinstance(server.failure, RuntimeError)
    assert mb.errors().tolist() == [-1]
    assert torch.equal(out, torch.ones_like(out))  # zeroed result: nothing added


def test_post_matches_twin_bit_for_bit(device):
    mb, twin = Mailbox(2, H, TMAX, device, meta_words=9), Mailbox(2, H, TMAX, device, meta_words=9)
    gen = torch.Generator().manual_seed(5)
    for t, slot, n_meta in ((3, 1, 9), (1, 1, None), (4, 0, 2)):
        x = (torch.randn(t, H, generator=gen) * 100).to(device)  # fp32 -> bf16 rounding too
        meta = None if n_meta is None else torch.randint(-2**31, 2**31 - 1, (n_meta,), generator=gen,
                                                         dtype=torch.int32).to(device)
        mb.post(slot, x, meta)
        R.mailbox_post_ref(twin.x_host, twin.ctrl, twin.seq, slot, x, twin.meta, meta)
    _sync(device)
    assert torch.equal(mb.x_host, twin.x_host)
    assert torch.equal(mb.meta, twin.meta) and mb.meta.abs().sum() > 0
    assert torch.equal(mb.ctrl, twin.ctrl)
    assert torch.equal(mb.seq, twin.seq)
    with pytest.raises(ValueError, match="meta_words"):
        mb.post(0, x, torch.zeros(10, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="int32"):
        mb.post(0, x, torch.zeros(3, dtype=torch.int64, device=device))


def test_server_hands_meta_to_compute(device):
    """With meta_words, compute_fn gets the slot's side data posted with x (the lane's routing)."""
    mb = Mailbox(1, H, TMAX, device, meta_words=4)
    got = []

    def fn(slot, x, meta):
        got.append(meta.clone())
        return x.float() * int(meta[0])

    with MailboxServer(mb, fn, threads=1, spin_s=0.0, max_sleep_s=2e-4):
        x = torch.ones(2, H, dtype=torch.bfloat16, device=device)
        out = torch.zeros(2, H, dtype=torch.float32, device=device)
        mb.post(0, x, torch.tensor([3, -1, 7], dtype=torch.int32, device=device))
        mb.wait_add(0, out, max_spins=1 << 30)
        _sync(device)
    assert got[0][:3].tolist() == [3, -1, 7] and torch.equal(out, torch.full_like(out, 3.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wait_add_matches_twin_bit_for_bit(device, dtype):
    mb = Mailbox(2, H, TMAX, device)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, H, generator=gen).to(device)
    mb.post(0, x)
    mb.post(1, x)
    _sync(device)
    # answer slot 0 by hand (as the server would: result rows, then done); slot 1 stays unanswered
    mb.result[0, :3] = torch.randn(3, H, generator=gen) * 3
    mb.ctrl[0, R.MAILBOX_DONE] = 1
    base = (torch.randn(3, H, generator=gen) * 5).to(dtype).to(device)
    out_k, out_r = base.clone(), base.clone()
    ctrl_r = mb.ctrl.clone()
    mb.wait_add(0, out_k, max_spins=10)
    _sync(device)
    assert R.mailbox_wait_add_ref(mb.result, ctrl_r, mb.seq, 0, out_r)
    assert torch.equal(out_k, out_r) and not torch.equal(out_k, base)
    out_k, out_r = base.clone(), base.clone()
    mb.wait_add(1, out_k, max_spins=5)
    _sync(device)
    assert not R.mailbox_wait_add_ref(mb.result, ctrl_r, mb.seq, 1, out_r, max_spins=5)
    assert torch.equal(out_k, out_r) and torch.equal(out_k, base)
    timed = [R.MAILBOX_DEV_NS, R.MAILBOX_WAIT_NS]  # the device clock's sums: the twin keeps no clock
    own, waited = mb.ctrl[:, timed].clone().unbind(1)
    mb.ctrl[:, timed] = 0
    assert torch.equal(mb.ctrl, ctrl_r)  # same error marks, and the timed-out wait's 5 polls
    assert mb.wait_polls() == 5
    on_gpu = torch.device(device).type == "cuda"  # %globaltimer: CUDA only; zeros in the interpreter
    assert bool((own > 0).all()) == on_gpu and bool(waited[1] > 0) == on_gpu
    assert mb.device_seconds() == (0.0, 0.0)  # read back from the words just cleared


def test_shape_checks(device):
    mb = Mailbox(1, H, TMAX, device)
    with pytest.raises(ValueError):
        mb.post(0, torch.zeros(TMAX + 1, H, device=device))
    with pytest.raises(ValueError):
        mb.wait_add(1, torch.zeros(1, H, device=device))


def test_bf16_rounding_edge_cases_match_torch(device):
    """Ties to even, carries into the exponent, infinities, subnormals: same bits as torch; NaN
    stays NaN (its payload differs between torch's own CPU and GPU casts)."""
    bits = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0x3F80FFFF,
            0x7F7FFFFF,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7FFFFFFF,
            0x00008000,
            0x80018000,
            0x00000000,
            0x80000000,
            0x3F7FFFFF,
            0x4049_0FDB,
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    x = torch.zeros(1, H, dtype=torch.int32)
    x[0, : bits.numel()] = bits
    x = x.view(torch.float32).to(device)
    mb, twin = Mailbox(1, H, TMAX, device), Mailbox(1, H, TMAX, device)
    mb.post(0, x)
    R.mailbox_post_ref(twin.x_host, twin.ctrl, twin.seq, 0, x)
    _sync(device)
    nan = twin.x_host.isnan()
    assert torch.equal(mb.x_host.isnan(), nan) and int(nan.sum()) == 2
    assert torch.equal(mb.x_host.view(torch.int16)[~nan], twin.x_host.view(torch.int16)[~nan])


class _HeldAfterDone(np.ndarray):
    """The server's view of ctrl, holding its thread for a while right after it publishes done."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if isinstance(key, tuple) and key[1:] == (R.MAILBOX_DONE,):
            time.sleep(0.3)


def test_an_answer_the_device_saw_is_already_counted(device):
    """Once the device got past its wait (a stream sync), `served` includes that answer. The server
    counted only after publishing done, so a count read right after a step could lag by one
    (8 served for 9 lane steps on a GPU): here its thread is held right after publishing."""
    mb = Mailbox(1, H, TMAX, device)
    mb._ctrl_np = mb.ctrl.numpy().view(_HeldAfterDone)
    with MailboxServer(mb, lambda slot, x: x.float(), spin_s=0.0) as server:
        for n in range(1, 3):
            out = torch.zeros(1, H, dtype=torch.float32, device=device)
            mb.post(0, torch.ones(1, H, dtype=torch.bfloat16, device=device))
            mb.wait_add(0, out, max_spins=1 << 30)
            _sync(device)
            assert server.served == n and mb.done().tolist() == [n]
            assert torch.equal(out, torch.ones_like(out))


def test_server_thread_runs_on_its_cpu(device):
    """cpu= pins the serving thread alone (a CPU lane keeps that core for it); the caller's own
    affinity is left as it was."""
    import os

    allowed = sorted(os.sched_getaffinity(0))
    mb = Mailbox(1, H, TMAX, device)
    seen = []

    def fn(slot, x):
        seen.append(os.sched_getaffinity(0))
        return x.float()

    with MailboxServer(mb, fn, threads=1, spin_s=0.0, max_sleep_s=2e-4, cpu=allowed[-1]):
        x = torch.ones(1, H, dtype=torch.bfloat16, device=device)
        out = torch.zeros(1, H, dtype=torch.float32, device=device)
        mb.post(0, x)
        mb.wait_add(0, out, max_spins=1 << 30)
        _sync(device)
    assert seen == [{allowed[-1]}] and sorted(os.sched_getaffinity(0)) == allowed
