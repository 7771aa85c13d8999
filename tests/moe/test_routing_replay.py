"""Routing replay and recording (moe/replay.py, moe/routing_record.py, store/routing_trace.py).

Replay gives exactly the configured picks (a trace's rows in order, wrapping; counts drawn with
the right frequencies, distinct per token), with the router's weights for them, deterministic
per seed; its device-side step captures like a CUDA graph (a CPU op tape replayed against the
eager path, the twin of decode-graph capture); a recorded run replays to the same picks and
tokens; bad files fail with one line and exit code 2; exact mode stays bit-identical across
tiers under replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.errors import UserError
from tiermoe.moe.replay import attach_routing, replay_tables
from tiermoe.store.routing_trace import make_header, read_trace, write_trace
from tiermoe.store.planner import spread_layers

E, K = 8, 2  # the tiny checkpoints' experts and top-k


def _load(tiny_dir, arch):
    from tiermoe.models.loader import load_model

    return load_model(tiny_dir(arch), device="cpu", dtype=torch.float32)


class _Spy:
    """An expert backend that notes (layer, x, ids, weights) and returns zeros."""

    def __init__(self):
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, layer, x, ids, weights):
        self.calls.append((layer, x.clone(), ids.clone(), weights.clone()))
        return torch.zeros_like(x)


def _spied(lm) -> _Spy:
    spy = _Spy()
    for m in lm.moe_layers():
        m.backend = spy
    return spy


def _run_tokens(lm, counts: list[int]) -> None:
    """Forwards of the given token counts (a prefill, then one-token steps), one sequence."""
    from tiermoe.models.batch import build_forward_batch

    caches = [{n: torch.zeros(8, 16, *shp) for n, shp in s.items()} for s in lm.cache_shapes()]
    past = 0
    for n in counts:
        lm(build_forward_batch([(list(range(3, 3 + n)), past, [0, 1, 2, 3], 0)], 16, "cpu"), caches)
        past += n


def _router_weights(gate, x, ids):
    """The combine weights a router gives `ids` for x, computed here from its definition."""
    m = gate.moe
    if m.scoring == "softmax":
        logits = F.linear(x, gate.weight)
        w = F.softmax(logits.float(), dim=-1).gather(1, ids)
        if m.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w if m.fp32_combine_weights else w.to(logits.dtype)
    w = F.linear(x.float(), gate.weight.float()).sigmoid().gather(1, ids)
    if m.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * m.routed_scaling_factor


def _trace(path, picks, layers=None, e=E, k=K, decode=None):
    layers = layers if layers is not None else list(range(picks.shape[1]))
    write_trace(path, make_header("test", layers, e, k), picks,
                np.ones(len(picks), bool) if decode is None else decode)
    return path


def _distinct_rows(n, layers, seed):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(E, K, replace=False) for _ in range(layers)] for _ in range(n)])  # [n, L, k]


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])  # softmax; sigmoid_noaux with groups
def test_trace_replays_rows_in_order_with_router_weights(tiny_dir, tmp_path, arch):
    lm = _load(tiny_dir, arch)
    n_moe = len(lm.spec.moe_layers)
    file_layers = 2  # the model's MoE layers spread over the file's (3 -> [0, 0, 1], 2 -> [0, 1])
    picks = _distinct_rows(7, file_layers, seed=1)
    hooks = attach_routing(lm, replay=str(_trace(tmp_path / "t.npz", picks)))
    assert hooks.counters()["replay"]["kind"] == "trace"
    spy = _spied(lm)
    _run_tokens(lm, [5, 1, 1, 1, 1])  # 9 tokens: wraps around the 7-row trace
    want_rows = [i % 7 for i in range(9)]
    src = spread_layers(n_moe, file_layers)
    gates = {m.layer: m.gate for m in lm.moe_layers()}
    by_layer: dict[int, list] = {}
    for layer, x, ids, w in spy.calls:
        by_layer.setdefault(layer, []).append(ids)
        assert torch.equal(w, _router_weights(gates[layer], x, ids)), layer
        assert ids.dtype == torch.long
    for i, layer in enumerate(lm.spec.moe_layers):
        got = torch.cat(by_layer[layer]).numpy()  # [9, k]
        assert (got == picks[want_rows, src[i]]).all(), (layer, got)


def test_weights_match_router_own_picks_where_they_agree(tiny_dir):
    """Replaying the router's own choice gives its own weights: the replay path adds nothing."""
    for arch in ("qwen3_moe", "glm4_moe"):
        gate = _load(tiny_dir, arch).moe_layers()[0].gate
        x = torch.randn(6, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
        ids, w = gate(x)
        ids2, w2 = gate(x, ids)
        assert torch.equal(ids, ids2) and torch.equal(w, w2), arch


def _inclusion(p: np.ndarray) -> np.ndarray:
    """P(expert in a top-2 drawn without replacement, proportional to p)."""
    return p + np.array([sum(p[j] * p[e] / (1 - p[j]) for j in range(len(p)) if j != e) for e in range(len(p))])


def test_counts_draws_follow_counts_distinct_and_seeded(tmp_path):
    counts = {"model.layers.3.mlp": [400, 200, 100, 50, 20, 10, 3, 1],
              "model.layers.4.mlp": [1, 1, 1, 1, 1, 1, 1, 300]}
    f = tmp_path / "c.json"
    f.write_text(json.dumps(counts))
    n = 20000
    a, info = replay_tables(str(f), num_layers=2, num_experts=E, top_k=K, seed=3, table_tokens=n)
    assert a.shape == (2, n, K) and info["kind"] == "counts"
    assert (a[..., 0] != a[..., 1]).all()  # distinct per token
    for i, c in enumerate(counts.values()):
        p = (np.array(c) + 0.5) / (sum(c) + 0.5 * E)
        want = n * _inclusion(p)
        got = np.bincount(a[i].reshape(-1), minlength=E)
        assert (np.abs(got - want) <= 5 * np.sqrt(want) + 2).all(), (i, got, want.round())
    b, _ = replay_tables(str(f), num_layers=2, num_experts=E, top_k=K, seed=3, table_tokens=n)
    c, _ = replay_tables(str(f), num_layers=2, num_experts=E, top_k=K, seed=4, table_tokens=n)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # another model shape: 3 layers of 16 experts (the popularity curve resampled), still distinct
    d, _ = replay_tables(str(f), num_layers=3, num_experts=16, top_k=4, table_tokens=500)
    assert d.shape == (3, 500, 4) and d.max() < 16
    assert all(len(set(row)) == 4 for row in d.reshape(-1, 4).tolist())


def test_counts_of_the_models_own_layers_are_matched_by_number(tmp_path):
    """A file listing the model's MoE layers and one more (glm5_next's MTP layer, 6 here) replays each
    layer with its own counts, as the warm start and the tier plan read them; spread by position, layer 5
    would take layer 6's. Without the model's layer numbers in the file, the spread stays."""
    hot = {3: 0, 4: 2, 5: 4, 6: 6}  # each layer's favourite expert
    counts = {f"model.layers.{L}.mlp": [300 if e == hot[L] else 1 for e in range(E)] for L in hot}
    f = tmp_path / "own.json"
    f.write_text(json.dumps(counts))
    table, info = replay_tables(str(f), num_layers=3, num_experts=E, top_k=K, table_tokens=400, layer_ids=[3, 4, 5])
    assert info["file_layer_of"] == [3, 4, 5]
    for i, layer in enumerate((3, 4, 5)):
        assert np.bincount(table[i].reshape(-1), minlength=E).argmax() == hot[layer], layer
    spread, info = replay_tables(str(f), num_layers=3, num_experts=E, top_k=K, table_tokens=400, layer_ids=[7, 8, 9])
    assert info["file_layer_of"] == [3, 5, 6]  # not the model's layers: first to first, last to last
    assert np.bincount(spread[2].reshape(-1), minlength=E).argmax() == hot[6]


def test_counts_replay_through_the_model(tiny_dir, tmp_path):
    """The model's layers take the table rows in order; a seed gives the same picks again."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({f"layers.{i}": [5, 4, 3, 2, 1, 1, 1, 1] for i in range(4)}))
    runs = []
    for seed in (0, 0, 1):
        lm = _load(tiny_dir, "qwen3_moe")
        attach_routing(lm, replay=str(f), seed=seed)
        spy = _spied(lm)
        _run_tokens(lm, [4, 1, 1])
        runs.append([ids for _, _, ids, _ in spy.calls])
    table, _ = replay_tables(str(f), num_layers=3, num_experts=E, top_k=K, seed=0)
    first = torch.cat(runs[0][0::3])  # first MoE layer: 6 tokens
    assert torch.equal(first, torch.from_numpy(table[0, :6]).long())
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


class _Tape(TorchDispatchMode):
    """A CPU twin of CUDA-graph capture: the aten ops of one call, replayed later on the same
    tensors without running any Python (what a graph replay does). Host syncs and ops whose
    output shape depends on data cannot be captured."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "unique", "masked_select")

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        assert not any(f in name for f in self.FORBIDDEN), f"{name}: not capturable (host sync / dynamic shape)"
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(out if isinstance(out, (tuple, list)) else [out],
                            new if isinstance(new, (tuple, list)) else [new]):
                if isinstance(o, torch.Tensor) and o.data_ptr() != n.data_ptr():
                    o.copy_(n)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_replay_and_record_capture_like_a_graph(tiny_dir, tmp_path, arch):
    """Eager calls and one captured call replayed give the same ids, weights and ring rows."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({f"layers.{i}": [9, 1, 8, 2, 7, 3, 6, 4] for i in range(3)}))
    outs = []
    for mode in ("eager", "tape"):
        lm = _load(tiny_dir, arch)
        hooks = attach_routing(lm, replay=str(f), record=str(tmp_path / f"{mode}.npz"), max_step_tokens=4)
        layer = lm.moe_layers()[0]
        x = torch.zeros(3, lm.spec.hidden_size)  # [B, H] the static input of a decode batch of 3
        seq = []
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(3, lm.spec.hidden_size, generator=gen) for _ in range(6)]
        tape = None
        for i, xi in enumerate(inputs):
            x.copy_(xi)
            with torch.inference_mode():
                if mode == "eager" or i == 0:
                    if mode == "tape":
                        tape = _Tape()
                        with tape:
                            ids, w = layer.routing.route(layer.gate, x)
                    else:
                        ids, w = layer.routing.route(layer.gate, x)
                else:
                    tape.replay()
            seq.append((ids.clone(), w.clone()))
        outs.append((seq, hooks.layers[0].ring.clone(), hooks.cursors.clone()))
        hooks.close()
    (s_e, ring_e, cur_e), (s_t, ring_t, cur_t) = outs
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(s_e, s_t))
    assert torch.equal(ring_e, ring_t) and cur_e[0] == 18 and torch.equal(cur_e[:1], cur_t[:1])
    assert len({tuple(a[0].reshape(-1).tolist()) for a in s_e}) > 1  # the rows moved on


def _engine(model, **options):
    from tiermoe.engine.build import build_engine_core

    return build_engine_core(str(model), device="cpu", max_num_seqs=2, options=options)


def _generate(engine, prompts, tokens=6):
    from tiermoe.engine.llm_engine import generate_ids
    from tiermoe.protocol import SamplingParams

    return generate_ids(engine, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))


def test_recorded_trace_replays_to_the_same_picks_and_tokens(tiny_dir, tmp_path):
    model = tiny_dir("glm4_moe")
    prompts = [[5, 17, 33, 64, 101], [9, 11]]
    own = _engine(model, record_routing=str(tmp_path / "own.npz"))
    out = _generate(own, prompts)
    assert own.stats()["routing"]["source"] == "model"
    own.runner.routing.close()
    header, picks, decode = read_trace(tmp_path / "own.npz")
    assert header["moe_layers"] == [1, 2] and header["num_experts"] == E and header["top_k"] == K
    assert picks.shape == (7 + 2 * 5, 2, K)  # two prompts, then 5 decode steps of 2 sequences
    assert decode.tolist() == [False] * 7 + [True] * 10
    plain = _engine(model)
    assert _generate(plain, prompts) == out  # recording changes nothing
    assert plain.stats()["routing"] == {"source": "model"} and plain.runner.routing is None

    again = _engine(model, routing_replay=str(tmp_path / "own.npz"), record_routing=str(tmp_path / "again.npz"))
    assert _generate(again, prompts) == out
    stats = again.stats()["routing"]
    assert stats["source"] == "replay" and stats["replay"]["file"] == str(tmp_path / "own.npz")
    again.runner.routing.close()
    _, picks2, decode2 = read_trace(tmp_path / "again.npz")
    assert np.array_equal(picks, picks2) and np.array_equal(decode, decode2)


def test_record_limit_and_padding_rows(tmp_path):
    """At most max_tokens kept; rows after a forward's flags (padding) and unflagged forwards
    (warm-up) are not recorded; the ring wraps around."""
    from tiermoe.moe.replay import LayerRouting
    from tiermoe.moe.routing_record import RoutingRecorder

    rec = RoutingRecorder(str(tmp_path / "r.npz"), make_header("m", [0], 64, 1), device=torch.device("cpu"),
                          id_dtype=torch.int16, num_layers=1, max_tokens=9000, max_step_tokens=4)
    lr = LayerRouting(None, None, rec.rings[0], rec.cursors[:1])
    fake_gate = lambda x: (x[:, :1].long(), x[:, :1])  # noqa: E731 - ids = the token's value
    kept = []
    value = 0
    for step in range(3100):
        t, real = (3, 2) if step % 2 else (4, 4)
        flags = None if step == 5 else [bool(step % 2)] * real
        rec.begin_forward(t, flags)
        lr.route(fake_gate, (torch.arange(value, value + t) % 64).float()[:, None])
        if flags:
            kept += [(v % 64, step % 2 == 1) for v in range(value, value + real)]
        value += t
    rec.close()
    _, picks, decode = read_trace(tmp_path / "r.npz")
    assert picks.shape == (9000, 1, 1) and rec.counters()["tokens"] == 9000
    assert picks[:, 0, 0].tolist() == [v for v, _ in kept[:9000]]
    assert decode.tolist() == [d for _, d in kept[:9000]]


BAD = {
    "not-json.json": "this is not JSON",
    "no-layers.json": "{}",
    "negative.json": json.dumps({"layers.0": [3, -1, 2, 2, 1, 1, 1, 1]}),
    "too-few-experts.json": json.dumps({"layers.0": [5]}),  # top-k 2 > its 1 expert
}


def _bad_trace(tmp_path, name):
    p = tmp_path / name
    if name == "truncated.npz":
        _trace(tmp_path / "full.npz", _distinct_rows(50, 2, 0))
        data = (tmp_path / "full.npz").read_bytes()
        p.write_bytes(data[: len(data) // 2])
    elif name == "topk.npz":  # a header with top-k larger than its expert count
        np.savez(p, picks=np.zeros((3, 2, 4), np.uint16), decode=np.ones(3, bool),
                 header=np.array(json.dumps(make_header("m", [0, 1], 3, 4))))
    elif name == "other-model.npz":  # a valid trace of a model with other top-k
        _trace(p, np.zeros((3, 2, 3), np.uint16), k=3)
    return p


@pytest.mark.parametrize("name", [*BAD, "truncated.npz", "topk.npz", "other-model.npz"])
def test_bad_files_one_line_exit_2(tiny_dir, tmp_path, name, capsys):
    from tiermoe.cli import main

    if name in BAD:
        (tmp_path / name).write_text(BAD[name])
        p = tmp_path / name
    else:
        p = _bad_trace(tmp_path, name)
    code = main(["generate", "--model", str(tiny_dir("qwen3_moe")), "--device", "cpu", "--prompt", "hi",
                 "--max-tokens", "1", "--routing-replay", str(p)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and str(p) in err, err


def test_bad_file_through_the_process(tiny_dir, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("[1, 2")
    out = subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(tiny_dir("qwen3_moe")),
                          "--device", "cpu", "--prompt", "hi", "--routing-replay", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "invalid JSON" in out.stderr


def test_no_moe_layers_and_bad_record_path(tiny_dir, tmp_path):
    import dataclasses

    lm = _load(tiny_dir, "qwen3_moe")
    lm.spec = dataclasses.replace(lm.spec, moe_layers=())
    with pytest.raises(UserError, match="no MoE layers"):
        attach_routing(lm, replay="x.json")
    with pytest.raises(UserError, match="--record-routing"):
        attach_routing(_load(tiny_dir, "qwen3_moe"), record=str(tmp_path / "missing-dir" / "r.npz"))


def test_exact_mode_bit_identical_across_tiers_under_replay(tiny_dir, tmp_path_factory, tmp_path):
    from testkit.stores import pack_tiny

    from tiermoe.eval.tiers import run_tiers

    _, store = pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", dtype="bfloat16", quant="bf16")
    f = tmp_path / "c.json"
    f.write_text(json.dumps({f"layers.{i}": [9, 1, 8, 2, 7, 3, 6, 4] for i in range(2)}))
    routing = {"routing_replay": str(f), "routing_replay_seed": 5}
    result = run_tiers(str(store), "cpu", [1.0, 0.0], [None, 0.0], routing)
    assert result["all_bit_identical"], result
    assert {r["counters"]["routing"]["source"] for r in result["configs"]} == {"replay"}


def test_glm5_next_trunk_layers_replay_and_record(tmp_path):
    """glm5_next's own MoE module takes the same hooks: each trunk MoE layer uses the trace's
    rows in order, as the record of the same run shows."""
    from tiermoe.models.tiny import write_tiny

    try:
        model = write_tiny("glm5_next", tmp_path / "g")
    except Exception as exc:  # transformers 5.17's config check predates glm5_next's layer types
        if "layer_types" not in str(exc):
            raise
        pytest.skip(f"this transformers cannot build glm5_next's config: {str(exc).splitlines()[0][:120]}")
    picks = _distinct_rows(5, 5, seed=2)  # [5, 5 MoE layers, k]
    trace = _trace(tmp_path / "t.npz", picks, layers=[3, 4, 5, 6, 7])
    eng = _engine(model, routing_replay=str(trace), record_routing=str(tmp_path / "r.npz"))
    _generate(eng, [[5, 17, 33], [9, 11]], tokens=3)
    eng.runner.routing.close()
    _, got, decode = read_trace(tmp_path / "r.npz")
    assert got.shape[0] == 5 + 2 * 2 and decode.sum() == 4
    assert np.array_equal(got, picks[[i % 5 for i in range(got.shape[0])]])


def test_serve_sigterm_leaves_a_valid_trace(tiny_dir, tmp_path):
    """A server stopped with SIGTERM writes what it recorded (the writer's final flush at exit)."""
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "serve.npz"
    proc = subprocess.Popen([sys.executable, "-m", "tiermoe.cli", "serve", str(tiny_dir("qwen3_moe")),
                             "--device", "cpu", "--port", str(port), "--log-level", "warning",
                             "--record-routing", str(out), "--served-model-name", "m"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.stderr.read()
    _, picks, decode = read_trace(out)
    assert picks.shape == (4 + 3, 3, K) and decode.tolist() == [False] * 4 + [True] * 3


@pytest.mark.skipif(os.environ.get("TIERMOE_KERNEL_TESTS_ON_GPU") != "1",
                    reason="needs CUDA (TIERMOE_KERNEL_TESTS_ON_GPU=1)")
@pytest.mark.parametrize("attention", ["sdpa", "paged"])
def test_graph_decode_replays_and_records_like_eager(tiny_dir, tmp_path, attention):
    """On a GPU: decode steps replayed from CUDA graphs take the same replayed picks, give the
    same tokens and record the same trace as the eager engine."""
    from tiermoe.store.pack import pack

    store = tmp_path / "store"
    pack(str(tiny_dir("glm4_moe", "bfloat16")), str(store), quant="int4", group_size=32, progress=False,
         log=lambda _: None)
    f = tmp_path / "c.json"
    f.write_text(json.dumps({f"layers.{i}": [9, 1, 8, 2, 7, 3, 6, 4] for i in range(2)}))
    runs = []
    for eager in (True, False):
        from tiermoe.engine.build import build_engine_core

        rec = tmp_path / f"rec-{eager}.npz"
        eng = build_engine_core(str(store), device="cuda", dtype="bfloat16", max_num_seqs=2, options={
            "expert_kernel": "triton", "gpu_expert_gb": 4 * 4096 / 2**30, "host_expert_gb": 16 * 4096 / 2**30,
            "enforce_eager": eager, "decode_attention": attention, "routing_replay": str(f),
            "record_routing": str(rec)})
        if not eager:
            eng.warm_up()
        out = _generate(eng, [[5, 17, 33, 64], [9, 11]], tokens=12)
        graphs = eng.runner.graphs.counters() if eng.runner.graphs is not None else None
        eng.runner.routing.close()
        eng.model.expert_backend.close()
        runs.append((out, read_trace(rec)[1:], graphs))
    (ref, (p0, d0), g0), (got, (p1, d1), g1) = runs
    assert g0 is None and g1["replays"] >= 10, g1
    assert got == ref and np.array_equal(p0, p1) and np.array_equal(d0, d1)
    assert p0.shape[0] == 6 + 2 * 11
