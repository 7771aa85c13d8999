import pytest

from tiermoe.store.policy import LFU, LRU, Clock, Static, make_policy
from tiermoe.store.residency import Residency


def _fill(p, keys):
    for k in keys:
        p.touch(k)
        p.insert(k)


def test_lru_evicts_least_recent_and_skips_protected():
    p = LRU(3)
    _fill(p, [1, 2, 3])
    p.touch(1)
    assert p.victim() == 2
    assert p.victim(protect={2}) == 3
    assert p.victim(protect={1, 2, 3}) is None
    p.remove(2)
    p.insert(4)
    assert p.keys() == {1, 3, 4} and p.victim() == 3


def test_lfu_counts_decay_and_admission():
    p = LFU(2, decay=0.5)
    _fill(p, [1, 2])
    for _ in range(3):
        p.touch(1)
    assert p.victim() == 2
    p.touch(3)  # one use of a new key does not beat a resident with one use (strictly greater)
    assert not p.should_admit(3, p.victim())
    p.touch(3)
    assert p.should_admit(3, p.victim())
    # decay: old counts fade, so recent popularity wins
    q = LFU(2, decay=0.5)
    _fill(q, [1, 2])
    for _ in range(8):
        q.touch(1)
    for _ in range(6):
        q.step()
    q.touch(2)
    q.touch(2)
    assert q.score(2) > q.score(1) and q.victim() == 1


def test_lfu_victim_heap_stays_consistent_under_churn():
    import random

    rnd = random.Random(0)
    p = LFU(5, decay=0.9)
    for _ in range(2000):
        k = rnd.randrange(20)
        p.touch(k)
        if k in p:
            continue
        v = p.victim() if p.full else None
        if p.should_admit(k, v):
            if v is not None:
                # the victim really has the lowest score among residents
                assert p._score[v] == min(p._score[r] for r in p.keys())
                p.remove(v)
            p.insert(k)
        if rnd.random() < 0.05:
            p.step()
    assert len(p) == 5


def test_clock_second_chance():
    p = Clock(3)
    _fill(p, [1, 2, 3])
    p.touch(1)
    p.touch(2)
    assert p.victim() == 3  # 1 and 2 referenced: their bits are cleared, 3 goes
    p.remove(3)
    p.insert(4)
    assert p.victim() == 1  # bits of 1 and 2 were cleared by the last sweep
    assert p.victim(protect={1, 2, 4}) is None
    assert Clock(0).victim() is None


def test_static_hot_set_is_never_evicted():
    for name in ("lru", "lfu", "clock"):
        p = make_policy(name, 3, static=[7])
        assert 7 in p
        _fill(p, [1, 2])
        for _ in range(10):
            v = p.victim()
            assert v != 7
            p.remove(v)
            p.insert(100 + _)
        assert 7 in p
    s = Static(2)
    s.warm_start({5: 1.0, 6: 3.0, 9: 2.0})
    assert s.keys() == {6, 9} and s.victim() is None and not s.should_admit(5, None)
    with pytest.raises(ValueError):
        make_policy("lru", 1, static=[1, 2])
    with pytest.raises(ValueError):
        make_policy("mru", 1)


def test_warm_start_orders():
    rates = {k: float(k) for k in range(10)}
    p = LRU(3)
    assert p.warm_start(rates) == [9, 8, 7]
    assert p.victim() == 7  # hottest inserted last = most recent
    q = LFU(3, decay=0.99)
    q.warm_start(rates)
    assert q.keys() == {7, 8, 9} and q.victim() == 7
    assert q.score(9) == pytest.approx(9 / (1 - 0.99))


def test_residency_tiers_are_exclusive_and_victims_flow_down():
    r = Residency.build("lru", 2, 2)
    a = [r.access(k) for k in (1, 2)]
    assert [x.served for x in a] == ["disk", "disk"] and r.slots.keys() == {1, 2}
    x = r.access(3)  # slot victim 1 demoted to host
    assert (x.served, x.to, x.slot_victim, x.demoted) == ("disk", "slots", 1, True)
    assert r.slots.keys() == {2, 3} and r.host.keys() == {1}
    x = r.access(1)  # host hit promoted; slot victim 2 swaps down into host
    assert (x.served, x.to, x.slot_victim, x.demoted) == ("host", "slots", 2, True)
    assert r.slots.keys() == {3, 1} and r.host.keys() == {2}
    r.access(4)
    r.access(5)  # host full now: the host's LRU key is dropped
    assert r.host.keys() == {1, 3} and r.tier(2) == "disk"
    x = r.access(6, protect={4, 5, 6})  # slots all protected -> goes to host, dropping its LRU key
    assert (x.served, x.to, x.host_victim) == ("disk", "host", 3)
    assert r.host.keys() == {1, 6}
    x = r.access(7, protect={4, 5, 1, 6, 7})  # nothing evictable anywhere -> used once, not kept
    assert (x.served, x.to) == ("disk", None) and r.tier(7) == "disk"
    none = Residency.build("lfu", 0, 0)
    assert none.access(1) == none.access(1) and none.access(1).to is None
