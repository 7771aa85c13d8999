"""Piecewise CUDA graphs for decode steps: one replay program per batch size.

A decode step of the eager engine is host-bound: about 75 kernel launches per layer issued
one by one from Python, more host time than GPU work; llama.cpp replays a CUDA graph instead.
Here a pure decode step of B sequences (every sequence computes one token, no drafts) is
recorded once per B and replayed afterwards:

    program(B) = [graph 0, attention core 0, graph 1, attention core 1, ..., graph L]

The graphs hold everything between two attention cores (norms, projections, rotary, router,
the device-side expert cache step, gather and fused MoE, residuals, the final norm); each
attention core (write this step's K/V rows, attend over each sequence's context: per-step
shapes) runs eagerly between them on the graphs' static tensors (models/blocks/graph_break.py).
Replays launch the same kernels on the same shapes as eager steps, so logits are bit-identical
to the eager engine (tests/runner/test_decode_graph.py on a GPU).

With `--decode-attention paged` (ModelRunner.use_paged_decode_attention) a decode step reads
its context through block tables of a fixed width (the paged decode kernel; glm5_next's MLA
layers batched torch ops): no attention core breaks the capture; the static batch's slot
mapping, block table and lengths are refilled before each replay.

Pieces of `layers_per_graph` layers (default 1; 0: no split): a recording also ends its capture
after every so many decoder layers (graph_break.layer_boundary). Why: the host's launch of a graph
takes time in proportion to its kernels (about a microsecond each), and the device starts on a graph
only when its launch returns. One graph of a whole step left the device idle for that long every
step; with one graph a layer the device starts after the first layer's launch, and the host launches
the others while it computes. Each piece costs one more launch call on the host.

What may be captured: a model whose `decode_graph_unsupported()` is None (models/serving.py
ServingModel; the decoder families' CausalLM and glm5_next, whose KDA state rows are read by
slot-id tensors and whose MLA + DSA core is the break without block tables) when its expert backend says so
(`ExpertBackend.graph_unsupported()` is None: the device-cache backend, exact or fast
mode, with no host sync in the MoE layer; fast mode's CPU lane answers through a mapped-memory
mailbox, moe/device_lane.py; the store backends' Python policy reads the picks back to the
host, so they stay eager), in steps where `graph_safe()` holds. A graph holds device work
only: the model's host bookkeeping of a step (glm5_next: slot lengths, fresh slots' state
zeroed) runs before each replay (`prepare_decode_step`); the recording traces `decode_step`. Programs are kept per batch
size and per the backend's `graph_key()` (lane on or off); the backend hears of each recording
and replay (`graph_recorded` / `graph_replayed`, to count what a replay did). The first step of
a kind runs eagerly (it compiles kernels and warms allocators); the second records and replays.
Disabled by `--enforce-eager` (vLLM's flag).
"""

from __future__ import annotations

import logging

import torch

from tiermoe.models.batch import ForwardBatch
from tiermoe.models.blocks import graph_break
from tiermoe.models.serving import ServingModel
from tiermoe.moe.experts import ExpertBackend

log = logging.getLogger("tiermoe.runner")


def decode_graphs_unsupported(model: ServingModel, device: torch.device) -> str | None:
    """None when decode steps of this model can be captured, else a one-line reason (the model
    says what it allows: `ServingModel.decode_graph_unsupported`)."""
    if device.type != "cuda":
        return f"device {device.type}: CUDA graphs need a CUDA device"
    return model.decode_graph_unsupported()


class _Recorder:
    """Records one forward as alternating graph captures and eager attention cores."""

    def __init__(self, pool, layers_per_graph: int) -> None:
        self.pool, self.layers_per_graph = pool, layers_per_graph
        self.program: list[tuple] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        self._layers = 0  # layers since the last split

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        self._graph.capture_end()
        self.program.append(("graph", self._graph))
        self._graph = None

    def layer_done(self) -> None:
        """After a decoder layer: end the graph and start the next one every layers_per_graph layers."""
        self._layers += 1
        if self.layers_per_graph and self._layers >= self.layers_per_graph:
            self._layers = 0
            self.end()
            self.begin()

    def break_here(self, core, tensors, batch, cache) -> torch.Tensor:
        """End the capture, keep `core` as an eager step writing into a static output, resume."""
        self.end()
        # Run once now for the output's shape and storage. Its inputs are not computed yet
        # (capture records, it does not run), so the K/V rows it writes for this step's tokens
        # are garbage; the replay that follows the recording rewrites them before any read.
        out = core(*tensors, batch, cache)
        self.program.append(("eager", core, tensors, cache, out))
        self.begin()
        return out


