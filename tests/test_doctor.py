"""`tiermoe doctor`: every section is reported, the plan follows from the checks, JSON is valid."""

from __future__ import annotations

import json

import pytest

from tiermoe import doctor
from tiermoe.cli import main

SECTIONS = ("GPU", "Memory", "CPU", "Disk", "Plan")


def test_doctor_text_has_every_section(capsys, tmp_path):
    assert main(["doctor", "--dir", str(tmp_path), "--disk-mib", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in SECTIONS:
        assert name in lines, f"missing section {name}:\n{out}"
    assert "memlock limit" in out and "features: " in out and "avx2" in out
    assert "MiB/s" in out  # the disk read test ran
    plan = out.split("\nPlan\n", 1)[1]
    assert plan.strip().startswith("- ")
    assert not list(tmp_path.iterdir())  # the disk test cleans up


def test_doctor_json(capsys, tmp_path):
    assert main(["doctor", "--json", "--dir", str(tmp_path), "--disk-mib", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"gpu", "memory", "cpu", "disk", "plan"}
    mem, disk = report["memory"], report["disk"]
    assert mem["total_bytes"] > 0 and 0 < mem["usable_bytes"] <= mem["available_bytes"]
    assert report["cpu"]["usable_cores"] >= 1 and set(report["cpu"]["flags"]) == set(doctor.CPU_FLAGS)
    assert disk["ok"] and disk["read_mib_s"] > 0 and disk["test_bytes"] == 4 << 20
    assert isinstance(disk["o_direct"], bool)
    decisions = report["plan"]["decisions"]
    assert all(d["what"] and d["why"] for d in decisions)
    engine = decisions[0]["what"]
    if report["gpu"]["available"]:
        assert engine.startswith("GPU engine")
    else:
        assert engine == "CPU engine; experts resident in RAM" and decisions[0]["why"].startswith("no GPU")


def _fake(gpu: bool, *, o_direct: bool = True, speed: float = 2000.0, memlock: int | None = 8 << 20, limit=None) -> dict:
    gib = 1 << 30
    return {
        "gpu": {"available": gpu, "reason": "no NVIDIA GPU found", "devices": [
            {"index": 0, "name": "NVIDIA H200", "capability": "9.0", "vram_total_bytes": 140 * gib, "vram_free_bytes": 139 * gib}
        ] if gpu else []},
        "memory": {"total_bytes": 64 * gib, "available_bytes": 60 * gib, "cgroup_limit_bytes": limit,
                   "usable_bytes": min(60 * gib, limit or 60 * gib), "memlock_soft_bytes": memlock, "memlock_hard_bytes": memlock},
        "cpu": {"model": "x", "cores": 16, "cgroup_cpu_quota": None, "usable_cores": 16,
                "flags": {f: f in ("avx2", "fma") for f in doctor.CPU_FLAGS}},
        "disk": {"ok": True, "path": "/c", "fstype": "ext4", "o_direct": o_direct, "read_mib_s": speed,
                 "o_direct_reason": "supported" if o_direct else "open(O_DIRECT) refused: EINVAL"},
    }


def test_plan_follows_the_hardware():
    gpu = doctor.plan(_fake(True, limit=8 << 30))
    assert gpu["decisions"][0]["what"] == "GPU engine on NVIDIA H200"
    assert "cgroup limit" in gpu["decisions"][1]["why"]
    assert any("memlock" in w for w in gpu["warnings"])
    assert any("CPU lane" in d["what"] and "upcasts bf16" in d["what"] for d in gpu["decisions"])

    cpu = doctor.plan(_fake(False, o_direct=False, speed=50.0, memlock=None))
    assert cpu["decisions"][0]["what"] == "CPU engine; experts resident in RAM"
    assert any("page cache" in d["what"] and "EINVAL" in d["why"] for d in cpu["decisions"])
    assert any("50 MiB/s" in w for w in cpu["warnings"]) and not any("memlock" in w for w in cpu["warnings"])


def test_cgroup_limit_is_read(monkeypatch, tmp_path):
    f = tmp_path / "memory.max"
    f.write_text("1073741824\n")
    monkeypatch.setattr(doctor, "_cgroup_paths", lambda *a: [f])
    assert doctor.cgroup_memory_limit() == 1 << 30
    f.write_text("max\n")
    assert doctor.cgroup_memory_limit() is None
    f.write_text("9223372036854771712\n")  # cgroup v1 "unlimited"
    assert doctor.cgroup_memory_limit() is None


def test_bad_disk_size_is_a_user_error(capsys):
    assert main(["doctor", "--disk-mib", "-1"]) == 2
    assert "--disk-mib" in capsys.readouterr().err


@pytest.mark.parametrize("mib", [0])
def test_disk_check_can_be_skipped(capsys, mib):
    assert main(["doctor", "--json", "--disk-mib", str(mib)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["disk"]["ok"] is False and "skipped" in report["disk"]["reason"]
    assert any(d["what"] == "no disk tier" for d in report["plan"]["decisions"])


def test_doctor_prints_a_stores_tier_plan(capsys, tmp_path, tiny_dir):
    """--store: the tiers that store gets here (`tiermoe plan`'s table), in text and in JSON."""
    from tiermoe.store.pack import pack

    store = tmp_path / "store"
    pack(str(tiny_dir("glm4_moe", "bfloat16")), str(store), quant="int4", group_size=32, progress=False,
         log=lambda _: None)
    assert main(["doctor", "--dir", str(tmp_path), "--disk-mib", "0", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    tiers = out.split(f"Tiers for {store}\n", 1)[1]
    assert "tier plan: 16 experts" in tiers and "host RAM" in tiers and "decode upper bound" in tiers
    assert main(["doctor", "--json", "--disk-mib", "0", "--store", str(store)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["store_plan"]["store"] == str(store) and "tier plan" in report["store_plan"]["table"]
    assert main(["doctor", "--disk-mib", "0", "--store", str(tmp_path / "nothing")]) == 2
    assert "neither a packed store" in capsys.readouterr().err


def test_each_gpus_pcie_link_and_numa_node_are_read_from_sysfs(tmp_path):
    """The PCIe link and NUMA node of a GPU's PCI address (sysfs files as Linux writes them), shown per GPU; with
    several GPUs the plan names --tensor-parallel-size. Unreadable values are None, never an error."""
    dev = tmp_path / "0000:1b:00.0"
    dev.mkdir()
    for name, text in (("numa_node", "1\n"), ("current_link_speed", "16.0 GT/s PCIe\n"), ("current_link_width", "8\n"),
                       ("max_link_speed", "32.0 GT/s PCIe\n"), ("max_link_width", "16\n")):
        (dev / name).write_text(text)
    link = doctor.pci_link("0000:1b:00.0", tmp_path)
    assert link == {"pci": "0000:1b:00.0", "numa_node": 1, "link": "16.0 GT/s x8", "link_max": "32.0 GT/s x16"}
    assert doctor.pci_link("0000:99:00.0", tmp_path) == {"pci": "0000:99:00.0", "numa_node": None, "link": None,
                                                         "link_max": None}
    (dev / "numa_node").write_text("-1\n")  # a single-node machine
    assert doctor.pci_link("0000:1b:00.0", tmp_path)["numa_node"] is None
    assert doctor.pci_link(None)["link"] is None

    report = _fake(True)
    report["disk"] = {"ok": False, "reason": "skipped (--disk-mib 0)"}
    report["gpu"]["devices"][0].update(link)
    report["gpu"]["devices"].append({**report["gpu"]["devices"][0], "index": 1, "numa_node": 0})
    report["plan"] = doctor.plan(report)
    text = doctor.render(report)
    assert "cuda:0 NVIDIA H200 (sm 9.0): 139.0 GiB free of 140.0 GiB; PCIe link 16.0 GT/s x8 (max 32.0 GT/s x16), " \
           "NUMA node 1" in text and "cuda:1" in text
    assert any("--tensor-parallel-size 2" in d["what"] and "NUMA nodes 0, 1" in d["why"]
               for d in report["plan"]["decisions"])
