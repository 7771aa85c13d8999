"""glm5_next's KDA state in static [num_slots, ...] tensors read and written by slot-id tensors.

The engine adapter (paged MLA rows, slots scattered over a reserved pool, ids on the device)
must give, bit for bit, what the self-contained model gives for the same steps (contiguous
rows, slots 0..B-1): after a prefill, over several decode steps of a batch that mixes slots,
with some slots idle, with a mixed chunk + decode step, fp32 and bf16; and after a speculative
verify and its rollback. A pure decode step through the decode graph's code path (host half
`prepare_decode_step`, device half `decode_step` on a static batch whose host metadata belongs
to another step, attention cores given the real batch) gives the eager step's bits: the recorded
work reads slots and lengths only from the refilled tensors.
"""

from __future__ import annotations

import pytest
import torch
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.errors import UserError
from tiermoe.models.batch import ForwardBatch, build_forward_batch
from tiermoe.models.blocks import graph_break
from tiermoe.models.glm5_next import SeqBatch, build_model
from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint

PAGE = 16
PAGES_PER_SLOT = 20
SLOTS = [5, 0, 3]  # engine slots of sequences 0, 1, 2 (the self-contained cache uses 0, 1, 2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("glm5_next_static") / "tiny")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (70, 23, 41)]


class _Pair:
    """The engine adapter and the self-contained model over the same weights, stepped alike."""

    def __init__(self, ckpt, dtype: torch.dtype):
        self.em = build_model(ckpt, device="cpu", dtype=dtype)
        self.em.reserve_slots(6)
        self.kv = [{n: torch.zeros(6 * PAGES_PER_SLOT, PAGE, *s, dtype=dtype) for n, s in shapes.items()}
                   for shapes in self.em.cache_shapes()]
        self.ref = self.em.model
        self.cache = self.ref.new_cache(3, 200)
        self.lens = [0, 0, 0]

    def chunks(self, steps: dict[int, list[int]]) -> list:
        """{sequence: new ids} -> build_forward_batch chunks (pages: a block per engine slot)."""
        out = []
        for i, ids in steps.items():
            slot = SLOTS[i]
            out.append((ids, self.lens[i], list(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT)), slot))
        return out

    def step(self, steps: dict[int, list[int]], keep: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of both; returns (engine hidden [T, H], self-contained hidden [T, H])."""
        fb = build_forward_batch(self.chunks(steps), PAGE, "cpu")
        got = self.em(fb, self.kv, keep_states=keep)
        sb = SeqBatch(list(steps), [self.lens[i] for i in steps], [len(v) for v in steps.values()],
                      keep_states=keep if keep is not None else False)
        want = self.ref(torch.tensor(sum(steps.values(), [])), sb, self.cache)
        for i, ids in steps.items():
            self.lens[i] += len(ids)
        return got, want

    def rollback(self, i: int, length: int) -> None:
        self.em.rollback(SLOTS[i], length)
        self.cache.rollback(i, length)
        self.lens[i] = length


def _next_ids(pair: _Pair, hidden: torch.Tensor, seqs: list[int]) -> dict[int, list[int]]:
    """Greedy next token of each sequence from its last row of a decode step."""
    top = pair.em.logits(hidden).argmax(-1).tolist()
    return {i: [top[j]] for j, i in enumerate(seqs)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scattered_slots_decode_bit_identical_to_contiguous_cache(ckpt, dtype):
    pair = _Pair(ckpt, dtype)
    prompts = _prompts()
    got, want = pair.step({0: prompts[0], 1: prompts[1], 2: prompts[2]})  # prefill of all three
    assert torch.equal(got, want)
    rows = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1, got.shape[0] - 1]
    nxt = _next_ids(pair, got[rows], [0, 1, 2])
    schedule = [[0, 1, 2], [0, 1, 2], [2, 0], [1], [0, 1, 2], [2, 1, 0]]  # some slots idle, order changes
    for seqs in schedule:
        got, want = pair.step({i: nxt[i] for i in seqs})
        assert torch.equal(got, want), seqs
        assert torch.equal(pair.em.logits(got), pair.ref.logits(want).float())
        nxt.update(_next_ids(pair, got, seqs))
    # a mixed step: a 2-token chunk beside single tokens (decode rows gathered by a subset of ids)
    got, want = pair.step({0: nxt[0], 1: nxt[1] + [7], 2: nxt[2]})
    assert torch.equal(got, want)
    # the state rows of slots no sequence uses stayed zero
    for layer in pair.em.kda.kda_layers:
        for free in (1, 2, 4):
            assert not pair.em.kda.conv_rows[layer][free].any() and not pair.em.kda.ssm_rows[layer][free].any()


def test_rollback_after_verify_stays_bit_identical(ckpt):
    pair = _Pair(ckpt, torch.float32)
    prompts = _prompts()
    got, want = pair.step({0: prompts[0][:40], 2: prompts[2][:20]})
    assert torch.equal(got, want)
    # verify 3 tokens on sequence 0 (kept), decode sequence 2, then roll sequence 0 back to 1 of them
    got, want = pair.step({0: [9, 10, 11], 2: [12]}, keep=[True, False])
    assert torch.equal(got, want)
    pair.rollback(0, 41)
    for step in range(4):
        got, want = pair.step({0: [20 + step], 2: [30 + step]})
        assert torch.equal(got, want)
    # a second verify, all rejected, then decode on
    pair.step({0: [1, 2, 3], 2: [4]}, keep=[True, False])
    pair.rollback(0, 45)
    got, want = pair.step({2: [5], 0: [6]})
    assert torch.equal(got, want)
    # rolled back to the state of a run that never saw the rejected tokens (within rounding:
    # the verify computed its projections over more rows)
    clean = _Pair(ckpt, torch.float32)
    clean.step({0: prompts[0][:40]})
    for t in [9, 20, 21, 22, 23, 6]:
        clean.step({0: [t]})
    for layer in clean.em.kda.kda_layers:
        a, b = clean.em.kda.ssm_rows[layer][SLOTS[0]], pair.em.kda.ssm_rows[layer][SLOTS[0]]
        assert torch.allclose(a, b, atol=1e-5), layer
        a, b = clean.em.kda.conv_rows[layer][SLOTS[0]], pair.em.kda.conv_rows[layer][SLOTS[0]]
        assert torch.allclose(a, b, atol=1e-5), layer


def test_slots_beyond_the_reserved_pool_raise(ckpt):
    em = build_model(ckpt, device="cpu", dtype=torch.float32)
    em.reserve_slots(2)
    conv = {i: t.data_ptr() for i, t in em.kda.conv_rows.items()}
    kv = [{n: torch.zeros(4, PAGE, *s) for n, s in shapes.items()} for shapes in em.cache_shapes()]
    with pytest.raises(UserError, match="reserved slots"):
        em(build_forward_batch([([1, 2], 0, [0], 2)], PAGE, "cpu"), kv)
    em(build_forward_batch([([1, 2], 0, [0], 1)], PAGE, "cpu"), kv)
    assert {i: t.data_ptr() for i, t in em.kda.conv_rows.items()} == conv  # addresses never move
class _RealBatchCores:
    """A recorder stand-in: each attention core runs at once, but on the batch of the step being
    replayed (as DecodeGraphs passes it), never the one the work was traced with."""

    def __init__(self, real: ForwardBatch):
        self.real, self.breaks, self.layers = real, 0, 0

    def break_here(self, core, tensors, batch, cache):
        self.breaks += 1
        assert all(t.shape[0] == self.real.num_tokens for t in tensors)  # [B, ...] inputs
        return core(*tensors, self.real, cache)

    def layer_done(self):  # where a recording may split its graph (runner/decode_graph.py)
        self.layers += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_through_the_graph_code_path_equals_eager(ckpt, dtype):
    eager, graphed = _Pair(ckpt, dtype), _Pair(ckpt, dtype)
    prompts = _prompts()
    first = {0: prompts[0], 1: prompts[1], 2: prompts[2]}
    h, _ = eager.step(first)
    graphed.step(first)
    rows = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1, h.shape[0] - 1]
    nxt = _next_ids(eager, h[rows], [0, 1, 2])
    static = None
    for seqs in ([0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 1, 2]):
        want, _ = eager.step({i: nxt[i] for i in seqs})
        fb = build_forward_batch(graphed.chunks({i: nxt[i] for i in seqs}), PAGE, "cpu")
        if static is None:  # "recorded" with the first step's batch, refilled like DecodeGraphs' _Entry
            static = ForwardBatch(fb.input_ids.clone(), fb.positions.clone(), fb.slot_mapping.clone(), fb.seqs,
                                  fb.logits_index, fb.seq_slots.clone())
        for name in ("input_ids", "positions", "slot_mapping", "seq_slots"):
            getattr(static, name).copy_(getattr(fb, name))
        graphed.em.prepare_decode_step(fb)
        rec = _RealBatchCores(fb)
        graph_break.set_recorder(rec)
        try:
            got = graphed.em.decode_step(static, graphed.kv)
        finally:
            graph_break.set_recorder(None)
        for i in seqs:
            graphed.lens[i] += 1
        assert torch.equal(got, want), seqs
        assert rec.breaks == sum(1 for layer in graphed.ref.layers if not layer.is_kda)  # one per MLA layer
        assert rec.layers == len(graphed.ref.layers)  # every layer's end marked
        nxt.update(_next_ids(eager, want, seqs))
    assert graphed.em.kda.lengths == eager.em.kda.lengths


def test_decode_graph_eligibility_follows_the_expert_backend(ckpt):
    em = build_model(ckpt, device="cpu", dtype=torch.float32)
    backend = em.expert_backend
    assert em.decode_graph_unsupported() == backend.graph_unsupported() is not None  # resident experts sync
    backend.graph_unsupported = lambda: None  # what a capturable backend (the device cache) answers
    try:
        assert em.decode_graph_unsupported() is None
    finally:
        del backend.graph_unsupported
    assert em.paged_decode_attention_unsupported(4096) is None  # MLA attends through block tables
    assert "--max-model-len 202752" in em.paged_decode_attention_unsupported(202752)


@pytest.mark.parametrize("cuts", [[64], [128], [64, 128], [192]])
def test_prompt_cut_at_chunk_boundaries_keeps_tokens(ckpt, cuts):
    """bf16: a 200-token prompt prefilled in pieces cut on KDA block edges (the scheduler's
    `prefill_chunk_multiple`) and then decoded greedily gives the tokens of the uncut prompt. [192] leaves
    an 8-token last piece, short enough for MLA's absorbed path: a prefill step expands K/V for it as for
    the uncut prompt (blocks/common.reference_ops), since the two forms round apart in bf16."""
    prompt = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(5)).tolist()

    def generate(pieces: list[int]) -> list[int]:
        em = build_model(ckpt, device="cpu", dtype=torch.bfloat16)
        em.reserve_slots(2)
        kv = [{n: torch.zeros(PAGES_PER_SLOT, PAGE, *s, dtype=torch.bfloat16) for n, s in shapes.items()}
              for shapes in em.cache_shapes()]
        pages = list(range(PAGES_PER_SLOT))
        bounds = [0, *pieces, len(prompt)]
        for lo, hi in zip(bounds, bounds[1:]):
            hidden = em(build_forward_batch([(prompt[lo:hi], lo, pages, 1)], PAGE, "cpu"), kv)
        tokens = [int(em.logits(hidden[-1:]).argmax())]
        for i in range(5):
            hidden = em(build_forward_batch([(tokens[-1:], len(prompt) + i, pages, 1)], PAGE, "cpu"), kv)
            tokens.append(int(em.logits(hidden).argmax()))
        return tokens

    assert generate(cuts) == generate([])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_through_block_tables_matches_the_per_sequence_cores(ckpt, dtype):
    """Decode steps that carry block tables (the runner's paged decode attention) take MLA's
    static path (selection and attention batched over sequences, every table position pooled):
    the same DSA selections, so the same tokens and logits to rounding, and nothing breaks the
    graph recording (no eager core)."""
    cores, tables = _Pair(ckpt, dtype), _Pair(ckpt, dtype)
    prompts = _prompts()
    first = {0: prompts[0], 1: prompts[1], 2: prompts[2]}
    h, _ = cores.step(first)
    tables.step(first)
    rows = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1, h.shape[0] - 1]
    nxt = _next_ids(cores, h[rows], [0, 1, 2])
    for seqs in ([0, 1, 2], [2, 0], [1], [0, 1, 2], [2, 1, 0], [0, 2]):
        want, _ = cores.step({i: nxt[i] for i in seqs})
        fb = build_forward_batch(tables.chunks({i: nxt[i] for i in seqs}), PAGE, "cpu", table_blocks=PAGES_PER_SLOT)
        rec = _RealBatchCores(fb)
        graph_break.set_recorder(rec)
        try:
            got = tables.em(fb, tables.kv)
        finally:
            graph_break.set_recorder(None)
        for i in seqs:
            tables.lens[i] += 1
        assert rec.breaks == 0 and rec.layers == len(tables.ref.layers)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), seqs
        assert _next_ids(tables, got, seqs) == _next_ids(cores, want, seqs)
        nxt.update(_next_ids(cores, want, seqs))
    for layer in tables.em.kda.kda_layers:  # the KDA path is the same either way
        assert torch.allclose(tables.em.kda.ssm_rows[layer].float(), cores.em.kda.ssm_rows[layer].float(), atol=1e-4)


def test_static_selection_equals_per_sequence_selection(ckpt):
    """DSAIndexer.select_decode over a padded table gives each sequence `select`'s exact list, on
    both sides of every pool edge and of the top-k cut (the tiny model: 4-token pools, top 8 tokens)."""
    em = build_model(ckpt, device="cpu", dtype=torch.float32)
    indexer = next(layer.self_attn.indexer for layer in em.model.layers if not layer.is_kda)
    gen = torch.Generator().manual_seed(3)
    lmax = 48
    lens = torch.tensor([1, 3, 4, 5, 7, 8, 9, 12, 13, 17, 30, 47, 48])
    b, nh, d = lens.shape[0], indexer.n_heads, indexer.head_dim
    q, w = torch.randn(b, nh, d, generator=gen), torch.randn(b, nh, generator=gen)
    rows = torch.randn(b, lmax, 2 * d, generator=gen)
    table = torch.arange(b * lmax).view(b, lmax)  # each sequence's positions at rows of its own
    got = indexer.select_decode(q, w, rows.view(b * lmax, 2 * d), table, lens)
    for i, n in enumerate(lens.tolist()):
        want = indexer.select(q[i:i + 1], w[i:i + 1], rows[i, :n], n - 1)
        assert torch.equal(got[i:i + 1], want), n
