"""`tiermoe eval parity` of an int4-packed store against its bf16 source checkpoint."""

from __future__ import annotations

import json
import math

import pytest

from tiermoe.cli import main
from tiermoe.store.pack import pack


@pytest.fixture(scope="module")
def int4_from_bf16(tiny_dir, tmp_path_factory):
    src = tiny_dir("glm4_moe", "bfloat16")
    out = tmp_path_factory.mktemp("parity-int4") / "glm4-int4"
    pack(str(src), str(out), quant="int4", group_size=32, progress=False, log=lambda _: None)
    return src, out


def test_int4_store_parity_against_bf16_source(int4_from_bf16, capsys):
    src, store = int4_from_bf16
    rc = main(["eval", "parity", "--model", str(store), "--reference", str(src), "--device", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    r = json.loads(out[-1])
    print("int4 parity vs bf16 source:", {k: r[k] for k in ("positions", "top1", "kl_mean", "kl_max")})
    assert r["positions"] >= 256 and r["dtype"] == "float32"
    assert math.isfinite(r["kl_mean"]) and math.isfinite(r["kl_max"]) and r["kl_mean"] > 0
    # int4 with 32-wide groups on a tiny random model: clearly worse than bit-exact, clearly
    # the same model (a wrong layout or scale would put top-1 near 1/vocab)
    assert r["top1"] > 0.6 and r["kl_mean"] < 0.5
