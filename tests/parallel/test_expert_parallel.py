"""Expert parallel on the CPU (moe/expert_parallel.py, tiermoe/parallel.py): the rank split and the combine.

Two processes join a gloo group (as two GPUs' processes join an NCCL one), each builds the real engine on a packed
tiny glm4_moe store and computes its share of every MoE layer's experts; the all-reduce adds the shares. Checked:
both ranks get the same logits; those are bit-identical across tier budgets (slots, RAM, disk); they equal one
process's logits within summation-order differences (fp32: max |diff| ~1e-7; bf16: top-1 and a small KL),
since one process adds every expert into one running sum and two ranks add two partial sums.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiermoe.moe.expert_parallel import fillers, localize
from tiermoe.store.shares import share_experts

RANK_SCRIPT = Path(__file__).with_name("_rank.py")
sys.path.insert(0, str(RANK_SCRIPT.parent))
import _rank  # noqa: E402


def test_shares_are_disjoint_and_balanced_by_the_statistics():
    """Each layer's experts dealt back and forth by rate: every expert has one owner, the shares differ by at
    most one expert, and their expected picks by at most the largest single rate."""
    g = torch.Generator().manual_seed(0)
    rates = [(torch.rand(288, generator=g) ** 4).tolist() for _ in range(3)]
    for world in (1, 2, 3, 4):
        for layer_rates, owner in zip(rates, share_experts(rates, world)):
            assert len(owner) == 288 and set(owner) == set(range(world))
            counts = [owner.count(r) for r in range(world)]
            load = [sum(x for x, o in zip(layer_rates, owner) if o == r) for r in range(world)]
            assert max(counts) - min(counts) <= 1
            assert max(load) - min(load) <= max(layer_rates) + 1e-9, (world, load)
    assert share_experts([[3.0, 2.0, 1.0, 0.5]], 2) == [[0, 1, 1, 0]]  # back and forth: 0, 1, then 1, 0
    with pytest.raises(ValueError):
        share_experts(rates, 0)


def test_other_ranks_picks_become_distinct_fillers():
    """Every replaced pick becomes one of the rank's fillers, a row never names an expert twice (the kernels'
    contract: a duplicate made the Triton path's prefill wrong), and the rank's own picks stay where they are."""
    g = torch.Generator().manual_seed(1)
    k, n = 8, 64
    rates = [torch.rand(n, generator=g).tolist()]
    for world in (2, 4):
        owner = torch.tensor(share_experts(rates, world)[0])
        for rank in range(world):
            cand = torch.tensor(fillers({0: owner.tolist()}, {0: rates[0]}, rank, k)[0])
            ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(200)])  # [T, k] distinct per row
            local, foreign = localize(ids, owner, cand, rank)
            assert torch.equal(foreign, owner[ids] != rank)
            assert torch.equal(local[~foreign], ids[~foreign])
            assert bool((owner[local] == rank).all()) and bool(torch.isin(local[foreign], cand).all())
            assert all(len(set(row)) == k for row in local.tolist())
    with pytest.raises(ValueError, match="fewer than the 8 picks"):
        fillers({0: [0, 1] * 4}, {0: [1.0] * 8}, 0, 8)


def _ranks(store, dtype: str, tmp_path, world: int = 2, kind: str = "store") -> list[dict]:
    """Every rank's results, each rank its own process (gloo over a rendezvous file)."""
    init = f"file://{tmp_path / f'rendezvous-{dtype}-{world}'}"
    outs = [tmp_path / f"rank{r}-of-{world}-{dtype}.pt" for r in range(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TRITON_INTERPRET": "1"} if kind != "store" else {})}
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(r), str(world), init, str(store), dtype,
                               str(outs[r]), kind],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_give_one_processs_logits(ep_store, dtype, tmp_path):
    from tiermoe.eval.parity import compare

    store = ep_store
    one, one_counters = _rank.logits_and_counters(str(store), dtype, _rank.BUDGETS["store"]["ram"])
    assert "expert_parallel" not in one_counters
    ranks = _ranks(store, dtype, tmp_path)
    two = ranks[0]["ram"][0]
    for r, res in enumerate(ranks):
        for budget in _rank.BUDGETS["store"]:
            logits, c = res[budget]
            assert torch.equal(logits, two), (r, budget)  # the same on both ranks, whatever the tier budgets
            ep = c["expert_parallel"]
            assert ep["rank"] == r and ep["world"] == 2 and ep["experts"] == 8, ep  # 2 layers x 8 experts / 2
            assert 0 < ep["foreign_picks"] < ep["picks"], ep
        assert res["small"][1]["disk"]["reads"] > 0  # that budget reads its share from disk
        host = res["ram"][1]["host"]  # RAM for every expert: each rank's host tier holds its share alone
        assert host["capacity"] == host["resident"] == 8 and host["misses"] == 0, host
        mtp, kernel, world = res["refused"]
        assert "--num-speculative-tokens" in mtp and "--expert-kernel" in kernel and "has 2 ranks" in world, \
            res["refused"]
        fast, c = res["fast"]  # fast mode: each rank's CPU lane computes some of its own share's misses
        assert c["cpu_lane"]["experts"] > 0 and c["expert_parallel"]["world"] == 2, c
        m = compare(two, fast)
        assert m["top1"] >= 0.9 and m["kl_mean"] < 1e-2, m
        error, after = res["failure"]  # rank 1's part failed once: both raise, then both serve again
        assert error is not None and "injected" in error[1], error
        assert error[0] == "StoreIntegrityError" and (r == 1 or "rank 1" in error[1]), error
        assert torch.equal(after[: len(_rank.PROMPT)], two[: len(_rank.PROMPT)])
    m = compare(one, two)
    assert m["top1"] == 1.0, m
    if dtype == "float32":
        assert m["max_abs_logit_diff"] < 1e-4 and m["kl_max"] < 1e-9, m
    else:
        assert m["kl_mean"] < 1e-3, m


def test_a_rank_count_without_its_group_is_a_clear_error(ep_store):
    from tiermoe.errors import UserError

    with pytest.raises(UserError, match="torchrun"):
        _rank.logits_and_counters(str(ep_store), "float32", {"tensor_parallel_size": 2})


@pytest.mark.slow
def test_two_ranks_through_the_device_cache(ep_store, tmp_path):
    """The Triton kernels (the interpreter on the CPU): two ranks' device caches over disk tiers that hold each
    rank's share give the Triton store path's logits bit for bit, with 4 or 10 GPU records; one process's
    device cache within summation order. No rank reads another's experts."""
    from tiermoe.eval.parity import compare

    (one,) = _ranks(ep_store, "bfloat16", tmp_path, world=1, kind="triton")
    ranks = _ranks(ep_store, "bfloat16", tmp_path, kind="triton")
    two = ranks[0]["store-triton"][0]
    for r, res in enumerate(ranks):
        for budget in ("store-triton", "cache-4", "cache-10"):
            assert torch.equal(res[budget][0], two), (r, budget)
        for budget in ("cache-4", "cache-10"):
            c = res[budget][1]
            tier = c["device_cache"]["disk_tier"]
            assert c["expert_parallel"]["experts"] == 8 and tier["failed_reads"] == 0, c
            assert tier["ram_entries"] <= 9 and tier["decode_reads"] == 0, tier  # its share in RAM, no other read
    assert torch.equal(one["cache-4"][0], one["store-triton"][0])
    m = compare(one["cache-4"][0], two)
    assert m["top1"] == 1.0 and m["kl_mean"] < 1e-3, m


def test_two_ranks_round_the_sum_of_their_fp32_parts_once(ep_store, tmp_path):
    """Each rank's part is its backend's fp32 sum before rounding (forward(partial=True)); the layer's output is
    the ranks' fp32 parts added, then rounded to bf16 once, on every rank. Built from the parts each rank saved:
    round(p0 + p1), never round(round(p0) + round(p1)). The Triton paths' parts lie between bf16 values, so
    there the two differ on some elements, and the output is the first; the torch path's parts are rounded
    already (its running sum is in bf16), where both are the same."""
    ranks = _ranks(ep_store, "bfloat16", tmp_path, kind="partial")
    for name in _rank.PARTS:
        for call in range(2):  # a decode step, a prefill chunk
            p0, p1 = (res[name]["part"][call] for res in ranks)  # fp32 [T, H] each rank's own part
            assert p0.dtype == p1.dtype == torch.float32 and not torch.equal(p0, p1)
            once = (p0 + p1).to(torch.bfloat16)  # [T, H]
            twice = (p0.to(torch.bfloat16).float() + p1.to(torch.bfloat16).float()).to(torch.bfloat16)
            for res in ranks:
                assert torch.equal(res[name]["out"][call], once), (name, call)
                assert torch.equal(res[name]["total"][call], p0 + p1), (name, call)  # partial=True: unrounded
            differ = int((once != twice).sum())
            assert differ > 0 if name != "store-torch" else differ == 0, (name, call, differ)


class _Group:
    """RankGroup's engine-facing methods, recording (a rank alone: nothing to send)."""

    def __init__(self):
        self.published, self.abandoned = [], []

    def publish(self, inputs):
        self.published.append(inputs)

    def agree_tokens(self, tokens):
        return tokens

    def abandon(self, exc):
        self.abandoned.append(exc)
        raise SystemExit(3)


def test_a_failure_the_ranks_did_not_agree_on_ends_the_rank(ep_store, monkeypatch):
    """A forward that fails outside the experts' part (here: execute raising) happened on one rank only, whose
    peers wait in that step's collectives: the engine hands it to RankGroup.abandon (which ends the process)
    instead of failing the requests and going on out of step. A failure raised at check_step (the ranks'
    agreement) fails the step's requests and the engine goes on."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.errors import StoreIntegrityError
    from tiermoe.protocol import SamplingParams

    eng = build_engine_core(str(ep_store), device="cpu", dtype="float32", max_num_seqs=1,
                            options=_rank.BUDGETS["store"]["ram"])
    try:
        eng.ranks = group = _Group()
        eng.add_request("a", [5, 17, 33], SamplingParams(max_tokens=4, temperature=0))
        agreed = StoreIntegrityError("expert-parallel rank 1: injected")
        monkeypatch.setattr(eng.runner, "check_step", lambda: (_ for _ in ()).throw(agreed))
        (out,) = eng.step()
        assert out.finish_reason == "error" and "injected" in out.error and not group.abandoned
        (first,) = group.published  # what the followers replay: the request as it was added
        assert [added[:2] for added in first.added] == [("a", [5, 17, 33])] and first.aborted == []
        eng.add_request("b", [5, 17, 33], SamplingParams(max_tokens=4, temperature=0))
        monkeypatch.setattr(eng.runner, "execute", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("oom")))
        with pytest.raises(SystemExit):
            eng.step()
        assert len(group.abandoned) == 1 and str(group.abandoned[0]) == "oom"
    finally:
        eng.model.expert_backend.close()
