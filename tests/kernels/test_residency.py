"""The disk tier's device side (kernels/triton/residency.py), through Triton's interpreter on CPU: a
step asks only for picks neither in a slot nor in RAM and posts nothing otherwise; the host's answers
(loads and another layer's evictions) land in host_addr and, for experts not in a slot, ptr_table, as
the plain-torch twin says; a failed answer and a wait that runs out of polls point the requested
experts at the zero record and leave the error mark."""

import threading
import time

import torch

from tiermoe.kernels import reference as R
from tiermoe.kernels.triton.residency import ResidencyMailbox

E, ZERO = 8, 0x7000


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _tables(device):
    """Two layer rows: experts 0-1 in slots, 2-4 in RAM (addresses 0x1000 + ...), 5-7 on disk only."""
    out = []
    for row in range(2):
        host = torch.tensor([0x1000 + 0x100 * row + e if 2 <= e <= 4 else 0 for e in range(E)], dtype=torch.int64)
        slots = torch.tensor([0, 1] + [-1] * (E - 2), dtype=torch.int32)
        table = torch.where(slots >= 0, 0x9000 + slots.long(), host)
        out.append((host.to(device), table.to(device), slots.to(device)))
    return out


class Host(threading.Thread):
    """Answers each request: loads its experts at 0x5000 + 16 * row + e, evicts expert 4 of the other row."""

    def __init__(self, mb: ResidencyMailbox, failed: bool = False):
        super().__init__(daemon=True)
        self.mb, self.failed, self.seen, self.stop = mb, failed, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            seq = self.mb.pending()
            if not seq:
                time.sleep(1e-4)
                continue
            row, experts = self.mb.read_request()
            self.seen.append((row, experts))
            addr = [ZERO if self.failed else 0x5000 + 16 * row + e for e in experts]
            self.mb.answer(seq, [(row, e, a) for e, a in zip(experts, addr)] + [(1 - row, 4, 0)], failed=self.failed)


def test_requests_only_disk_picks_and_applies_the_answers(device):
    tables = _tables(device)
    want = [tuple(t.clone().cpu() for t in row) for row in tables]
    mb = ResidencyMailbox(tables, max_picks=16, max_answers=16, zero_addr=ZERO, device=device)
    host = Host(mb)
    host.start()
    try:
        # row 0: picks in slots and RAM only -> nothing is posted, nothing waits
        mb.ensure(0, torch.tensor([[0, 2], [3, 1]], dtype=torch.int32, device=device))
        _sync(device)
        assert int(mb.seq) == 0 and host.seen == [] and mb.wait_polls() == 0
        # row 1: two tokens pick disk-only 5 and 7 (7 twice) beside a slot and a RAM expert
        picks = torch.tensor([[7, 0], [5, 3], [7, 2]], dtype=torch.int32, device=device)
        assert R.residency_need_ref(picks, tables[1][0], tables[1][2]) == [7, 5, 7]
        mb.ensure(1, picks, max_spins=1 << 30)
        _sync(device)
    finally:
        host.stop.set()
        host.join()
    assert host.seen == [(1, [7, 5])] and int(mb.seq) == 1 and mb.error() == 0
    R.residency_apply_ref([(1, 7, 0x5000 + 16 + 7), (1, 5, 0x5000 + 16 + 5), (0, 4, 0)], want)
    for got, ref in zip(tables, want):
        for g, r in zip(got, ref):
            assert torch.equal(g.cpu(), r)
    assert int(tables[1][0][5]) == 0x5015 and int(tables[1][1][5]) == 0x5015  # loaded: in RAM, read from there
    assert int(tables[0][0][4]) == 0 and int(tables[0][1][4]) == 0  # row 0's expert 4 evicted: disk only


def test_an_answer_for_an_expert_in_a_slot_leaves_its_table_row():
    tables = _tables(torch.device("cpu"))
    R.residency_apply_ref([(0, 1, 0x4444)], tables)
    assert int(tables[0][0][1]) == 0x4444 and int(tables[0][1][1]) == 0x9001  # still read from its slot


def test_failed_answer_and_timeout_point_the_request_at_the_zero_record(device):
    tables = _tables(device)
    mb = ResidencyMailbox(tables, max_picks=16, max_answers=16, zero_addr=ZERO, device=device)
    host = Host(mb, failed=True)
    host.start()
    try:
        mb.ensure(0, torch.tensor([[6, 2]], dtype=torch.int32, device=device), max_spins=1 << 30)
        _sync(device)
    finally:
        host.stop.set()
        host.join()
    assert mb.error() == -1 and int(tables[0][0][6]) == ZERO and int(tables[0][1][6]) == ZERO
    assert int(tables[0][0][2]) == 0x1002  # a RAM pick of the same step is untouched
    assert int(tables[1][0][4]) == 0  # the eviction the host made is applied all the same
    mb.clear_error()
    # nobody answers: the wait gives up after its polls, marks the error and the request reads zeros
    mb.ensure(1, torch.tensor([[5]], dtype=torch.int32, device=device), max_spins=50)
    _sync(device)
    assert mb.error() == 2 and int(tables[1][0][5]) == ZERO and int(tables[1][1][5]) == ZERO


def test_hint_names_the_predicted_picks_on_disk_only_and_waits_for_nothing(device):
    tables = _tables(device)
    mb = ResidencyMailbox(tables, max_picks=16, max_answers=16, zero_addr=ZERO, device=device)
    assert mb.read_hints(0) == (0, [])
    mb.hint_next(1, torch.tensor([[6, 0], [2, 6], [7, 5]], dtype=torch.int32, device=device))  # no host thread
    _sync(device)
    assert mb.read_hints(0) == (1, [(1, [6, 7, 5])])  # (hint seq, [(row, on disk only in pick order, deduped)])
    assert mb.read_hints(1) == (1, [])  # seen already
    mb.hint_next(0, torch.tensor([[1, 3]], dtype=torch.int32, device=device))  # nothing on disk: an empty hint
    _sync(device)
    assert mb.read_hints(1) == (2, [(0, [])]) and int(mb.seq) == 0  # no request was posted


def test_hints_of_one_layer_all_reach_the_host_and_an_overrun_ring_drops_the_oldest(device):
    """A layer hints several layers ahead before the host looks: every hint is in the ring, oldest
    first; hints the ring came round to (more than HINT_SLOTS - 1 unread) are dropped, never torn."""
    from tiermoe.kernels.triton.residency import HINT_SLOTS

    tables = _tables(device)
    mb = ResidencyMailbox(tables, max_picks=16, max_answers=16, zero_addr=ZERO, device=device)
    mb.hint_next(0, torch.tensor([[6]], dtype=torch.int32, device=device))
    mb.hint_next(1, torch.tensor([[7, 5]], dtype=torch.int32, device=device))
    _sync(device)
    assert mb.read_hints(0) == (2, [(0, [6]), (1, [7, 5])])
    for i in range(HINT_SLOTS + 3):  # unread: the ring comes round
        mb.hint_next(i % 2, torch.tensor([[6 if i % 2 == 0 else 7]], dtype=torch.int32, device=device))
    _sync(device)
    seq, hints = mb.read_hints(2)
    assert seq == 2 + HINT_SLOTS + 3
    assert len(hints) == HINT_SLOTS - 1  # the newest, less the area the next post would write
    assert hints[-1] == ((HINT_SLOTS + 2) % 2, [6 if (HINT_SLOTS + 2) % 2 == 0 else 7])
