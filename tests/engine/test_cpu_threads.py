"""`--cpu-threads N`: torch's intra-op threads for the engine, and the total the CPU lane's
default takes its share of (each case in its own process: the setting is process state)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tiermoe.store.pack import pack


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_serve_builds_its_engine_with_the_threads_asked_for(tiny_dir):
    r = _python(f"""
        import argparse, torch
        from tiermoe.server.cli import build_core, register
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["serve", {str(tiny_dir("qwen3_moe"))!r}, "--device", "cpu", "--cpu-threads", "1"])
        build_core(args)
        print(torch.get_num_threads())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "1"


def test_serve_on_a_cpu_leaves_one_core_to_the_server_when_not_told(tiny_dir):
    """Unset, `serve` on a CPU device takes one thread less than torch's count (at least one): the
    event loop and the clients need a core, else every OpenMP barrier waits for a preempted thread."""
    r = _python(f"""
        import argparse, torch
        from tiermoe.server.cli import build_core, register
        torch.set_num_threads(3)
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["serve", {str(tiny_dir("qwen3_moe"))!r}, "--device", "cpu"])
        build_core(args)
        print(torch.get_num_threads())
        from tiermoe.engine.threads import serving_threads
        print(serving_threads(None, "cuda"), serving_threads(4, "cpu"))
        torch.set_num_threads(1)
        print(serving_threads(None, "cpu"))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-4:] == ["2", "None", "4", "1"]


def test_the_cpu_lane_takes_its_share_of_them(tiny_dir, tmp_path):
    store = tmp_path / "st"
    pack(tiny_dir("qwen3_moe"), store, progress=False, log=lambda _: None)
    r = _python(f"""
        from tiermoe.engine.build import engine_config
        from tiermoe.engine.threads import use_cpu_threads
        use_cpu_threads(6)
        print(engine_config({str(store)!r}, device="cpu", options={{"mode": "fast"}}).experts.lane.threads)
        print(engine_config({str(store)!r}, device="cpu", options={{"mode": "fast", "cpu_lane_threads": 5}})
              .experts.lane.threads)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["3", "5"]  # half of them on a CPU device; --cpu-lane-threads still wins


def test_generate_refuses_zero_threads_in_one_line(tiny_dir):
    r = subprocess.run([sys.executable, "-m", "tiermoe.cli", "generate", "--model", str(tiny_dir("qwen3_moe")),
                        "--prompt", "hi", "--cpu-threads", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "tiermoe: error: --cpu-threads 0: must be at least 1"
