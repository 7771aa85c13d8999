"""What a server did between two /stats snapshots: the expert tiers' counters a decode token, the CPU lane's rate
and the disk tier's rate over its read waits (docs/results.md cites these for the real-routing sweeps).

    python3 scripts/stats_delta.py STATS_BEFORE.json STATS_AFTER.json

The snapshots are what scripts/gpu_real_routing.sh keeps around each sweep (stats-before-TAG.json, stats-TAG.json).
Counters are differences over the sweep, its prefill included: "per_decode_token" divides them by the tokens the
engine decoded, so for counters that prefill moves too (slot and host hits, disk reads, other_reads) it is an
upper bound; `decode_reads` counts decode steps' reads alone. The lane's rate is its weight bytes over its busy
seconds. The disk tier's figure is every byte it read (read-ahead included) over the seconds a request waited
for a read: read-ahead that finished before it was needed adds bytes and no seconds, so this is not the disk's
rate (`tiermoe plan` and `tiermoe doctor` measure that). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

COUNTERS = ("slots.hits", "slots.misses", "host.hits", "disk.reads", "cpu_lane.experts", "cpu_lane.disk_experts",
            "device_cache.disk_tier.decode_reads", "device_cache.disk_tier.other_reads",
            "device_cache.disk_tier.prefetch_issued", "device_cache.disk_tier.prefetch_used",
            "device_cache.disk_tier.prefetch_wasted", "device_cache.disk_tier.prefetch_failed",
            "device_cache.disk_tier.reclaimed", "device_cache.disk_tier.requests")


def flatten(tree: object, prefix: str = "") -> dict[str, float]:
    """Nested /stats JSON -> {"a.b.c": number} for every numeric leaf (booleans left out)."""
    out: dict[str, float] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out[prefix] = tree
    return out


def rate(delta: dict[str, float], bytes_key: str, seconds_key: str) -> float | None:
    """GB/s of bytes_key over seconds_key in the window, None when the part did not run."""
    seconds = delta.get(seconds_key, 0.0)
    return round(delta[bytes_key] / seconds / 1e9, 2) if seconds > 0 else None


def summarize(before: dict, after: dict) -> dict:
    a, b = flatten(before["engine"]["experts"]), flatten(after["engine"]["experts"])
    delta = {key: value - a.get(key, 0) for key, value in b.items()}
    if delta.get("decode_tokens", 0) < 0:
        raise SystemExit("the counters went down between the snapshots: the server restarted in between")
    tokens = delta["decode_tokens"]
    out: dict = {"decode_tokens": tokens, "decode_steps": delta["decode_steps"]}
    for key in COUNTERS:
        if key in delta:
            out[key] = {"total": delta[key], "per_decode_token": round(delta[key] / tokens, 2) if tokens else None}
    out["cpu_lane_gbs"] = rate(delta, "cpu_lane.weight_bytes", "cpu_lane.busy_s")
    out["cpu_lane_busy_s"] = delta.get("cpu_lane.busy_s")
    disk = "device_cache.disk_tier."
    if disk + "read_s" in delta:
        out["disk_bytes_over_wait_s_gbs"] = rate(delta, disk + "bytes_read", disk + "read_s")
        out["disk_bytes_over_wait_s_gbs_server_life"] = rate(b, disk + "bytes_read", disk + "read_s")
        out["disk_gb_read"] = round(delta[disk + "bytes_read"] / 1e9, 1)
    for key in ("serve_s", "device_wait_s", "posts"):
        if "device_cache.mailbox." + key in delta:
            out["mailbox_" + key] = round(delta["device_cache.mailbox." + key], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args()
    with open(args.before) as f_before, open(args.after) as f_after:
        print(json.dumps(summarize(json.load(f_before), json.load(f_after)), indent=1))


if __name__ == "__main__":
    main()
