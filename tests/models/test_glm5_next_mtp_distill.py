"""MTP distillation of a tiny glm5_next (only the MTP layer changes, and it learns to agree
with the trunk), `tiermoe tiny ... --distill-mtp` and `tiermoe bench mtp`."""

from __future__ import annotations

import json

import pytest
import torch
from testkit.torch_threads import one_torch_thread  # noqa: F401  (autouse fixture)

from tiermoe.cli import main


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_distill_trains_only_the_mtp_layer_and_drafts_get_accepted(tmp_path):
    from tiermoe.models.glm5_next import load_model
    from tiermoe.models.glm5_next.distill import distill_mtp
    from tiermoe.models.glm5_next.speculative import greedy_generate
    from tiermoe.models.glm5_next.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "tiny", branch_scale=0.25)
    before = _tensors(path)
    report = distill_mtp(path, steps=80, num_prompts=24, gen_len=24, held_out=6, seed=3)
    after = _tensors(path)
    assert report.steps == 80 and report.files == ["model.safetensors"]
    assert report.loss_last < report.loss_first / 2
    assert report.agreement_after > report.agreement_before + 0.05
    mtp = ".layers.8."
    assert before.keys() == after.keys()
    for key, value in before.items():
        unchanged = torch.equal(value, after[key])
        if mtp not in key or key.endswith("e_score_correction_bias") or "indexer" in key:
            assert unchanged, key  # trunk, embeddings, lm_head, routing bias; the indexer gets no gradient
        else:
            assert not unchanged, key
        assert value.dtype == after[key].dtype
    model = load_model(path)
    prompts = [list(range(40, 64)), list(range(300, 310))]
    plain, _ = greedy_generate(model, prompts, 16)
    spec, stats = greedy_generate(model, prompts, 16, num_draft=2)
    assert spec == plain and stats.accepted > 0


def test_tiny_cli_distill_flag(tmp_path, monkeypatch, capsys):
    import tiermoe.models.glm5_next.distill as distill

    assert main(["tiny", "qwen3_moe", str(tmp_path / "q"), "--distill-mtp"]) == 2
    assert "no MTP layer" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(distill, "distill_mtp", lambda path, seed: calls.append((path, seed)) or distill.DistillReport(
        1, 0.1, 10, 5.0, 4.0, 0.0, 0.5, ["model.safetensors"]))
    assert main(["tiny", "glm5_next", str(tmp_path / "g"), "--distill-mtp", "--seed", "4"]) == 0
    assert calls == [(tmp_path / "g", 4)] and "0.0% -> 50.0%" in capsys.readouterr().out


def test_bench_mtp_reports_and_checks_exactness(tmp_path, monkeypatch, capsys):
    out = tmp_path / "mtp.json"
    argv = ["bench", "mtp", "--tiny", "glm5_next", "--distill-steps", "0", "--tokens", "6", "--prompts", "2",
            "--num-draft", "1,2", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["identical"] is True and report["batch"] == 1
    rows = {r["num_speculative_tokens"]: r for r in report["settings"]}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0]["drafted"] == 0 and rows[0]["speedup"] == 1.0
    for k in (1, 2):
        assert rows[k]["identical"] and rows[k]["decode_tokens"] == 2 * 5  # first token is the prefill's
        assert rows[k]["drafted"] > 0 and 0.0 <= rows[k]["acceptance_rate"] <= 1.0
        assert rows[k]["tokens_per_verify"] >= 1.0 and rows[k]["tok_per_s"] > 0
    assert "speed-up" in capsys.readouterr().out

    import tiermoe.bench.mtp as bench

    real = bench.decode_prompts

    def corrupt(engine, prompts, tokens):  # drafting-on runs report a different token
        r = real(engine, prompts, tokens)
        if engine.runner.spec is not None:
            r["tokens"][0][-1] += 1
        return r

    monkeypatch.setattr(bench, "decode_prompts", corrupt)
    assert main(argv[:-2] + ["--num-draft", "1"]) == 1
    assert "differ" in capsys.readouterr().out
