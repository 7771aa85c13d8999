"""`tiermoe serve --tensor-parallel-size 2` as a user runs it, on the CPU (gloo between the two processes): the
leader serves the official OpenAI client the tokens one process serves (fp32, greedy), concurrent requests
included; /stats shows the split; SIGTERM ends both processes; a follower that dies ends the leader with a
one-line error instead of leaving it waiting."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from testkit.cli_server import CliServer
from testkit.servers import free_port

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


def _args(store) -> list[str]:
    return [str(store), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--log-level", "warning",
            "--served-model-name", "tiny", "--cpu-threads", "1"]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _complete(server: CliServer, prompt: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12
    return r.choices[0].text


def test_two_ranks_serve_one_processs_tokens(ep_store):
    with CliServer(_args(ep_store), {}) as one:
        assert one.returncode is None, one.stderr
        want = [_complete(one, p) for p in PROMPTS]
    with CliServer(_args(ep_store) + ["--tensor-parallel-size", "2"], {}) as two:
        assert two.returncode is None, two.stderr
        followers = _children(two.proc.pid)
        assert len(followers) == 1, followers
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together on both ranks
            got = list(pool.map(lambda p: _complete(two, p), PROMPTS))
        assert [_complete(two, p) for p in PROMPTS] == want  # one at a time
        split = httpx.get(two.url + "/stats", timeout=30).json()["engine"]["experts"]["expert_parallel"]
        two.proc.send_signal(signal.SIGTERM)
        assert two.proc.wait(60) == 0, two.stderr
    assert got == want
    assert split["rank"] == 0 and split["world"] == 2 and split["experts"] == 8 and split["foreign_picks"] > 0, split
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{followers[0]}"):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{followers[0]}") or "Z" in Path(f"/proc/{followers[0]}/stat").read_text()


def test_a_follower_that_dies_ends_the_leader_with_one_line(ep_store):
    with CliServer(_args(ep_store) + ["--tensor-parallel-size", "2"], {}) as two:
        assert two.returncode is None, two.stderr
        (follower,) = _children(two.proc.pid)
        os.kill(follower, signal.SIGKILL)
        assert two.proc.wait(60) == 2
        time.sleep(0.3)
        assert "tiermoe: error: expert-parallel rank 1 exited" in two.stderr, two.stderr[-2000:]


@pytest.mark.parametrize("flags", [["CHECKPOINT"], ["STORE", "--num-speculative-tokens", "1"],
                                   ["STORE", "--tensor-parallel-size", "3"]])
def test_what_every_rank_would_refuse_is_one_line_before_any_rank_starts(ep_store, flags, capsys):
    """A checkpoint (not a packed store), MTP drafting, or more ranks than leave each rank a token's picks of
    every layer (3 ranks of 8 experts at 4 picks): one error line, exit 2, and no follower process started."""
    from tiermoe.cli import main

    model = {"CHECKPOINT": str(ep_store.parent / "checkpoint"), "STORE": str(ep_store)}[flags[0]]
    before = set(_children(os.getpid()))
    port = str(free_port())
    assert main(["serve", model, "--device", "cpu", "--tensor-parallel-size", "2", "--port", port, *flags[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tiermoe: error: --tensor-parallel-size "), err
    assert set(_children(os.getpid())) == before


def test_two_ranks_in_fast_mode(ep_store):
    """Fast mode on two ranks: each rank's CPU lane computes some of its own share's misses; the leader's /stats
    shows its lane at work, and greedy requests are served."""
    args = _args(ep_store) + ["--tensor-parallel-size", "2", "--mode", "fast", "--cpu-lane-experts", "2"]
    with CliServer(args, {}) as two:
        assert two.returncode is None, two.stderr
        assert len(_complete(two, PROMPTS[0])) > 0
        experts = httpx.get(two.url + "/stats", timeout=30).json()["engine"]["experts"]
    assert experts["mode"] == "fast" and experts["cpu_lane"]["experts"] > 0, experts["cpu_lane"]
    assert experts["expert_parallel"]["world"] == 2
