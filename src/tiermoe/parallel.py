"""Several GPUs in one box: the process group of an expert-parallel engine.

One process per GPU, as torch's launcher (`torchrun`) starts them: every rank loads the whole dense model and
its own share of every MoE layer's experts (moe/expert_parallel.py), and the ranks add their partial MoE
outputs with one all-reduce per layer. NCCL carries it between GPUs, gloo between CPU processes (CI).

The caller joins the group before the engine is built (`join`, or torchrun's environment through
`join_from_env`); settling `tensor_parallel_size` then checks the group and reads this rank's place once.
"""

from __future__ import annotations

import os

import torch

from tiermoe.config import ParallelConfig
from tiermoe.errors import UserError


def join(rank: int, world: int, init_method: str, device: str) -> ParallelConfig:
    """Join the group of `world` ranks as `rank` (NCCL on a CUDA device, whose GPU is then `rank`'s; gloo on
    the CPU), rendezvous at `init_method` (tcp://host:port or file://path)."""
    import torch.distributed as dist

    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    return ParallelConfig(rank=rank, world=world)


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
    if world is None or int(world) == 1:
        return None
    if int(world) < 1:
        raise UserError(f"--tensor-parallel-size {world}: must be >= 1")
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
