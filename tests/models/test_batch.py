"""build_forward_batch: the flat KV slots of every context position, and the new tokens' rows."""

from __future__ import annotations

import random

import torch

from tiermoe.models.batch import build_forward_batch


def _flat(pages: list[int], ctx: int, page_size: int) -> list[int]:
    """The definition: position p lives in page pages[p // page_size] at offset p % page_size."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(ctx)]


def test_slots_follow_the_page_tables():
    rnd = random.Random(0)
    for _ in range(200):
        ps = rnd.choice((1, 4, 16))
        chunks, want = [], []
        for slot in range(rnd.randint(1, 4)):
            ctx = rnd.randint(1, 300)
            q = rnd.randint(1, ctx)
            pages = rnd.sample(range(1000), -(-ctx // ps) + rnd.randint(0, 3))  # spare pages stay unused
            chunks.append(([rnd.randrange(100) for _ in range(q)], ctx - q, pages, slot))
            want.append(_flat(pages, ctx, ps))
        b = build_forward_batch(chunks, ps, "cpu")
        for seq, flat, (new, past, _, slot) in zip(b.seqs, want, chunks):
            assert seq.kv_index.dtype == torch.long and seq.kv_index.tolist() == flat
            assert (seq.q_len, seq.ctx_len, seq.slot) == (len(new), past + len(new), slot)
        assert b.slot_mapping.tolist() == [x for flat, (_, past, _, _) in zip(want, chunks) for x in flat[past:]]
        assert b.positions.tolist() == [p for new, past, _, _ in chunks for p in range(past, past + len(new))]
        assert b.logits_index.tolist() == [s.q_start + s.q_len - 1 for s in b.seqs]


def test_decode_block_tables_follow_the_page_tables():
    """Pure decode steps with block tables (the paged decode kernel): the new token's slot, the
    table rows (unused entries 0) and the context lengths, from the same definition."""
    rnd = random.Random(1)
    for _ in range(200):
        ps = rnd.choice((1, 4, 16))
        width = 40
        chunks = []
        for slot in range(rnd.randint(1, 4)):
            ctx = rnd.randint(1, width * ps)
            pages = rnd.sample(range(1000), -(-ctx // ps) + rnd.randint(0, 3))
            chunks.append(([rnd.randrange(100)], ctx - 1, pages, slot))
        b = build_forward_batch(chunks, ps, "cpu", table_blocks=width)
        assert b.slot_mapping.tolist() == [_flat(pages, past + 1, ps)[-1] for _, past, pages, _ in chunks]
        for row, (_, past, pages, _) in zip(b.block_table.tolist(), chunks):
            n = -(-(past + 1) // ps)
            assert row == pages[:n] + [0] * (width - n)
        assert b.seq_lens.tolist() == [past + 1 for _, past, _, _ in chunks]
        assert all(s.kv_index is None for s in b.seqs)
