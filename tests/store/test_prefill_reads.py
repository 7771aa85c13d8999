"""store/prefill_reads.py: the disk reads of a prefill by chunk size, and `tiermoe plan`'s line about them."""

from __future__ import annotations

import pytest

from tiermoe.store.prefill_reads import disk_reads_per_chunk, prefill_note, prompt_disk_reads


def test_a_chunk_reads_each_disk_only_expert_it_picks_once():
    rates = {"hot": 1.0, "warm": 0.5, "cold": 0.25, "never": 0.0}  # picks per token, one layer of top-1.75
    # one slot (hot), one RAM entry (warm): cold and never live on disk only
    assert disk_reads_per_chunk(rates, 1, 1, 1) == pytest.approx(0.25)
    assert disk_reads_per_chunk(rates, 1, 1, 2) == pytest.approx(1 - 0.75 ** 2)  # at least one of two tokens
    assert disk_reads_per_chunk(rates, 1, 1, 10_000) == pytest.approx(1.0)  # a long chunk: cold once, never not
    assert disk_reads_per_chunk(rates, 4, 0, 10_000) == 0.0  # nothing on disk


def test_a_prompt_in_chunks_reads_the_cold_experts_once_a_chunk():
    rates = {(layer, e): 8 / 64 for layer in range(4) for e in range(64)}  # uniform top-8 of 64, 4 layers
    once = prompt_disk_reads(rates, 0, 128, 8192, 8192)
    assert once == pytest.approx(128.0)  # 8k tokens pick all 128 disk-only experts
    assert prompt_disk_reads(rates, 0, 128, 8192, 2048) == pytest.approx(4 * 128.0)  # again in every chunk
    assert prompt_disk_reads(rates, 0, 128, 3000, 2048) == pytest.approx(
        disk_reads_per_chunk(rates, 0, 128, 2048) + disk_reads_per_chunk(rates, 0, 128, 952))  # a shorter last one


def test_the_plan_line_names_both_chunkings_and_their_seconds():
    rates = {(0, e): 0.125 for e in range(64)}
    line = prefill_note(rates, 8, 8, 10**8, 2.0, 2048)  # 48 disk-only records of 100 MB at 2 GB/s
    assert line.startswith("prefill of a 8,192-token prompt: 4 chunks of 2,048 tokens read about 192 disk-only")
    assert "(19.2 GB, 9.6 s at 2.00 GB/s)" in line and "1 chunk of 8,192 tokens read about 48" in line
    assert "--max-num-batched-tokens" in line


def test_a_mixed_store_counts_each_disk_read_at_its_own_length():
    rates = {0: 1.0, 1: 0.5, 2: 0.5}  # key 0 in a slot; 1 (hot, 300 B) and 2 (cold, 100 B) on disk
    line = prefill_note(rates, 1, 0, {0: 300, 1: 300, 2: 100}, 1.0, 8192, prompt_tokens=8192)
    assert "read about 2 disk-only experts (0.00 GB" in line  # 400 bytes, not 2 x the longest record
    assert prompt_disk_reads(rates, 1, 0, 8192, 8192, {1: 300, 2: 100}) == pytest.approx(400.0)
