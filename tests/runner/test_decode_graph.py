"""Piecewise CUDA graphs of decode steps (runner/decode_graph.py).

On CPU (CI): the capture boundaries sit where they must (one per layer, around attention's
KV-cache core) and cost nothing outside a recording (same bits with a pass-through recorder);
eligibility rules. On a GPU (TIERMOE_KERNEL_TESTS_ON_GPU=1): decode through recorded and
replayed graphs gives the tokens and logprobs of the eager engine, bit for bit, at batch 1 and 2.
"""

from __future__ import annotations

import os

ON_GPU = os.environ.get("TIERMOE_KERNEL_TESTS_ON_GPU") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tiermoe.models.batch import build_forward_batch  # noqa: E402
from tiermoe.models.blocks import graph_break  # noqa: E402
from tiermoe.runner.decode_graph import decode_graphs_unsupported  # noqa: E402

GIB = 2**30


class _PassThrough:
    """A recorder that only notes each boundary and runs the core as the eager step would."""

    def __init__(self):
        self.breaks = []
        self.layers = 0

    def break_here(self, core, tensors, batch, cache):
        self.breaks.append((core.__self__.__class__.__name__, [tuple(t.shape) for t in tensors]))
        return core(*tensors, batch, cache)

    def layer_done(self):
        self.layers += 1


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_boundaries_one_per_layer_and_free_outside_recording(tiny_dir, arch):
    from tiermoe.models.loader import load_model

    lm = load_model(tiny_dir(arch), device="cpu", dtype=torch.float32)
    caches = [{n: torch.zeros(8, 16, *shp) for n, shp in s.items()} for s in lm.cache_shapes()]
    prompt = build_forward_batch([([5, 17, 33, 64], 0, [0], 0), ([9, 11], 0, [1], 1)], 16, "cpu")
    lm(prompt, caches)
    step = build_forward_batch([([101], 4, [0], 0), ([7], 2, [1], 1)], 16, "cpu")  # a decode step, B = 2
    kv_before = [{n: t.clone() for n, t in c.items()} for c in caches]
    ref = lm(step, caches)
    caches_ref = caches
    caches = kv_before
    rec = _PassThrough()
    graph_break.set_recorder(rec)
    try:
        got = lm(step, caches)
    finally:
        graph_break.set_recorder(None)
    assert torch.equal(got, ref)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(caches, caches_ref) for n in a)
    assert len(rec.breaks) == lm.spec.num_layers and rec.layers == lm.spec.num_layers
    name = "MLAttention" if arch == "deepseek_v3" else "GQAttention"
    assert {b[0] for b in rec.breaks} == {name} and all(s[0][0] == 2 for _, s in rec.breaks)  # [B, ...] inputs


def test_paged_decode_attention_leaves_nothing_to_break_at(tiny_dir):
    """With block tables (--decode-attention paged) a decode step has static shapes throughout:
    no attention core breaks the capture, so a step records as one graph."""
    from tiermoe.models.loader import load_model

    dev = "cuda" if ON_GPU else "cpu"  # the paged kernel runs on CUDA or through the interpreter
    lm = load_model(tiny_dir("glm4_moe"), device=dev, dtype=torch.float32)
    caches = [{n: torch.zeros(8, 16, *shp, device=dev) for n, shp in s.items()} for s in lm.cache_shapes()]
    lm(build_forward_batch([([5, 17, 33, 64], 0, [3], 0), ([9, 11], 0, [5], 1)], 16, dev), caches)
    step = build_forward_batch([([101], 4, [3], 0), ([7], 2, [5], 1)], 16, dev, table_blocks=4)
    assert step.block_table.tolist() == [[3, 0, 0, 0], [5, 0, 0, 0]] and step.seq_lens.tolist() == [5, 3]
    rec = _PassThrough()
    graph_break.set_recorder(rec)
    try:
        got = lm(step, caches)  # [B, H]
    finally:
        graph_break.set_recorder(None)
    assert rec.breaks == [] and got.shape[0] == 2
    assert rec.layers == lm.spec.num_layers  # where a recording may split its graph into pieces
    with pytest.raises(ValueError, match="pure decode"):
        build_forward_batch([([1, 2], 0, [0], 0)], 16, "cpu", table_blocks=4)
    with pytest.raises(ValueError, match="table width"):
        build_forward_batch([([1], 70, [0, 1, 2, 3, 4], 0)], 16, "cpu", table_blocks=4)


@pytest.mark.parametrize("layers_per_graph, pieces", [(0, ["g", "core", "g", "core", "g"]),
                                                      (1, ["g", "core", "g", "g", "core", "g", "g"]),
                                                      (2, ["g", "core", "g", "core", "g", "g"])])
