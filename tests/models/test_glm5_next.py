"""glm5_next (GLM-5.3-Flash) against transformers' reference, fp32 on CPU, plus cache, batching,
engine-adapter, MTP speculative decoding and loader-error behaviour."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.errors import UserError
from tiermoe.models.glm5_next import SeqBatch, build_model, load_config, load_model
from tiermoe.models.glm5_next.kda import kda_chunked, kda_recurrent
from tiermoe.models.glm5_next.speculative import MTPSpeculator, greedy_generate
from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("glm5_next") / "tiny")


@pytest.fixture(scope="module")
def ours(ckpt):
    return load_model(ckpt)


@pytest.fixture(scope="module")
def prompts(ckpt):
    """One chat-templated English prompt and random-id prompts: 320 positions in all, each
    longer than index_topk * index_kpool (so DSA selects a strict subset of the context)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    text = "Mixture-of-Experts models route each token to a few experts out of many. " * 3
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    chat = list(chat["input_ids"] if isinstance(chat, dict) else chat)
    gen = torch.Generator().manual_seed(7)
    rand = [torch.randint(3, len(tok), (n,), generator=gen).tolist() for n in (100, 72)]
    return [chat[:148]] + rand


def _ours_full(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids))
    return model.logits(model(torch.tensor(ids), SeqBatch([0], [0], [len(ids)]), cache))


def _metrics(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, float]:
    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp(min=0)
    return float((ref.argmax(-1) == got.argmax(-1)).double().mean()), float(kl.mean()), float((ref - got).abs().max())


def test_parity_against_transformers_fp32(ckpt, ours, prompts):
    from transformers import Glm5NextForConditionalGeneration

    cfg = load_config(ckpt)
    assert min(len(p) for p in prompts) > cfg.index_topk * cfg.index_kpool
    assert sum(len(p) for p in prompts) >= 256
    ref_model = Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    refs, gots = [], []
    with torch.no_grad():
        for ids in prompts:
            refs.append(ref_model(input_ids=torch.tensor([ids])).logits[0])
            gots.append(_ours_full(ours, ids))
    top1, kl, diff = _metrics(torch.cat(refs), torch.cat(gots))
    assert top1 == 1.0
    assert kl < 1e-6
    assert diff < 1e-3

    # The same through the engine adapter: paged latent cache, 32-token chunks.
    from tiermoe.models.batch import build_forward_batch

    em = build_model(ckpt, device="cpu", dtype=torch.float32)
    kv = [{n: torch.zeros(40, 16, *s) for n, s in shapes.items()} for shapes in em.cache_shapes()]
    chunks = []
    for slot, ids in enumerate(prompts[1:]):
        for st in range(0, len(ids), 32):
            n = min(32, len(ids) - st)
            fb = build_forward_batch([(ids[st:st + n], st, list(range(20 * slot, 20 * slot + 20)), slot)], 16, "cpu",
                                     all_logits=True)
            chunks.append(em.logits(em(fb, kv)[fb.logits_index]))
    top1, kl, _ = _metrics(torch.cat(refs[1:]), torch.cat(chunks))
    assert top1 == 1.0 and kl < 1e-6


def test_bf16_bit_exact_against_eager_reference(ckpt, prompts):
    """In bf16 every op mirrors the reference's dtype handling: logits are bit-identical to
    transformers run with its eager experts loop (its default grouped_mm path accumulates the
    k expert outputs in fp32 instead, which the engine's combine_experts does not)."""
    from transformers import Glm5NextForConditionalGeneration

    ref = Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.bfloat16,
                                                           experts_implementation="eager").eval()
    ours_bf16 = load_model(ckpt, dtype=torch.bfloat16)
    ids = prompts[1]
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).logits[0]
    assert torch.equal(_ours_full(ours_bf16, ids), want)


