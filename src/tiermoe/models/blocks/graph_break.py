"""Where a piecewise CUDA graph of a decode step must stop: attention's KV-cache core.

A decode step launches dozens of small kernels per layer; issued one by one from Python, their
host time outweighs the GPU's work. Everything but the attention core has static shapes for a
given batch size and can be captured in CUDA graphs; the core (write this step's K/V rows, then
attend over each sequence's whole context) has per-step shapes and stays eager. Attention
modules call `graph_break(core, tensors, batch, cache)` instead of `core(*tensors, batch,
cache)`: with no recorder active (every ordinary forward) that is exactly the call; while
runner/decode_graph.py records a step, the recorder ends the current capture there, keeps the
core as an eager step of the replay program and starts the next capture.
"""

from __future__ import annotations

from typing import Callable

import torch

_recorder = None  # the active runner.decode_graph recorder, if any


def graph_break(core: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], batch, cache) -> torch.Tensor:
    """core(*tensors, batch, cache) -> tensor; a capture boundary while a recorder is active."""
    if _recorder is None:
        return core(*tensors, batch, cache)
    return _recorder.break_here(core, tensors, batch, cache)


def set_recorder(recorder) -> None:
    global _recorder
    _recorder = recorder
