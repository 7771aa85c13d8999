"""The expert seam and the typed configuration: one declared interface, backends chosen by name,
no probing of the backend by the runner or the engine, every "auto" settled once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiermoe
from tiermoe.config import EngineArgs, LaneConfig
from tiermoe.errors import UserError
from tiermoe.moe.experts import ExpertBackend, ResidentExperts, combine_experts

SRC = Path(tiermoe.__file__).parent


def _sources(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((SRC / pkg).glob("*.py"))]


def test_runner_and_engine_never_probe_the_expert_backend():
    """Every method the runner and the engine call is declared by ExpertBackend: no getattr or
    hasattr on the backend (or on the model for its backend) anywhere in runner/ or engine/."""
    methods = {name for name, _ in inspect.getmembers(ExpertBackend, inspect.isfunction)}
    names = methods | {"expert_backend", "experts", "device_cache", "device_lane", "lane", "store"}
    offending = []
    for path in _sources("runner", "engine"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            target, attr = ast.unparse(node.args[0]), node.args[1]
            named = isinstance(attr, ast.Constant) and attr.value in names
            if named or "expert" in target:
                offending.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert not offending, "\n".join(offending)
    lines = [line for p in _sources("runner", "engine") for line in p.read_text().splitlines()
             if not line.lstrip().startswith(("from ", "import "))]
    assert not [line for line in lines if re.search(r"(backend|experts)\.device_cache\b", line)]


def test_every_backend_states_the_whole_interface():
    from tiermoe.moe.device_cache import DeviceCacheExperts
    from tiermoe.moe.lane import LaneExperts
    from tiermoe.moe.store_backends import StoreTorchExperts, StoreTritonExperts

    abstract = ExpertBackend.__abstractmethods__
    assert {"forward", "begin_step", "end_step", "graph_key", "graph_safe", "graph_recorded", "graph_replayed",
            "counters", "close", "attach", "save_decisions", "restore_decisions", "graph_unsupported"} <= abstract
    for cls in (ResidentExperts, StoreTorchExperts, StoreTritonExperts, DeviceCacheExperts, LaneExperts):
        assert issubclass(cls, ExpertBackend) and not inspect.isabstract(cls), cls
    with pytest.raises(TypeError):
        ExpertBackend()  # an interface, not a backend
    resident = ResidentExperts()  # the oracle: trivial answers
    assert resident.graph_unsupported() and not resident.graph_safe() and resident.counters() is None
    assert resident.save_decisions() is None


def test_backends_are_chosen_by_name_from_the_registry():
    from tiermoe.moe.backends import EXPERT_BACKENDS

    assert EXPERT_BACKENDS.names() == ("store-torch", "store-triton", "device-cache")
    with pytest.raises(UserError, match="expert backend 'store-magic': choose one of store-torch"):
        EXPERT_BACKENDS["store-magic"]


def test_combine_experts_skip_leaves_experts_out_without_fetching_them():
    g = torch.Generator().manual_seed(0)
    experts = {e: (torch.randn(8, 4, generator=g), torch.randn(4, 4, generator=g)) for e in range(6)}
    x = torch.randn(5, 4, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5)])  # [T, 2]
    w = torch.rand(5, 2, generator=g)
    fetched = []

    def weights_of(expert_ids):
        fetched.extend(expert_ids)
        return {e: experts[e] for e in expert_ids}

    skip = {int(ids[0, 0]), int(ids[3, 1])}
    part = combine_experts(x, ids, w, weights_of, skip=skip)
    assert not skip & set(fetched)
    zeroed = combine_experts(x, ids, w.masked_fill(torch.isin(ids, torch.tensor(sorted(skip))), 0), weights_of)
    assert torch.equal(part, zeroed)  # the same arithmetic for every other expert, in the same order
    everything = set(torch.unique(ids).tolist())
    assert torch.equal(combine_experts(x, ids, w, weights_of, skip=everything), torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resident_partial_is_its_result_widened(dtype):
    """forward(partial=True) is fp32 and rounds back to the partial=False result bit for bit. combine_experts
    rounds every expert's add to x's dtype, so the resident (and the torch store path's) partial is that
    result widened exactly: no unrounded sum to keep."""
    g = torch.Generator().manual_seed(2)
    resident = ResidentExperts()
    resident.add_layer(1, torch.randn(6, 8, 4, generator=g).to(dtype), torch.randn(6, 4, 4, generator=g).to(dtype))
    x = torch.randn(5, 4, generator=g).to(dtype)  # [T, H]
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(5)])  # [T, 3]
    w = torch.rand(5, 3, generator=g)  # [T, 3]
    out, part = resident.forward(1, x, ids, w), resident.forward(1, x, ids, w, partial=True)  # [T, H]
    assert out.dtype == dtype and part.dtype == torch.float32
    assert torch.equal(part.to(dtype), out) and torch.equal(part, out.float())


def test_engine_args_take_the_namespace_and_explicit_values_win():
    import argparse

    ns = argparse.Namespace(model="m", device="cuda", max_num_seqs=3, cpu_lane_experts=None, host="0.0.0.0",
                            port=8000, mode="fast")
    args = EngineArgs.from_options(ns, device=None, max_num_seqs=5)
    assert args.model == "m" and args.device is None and args.max_num_seqs == 5 and args.mode == "fast"
    assert args.cpu_lane_experts == EngineArgs().cpu_lane_experts  # None: the one default
    with pytest.raises(TypeError, match="not engine flags: colour"):
        EngineArgs.from_options({}, colour="red")
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.mode = "exact"


def test_flags_take_their_defaults_from_engine_args():
    import argparse

    from tiermoe.engine.build import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args([])
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        if hasattr(ns, f.name) and getattr(ns, f.name) is not None:
            assert getattr(ns, f.name) == getattr(defaults, f.name), f.name


def test_settle_config_decides_every_auto_once(tiny_dir, tmp_path_factory):
    from testkit.stores import pack_tiny

    from tiermoe.engine.build import engine_config

    cfg = engine_config(str(tiny_dir("glm4_moe")), device="cpu", options={})
    assert cfg.experts is None and cfg.device == "cpu" and cfg.dtype == torch.float32
    assert cfg.max_batched_tokens == 512 and cfg.decode_attention == "sdpa" and not cfg.decode_graphs
    assert cfg.max_model_len > 0 and cfg.routing is None
    _, store = pack_tiny(tiny_dir, tmp_path_factory, "glm4_moe", quant="int4", group_size=32)
    cfg = engine_config(str(store), device="cpu", dtype="bfloat16", options={"mode": "fast", "cpu_lane_threads": 1,
                                                                            "expert_kernel": "torch"})
    experts = cfg.experts
    assert experts.backend == "store-torch" and experts.mode == "fast" and experts.device_cache is None
    assert experts.lane == LaneConfig(max_experts=4, max_tokens=16, threads=1, workers=1, disk=True,
                                      device="cpu")  # the lane computes disk-only experts too (no repack)
    assert experts.store.policy == "lfu" and experts.store.direct_io and experts.store.dtype == torch.bfloat16
    with pytest.raises(UserError, match="--cpu-lane-"):
        engine_config(str(store), device="cpu", options={"cpu_lane_workers": -1})
    with pytest.raises(UserError, match="--decode-attention 'flash'"):
        engine_config(str(store), device="cpu", options={"decode_attention": "flash"})


def test_kernel_packages_do_not_set_the_triton_interpreter():
    """TRITON_INTERPRET is the user's switch (tiermoe/env.py): importing the kernels leaves it
    alone; an entry point that wants the interpreter asks for it explicitly."""
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import tiermoe.kernels.triton, tiermoe.moe.backends, tiermoe.engine.build\n"
            "print(os.environ.get('TRITON_INTERPRET'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_no_untyped_options_in_the_expert_backends():
    for path in _sources("moe") + [SRC / "engine" / "build.py", SRC / "engine" / "settle.py"]:
        text = path.read_text()
        assert "options.get(" not in text and "options[" not in text, path
        assert "os.environ" not in text, path  # environment variables are read in tiermoe/env.py
