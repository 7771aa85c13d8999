"""Several GPUs in one box: the process group of an expert-parallel engine.

One process per GPU, as torch's launcher (`torchrun`) starts them: every rank loads the whole dense model and
its own share of every MoE layer's experts (moe/expert_parallel.py), and the ranks add their partial MoE
outputs with one all-reduce per layer. NCCL carries it between GPUs, gloo between CPU processes (CI).

The caller joins the group before the engine is built (`join`, or torchrun's environment through
`join_from_env`); settling `tensor_parallel_size` then checks the group and reads this rank's place once.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from tiermoe.config import ParallelConfig
from tiermoe.errors import UserError


# A follower rank waits for the leader's next step for as long as the server stays idle.
IDLE_TIMEOUT = timedelta(days=365)


def join(rank: int, world: int, init_method: str, device: str) -> ParallelConfig:
    """Join the group of `world` ranks as `rank` (NCCL on a CUDA device, whose GPU is then `rank`'s; gloo on
    the CPU), rendezvous at `init_method` (tcp://host:port or file://path)."""
    import torch.distributed as dist

    # every rank is on this machine: gloo's sockets on loopback, whatever the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = str(device).startswith("cuda")
    if cuda:  # a rank this server started sees its one GPU alone; under torchrun, LOCAL_RANK's
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=IDLE_TIMEOUT if not cuda else None)
    return ParallelConfig(rank=rank, world=world)


def step_group():
    """A gloo group over every rank for the engines' step messages (Python objects, on the CPU), which may
    wait as long as the server is idle."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def broadcast(obj: object, group) -> object:
    """Rank 0's `obj` on every rank of `group` (the others' argument is ignored)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(obj: object, group) -> list:
    """Every rank's `obj`, in rank order, on every rank of `group`."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def launch_followers(world: int, argv: list[str], port: int, cuda: bool = False) -> list:
    """Start ranks 1..world-1, each `python ARGV` with its RANK, rendezvous at 127.0.0.1:`port`; this
    process becomes rank 0 (join_from_env after this). cuda: each started rank sees only its own GPU. Returns
    the follower processes."""
    import subprocess
    import sys

    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    # their own session: a terminal's Ctrl-C reaches the leader alone, which drains and then stops them
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]

    def env(r: int) -> dict:
        gpu = {"CUDA_VISIBLE_DEVICES": visible[r] if r < len(visible) else str(r)} if cuda else {}
        return {**base, "RANK": str(r), "LOCAL_RANK": str(r), **gpu}

    return [subprocess.Popen([sys.executable, *argv], env=env(r), start_new_session=True) for r in range(1, world)]


def join_from_env(device: str) -> ParallelConfig:
    """Join as torchrun's environment says (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UserError("expert parallel: RANK and WORLD_SIZE are not set (start one process per GPU with "
                        "torchrun)") from None
    return join(rank, world, "env://", device)


def settle(world: int) -> ParallelConfig | None:
    """This process's place for `tensor_parallel_size` = world (None: one process serves alone); the group
    must have been joined with that many ranks."""
    if world is not None and int(world) < 1:
        raise UserError(f"--tensor-parallel-size {world}: must be >= 1")
    if world is None or int(world) == 1:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UserError(f"--tensor-parallel-size {world}: start one process per GPU with torchrun (no process "
                        "group was joined)")
    if dist.get_world_size() != int(world):
        raise UserError(f"--tensor-parallel-size {world}: the process group has {dist.get_world_size()} ranks")
    return ParallelConfig(rank=dist.get_rank(), world=int(world))


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks, in place."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def leave() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
