"""ForwardBatch: the flattened, variable-length batch one model forward sees.

Tokens of all scheduled sequences are concatenated into one [T] stream (prefill chunks and
single decode tokens mixed). Each sequence brings its slice of that stream and its KV page
table; `kv_index` lists the flat KV-cache slots of all its context tokens, computed once per
step and shared by every layer.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch


@dataclass
class SeqSlice:
    q_start: int  # first token of this sequence in the flat stream
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in the KV cache after this step (= past + q_len)
    # [ctx_len] flat cache slots of the whole context, in order; None when the step carries block
    # tables instead (paged decode attention reads those; nothing else would use it)
    kv_index: torch.Tensor | None
    slot: int = 0  # sequence slot (for per-sequence recurrent state in some families)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's K/V is written to
    seqs: list[SeqSlice]
    logits_index: torch.Tensor  # [N] rows of the stream whose logits are wanted
    # [B] long: each sequence's slot on the device, for families whose per-sequence recurrent state
    # lives in [num_slots, ...] tensors (glm5_next's KDA); a decode graph refills it per replay
    seq_slots: torch.Tensor | None = None
    # Pure decode steps with the paged decode attention kernel only (else None): the context
    # read through page tables of a fixed width, so the step's shapes depend on B alone.
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32 page of each block
    seq_lens: torch.Tensor | None = None  # [B] int32 context length, this step's token included

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _int_tensor(values: list[int], typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list of ints through the array module: about 3.5x faster than
    torch.tensor for the long page lists of long contexts (12.5k pages at 200k tokens)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(typecode, values), dtype=dtype)


def build_forward_batch(
    chunks: list[tuple[list[int], int, list[int], int]],
    page_size: int,
    device: torch.device | str,
    all_logits: bool = False,
    table_blocks: int = 0,
) -> ForwardBatch:
    """chunks: per sequence (new token ids, number of tokens already cached, page ids, slot).

    Logits are taken at the last new token of each sequence (or at every token if all_logits).
    table_blocks > 0 (pure decode steps only): also build block_table [B, table_blocks] and
    seq_lens [B] for the paged decode attention kernel (unused table entries are page 0).
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seqs: list[SeqSlice] = []
    logits_rows: list[int] = []
    offsets = torch.arange(page_size, dtype=torch.long)  # [page_size]
    table = torch.zeros(len(chunks), table_blocks, dtype=torch.int32) if table_blocks else None  # [B, blocks]
    for b, (new_ids, past, pages, seq_slot) in enumerate(chunks):
        q_start, q_len = len(ids), len(new_ids)
        ctx = past + q_len
        n_used = -(-ctx // page_size)  # pages holding the context
        ids.extend(new_ids)
        positions.extend(range(past, ctx))
        kv_index = None
        if table is not None:  # a decode step: O(1) work for the new slot, one C-level copy for the row
            if q_len != 1:
                raise ValueError("block tables are built for pure decode steps (one new token per sequence)")
            if n_used > table_blocks:
                raise ValueError(f"context of {ctx} tokens needs {n_used} blocks > table width {table_blocks}")
            slots.append(pages[(ctx - 1) // page_size] * page_size + (ctx - 1) % page_size)
            table[b, :n_used] = _int_tensor(pages[:n_used], "i", torch.int32)
        else:
            # flat slot of position p = pages[p // page_size] * page_size + p % page_size, built
            # with tensor ops: a Python list over the whole context was O(context) interpreter
            # work per sequence and step
            used = _int_tensor(pages[:n_used], "q", torch.long)  # [n_used]
            flat = (used[:, None] * page_size + offsets).reshape(-1)[:ctx]  # [ctx]
            slots.extend(flat[past:].tolist())
            kv_index = flat.to(device)
        seqs.append(SeqSlice(q_start, q_len, ctx, kv_index, seq_slot))
        if all_logits:
            logits_rows.extend(range(q_start, q_start + q_len))
        else:
            logits_rows.append(q_start + q_len - 1)
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    batch = ForwardBatch(as_long(ids), as_long(positions), as_long(slots), seqs, as_long(logits_rows),
                         as_long([s.slot for s in seqs]))
    if table is not None:
        batch.block_table = table.to(device)
        batch.seq_lens = torch.tensor([s.ctx_len for s in seqs], dtype=torch.int32, device=device)
    return batch
