"""The physical floor of MoE decode: the fastest a tier plan can possibly go on given hardware.

Every speed figure should be stated against this floor, not only against other systems: a
number at 90 % of the floor is finished work, one at 30 % points at the lane to fix.

Model (C1 decode, one token): routed expert reads per token = top_k x moe_layers, each of
`bytes_per_expert`. Every read is served by one tier:
  gpu   resident in GPU memory            -> bytes / HBM bandwidth
  ram   pinned host RAM, read over PCIe   -> bytes / PCIe bandwidth
  cpu   computed in place by the CPU lane -> bytes / CPU-lane weight bandwidth
  disk  read from the disk store          -> bytes / disk bandwidth, and then over PCIe
The lanes run in parallel, so MoE time per token is at least the slowest lane; when
`host_gbs` is given, PCIe and CPU-lane reads also share the host memory bandwidth (an extra
lane). Decode time per token >= that maximum + the non-MoE work (attention, dense layers,
router, sampling) measured separately.

`balance_host=True` treats the ram and cpu reads as one pool that a planner may split freely
between the PCIe and CPU lanes, and uses the best split (both lanes finish together).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from tiermoe.errors import UserError

TIERS = ("gpu", "ram", "cpu", "disk")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


@dataclass(frozen=True)
class Bandwidths:
    """Sustained bandwidths in GB/s (1e9 bytes/s). Defaults: the H200 benchmark host's measurements."""

    hbm_gbs: float = 4260.0
    pcie_gbs: float = 55.0
    cpu_gbs: float = 51.0  # expert-weight bytes/s the CPU lane computes through
    disk_gbs: float = 1.6
    host_gbs: float | None = None  # shared host-RAM read bandwidth (None: not a separate limit)


def parse_bytes(text: str | float | int) -> float:
    """'13.4MB' -> 13.4e6, '9MiB' -> 9437184, '13400000' -> 13400000."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"--bytes-per-expert: cannot read {text!r} (use e.g. 13.4MB, 9MiB or a byte count)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_tier_map(text: str, name: str) -> dict[str, float]:
    """'gpu=120,ram=175,disk=23' -> {'gpu': 120.0, 'ram': 175.0, 'disk': 23.0}."""
    out: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in TIERS:
            raise UserError(f"{name}: expected tier=value with tier in {', '.join(TIERS)}, got {part!r}")
        try:
            out[key] = float(value)
        except ValueError as exc:
            raise UserError(f"{name}: {value!r} is not a number") from exc
        if out[key] < 0:
            raise UserError(f"{name}: {key} must be >= 0")
    if not out:
        raise UserError(f"{name}: empty")
    return out


def decode_floor(
    bytes_per_expert: float,
    top_k: int,
    moe_layers: int,
    *,
    hits: dict[str, float] | None = None,
    fractions: dict[str, float] | None = None,
    bandwidths: Bandwidths = Bandwidths(),
    non_moe_ms: float = 0.0,
    balance_host: bool = False,
) -> dict:
    """Decode floor in ms/token and tok/s for a tier plan (see the module docstring).

    Give either `hits` (expert reads per token per tier) or `fractions` (share of the
    top_k x moe_layers reads per tier). Returns a JSON-able dict: per-lane bytes and ms, the
    bounding lane, moe_ms, floor_ms, tok_s.
    """
    if (hits is None) == (fractions is None):
        raise UserError("give exactly one of hits per tier or fractions per tier")
    if bytes_per_expert <= 0 or top_k <= 0 or moe_layers <= 0:
        raise UserError("bytes per expert, top-k and MoE layers must be positive")
    for name in ("hbm_gbs", "pcie_gbs", "cpu_gbs", "disk_gbs"):
        if getattr(bandwidths, name) <= 0:
            raise UserError(f"bandwidth {name} must be positive")
    picks = top_k * moe_layers
    if fractions is not None:
        total = sum(fractions.values())
        if total > 1.0 + 1e-6:
            raise UserError(f"tier fractions add up to {total:.3f} > 1")
        hits = {t: f * picks for t, f in fractions.items()}
    assert hits is not None
    unknown = set(hits) - set(TIERS)
    if unknown:
        raise UserError(f"unknown tier(s) {sorted(unknown)}; tiers are {', '.join(TIERS)}")
    reads = {t: float(hits.get(t, 0.0)) for t in TIERS}
    nbytes = {t: reads[t] * bytes_per_expert for t in TIERS}
    bw = bandwidths
    split = None
    pcie_b, cpu_b = nbytes["ram"] + nbytes["disk"], nbytes["cpu"]
    if balance_host:
        pool = nbytes["ram"] + nbytes["cpu"]
        # (x + disk) / pcie == (pool - x) / cpu  ->  x bytes over PCIe, the rest on the CPU lane
        x = (pool * bw.pcie_gbs - nbytes["disk"] * bw.cpu_gbs) / (bw.pcie_gbs + bw.cpu_gbs)
        x = min(max(x, 0.0), pool)
        pcie_b, cpu_b = x + nbytes["disk"], pool - x
        split = {"pcie_share_of_host_reads": x / pool if pool else None}
    lanes = {
        "hbm": (nbytes["gpu"], bw.hbm_gbs),
        "pcie": (pcie_b, bw.pcie_gbs),
        "cpu": (cpu_b, bw.cpu_gbs),
        "disk": (nbytes["disk"], bw.disk_gbs),
    }
    if bw.host_gbs:
        lanes["host"] = (nbytes["ram"] + nbytes["cpu"] + nbytes["disk"], bw.host_gbs)
    lane_ms = {k: {"bytes_per_token": b, "gbs": g, "ms": b / (g * 1e9) * 1e3} for k, (b, g) in lanes.items()}
    bound = max(lane_ms, key=lambda k: lane_ms[k]["ms"])
    moe_ms = lane_ms[bound]["ms"]
    floor_ms = moe_ms + non_moe_ms
    return {
        "bytes_per_expert": bytes_per_expert,
        "top_k": top_k,
        "moe_layers": moe_layers,
        "picks_per_token": picks,
        "reads_per_token": reads,
        "reads_total": sum(reads.values()),
        "routed_bytes_per_token": picks * bytes_per_expert,
        "bandwidths_gbs": asdict(bw),
        "balance_host": balance_host,
        "host_split": split,
        "lanes": lane_ms,
        "bound": bound,
        "moe_ms": moe_ms,
        "non_moe_ms": non_moe_ms,
        "floor_ms": floor_ms,
        "tok_s": 1e3 / floor_ms if floor_ms > 0 else float("inf"),
    }


def fraction_of_floor(measured_tok_s: float, floor: dict) -> float:
    """A measured decode rate as a share of the floor's tok/s (1.0 = at the floor)."""
    return measured_tok_s / floor["tok_s"]


def table_lines(floor: dict) -> list[str]:
    lines = ["lane   bytes/token        GB/s      ms/token", "-----  -----------  ----------  ---------"]
    for name, lane in floor["lanes"].items():
        mark = "  <- bound" if name == floor["bound"] else ""
        gb = lane["bytes_per_token"] / 1e9
        lines.append(f"{name:<5}  {gb:>8.3f} GB  {lane['gbs']:>10.1f}  {lane['ms']:>9.2f}{mark}")
    lines.append(
        f"MoE {floor['moe_ms']:.2f} ms + non-MoE {floor['non_moe_ms']:.2f} ms = floor {floor['floor_ms']:.2f} ms/token"
        f" = {floor['tok_s']:.1f} tok/s"
    )
    return lines
