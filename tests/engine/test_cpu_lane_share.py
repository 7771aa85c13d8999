"""`--cpu-lane-share auto|SHARE`: the CPU lane's share of each layer's misses beside a GPU, fixed
instead of measured by the cost model at start-up (moe/lane_cost.py). On CI (no GPU) the CUDA
branch of LaneExperts.set_mode is reached through a lane configured for "cuda" over a CPU store:
the branch reads only the lane's configuration, and measure() is replaced so that it cannot run."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from testkit.stores import pack_tiny

from tiermoe.cli import build_parser
from tiermoe.config import lane_share
from tiermoe.errors import UserError


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    # fp32 checkpoint: 2 MoE layers x 8 experts, top-2; int4 records the lane's kernel reads
    return pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", quant="int4", group_size=32)[1]


@pytest.fixture
def no_measurement(monkeypatch):
    from tiermoe.moe import lane_cost

    def measure(*_, **__):
        raise AssertionError("the cost model measured although a share was given")

    monkeypatch.setattr(lane_cost, "measure", measure)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["serve", "m"]])
def test_the_flag_parses_auto_and_a_share(argv):
    parser = build_parser()
    assert parser.parse_args(argv).cpu_lane_share is None  # the default: auto
    assert parser.parse_args([*argv, "--cpu-lane-share", "auto"]).cpu_lane_share is None
    assert parser.parse_args([*argv, "--cpu-lane-share", "0.5"]).cpu_lane_share == 0.5
    assert parser.parse_args([*argv, "--cpu-lane-share", "1"]).cpu_lane_share == 1.0


@pytest.mark.parametrize("value", [-0.1, 1.5, "half", "nan", "inf", "", [0.5]])
def test_one_check_refuses_what_is_not_a_share(value):
    with pytest.raises(ValueError, match=r"is not auto or a number from 0 to 1$"):
        lane_share(value)
    assert lane_share(0) == 0.0 and lane_share("AUTO") is None and lane_share(None) is None


@pytest.mark.parametrize("value", ["-0.1", "1.5", "half"])
def test_generate_refuses_a_bad_share_in_one_line_and_exit_2(tiny_dir, value):
    r = subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(tiny_dir("qwen3_moe")),
                        "--prompt", "hi", "--cpu-lane-share", value], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    usage, error = r.stderr.splitlines()  # refused while parsing: the short usage line, then the one error line
    assert usage.startswith("usage: tiermoe generate")
    assert error == (f"tiermoe generate: error: argument --cpu-lane-share: {value!r} is not auto or a number from "
                     "0 to 1 (see `tiermoe generate --help`)")


def test_options_settle_the_share_into_the_lane_config(store):
    from tiermoe.engine.build import engine_config

    def lane(**options):
        return engine_config(str(store), device="cpu", options={"mode": "fast", **options}).experts.lane

    assert lane().share is None and lane(cpu_lane_share="auto").share is None
    assert lane(cpu_lane_share=0.5).share == 0.5 and lane(cpu_lane_share="0.25").share == 0.25
    with pytest.raises(UserError, match=r"^--cpu-lane-share: 2\.0 is not auto or a number from 0 to 1$"):
        lane(cpu_lane_share=2.0)


def test_on_a_cpu_device_the_lane_keeps_its_fixed_count(store, no_measurement):
    """The cost model does not run on a CPU device, and a given share does not cut the count."""
    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.paired_kl import decode_logits, prompt_ids

    eng = build_engine_core(str(store), device="cpu", dtype="bfloat16", max_num_seqs=1,
                            options={"mode": "fast", "cpu_lane_share": 0.5, "cpu_lane_threads": 1})
    be = eng.model.expert_backend
    try:
        decode_logits(eng, prompt_ids(eng.tokenizer, ["Hello there"])[0], 4)
        lane = be.counters()["cpu_lane"]
    finally:
        be.close()
    assert be.bandwidths is None and lane["share"] is None and "bandwidths" not in lane
    # every pick of the 2 MoE layers (top-2) misses the empty CPU slot tier, and the lane takes all 4
    assert lane["per_decode_token"] == pytest.approx(4.0)


def _lane_beside_a_gpu(store, **options):
    """The store backend on the CPU with the lane configured as beside a GPU (module doc)."""
    from tiermoe.engine.build import engine_config
    from tiermoe.moe.backends import open_expert_backend

    experts = engine_config(str(store), device="cpu", options={"mode": "fast", "cpu_lane_threads": 1,
                                                               **options}).experts
    return open_expert_backend(replace(experts, lane=replace(experts.lane, device="cuda")))


def test_beside_a_gpu_a_given_share_replaces_the_measurement(store, no_measurement):
    be = _lane_beside_a_gpu(store, cpu_lane_share=0.25)
    try:
        lane = be.counters()["cpu_lane"]
        assert be.bandwidths is None and "bandwidths" not in lane
        assert be.lane.share == lane["share"] == 0.25  # what CpuLane.assign splits by, and what /stats shows
    finally:
        be.close()


def test_beside_a_gpu_auto_measures_the_share(store, monkeypatch):
    from tiermoe.moe import lane_cost

    measured = lane_cost.LaneBandwidths(pcie_gbs=8, host_gbs=40, lane_gbs=4, pcie_shared_gbs=6, lane_shared_gbs=2)
    monkeypatch.setattr(lane_cost, "measure", lambda lane, device: measured)
    be = _lane_beside_a_gpu(store)
    try:
        lane = be.counters()["cpu_lane"]
        assert be.bandwidths == measured and lane["bandwidths"]["share"] == 0.25
        assert be.lane.share == lane["share"] == 0.25
    finally:
        be.close()


def test_service_share_moves_halfway_to_the_rate_in_service():
    from tiermoe.moe.lane_cost import ServiceShare

    tuner = ServiceShare(pcie_gbs=50.0, share=0.5, window_bytes=10**9)
    assert tuner.update(busy_s=0.01, weight_bytes=10**9 - 1) is None  # the window is not full yet
    # 2 GB in 0.1 s: 20 GB/s in service -> target 20 / 70; halfway from 0.5
    assert tuner.update(busy_s=0.1, weight_bytes=2 * 10**9) == pytest.approx(0.5 + (20 / 70 - 0.5) / 2)
    assert tuner.service_gbs == pytest.approx(20.0) and tuner.updates == 1
    share = tuner.share
    # the next window at 20 GB/s as well moves it on; once within min_step of the target it stays
    while (new := tuner.update(busy_s=tuner._busy_s + 0.1, weight_bytes=tuner._bytes + 2 * 10**9)) is not None:
        assert abs(new - 20 / 70) < abs(share - 20 / 70)
        share = new
    assert abs(tuner.share - 20 / 70) < 2 * tuner.min_step
    assert tuner.as_dict()["service_gbs"] == pytest.approx(20.0)


def test_service_share_balances_the_two_sides_times():
    """With both sides' times (the device mailbox's balance: the lane's seconds answering, the device's
    seconds on its own part), the share moves toward s / (s + (1 - s) rho), rho = lane / device: a lane
    that takes longer gets fewer experts, one that takes less gets more, and equal times keep it."""
    from tiermoe.moe.lane_cost import ServiceShare

    gb = 10**9
    tuner = ServiceShare(pcie_gbs=50.0, share=0.5, window_bytes=gb)
    # the lane took 3 s where the device took 2 s of its own work: rho 1.5 -> target 0.5 / (0.5 + 0.75) = 0.4
    assert tuner.update(1.0, 2 * gb, balance=lambda: (3.0, 2.0)) == pytest.approx(0.5 + (0.4 - 0.5) / 2)
    assert tuner.rho == pytest.approx(1.5) and tuner.as_dict()["rho"] == pytest.approx(1.5)
    # windows are deltas: 1 s of lane against 2 s of device -> rho 0.5, the lane gets more
    before = tuner.share
    after = tuner.update(2.0, 4 * gb, balance=lambda: (4.0, 4.0))
    s = before
    assert after == pytest.approx(s + (s / (s + (1 - s) * 0.5) - s) / 2) and after > before
    # equal times: the target is the share in force, so nothing is written
    assert tuner.update(3.0, 6 * gb, balance=lambda: (5.0, 5.0)) is None
    # a share at 0 is not stuck there: a lane with time to spare gets experts again
    low = ServiceShare(pcie_gbs=50.0, share=0.0, window_bytes=gb)
    assert low.update(1.0, 2 * gb, balance=lambda: (0.1, 1.0)) > 0.05
    # and a slow lane keeps the floor, so its windows keep closing and it is measured again
    slow = ServiceShare(pcie_gbs=50.0, share=0.12, window_bytes=gb)
    assert slow.update(1.0, 2 * gb, balance=lambda: (10.0, 1.0)) == slow.floor == 0.1


def test_beside_a_gpu_the_measured_share_follows_the_lane_in_service(store, monkeypatch):
    """A decode step whose lane work fills the window moves the share toward lane / (pcie + lane)
    at the rate the lane reached (the tiny records' rate is far under the start-up figure's)."""
    import torch

    from tiermoe.moe import lane_cost

    measured = lane_cost.LaneBandwidths(pcie_gbs=8, host_gbs=40, lane_gbs=20, pcie_shared_gbs=6, lane_shared_gbs=18)
    monkeypatch.setattr(lane_cost, "measure", lambda lane, device: measured)
    be = _lane_beside_a_gpu(store)
    try:
        assert be.lane.share == 0.75 and be.service.share == 0.75
        be.service.window_bytes = 1
        layer = be.store.manifest.moe_layers[0]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, be.store.layout.hidden, generator=g).to(torch.bfloat16)  # [1, H]
        ids, w = torch.tensor([[1, 5]]), torch.tensor([[0.6, 0.4]])  # [1, k] picks and weights
        be.begin_step(tokens=1, decode=True)
        be.forward(layer, x, ids, w)
        be.end_step()
        service = be.counters()["cpu_lane"]["service"]
        lane_gbs = service["service_gbs"]
        assert service["updates"] == 1 and lane_gbs > 0
        assert be.lane.share == service["share"] == pytest.approx(0.75 + (lane_gbs / (6 + lane_gbs) - 0.75) / 2)
    finally:
        be.close()


def test_a_given_share_is_not_tuned_in_service(store, no_measurement):
    be = _lane_beside_a_gpu(store, cpu_lane_share=0.25)
    try:
        assert be.service is None and "service" not in be.counters()["cpu_lane"]
    finally:
        be.close()
