"""How many disk-only experts a prefill reads, by chunk size (`tiermoe plan`'s prefill line).

Why: a prefill chunk of thousands of tokens picks nearly every expert of every layer, and the disk tier reads each
disk-only expert it picks for that chunk; the next chunk reads them again, because RAM, which holds the hot experts
for decode, has no room to keep a whole layer's cold ones. A long prompt's time to first token on a disk tier is
then the chunk count times one chunk's reads (docs/results.md, section 33: an 8k prompt read 98 GB in 2,048-token
chunks), so the chunk size (`--max-num-batched-tokens`) is the lever the plan shows.

Model: each token picks expert e of a layer with probability rate_e (the expected picks per token, at most 1), each
token independently, so a chunk of T tokens picks it at least once with probability 1 - (1 - rate_e)^T. Placement is
static by popularity, as the plan's tiers: the coldest keys after the slots and host RAM are the disk-only ones.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

from tiermoe.config import default_batched_tokens
from tiermoe.store.floor import Bandwidths
from tiermoe.store.slot_split import static_tiers


def disk_reads_per_chunk(rates: Mapping[Hashable, float], n_slots: int, n_host: int, chunk_tokens: int,
                         weight: Mapping[Hashable, float] | None = None) -> float:
    """Expected disk-only experts one chunk of `chunk_tokens` tokens picks (each read once for that chunk); with
    `weight` each counts at its weight (a mixed store: its record's bytes)."""
    w = weight or {}
    return sum(w.get(k, 1.0) * (1.0 - (1.0 - min(1.0, max(0.0, rates[k]))) ** chunk_tokens)
               for k in static_tiers(rates, n_slots, n_host)["disk"])


def prompt_disk_reads(rates: Mapping[Hashable, float], n_slots: int, n_host: int, prompt_tokens: int,
                      chunk_tokens: int, weight: Mapping[Hashable, float] | None = None) -> float:
    """Expected disk reads of a prompt of `prompt_tokens` prefilled in chunks of `chunk_tokens` (the last one
    shorter); `weight` as disk_reads_per_chunk's."""
    chunk = max(1, min(chunk_tokens, prompt_tokens))
    full, rest = divmod(prompt_tokens, chunk)
    reads = full * disk_reads_per_chunk(rates, n_slots, n_host, chunk, weight)
    return reads + (disk_reads_per_chunk(rates, n_slots, n_host, rest, weight) if rest else 0.0)


def prefill_note(rates: Mapping[Hashable, float], n_slots: int, n_host: int, record_bytes: int | Mapping[Hashable, int],
                 disk_gbs: float, chunk_tokens: int, prompt_tokens: int = 8192) -> str:
    """One line for the plan: a `prompt_tokens` prompt's disk reads in chunks of `chunk_tokens` (serve's default),
    and in one chunk, with the seconds they take at `disk_gbs`. record_bytes: every record's, or each key's own
    (a mixed store's hot and cold records differ)."""
    lengths = record_bytes if isinstance(record_bytes, Mapping) else None
    parts = []
    for chunk in dict.fromkeys((min(max(1, chunk_tokens), prompt_tokens), prompt_tokens)):
        reads = prompt_disk_reads(rates, n_slots, n_host, prompt_tokens, chunk)
        nbytes = reads * record_bytes if lengths is None else \
            prompt_disk_reads(rates, n_slots, n_host, prompt_tokens, chunk, lengths)
        gb = nbytes / 1e9
        parts.append(f"{math.ceil(prompt_tokens / chunk)} chunk{'s' if chunk < prompt_tokens else ''} of {chunk:,} "
                     f"tokens read about {reads:,.0f} disk-only experts ({gb:,.{1 if gb >= 10 else 2}f} GB, "
                     f"{gb / disk_gbs:,.{1 if gb >= 10 else 2}f} s at {disk_gbs:.2f} GB/s)")
    return (f"prefill of a {prompt_tokens:,}-token prompt: " + "; ".join(parts)
            + " (each chunk reads every disk-only expert it picks; `--max-num-batched-tokens` sets the chunk)")


def plan_prefill_note(manifest, rates: Mapping[Hashable, float], n_slots: int, n_host: int, disk_gbs: float | None,
                      device: str, ranks: int = 1) -> str:
    """`tiermoe plan`'s note for a store with disk-only experts: serve's chunk on `device`, each record read at its
    own length (a mixed store's differ), the disk at `disk_gbs` (None: the floor model's default); with `ranks` > 1
    the figures are rank 0's share, and every rank reads its own from the disk at the same time."""
    lengths = {r.index: r.length for r in manifest.records} if manifest.mixed else manifest.record_bytes
    gbs = disk_gbs or Bandwidths.disk_gbs
    note = prefill_note(rates, n_slots, n_host, lengths, gbs, default_batched_tokens(device))
    return note if ranks == 1 else f"{note}; this is rank 0's share, and the {ranks} ranks read theirs at once"
