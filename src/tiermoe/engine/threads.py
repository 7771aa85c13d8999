"""`--cpu-threads N`: how many threads the CPU work of an engine uses (llama.cpp's `-t`).

torch's intra-op thread count is a setting of the calling thread (OpenMP's), so it is set on the
thread that builds the engine, which is the thread that steps it (the server builds its core on
its engine thread: async_engine.py). What is sized from torch's count then follows it: on a CPU
device all of the model's compute; the CPU lane's threads unless --cpu-lane-threads is given
(half of them on a CPU device, where the lane shares the cores with the model, all of them beside
a GPU: engine/settle.settle_lane); and the decode bound the store's plan logs (store/planner.py).
"""

from __future__ import annotations

from tiermoe.errors import UserError


def add_cpu_threads_arg(p) -> None:
    """The flag, one definition for every command that builds an engine."""
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="threads for the CPU work, as llama.cpp's -t: torch's intra-op threads (all of the "
                        "compute on a CPU device), of which the CPU lane takes half on a CPU device and all "
                        "beside a GPU unless --cpu-lane-threads says otherwise (default: torch's, one per core)")


def use_cpu_threads(n: int | None) -> None:
    """Set torch's threads for the calling thread (call it on the thread that will build and step
    the engine); None leaves torch's default."""
    if n is None:
        return
    if n < 1:
        raise UserError(f"--cpu-threads {n}: must be at least 1")
    import torch

    torch.set_num_threads(n)