def test_recorder_splits_every_layers_per_graph_layers(layers_per_graph, pieces):
    """The program's pieces for two layers (attention core mid-layer) and the final norm after them:
    a graph ends at each core and, every layers_per_graph layers, at the layer's end."""
    from tiermoe.runner.decode_graph import _Recorder

    class Marks(_Recorder):  # graph captures replaced by marks (no CUDA here)
        def begin(self):
            self._graph = "g"

        def end(self):
            self.program.append(("graph", self._graph))
            self._graph = None

    rec = Marks(None, layers_per_graph)
    rec.begin()
    for _ in range(2):
        rec.break_here(lambda *a: torch.zeros(1), (), None, None)
        rec.layer_done()
    rec.end()  # after the final norm
    assert ["g" if step[0] == "graph" else "core" for step in rec.program] == pieces


def test_glm5_next_forward_marks_every_layer(tiny_dir):
    """glm5_next's layers mark their ends too (its decode graphs split as the decoder families' do)."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.protocol import SamplingParams

    eng = build_engine_core(str(tiny_dir("glm5_next")), device="cpu", max_num_seqs=1, options={})
    eng.add_request("r", [5, 17, 33], SamplingParams(max_tokens=1, ignore_eos=True))
    rec = _PassThrough()
    graph_break.set_recorder(rec)
    try:
        eng.step()  # one forward of the prompt
    finally:
        graph_break.set_recorder(None)
    assert rec.layers == eng.model.spec.num_layers > 0


def test_eligibility(tiny_dir):
    from tiermoe.models.loader import load_model

    lm = load_model(tiny_dir("glm4_moe"), device="cpu", dtype=torch.float32)
    assert "need a CUDA device" in decode_graphs_unsupported(lm, torch.device("cpu"))
    assert "device cache" in decode_graphs_unsupported(lm, torch.device("cuda"))  # resident experts sync
    glm5 = load_model(tiny_dir("glm5_next"), device="cpu", dtype=torch.float32)
    assert decode_graphs_unsupported(glm5, torch.device("cuda")) is not None


def test_cpu_engine_stays_eager(tiny_dir):
    from tiermoe.engine.build import build_engine_core

    eng = build_engine_core(str(tiny_dir("glm4_moe")), device="cpu", max_num_seqs=2, options={})
    assert eng.runner.graphs is None
    assert eng.stats()["decode_attention"] == "sdpa"  # auto: the paged kernel only on CUDA


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (TIERMOE_KERNEL_TESTS_ON_GPU=1)")
def test_auto_decode_attention_is_paged_where_the_model_allows(tiny_dir):
    """The default (auto) picks the paged kernel for grouped-query attention on CUDA and falls
    back to SDPA, without an error, for latent attention (no paged kernel)."""
    from tiermoe.engine.build import build_engine_core

    for arch, want in (("glm4_moe", "paged"), ("deepseek_v3", "sdpa")):
        eng = build_engine_core(str(tiny_dir(arch)), device="cuda", max_num_seqs=2, options={})
        assert eng.stats()["decode_attention"] == want, arch


def _int4_store(tiny_dir, tmp_path):
    """tiny glm4_moe (2 MoE layers of 8 experts, top-2) packed as int4 records of 4096 bytes."""
    from tiermoe.store.pack import pack

    store = tmp_path / "store"
    pack(str(tiny_dir("glm4_moe", "bfloat16")), str(store), quant="int4", group_size=32, progress=False,
         log=lambda _: None)
    return store


REC = 4096
# cpu_lane_share: on CUDA a fixed share (the measured one rounds to no expert with 4 KB records); unused on a CPU
FAST_OPTS = {"expert_kernel": "triton", "gpu_expert_gb": 4 * REC / GIB, "host_expert_gb": 16 * REC / GIB,
             "cpu_lane_experts": 2, "cpu_lane_share": 1.0, "cpu_lane_threads": 2}


def _generate(store, device: str, options: dict, batch: int, warm: bool = False,
              max_tokens: int = 12) -> tuple[list, dict]:
    """Tokens and logprobs of `batch` requests decoded together (sorted by request), and the
    counters afterwards: the expert backend's, the graphs' (with each program's pieces)."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.protocol import SamplingParams

    eng = build_engine_core(str(store), device=device, dtype="bfloat16", max_num_seqs=2, options=options)
    if warm:  # as `tiermoe serve` does: every shape compiled (and on CUDA recorded) before the requests
        assert eng.warm_up() > 4
        if eng.runner.graphs is not None:
            assert eng.runner.graphs.counters()["captured_batch_sizes"] == [1, 2]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    for i in range(batch):
        eng.add_request(f"r{i}", [5 + i, 17, 33, 64, 101, 250][: 6 - i], params)
    outs: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(
                (t, lp.logprob, tuple(lp.top)) for t, lp in zip(o.new_token_ids, o.logprobs or []))
    counters = eng.stats()["experts"]  # what /stats reports under engine.experts
    graphs = eng.runner.graphs.counters() if eng.runner.graphs is not None else None
    if graphs is not None:  # graph and eager pieces of each recorded program
        graphs["programs"] = {b: [k for k, *_ in e.program] for (b, _), e in eng.runner.graphs._entries.items()}
    eng.model.expert_backend.close()
    return [outs[k] for k in sorted(outs)], {"experts": counters, "graphs": graphs, "layers": eng.model.spec.num_layers}


def _assert_every_post_answered_once(experts: dict) -> None:
    dc = experts["device_cache"]
    counts = {k: dc["mailbox"][k] for k in ("posts", "served", "unanswered", "timeouts", "failed")}
    assert counts == {"posts": dc["lane_calls"], "served": dc["lane_calls"], "unanswered": 0, "timeouts": 0,
                      "failed": 0}, dc


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="on CUDA the graph test below runs it, eager and through graphs")
def test_fast_mode_warm_up_changes_no_token(tiny_dir, tmp_path):
    """Fast mode's tokens depend on the device cache's decisions (the CPU lane takes the coldest
    misses, and its fp32 partial is rounded apart from the device's), so the warm-up's dummy
    steps must leave those decisions as they found them (ModelRunner.warm_up). On CPU: eager
    steps through the interpreter, the lane answering through the mailbox; the GPU test below
    adds graphs."""
    store = _int4_store(tiny_dir, tmp_path)
    opts = {**FAST_OPTS, "mode": "fast"}
    ref, c = _generate(store, "cpu", opts, batch=2, max_tokens=6)
    assert c["experts"]["device_cache"]["lane_calls"] > 0 and c["experts"]["cpu_lane"]["experts"] > 0
    _assert_every_post_answered_once(c["experts"])
    got, c = _generate(store, "cpu", opts, batch=2, warm=True, max_tokens=6)
    assert got == ref
    _assert_every_post_answered_once(c["experts"])  # the warm-up's lane steps included


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (TIERMOE_KERNEL_TESTS_ON_GPU=1)")
@pytest.mark.parametrize("attention,mode", [("sdpa", "exact"), ("paged", "exact"), ("paged", "fast")])
def test_graph_decode_is_bit_identical_to_eager(tiny_dir, tmp_path, attention, mode):
    """Fast mode too: the CPU lane answers through the mailbox inside the replayed graph; with
    the start-up warm-up as without it."""
    store = _int4_store(tiny_dir, tmp_path)
    opts = {**FAST_OPTS, "mode": mode, "decode_attention": attention}

    def generate(eager: bool, batch: int, warm: bool = False) -> tuple[list, dict]:
        return _generate(store, "cuda", {**opts, "enforce_eager": eager}, batch, warm)

    for batch in (1, 2):
        ref, c = generate(True, batch)
        assert c["graphs"] is None
        got, c = generate(False, batch)
        assert got == ref, batch
        assert c["graphs"]["replays"] >= 9 and c["graphs"]["captured_batch_sizes"] == [batch], c["graphs"]
        dc = c["experts"]["device_cache"]
        assert dc["graph_replays"] == c["graphs"]["replays"]
        # every decode step (12 tokens per sequence, the first from the prefill) ran one cache step per layer
        assert dc["cache_steps"] == 11 * dc["layers"], dc
        if mode == "fast":  # the lane served every decode layer (lane_calls) and computed experts
            assert dc["lane_calls"] == dc["cache_steps"] and c["experts"]["cpu_lane"]["experts"] > 0, c
            _assert_every_post_answered_once(c["experts"])  # replayed posts too
        warm, cw = generate(False, batch, warm=True)
        assert warm == ref, batch  # warm-up changes no token
        if mode == "fast":
            _assert_every_post_answered_once(cw["experts"])
        assert generate(True, batch, warm=True)[0] == ref, batch  # nor in eager steps
        if attention == "paged":  # no eager core: one graph a layer, the last with the final norm
            assert c["graphs"]["programs"] == {batch: ["graph"] * (c["layers"] + 1)}, c["graphs"]
        else:  # one eager attention core per layer between graph pieces
            assert c["graphs"]["programs"][batch].count("eager") == c["layers"], c