def test_sparse_selection_is_a_strict_subset(ours, prompts):
    """At the end of a long prompt the indexer keeps topk/P whole pools plus the query's own
    incomplete pool (the always-selected tail), not the whole context."""
    layer = next(m for m in ours.modules() if getattr(m, "indexer", None) is not None)
    seen = {}
    orig = layer.indexer.select

    def spy(q, w, rows, start):
        seen["sel"] = out = orig(q, w, rows, start)
        return out

    layer.indexer.select = spy
    try:
        _ours_full(ours, prompts[1][:99])
    finally:
        del layer.indexer.select
    picked = set(seen["sel"][-1].tolist()) - {-1}
    cfg = ours.cfg
    assert len(picked) == cfg.index_topk + cfg.index_kpool - 1 < 99
    assert {96, 97, 98} <= picked  # tail: tokens after the last complete pool
    pools = sorted(picked - {96, 97, 98})
    assert all(p % 4 == 0 for p in pools[::4]) and len(pools) == cfg.index_topk


def test_prefill_then_decode_equals_full_forward(ours, prompts):
    ids = prompts[1]
    full = _ours_full(ours, ids)
    cache = ours.new_cache(2, len(ids))
    outs, pos = [], 0
    for n in [40] + [1] * 20 + [7, 1, 13] + [1] * (len(ids) - 81):
        batch = SeqBatch([1], [pos], [n])
        outs.append(ours.logits(ours(torch.tensor(ids[pos:pos + n]), batch, cache)))
        pos += n
    assert pos == len(ids)
    inc = torch.cat(outs)
    assert torch.equal(inc.argmax(-1), full.argmax(-1))
    assert (inc - full).abs().max() < 1e-3


def test_batch_of_mixed_lengths_equals_each_alone(ours, prompts):
    seqs = [prompts[1][:50], prompts[2], prompts[0][:15]]
    cache = ours.new_cache(4, 200)
    batch = SeqBatch([2, 0, 3], [0, 0, 0], [len(s) for s in seqs])
    together = ours.logits(ours(torch.tensor(sum(seqs, [])), batch, cache))
    # Next step mixes a decode token, a 5-token chunk and a decode token.
    extra = [[11], [12, 13, 14, 15, 16], [17]]
    step = SeqBatch([2, 0, 3], [len(s) for s in seqs], [len(e) for e in extra])
    nxt = ours.logits(ours(torch.tensor(sum(extra, [])), step, cache))
    for b, (s, e) in enumerate(zip(seqs, extra)):
        alone = _ours_full(ours, s + e)
        got = torch.cat([together[batch.cu[b]:batch.cu[b + 1]], nxt[step.cu[b]:step.cu[b + 1]]])
        assert torch.equal(got.argmax(-1), alone.argmax(-1))
        assert (got - alone).abs().max() < 1e-4


def test_kda_chunked_matches_recurrent():
    gen = torch.Generator().manual_seed(0)
    b, n, h, d = 2, 150, 3, 8
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for _ in range(3))
    g = -5 * torch.rand(b, n, h, d, generator=gen).sigmoid()
    beta = torch.rand(b, n, h, generator=gen)
    s0 = torch.randn(b, h, d, d, generator=gen)
    o1, s1 = kda_chunked(q, k, v, g, beta, s0)
    o2, s2, steps = kda_recurrent(q, k, v, g, beta, s0, keep_states=True)
    assert torch.allclose(o1, o2, atol=1e-4) and torch.allclose(s1, s2, atol=1e-4)
    assert steps.shape == (n + 1, b, h, d, d) and torch.equal(steps[-1], s2)


