"""Routing replay and recording: the MoE layers' picks taken from a file, or written to one.

A benchmarking option. Random-weight models route almost the same experts for every token, so
their tiered speed says nothing about a real model's; `--routing-replay FILE` makes every
(trunk) MoE layer use picks from FILE instead of its router's top-k. The router still runs (its
cost stays in the step); the combine weights are the ones it gives the replayed ids (see
Router.forward). Without the flag nothing here exists: each layer's `routing` is None and the
model runs its own routing, unchanged.

FILE is either
- per-layer pick counts (JSON, the `--expert-stats` format, store/planner.load_stats): each
  layer gets a table of TABLE_TOKENS tokens whose top-k distinct experts are drawn
  independently, seeded (`--routing-replay-seed`), with probability proportional to count +
  SMOOTHING (store/sim.sample_trace's Gumbel-top-k draw). A layer must list at least top-k
  experts with a nonzero count: with fewer the file cannot describe this model's top-k
  routing, and the smoothing alone would make up the remaining picks, so it is refused.
- a routing trace (store/routing_trace.py, written by `--record-routing`): every token in the
  recorded order (prefill and decode), so its temporal locality is kept, wrapping around at the
  end. Its expert count and top-k must be the model's. The seed plays no part.

Layers: a counts file that lists every one of the model's MoE layers by number (the model's own
statistics, e.g. `--expert-stats` of the same model, or a store's expert-stats.json) gives each layer
its own counts, as the tier plan and the device cache's warm start read the same file
(planner.key_rates): matched by position instead, a file with one layer more (glm5_next's MTP layer)
would replay most layers with a neighbour's counts while the slots hold their own layer's favourites.
Otherwise (another model's statistics, a trace) model MoE layer i of n takes file layer
round(i * (m - 1) / max(1, n - 1)) of m (store/planner.spread_layers); a counts file with another
expert count has its popularity curve resampled to the model's (planner.counts_for_model). The MTP
layer of a model that drafts (glm5_next) keeps its own router and is not recorded: only `spec.moe_layers` are.

Device side, no host sync (so decode CUDA graphs capture it; runner/decode_graph.py):
tables [L, N, k] (int16; int32 beyond 32767 experts) and cursors [L] int64 on the model's
device. A forward of T tokens, in layer i: rows = (cursor[i] + arange(T)) % N, ids =
table[i][rows], cursor[i] += T: index ops on tensors the graph keeps, so every replay of a
captured step reads the next rows. One cursor per layer rather than one per step: every trunk
MoE layer runs once per forward with the same T, so the cursors move in lockstep and a token
reads the same trace row in all layers (the trace's pattern across layers is kept), yet no
layer depends on another to advance a shared cursor (no "last layer" bookkeeping, an MTP layer
or a lone layer in a test runs the same code) and layer-ahead prefetch (moe/store_backends.py) can read
the next layer's rows without moving them (`peek`). The price is one scalar add per layer.
Every token a forward computes takes a row: warm-up steps do (the cursors are reset after
warm-up, so a trace starts at its first row), and so would padding rows of a captured batch
(decode graphs are recorded per exact batch size, so there are none).

Recording (`--record-routing`, moe/routing_record.py) writes the ids each layer used, replayed
or not, into a device ring the same way; the host copies them out between steps.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from tiermoe.config import DEFAULTS, RoutingConfig
from tiermoe.errors import UserError

log = logging.getLogger("tiermoe.moe")

TABLE_TOKENS = 65536  # rows per layer drawn from a counts file (int16 ids: 128 KiB per layer and pick)
SMOOTHING = 0.5  # added to every count, as `tiermoe sim` does


def _is_trace(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"  # a zip archive: .npz
    except OSError:
        return False  # load_stats names the problem


def replay_tables(path: str, *, num_layers: int, num_experts: int, top_k: int, seed: int = 0,
                  table_tokens: int = TABLE_TOKENS, layer_ids: list[int] | None = None) -> tuple[np.ndarray, dict]:
    """(ids [num_layers, N, top_k] in [0, num_experts), int16 (int32 beyond 32767 experts),
    info for /stats, with `file_layer_of`: the file layer each model layer replays, a counts file's layer number
    or a trace's layer position) from FILE; a one-line UserError for a file this model cannot replay.
    layer_ids: the model's MoE layer numbers, which a counts file listing all of them is matched by."""
    p = Path(path)
    id_dtype = np.int16 if num_experts <= 32767 else np.int32
    if not 0 < top_k <= num_experts:
        raise UserError(f"--routing-replay: the model's top-k {top_k} exceeds its {num_experts} experts")
    if _is_trace(p):
        from tiermoe.store.routing_trace import read_trace

        header, picks, _ = read_trace(p)  # picks [N, L', k]
        if header["num_experts"] != num_experts or header["top_k"] != top_k:
            raise UserError(f"{p}: a trace of {header['num_experts']} experts, top-{header['top_k']}; the model has "
                            f"{num_experts} experts, top-{top_k}")
        if picks.shape[0] == 0:
            raise UserError(f"{p}: the routing trace holds no tokens")
        src = _spread(num_layers, picks.shape[1])
        table = np.ascontiguousarray(picks[:, src, :].transpose(1, 0, 2), dtype=id_dtype)  # [L, N, k]
        info = {"kind": "trace", "file_layers": int(picks.shape[1]), "file_experts": int(header["num_experts"]),
                "trace_model": header["model"], "file_layer_of": src}
        return table, info
    from tiermoe.store.planner import counts_for_model, load_stats
    from tiermoe.store.sim import sample_trace

    stats = load_stats(p)
    for layer in sorted(stats):
        c = stats[layer]
        if not all(math.isfinite(x) for x in c):
            raise UserError(f"{p}: layer {layer}: counts must be finite numbers")
        nonzero = sum(1 for x in c if x > 0)
        if nonzero < top_k:
            raise UserError(f"{p}: layer {layer} has {nonzero} experts with a nonzero count (of {len(c)}), fewer "
                            f"than the model's top-k {top_k}")
    file_layers = sorted(stats)
    if layer_ids is not None and len(layer_ids) == num_layers and set(layer_ids) <= set(stats):
        of = list(layer_ids)  # the model's own statistics: each layer its own counts, by number
    else:
        of = [file_layers[j] for j in _spread(num_layers, len(file_layers))]
    counts = counts_for_model({i: stats[L] for i, L in enumerate(of)}, num_layers, num_experts)  # [E] per layer
    t0 = time.perf_counter()
    keys = sample_trace({i: c.tolist() for i, c in enumerate(counts)}, table_tokens, top_k, seed, SMOOTHING)
    table = (keys - (np.arange(num_layers) * num_experts)[None, :, None]).transpose(1, 0, 2)  # [L, N, k]
    log.info("routing replay: %d tokens x %d layers drawn from %s in %.1f s", table_tokens, num_layers, p,
             time.perf_counter() - t0)
    info = {"kind": "counts", "file_layers": len(stats), "file_experts": sorted({len(c) for c in stats.values()}),
            "file_layer_of": of}
    return np.ascontiguousarray(table, dtype=id_dtype), info


def _spread(n: int, m: int) -> list[int]:
    from tiermoe.store.planner import spread_layers

    return spread_layers(n, m)


class LayerRouting:
    """One MoE layer's replay table and/or recording ring (views of the model-wide tensors)."""

    def __init__(self, table: torch.Tensor | None, cursor: torch.Tensor | None, ring: torch.Tensor | None,
                 ring_cursor: torch.Tensor | None):
        self.table, self.cursor = table, cursor  # [N, k] int16/int32, [1] int64
        self.ring, self.ring_cursor = ring, ring_cursor  # [C, k] int16/int32, [1] int64

    def route(self, gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (topk_ids [T, k] long, topk_weights [T, k]) for x [T, H]: replayed ids
        with the router's weights for them, or the router's own; recorded when recording."""
        if self.table is None:
            ids, weights = gate(x)
        else:
            ids, weights = gate(x, self._rows(x.shape[0], advance=True))
        if self.ring is not None:
            t = ids.shape[0]
            rows = (self.ring_cursor + torch.arange(t, device=ids.device)) % self.ring.shape[0]  # [T]
            self.ring.index_copy_(0, rows, ids.to(self.ring.dtype))
            self.ring_cursor.add_(t)
        return ids, weights

    def peek(self, t: int) -> torch.Tensor:
        """The replayed ids [t, k] long of the next forward of t tokens, cursor left in place."""
        return self._rows(t, advance=False)

    def _rows(self, t: int, advance: bool) -> torch.Tensor:
        rows = (self.cursor + torch.arange(t, device=self.cursor.device)) % self.table.shape[0]  # [T]
        ids = self.table.index_select(0, rows).long()  # [T, k]
        if advance:
            self.cursor.add_(t)
        return ids


class RoutingHooks:
    """The model-wide side: tables, cursors, the recorder; what /stats shows about routing."""

    def __init__(self, layers: list[LayerRouting], cursors: torch.Tensor | None, replay: dict | None, recorder):
        self.layers, self.cursors, self.replay, self.recorder = layers, cursors, replay, recorder

    def begin_forward(self, num_tokens: int, decode_flags: list[bool] | None) -> None:
        """Before a forward of num_tokens tokens is queued (ModelRunner): decode_flags, one per
        real token in stream order (padding rows, if any, after them), or None for a forward
        that is not recorded (warm-up)."""
        if self.recorder is not None:
            self.recorder.begin_forward(num_tokens, decode_flags)

    def step_done(self) -> None:
        """At an engine step boundary: lets the recorder copy out and write periodically."""
        if self.recorder is not None:
            self.recorder.poll()

    def reset_replay(self) -> None:
        """Back to each table's first row (after warm-up)."""
        if self.cursors is not None:
            self.cursors.zero_()

    def counters(self) -> dict:
        return {"source": "replay" if self.replay is not None else "model", "replay": self.replay,
                "record": self.recorder.counters() if self.recorder is not None else None}

    def close(self) -> None:
        """Write what was recorded (also registered at exit by the recorder)."""
        if self.recorder is not None:
            self.recorder.close()


class RoutingPlan:
    """What a model's routing hooks need, checked before the model is loaded (a bad file fails
    in a second, not after minutes of loading experts): the replay tables on the host, the
    record file's header, written once empty so a bad path fails here too."""

    def __init__(self, spec, *, replay: str | None = None, seed: int = 0, record: str | None = None,
                 record_max_tokens: int = DEFAULTS.record_routing_max_tokens, max_step_tokens: int = 2048,
                 model_name: str = ""):
        flag = "--routing-replay" if replay else "--record-routing"
        if spec.moe is None or not spec.moe_layers:
            raise UserError(f"{flag}: {model_name or 'this model'} has no MoE layers")
        self.layers = list(spec.moe_layers)
        n, e, k = len(self.layers), spec.moe.num_experts, spec.moe.top_k
        self.id_dtype = torch.int16 if e <= 32767 else torch.int32
        self.tables, self.replay = None, None
        if replay:
            self.tables, info = replay_tables(replay, num_layers=n, num_experts=e, top_k=k, seed=int(seed or 0),
                                              layer_ids=self.layers)
            self.replay = {"file": str(replay), **info, "seed": int(seed or 0), "layers": n,
                           "table_tokens": int(self.tables.shape[1])}
        self.record, self.record_max_tokens, self.max_step_tokens = record, int(record_max_tokens), max_step_tokens
        self.header = None
        if record:
            from tiermoe.store.routing_trace import make_header, write_trace

            if self.record_max_tokens < 1:
                raise UserError(f"--record-routing-max-tokens must be at least 1, got {self.record_max_tokens}")
            self.header = make_header(model_name, self.layers, e, k)
            try:
                write_trace(record, self.header, np.zeros((0, n, k), np.uint16), np.zeros(0, bool))
            except UserError as exc:
                raise UserError(f"--record-routing: {exc}") from None

    def attach(self, model) -> RoutingHooks:
        """Set the `routing` hook of each trunk MoE layer of the loaded model."""
        by_layer = {m.layer: m for m in model.moe_layers()}
        modules = [by_layer[i] for i in self.layers]
        device = model.device
        tables = cursors = recorder = None
        if self.tables is not None:
            tables = torch.from_numpy(self.tables).to(device)  # [L, N, k] int16 (int32 beyond 32767 experts)
            cursors = torch.zeros(len(modules), dtype=torch.long, device=device)  # [L]
            log.info("routing replay from %s (%s, %d rows per layer): the routers' picks are replaced",
                     self.replay["file"], self.replay["kind"], tables.shape[1])
        if self.record:
            from tiermoe.moe.routing_record import RoutingRecorder

            recorder = RoutingRecorder(self.record, self.header, device=device, id_dtype=self.id_dtype,
                                       num_layers=len(modules), max_tokens=self.record_max_tokens,
                                       max_step_tokens=self.max_step_tokens)
        layers = []
        for i, m in enumerate(modules):
            m.routing = LayerRouting(tables[i] if tables is not None else None,
                                     cursors[i : i + 1] if cursors is not None else None,
                                     recorder.rings[i] if recorder else None,
                                     recorder.cursors[i : i + 1] if recorder else None)
            layers.append(m.routing)
        return RoutingHooks(layers, cursors, self.replay, recorder)


def plan_routing(spec, routing: RoutingConfig, model_name: str = "", max_step_tokens: int = 2048) -> RoutingPlan:
    """The plan for the engine's routing configuration (replay and/or record)."""
    return RoutingPlan(spec, replay=routing.replay, seed=routing.seed, record=routing.record,
                       record_max_tokens=routing.record_max_tokens, max_step_tokens=max_step_tokens,
                       model_name=model_name)


def attach_routing(model, *, replay: str | None = None, seed: int = 0, record: str | None = None,
                   record_max_tokens: int = DEFAULTS.record_routing_max_tokens, max_step_tokens: int = 2048,
                   model_name: str = "") -> RoutingHooks | None:
    """plan + attach in one call (a model already loaded); None when nothing is asked for."""
    if not replay and not record:
        return None
    return RoutingPlan(model.spec, replay=replay, seed=seed, record=record, record_max_tokens=record_max_tokens,
                       max_step_tokens=max_step_tokens, model_name=model_name).attach(model)
