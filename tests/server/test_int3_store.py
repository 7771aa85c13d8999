"""An int3 store end to end as a user runs it: `tiermoe pack --quant int3`, `tiermoe verify`, then
`tiermoe serve` in its own process answering the official OpenAI client. On a CPU the torch path
dequantizes every record it fetches; fast mode's CPU lane computes int3 records with its compiled
kernel where that reads int3, else with its plain-torch twin, and either way the request is served."""

from __future__ import annotations

import httpx
import openai
import pytest
from testkit.cli_server import CliServer

from tiermoe.cli import main

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def int3_store(tiny_dir, tmp_path_factory):
    """The tiny glm4_moe packed by the CLI as int3, with the group size pack picks (32: 64 does not
    divide the experts' width of 32)."""
    src = tiny_dir("glm4_moe", "bfloat16")
    out = tmp_path_factory.mktemp("int3") / "glm4-int3"
    assert main(["pack", str(src), str(out), "--quant", "int3", "--quiet"]) == 0
    return out


def test_pack_verify_serve_round_trip(int3_store, capsys):
    assert main(["verify", str(int3_store), "--quiet"]) == 0
    assert "ok: 16 records and 1 dense shard verified" in capsys.readouterr().out
    args = [str(int3_store), "--device", "cpu", "--max-model-len", "256", "--host-expert-gb", "0",
            "--served-model-name", "tiny-int3", "--log-level", "warning"]
    with CliServer(args, {}) as server:
        assert server.returncode is None, server.stderr
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        replies = [client.chat.completions.create(model="tiny-int3", messages=MESSAGES, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True}) for _ in range(2)]
        assert all(r.usage.completion_tokens == 6 for r in replies)
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content  # greedy: same text
        experts = httpx.get(server.url + "/stats", timeout=30).json()["engine"]["experts"]
    assert experts["mode"] == "exact" and experts["expert_kernel"] == "torch"
    assert experts["record_bytes"] == 4096 and experts["disk"]["reads"] > 0  # no host tier: every pick read


@pytest.mark.parametrize("lane_reads_int3", [True, False])
def test_fast_mode_serves_int3(int3_store, monkeypatch, lane_reads_int3):
    """Fast mode in-process (the same engine and app `tiermoe serve --mode fast` builds), over HTTP:
    with the CPU lane's compiled kernel as it is, and with int3 taken from the kinds it reads, when
    the lane must fall back to its plain-torch twin."""
    from testkit.servers import ServerThread

    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.build import build_engine_core
    from tiermoe.moe import cpu_lane
    from tiermoe.server.app import create_app

    if not lane_reads_int3:
        monkeypatch.setattr(cpu_lane, "NATIVE_KINDS", {k: v for k, v in cpu_lane.NATIVE_KINDS.items() if k != "int3"})

    core = build_engine_core(str(int3_store), device="cpu", dtype="bfloat16", max_model_len=256, max_num_seqs=1,
                             options={"mode": "fast", "cpu_lane_threads": 1})
    with ServerThread(create_app(AsyncEngine(core), served_model_name="tiny-int3", max_model_len=256)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny-int3", "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        experts = httpx.get(server.url + "/stats", timeout=30).json()["engine"]["experts"]
    lane = experts["cpu_lane"]
    assert experts["mode"] == "fast" and lane["decode_experts"] > 0
    if lane_reads_int3:
        assert lane["kernel"] == "torch" or lane["kernel"].startswith("native-")
    else:
        assert lane["kernel"] == "torch" and lane["repacks"] == lane["decode_experts"]  # the twin decodes records