def _glm5_store(tiny_dir, tmp_path):
    """tiny glm5_next (KDA, MLA + DSA with a shared-indexer layer, mHC; 5 MoE layers of 8
    experts, top-2) packed as int4 records; skips where transformers cannot build its config."""
    from tiermoe.store.pack import pack

    try:
        path = tiny_dir("glm5_next", "bfloat16")
    except Exception as exc:  # transformers 5.17's config check predates glm5_next's layer types
        if "layer_types" not in str(exc):
            raise
        pytest.skip(f"this transformers cannot build glm5_next's config: {str(exc).splitlines()[0][:120]}")
    store = tmp_path / "glm5_store"
    pack(str(path), str(store), quant="int4", group_size=32, progress=False, log=lambda _: None)
    return store


def _glm5_logits(store, eager: bool, batch: int, steps: int = 8, warm: bool = False, drafts: int = 0,
                 attention: str = "auto") -> tuple[list[torch.Tensor], dict | None, dict, list[list[int]]]:
    """Every step's logits [N, V] (cloned as the runner computes them) of `batch` greedy requests
    decoded together on CUDA, the graphs' counters with each program's pieces, the expert
    backend's counters and each request's tokens. warm: the start-up warm-up first; drafts:
    MTP speculative tokens per step (verify steps run eagerly, plain decode steps replay);
    attention: --decode-attention (auto: block tables, MLA's static path)."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.protocol import SamplingParams

    opts = {"expert_kernel": "triton", "gpu_expert_gb": 64 * REC / GIB, "host_expert_gb": 64 * REC / GIB,
            "mode": "exact", "enforce_eager": eager, "num_speculative_tokens": drafts, "decode_attention": attention}
    eng = build_engine_core(str(store), device="cuda", dtype="bfloat16", max_num_seqs=3, options=opts)
    if warm:
        assert eng.warm_up() > 3
    seen: list[torch.Tensor] = []
    model_logits = eng.model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = model_logits(hidden)
        seen.append(out.clone())
        return out

    eng.model.logits = logits  # the runner's one call per step that turns hidden states into logits
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [5 + i, 17, 33, 64, 101, 250][: 6 - i], params)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    graphs = eng.runner.graphs.counters() if eng.runner.graphs is not None else None
    if graphs is not None:
        graphs["programs"] = {b: [k for k, *_ in e.program] for (b, _), e in eng.runner.graphs._entries.items()}
    experts = eng.stats()["experts"]
    eng.model.expert_backend.close()
    return seen, graphs, experts, [tokens[k] for k in sorted(tokens)]


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (TIERMOE_KERNEL_TESTS_ON_GPU=1)")
def test_glm5_next_graph_decode_logits_bit_identical_to_eager(tiny_dir, tmp_path):
    """glm5_next's decode steps replayed from graphs (KDA state rows by slot-id tensors, mHC,
    MoE through the device cache captured; with block tables the MLA layers too, one graph a step,
    without them each MLA layer's rows + DSA selection + attention an eager core) give the eager
    steps' logits bit for bit, at batch 1 and 3 over several steps."""
    store = _glm5_store(tiny_dir, tmp_path)
    mla_layers = 3  # tiny trunk: layers 2 (own indexer), 3 (shared), 7 (own indexer)
    for batch, attention in ((1, "auto"), (3, "auto"), (3, "sdpa")):
        want, graphs, _, _ = _glm5_logits(store, True, batch, attention=attention)
        assert graphs is None
        got, graphs, experts, _ = _glm5_logits(store, False, batch, attention=attention)
        assert graphs is not None and graphs["failed"] is None, graphs
        assert len(got) == len(want) == 8, batch  # the prefill step and 7 decode steps
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (batch, i, (g - w).abs().max().item())
        # the first decode step runs eagerly, the second records; replays from then on
        assert graphs["captured_batch_sizes"] == [batch] and graphs["replays"] >= 5, graphs
        assert graphs["programs"][batch].count("eager") == (mla_layers if attention == "sdpa" else 0), graphs
        assert experts["device_cache"]["graph_replays"] == graphs["replays"], experts


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (TIERMOE_KERNEL_TESTS_ON_GPU=1)")
def test_glm5_next_graphs_with_warm_up_and_drafts_keep_tokens(tiny_dir, tmp_path):
    """The warm-up's dummy decode steps (fresh slots, recorded programs) change no logit; with
    MTP drafting, verify steps (KDA states kept, rolled back) run eagerly between replayed plain
    decode steps and the tokens stay those of eager decoding without drafts."""
    store = _glm5_store(tiny_dir, tmp_path)
    want, _, _, plain = _glm5_logits(store, True, 3, steps=10)
    got, graphs, _, tokens = _glm5_logits(store, False, 3, steps=10, warm=True)
    assert tokens == plain and all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == len(want)
    assert graphs["captured_batch_sizes"] == [1, 2, 3] and graphs["replays"] >= 8, graphs
    _, graphs, _, drafted = _glm5_logits(store, False, 3, steps=10, drafts=2)
    assert drafted == plain
    assert graphs["failed"] is None, graphs
