"""ForwardBatch: the flattened, variable-length batch one model forward sees.

Tokens of all scheduled sequences are concatenated into one [T] stream (prefill chunks and
single decode tokens mixed). Each sequence brings its slice of that stream and its KV page
table; `kv_index` lists the flat KV-cache slots of all its context tokens, computed once per
step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqSlice:
    q_start: int  # first token of this sequence in the flat stream
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in the KV cache after this step (= past + q_len)
    kv_index: torch.Tensor  # [ctx_len] flat cache slots of the whole context, in order
    slot: int = 0  # sequence slot (for per-sequence recurrent state in some families)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's K/V is written to
    seqs: list[SeqSlice]
    logits_index: torch.Tensor  # [N] rows of the stream whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_forward_batch(
    chunks: list[tuple[list[int], int, list[int], int]],
    page_size: int,
    device: torch.device | str,
    all_logits: bool = False,
) -> ForwardBatch:
    """chunks: per sequence (new token ids, number of tokens already cached, page ids, slot).

    Logits are taken at the last new token of each sequence (or at every token if all_logits).
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seqs: list[SeqSlice] = []
    logits_rows: list[int] = []
    offsets = torch.arange(page_size, dtype=torch.long)  # [page_size]
    for new_ids, past, pages, seq_slot in chunks:
        q_start, q_len = len(ids), len(new_ids)
        ctx = past + q_len
        # flat slot of position p = pages[p // page_size] * page_size + p % page_size, built with
        # tensor ops: a Python list over the whole context was O(context) interpreter work per
        # sequence and step
        used = torch.tensor(pages[: -(-ctx // page_size)], dtype=torch.long)  # [ceil(ctx / page)]
        flat = (used[:, None] * page_size + offsets).reshape(-1)[:ctx]  # [ctx]
        ids.extend(new_ids)
        positions.extend(range(past, ctx))
        slots.extend(flat[past:].tolist())
        kv_index = flat.to(device)
        seqs.append(SeqSlice(q_start, q_len, ctx, kv_index, seq_slot))
        if all_logits:
            logits_rows.extend(range(q_start, q_start + q_len))
        else:
            logits_rows.append(q_start + q_len - 1)
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return ForwardBatch(as_long(ids), as_long(positions), as_long(slots), seqs, as_long(logits_rows))
