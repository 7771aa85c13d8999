"""KV page allocator: allocation, release, prefix reuse and eviction."""

from __future__ import annotations

from tiermoe.scheduler.kv_pages import KVPages


def test_allocate_and_release():
    kv = KVPages(num_pages=4, page_size=4)
    pages: list[int] = []
    assert kv.allocate(pages, 9) and len(pages) == 3
    assert not kv.allocate(pages, 20) and len(pages) == 3  # all-or-nothing
    kv.release(pages)
    assert pages == [] and kv.num_free == 4


def test_prefix_match_leaves_one_token_and_shares_pages():
    kv = KVPages(num_pages=8, page_size=4)
    ids = list(range(12))
    a: list[int] = []
    kv.allocate(a, 12)
    kv.commit(a, ids, 12)
    b = kv.match_prefix(ids)  # 12 tokens: only 2 full pages may be reused (1 token left to compute)
    assert b == a[:2] and kv.ref[a[0]] == 2
    first = list(a)
    kv.release(a)
    kv.release(b)
    assert kv.num_free == 8
    c = kv.match_prefix(ids + [99])  # freed pages keep their hashes
    assert c == first[:3]


def test_eviction_forgets_hash():
    kv = KVPages(num_pages=2, page_size=2)
    a: list[int] = []
    kv.allocate(a, 4)
    kv.commit(a, [1, 2, 3, 4], 4)
    kv.release(a)
    b: list[int] = []
    kv.allocate(b, 4)  # reuses both pages for other tokens
    assert kv.match_prefix([1, 2, 3, 4, 5]) == []
