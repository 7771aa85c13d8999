"""`run_parity(..., decode_from=N)` also against transformers' own cached decode.

Our decode steps are judged against the reference's full forward, which for recurrent (KDA)
layers is another algorithm than a one-token step: in bf16 the two sum in different orders. The
reference's cached decode is the fair counterpart, and its distance from its own full forward is
what the decode algorithm alone costs.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.eval import parity
from tiermoe.eval.parity import format_result, reference_decode_logits, run_parity
from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint

DECODE_KEYS = ("ours_vs_ref_decode", "ref_decode_vs_ref")


@pytest.fixture(scope="module")
def glm5_tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("glm5-decode-ref") / "tiny")


@pytest.fixture(scope="module")
def glm5_confident(tmp_path_factory):
    """Residual branches scaled down: decisive logits, so bf16 rounding flips few top-1s."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("glm5-decode-ref") / "confident", branch_scale=0.25)


def _finite(metrics: dict) -> bool:
    return all(math.isfinite(metrics[k]) for k in ("top1", "kl_mean", "kl_max", "max_abs_logit_diff"))


@pytest.mark.slow  # about half a minute on a small CPU machine
def test_glm5_next_fp32_decode_steps_equal_the_reference_decode(glm5_tiny):
    """fp32: our KDA recurrent and MLA decode steps agree with transformers' cached decode, and
    that decode with its own full forward (the decode algorithm is invisible at this precision)."""
    result = run_parity(str(glm5_tiny), None, "cpu", "float32", chunk=16, decode_from=0)
    ours_dec, ref_dec = result["ours_vs_ref_decode"], result["ref_decode_vs_ref"]
    assert ours_dec["positions"] == ref_dec["positions"] == result["positions"] >= 256
    assert ours_dec["top1"] == 1.0 and ours_dec["kl_mean"] < 1e-6
    assert ref_dec["top1"] == 1.0 and ref_dec["kl_mean"] < 1e-6
    assert "ref_decode_skipped" not in result


@pytest.mark.slow  # about half a minute on a small CPU machine
def test_glm5_next_bf16_reference_decode_has_its_own_spread(glm5_confident):
    """bf16 on the confident tiny: transformers' cached decode is not its full forward (the
    recurrent step rounds differently), and our decode steps stray from the full forward by the
    same order as that decode does, rather than by a bug's margin."""
    result = run_parity(str(glm5_confident), None, "cpu", "bfloat16", chunk=16, decode_from=0)
    ours_dec, ref_dec = result["ours_vs_ref_decode"], result["ref_decode_vs_ref"]
    print("glm5_next bf16 confident:", {k: (result[k]["top1"], result[k]["kl_mean"]) for k in DECODE_KEYS},
          "ours vs full forward:", (result["top1"], result["kl_mean"]))
    assert _finite(ours_dec) and _finite(ref_dec) and _finite(result["ref_decode_vs_ref_fp32"])
    # the reference's decode algorithm alone moves its bf16 logits
    assert ref_dec["kl_mean"] > 0 and ref_dec["max_abs_logit_diff"] > 0
    # the same model either way: a decode that lost its cache would put top-1 far lower
    assert ours_dec["top1"] >= 0.95 and ref_dec["top1"] >= 0.95 and result["top1"] >= 0.95
    # ours-vs-full forward is of the decode algorithm's own order (a factor, not a fixed figure)
    assert result["kl_mean"] < 4 * ref_dec["kl_mean"]
    printed = json.loads(format_result(result))
    assert all(k in printed for k in (*DECODE_KEYS, "ref_decode_vs_ref_fp32"))


def test_plain_attention_decode_is_the_reference_decode_bit_for_bit(tiny_dir):
    """qwen3_moe, bf16: the cache goes in through transformers' generic keyword, and our decode
    steps give its cached decode's logits exactly, so the whole gap to its full forward is the
    decode algorithm's."""
    result = run_parity(str(tiny_dir("qwen3_moe")), None, "cpu", "bfloat16", chunk=16, decode_from=0,
                        fp32_floor=False)
    ours_dec, ref_dec = result["ours_vs_ref_decode"], result["ref_decode_vs_ref"]
    assert ours_dec["top1"] == 1.0 and ours_dec["max_abs_logit_diff"] == 0.0
    assert ref_dec["top1"] == result["top1"] and ref_dec["kl_mean"] == pytest.approx(result["kl_mean"], rel=1e-9)


def test_a_reference_that_cannot_decode_leaves_the_keys_out(tiny_dir, monkeypatch):
    def no_decode(*_args, **_kwargs):
        raise NotImplementedError("no cache")

    monkeypatch.setattr(parity, "reference_decode_logits", no_decode)
    result = run_parity(str(tiny_dir("qwen3_moe")), None, "cpu", "float32", decode_from=0)
    assert not any(k in result for k in DECODE_KEYS)
    assert "no cache" in result["ref_decode_skipped"]
    assert result["top1"] == 1.0  # the full-forward comparison is unaffected
    json.loads(format_result(result))


class _StubLM(torch.nn.Module):
    """Records each forward's token count and cache; logits are the position one-hot, so the
    stitched output shows every position came back once and in order."""

    def __init__(self, keyword: str, vocab: int = 16):
        super().__init__()
        self.keyword, self.vocab, self.calls = keyword, vocab, []

    def forward(self, input_ids, use_cache=None, **kwargs):
        given = kwargs.get(self.keyword)
        seen = 0 if given is None else given["seen"]
        n = input_ids.shape[1]
        self.calls.append((n, given is not None))
        logits = torch.nn.functional.one_hot(torch.arange(seen, seen + n), self.vocab).float()[None]
        cache = {"seen": seen + n} if use_cache else None
        return SimpleNamespace(logits=logits, **{"cache" if self.keyword == "cache" else "past_key_values": cache})


class _NewCacheLM(_StubLM):
    def forward(self, input_ids, cache=None, use_cache=None):
        return super().forward(input_ids, use_cache=use_cache, cache=cache)


class _OldCacheLM(_StubLM):
    def forward(self, input_ids, past_key_values=None, use_cache=None):
        return super().forward(input_ids, use_cache=use_cache, past_key_values=past_key_values)


@pytest.mark.parametrize("cls,keyword", [(_NewCacheLM, "cache"), (_OldCacheLM, "past_key_values")])
@pytest.mark.parametrize("decode_from,steps", [(0, [1] * 6), (3, [3, 1, 1, 1]), (9, [6])])
def test_reference_decode_schedule(cls, keyword, decode_from, steps):
    """The positions before decode_from in one forward, then one a forward, each given the cache
    the previous returned, under whichever keyword the model's forward takes."""
    model = cls(keyword)
    logits = reference_decode_logits(model, list(range(6)), decode_from, "cpu")
    assert [n for n, _ in model.calls] == steps
    assert [fed for _, fed in model.calls] == [False] + [True] * (len(steps) - 1)
    assert torch.equal(logits.argmax(-1), torch.arange(6))


def test_reference_decode_without_a_returned_cache_raises():
    class NoCache(_NewCacheLM):
        def forward(self, input_ids, cache=None, use_cache=None):
            return super().forward(input_ids, use_cache=False, cache=cache)

    with pytest.raises(NotImplementedError, match="no cache"):
        reference_decode_logits(NoCache("cache"), [1, 2, 3], 0, "cpu")
