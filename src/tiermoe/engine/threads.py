"""`--cpu-threads N`: how many threads the CPU work of an engine uses (llama.cpp's `-t`).

torch's intra-op thread count is a setting of the calling thread (OpenMP's), so it is set on the
thread that builds the engine, which is the thread that steps it (the server builds its core on
its engine thread: async_engine.py). What is sized from torch's count then follows it: on a CPU
device all of the model's compute; the CPU lane's threads unless --cpu-lane-threads is given
(half of them on a CPU device, where the lane shares the cores with the model, all of them beside
a GPU: engine/settle.settle_lane); and the decode bound the store's plan logs (store/planner.py).
`tiermoe serve` on a CPU device leaves one core to the server when the flag is unset
(`serving_threads`).
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


def serving_threads(n: int | None, device: str) -> int | None:
    """The thread count `tiermoe serve` uses: --cpu-threads as given; unset on a CPU device, one
    less than torch's (at least 1); unset beside a GPU, torch's (None).

    Why one less: the server's event loop, its tokenizer threads and the clients on the same
    machine need a core as well. With torch's OpenMP team on every core, each of them preempts a
    team thread, and each of the thousand or so parallel regions of a decode step then waits at
    its barrier until that thread runs again: the default model's decode on a 2-core machine fell
    from about 25 to under 1 token/s while another process computed (docs/results.md section 35).
    Beside a GPU the model's compute is on the device, and the CPU lane sizes its own pool."""
    if n is not None or not device.startswith("cpu"):
        return n
    import torch

    return max(1, torch.get_num_threads() - 1)