class _Entry:
    """A recorded program and the static batch tensors its graphs read (refilled per replay)."""

    def __init__(self, program: list[tuple], static: ForwardBatch, hidden: torch.Tensor):
        self.program, self.static, self.hidden = program, static, hidden

    def load(self, batch: ForwardBatch) -> None:
        st = self.static
        st.input_ids.copy_(batch.input_ids)
        st.positions.copy_(batch.positions)
        st.slot_mapping.copy_(batch.slot_mapping)
        st.seq_slots.copy_(batch.seq_slots)
        if st.block_table is not None:
            st.block_table.copy_(batch.block_table)
            st.seq_lens.copy_(batch.seq_lens)


class DecodeGraphs:
    """Replay programs of pure decode steps for batch sizes 1..max_batch (see module doc)."""

    def __init__(self, model, kv_caches: list[dict[str, torch.Tensor]], max_batch: int,
                 layers_per_graph: int = 1) -> None:
        self.model, self.kv_caches, self.max_batch = model, kv_caches, int(max_batch)
        self.layers_per_graph = int(layers_per_graph)  # decoder layers per graph piece (module doc; 0: no split)
        self.experts: ExpertBackend = model.expert_backend
        self._entries: dict[tuple, _Entry] = {}  # (batch size, backend's graph key) -> program
        self._seen: set[tuple] = set()
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None  # why recording failed (graphs then stay off)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [B, H] of a pure decode step, or None when the caller must run it eagerly.

        The returned tensor is the program's static output: read it (logits) before the next
        step of the same batch size overwrites it.
        """
        b = batch.num_tokens
        if b > self.max_batch or not self.experts.graph_safe():
            return None
        # a backend whose layers run differently by mode (fast mode's CPU lane) keys its programs
        key = (b, self.experts.graph_key())
        entry = self._entries.get(key)
        if entry is None:
            if key not in self._seen:  # first step of this kind: eager (compiles, warms allocators)
                self._seen.add(key)
                return None
            try:
                entry = self._record(batch, key)
            except Exception as exc:  # a capture that fails must not fail the request: stay eager
                log.warning("decode CUDA graphs disabled: recording batch size %d failed (%s)", b,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self.max_batch, self.failed = 0, str(exc)
                torch.cuda.synchronize()
                return None
        # host bookkeeping of the step (glm5_next: KDA slot lengths, fresh slots zeroed): the
        # graph holds only device work; after the recording, which leaves no state behind
        self.model.prepare_decode_step(batch)
        with torch.inference_mode():  # the static tensors were made in the recording's inference mode
            entry.load(batch)
            for step in entry.program:
                if step[0] == "graph":
                    step[1].replay()
                else:
                    _, core, tensors, cache, out = step
                    out.copy_(core(*tensors, batch, cache))
        self.replays += 1
        self.experts.graph_replayed(key)
        return entry.hidden

    def _record(self, batch: ForwardBatch, key: tuple) -> _Entry:
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        static = ForwardBatch(batch.input_ids.clone(), batch.positions.clone(), batch.slot_mapping.clone(),
                              batch.seqs, batch.logits_index, batch.seq_slots.clone(), clone(batch.block_table),
                              clone(batch.seq_lens))
        rec = _Recorder(torch.cuda.graph_pool_handle(), self.layers_per_graph)
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            graph_break.set_recorder(rec)
            try:
                rec.begin()
                hidden = self.model.decode_step(static, self.kv_caches)  # [B, H] (recorded, not computed)
                rec.end()
            except BaseException:
                if rec._graph is not None:  # leave no capture open on the stream
                    try:
                        rec._graph.capture_end()
                    except Exception:
                        pass
                raise
            finally:
                graph_break.set_recorder(None)
        main.wait_stream(side)
        self.experts.graph_recorded(key)
        self.captures += 1
        entry = _Entry(rec.program, static, hidden)
        self._entries[key] = entry
        return entry

    def drop_recordings(self) -> None:
        """Forget every recorded program (the next steps of each kind record anew), e.g. after
        layers_per_graph changed."""
        self._entries.clear()
        self._seen.clear()

    def counters(self) -> dict:
        graphs = {b: sum(1 for step in e.program if step[0] == "graph") for (b, _), e in self._entries.items()}
        return {"captured_batch_sizes": sorted({b for b, _ in self._entries}), "captures": self.captures,
                "replays": self.replays, "failed": self.failed, "layers_per_graph": self.layers_per_graph,
                "graphs_per_step": graphs}
