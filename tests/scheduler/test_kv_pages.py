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


def test_commit_with_a_kept_chain_publishes_the_same_hashes():
    """A sequence's kept chain (Request.page_hashes) gives the same published hashes as
    rehashing the whole context every step, and the chain equals the definition."""
    import random

    rnd = random.Random(1)
    toks = [rnd.randrange(50) for _ in range(400)]
    fresh, kept = KVPages(64, 16), KVPages(64, 16)
    pa, pb, chain = [], [], []
    assert fresh.allocate(pa, 400) and kept.allocate(pb, 400)
    for n in [*range(0, 401, 7), 400]:  # chunked prefill, then one token at a time
        fresh.commit(pa, toks, n)
        kept.commit(pb, toks, n, chain=chain)
        assert fresh.page_hash == kept.page_hash and fresh.by_hash == kept.by_hash
    assert chain == KVPages.chain_hashes(toks, 16, 25)
    assert kept.match_prefix(toks + [1]) == pb  # the published pages serve the prefix
