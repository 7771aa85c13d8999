"""Where a piecewise CUDA graph of a decode step must stop: attention's KV-cache core.

A decode step launches dozens of small kernels per layer; issued one by one from Python, their
host time outweighs the GPU's work. Everything but the attention core has static shapes for a
given batch size and can be captured in CUDA graphs; the core (write this step's K/V rows, then
attend over each sequence's whole context) has per-step shapes and stays eager. Attention
modules call `graph_break(core, tensors, batch, cache)` instead of `core(*tensors, batch,
cache)`: with no recorder active (every ordinary forward) that is exactly the call; while
runner/decode_graph.py records a step, the recorder ends the current capture there, keeps the
core as an eager step of the replay program and starts the next capture.

Model forwards also call `layer_boundary()` after each decoder layer. A recording may end its
capture there too (runner/decode_graph.py `layers_per_graph`): a replay then launches one graph
per few layers instead of one for the whole step. The device starts on the first piece as soon as
its launch returns while the host launches the rest, instead of idling for the whole step's launch.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class Recorder(Protocol):
    """What a recording (runner/decode_graph.py) answers to while a forward runs."""

    def break_here(self, core: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], batch,
                   cache) -> torch.Tensor:
        """Run `core` as an eager step between graph captures; its output."""

    def layer_done(self) -> None:
        """A decoder layer ended."""


_recorder: Recorder | None = None  # the active recorder, if any


def graph_break(core: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], batch, cache) -> torch.Tensor:
    """core(*tensors, batch, cache) -> tensor; a capture boundary while a recorder is active."""
    if _recorder is None:
        return core(*tensors, batch, cache)
    return _recorder.break_here(core, tensors, batch, cache)


def layer_boundary() -> None:
    """After each decoder layer of a forward: nothing, or a place where a recording may split its capture."""
    if _recorder is not None:
        _recorder.layer_done()


def set_recorder(recorder: Recorder | None) -> None:
    global _recorder
    _recorder = recorder