def test_resident_experts_match_transformers_experts(ckpt):
    """Routed experts, swiglu_limit clamp included, are bit-identical to the reference loop."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts

    from tiermoe.moe.experts import ResidentExperts

    cfg = Glm5NextTextConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=6, swiglu_limit=0.5)
    ref = Glm5NextTextExperts(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=gen))
        ref.down_proj.copy_(torch.randn(6, 16, 8, generator=gen) / 3)
    x = torch.randn(20, 16, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(20)])
    w = torch.rand(20, 3, generator=gen)
    ours = ResidentExperts(0.5)
    ours.add_layer(5, ref.gate_up_proj.detach(), ref.down_proj.detach())
    with torch.no_grad():
        assert torch.equal(ours.forward(5, x, ids, w), ref(x, ids, w))


def test_mtp_speculation_keeps_greedy_output(ours, prompts):
    batch_prompts = [prompts[1][:40], prompts[0][:25]]
    plain, _ = greedy_generate(ours, batch_prompts, 12)
    for k in (1, 2):
        spec, stats = greedy_generate(ours, batch_prompts, 12, num_draft=k)
        assert spec == plain
        assert stats.drafted > 0 and stats.steps < 12


def test_verify_accepts_rolls_back_and_stays_exact(ours, prompts):
    """Drive verify() with drafts that are right, half right and wrong: the emitted tokens are
    the plain greedy ones and the cache stays consistent after every rollback."""
    prompt = prompts[2][:30]
    plain, _ = greedy_generate(ours, [prompt], 20)
    truth = plain[0]
    spec = MTPSpeculator(ours, ours.new_cache(1, 80), num_draft=2)
    out = spec.prefill([0], [prompt])
    step = expected = 0
    while len(out) < 16:
        a, b = truth[len(out):len(out) + 2]
        drafts = [[a, b], [a, (b + 1) % 500], [(a + 1) % 500, b]][step % 3]
        emitted = spec.verify([0], [drafts])[0]
        assert emitted == truth[len(out):len(out) + len(emitted)]
        out += emitted
        expected += (2, 1, 0)[step % 3]
        step += 1
    assert spec.stats.accepted == expected and spec.stats.drafted == 2 * step
    assert spec.cache.lengths[0] == len(prompt) + len(out) - 1
    assert len(spec.draft([0])[0]) == 2  # the MTP layer resumes from the repaired state
    # ...and the trunk state after all those rollbacks still continues exactly.
    nxt = spec.verify([0], [[truth[len(out)], truth[len(out) + 1]]])[0]
    assert nxt == truth[len(out):len(out) + len(nxt)]


def test_missing_tensor_is_one_line_user_error(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    state = load_file(str(bad / "model.safetensors"))
    key = "model.language_model.layers.2.self_attn.indexer.wk.weight"
    del state[key]
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError) as err:
        load_model(bad)
    msg = str(err.value)
    assert "\n" not in msg and key in msg and "model.safetensors" in msg


def test_shared_indexer_after_kda_layer_is_refused(ckpt, tmp_path):
    bad = tmp_path / "cfg"
    bad.mkdir()
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["indexer_types"][7] = "shared"  # layer 6 is KDA: nothing to share
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"indexer_types\[7\]"):
        load_config(bad)


def test_tiered_store_batch_of_four_equals_alone(ckpt, tmp_path):
    """Pack the checkpoint (MTP experts included), serve routed experts from the store with a
    host tier far smaller than the experts, and decode 4 sequences together: the tokens equal
    resident experts and each sequence decoded alone."""
    from tiermoe.moe.store_backends import StoreTorchExperts
    from tiermoe.store.facade import ExpertStore
    from tiermoe.store.pack import pack

    out = tmp_path / "store"
    pack(str(ckpt), str(out), quant="bf16", direct_io=False, progress=False, log=lambda s: None)
    store = ExpertStore.open(out, device="cpu", dtype=torch.bfloat16, host_expert_gb=0.0002, direct_io=False)
    tiered = load_model(out, dtype=torch.bfloat16, expert_backend=StoreTorchExperts(store))
    resident = load_model(ckpt, dtype=torch.bfloat16)
    seqs = [list(range(5, 45)), list(range(50, 75)), [7] * 30, list(range(100, 160))]
    together, _ = greedy_generate(tiered, seqs, 8)
    assert together == greedy_generate(resident, seqs, 8)[0]
    assert together == [greedy_generate(tiered, [s], 8)[0][0] for s in seqs]
    assert store.counters()["disk"]["reads"] > 0  # experts really came through the tiers
