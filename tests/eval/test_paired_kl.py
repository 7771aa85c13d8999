"""`tiermoe eval paired-kl`: the command line, its JSON line and its one-line errors."""

from __future__ import annotations

import json

from tiermoe.cli import main
from tiermoe.store.pack import pack


def test_paired_kl_cli_json_line(tiny_dir, tmp_path, capsys):
    src = tiny_dir("qwen3_moe")  # another family: 3 MoE layers, no shared expert
    store = tmp_path / "qwen3-int4"
    pack(str(src), str(store), quant="int4", group_size=32, progress=False, log=lambda _: None)
    rc = main(["eval", "paired-kl", "--model", str(store), "--tokens", "6", "--prompts", "Hello", "Count to five.",
               "--cpu-lane-experts", "2", "--cpu-lane-threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and lines[0].startswith("paired KL over 12 positions")
    r = json.loads(lines[-1])
    assert r["positions"] == 12 and r["prompts"] == 2 and r["tokens_per_prompt"] == 6
    assert r["kl_mean"] < 1e-3 and r["top1"] > 0.995
    # on a CPU exact mode runs the torch expert path; below fp32 its per-expert rounding is named beside the KL
    assert r["exact_kernel"] == "torch" and lines[0].endswith("exact mode's experts: torch")
    assert any(line.startswith("note: exact mode ran the torch") for line in lines) == (r["dtype"] != "float32")
    lane = r["cpu_lane"]
    assert lane["max_experts_per_layer"] == 2 and lane["threads"] == 1
    assert 0 < lane["per_decode_token"] <= 2 * 3  # at most 2 per MoE layer


def test_paired_kl_refuses_a_checkpoint(tiny_dir, capsys):
    rc = main(["eval", "paired-kl", "--model", str(tiny_dir("qwen3_moe")), "--tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not a packed store" in err[0]


def test_paired_kl_refuses_an_empty_prompt(tmp_path, capsys):
    """Before any store is opened: an empty text compared only the chat template's tokens."""
    from testkit.cli import refused

    for text in ("", "   "):
        refused(capsys, ["eval", "paired-kl", "--model", str(tmp_path / "none"), "--prompts", "hi", text],
                "--prompts", "empty")
