"""`tiermoe serve --tensor-parallel-size N`: the processes of an expert-parallel group (engine/ranks.py).

This process becomes rank 0, the leader: it serves HTTP. Unless torchrun started every rank already (RANK and
WORLD_SIZE set: each runs the same `tiermoe serve` command, and ranks 1..N-1 follow), it starts ranks 1..N-1
itself, each `python -m tiermoe.server.ranks ARGS.json`: the same settings, the same engine built, then
`engine.ranks.follow` until the leader stops; they serve nothing. On CUDA each started rank sees only its own
GPU (CUDA_VISIBLE_DEVICES), so every thread of it, not just the one that chose the device, works there. The
machine's physical cores are dealt to the ranks it starts (`rank_cpus`: every N-th, which on a machine with N
NUMA nodes gives each rank a node), so fast mode's CPU lanes, each taking its rank's cores, do not share any.

A follower that dies leaves the group unable to run a forward (every MoE layer waits for every rank), so a
watchdog in the leader ends the leader with a one-line error when one exits unasked; a follower ends when the
leader's step messages stop (its connection closes). Followers run in their own session and ignore SIGINT and
SIGTERM: Ctrl-C or SIGTERM reaches the leader, which drains its requests and then stops them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tiermoe.engine.ranks import follow
from tiermoe.errors import UserError

log = logging.getLogger("tiermoe.server")

STOP_WAIT_S = 600.0  # how long shutdown waits for a step in progress before ending the followers without it


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _settings(args) -> dict:
    """The serve settings a follower needs (JSON: the namespace less its handler)."""
    return {k: v for k, v in vars(args).items() if k != "handler"}


def rank_cpus(world: int) -> list[list[int]] | None:
    """Each rank's CPUs: every world-th physical core of this process's (lane_kernel.physical_cores lists them
    interleaved over NUMA nodes), or None when there are fewer cores than ranks."""
    from tiermoe.moe.lane_kernel import physical_cores

    cores = physical_cores()
    split = [cores[r::world] for r in range(world)]
    return split if all(split) else None


class LeaderGroup:
    """Rank 0's view of the group: the followers it started, their watchdog, and the way out."""

    def __init__(self, followers: list[subprocess.Popen], settings_file: str | None) -> None:
        self.followers = followers
        self.settings_file = settings_file
        self.closing = False
        self._watch = threading.Thread(target=self._watchdog, name="tiermoe-ranks", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, args) -> "LeaderGroup":
        from tiermoe.engine.settle import resolve_device
        from tiermoe.parallel import join_from_env, launch_followers

        from pathlib import Path

        from tiermoe.engine.settle import is_packed_store

        world = int(args.tensor_parallel_size)
        # what every rank would refuse alike, before any is started
        if args.model is None or not is_packed_store(Path(args.model)):
            raise UserError(f"--tensor-parallel-size {world}: expert parallel serves a packed store (`tiermoe pack` "
                            "first)")
        if args.num_speculative_tokens:
            raise UserError(f"--tensor-parallel-size {world}: --num-speculative-tokens is not served by several "
                            "ranks yet")
        from tiermoe.store.records import load_manifest
        from tiermoe.store.shares import check_ranks

        check_ranks(load_manifest(args.model), world)
        device = resolve_device(args.device)
        if not device.startswith("cuda") and world > len(os.sched_getaffinity(0)):
            raise UserError(f"--tensor-parallel-size {world}: this machine has {len(os.sched_getaffinity(0))} "
                            "CPUs for the ranks' processes")
        if device.startswith("cuda"):
            import torch

            if torch.cuda.device_count() < world:
                raise UserError(f"--tensor-parallel-size {world}: this machine has {torch.cuda.device_count()} GPU(s)")
        followers, settings_file = [], None
        if "WORLD_SIZE" not in os.environ:  # not under torchrun: start the others
            cpus = rank_cpus(world)
            if cpus is not None:
                os.sched_setaffinity(0, cpus[0])  # threads started from here on inherit it
                if args.cpu_threads is None:
                    args.cpu_threads = len(cpus[0])
                log.info("expert parallel: each rank on %d of this machine's physical cores", len(cpus[0]))
            fd, settings_file = tempfile.mkstemp(prefix="tiermoe-ranks-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({**_settings(args), "rank_cpus": cpus}, f)
            followers = launch_followers(world, ["-m", "tiermoe.server.ranks", settings_file], _free_port(),
                                         cuda=device.startswith("cuda"))
        group = cls(followers, settings_file)
        try:
            parallel = join_from_env(device)
        except BaseException:
            group.abandon()
            raise
        if parallel.rank != 0:
            group.abandon()
            raise UserError("under torchrun, `tiermoe serve` runs as rank 0 only: start the other ranks with "
                            "`python -m tiermoe.server.ranks`")
        log.info("expert parallel: rank 0 of %d (%s)", world, "ranks 1.. started here" if followers else "torchrun")
        return group

    def _watchdog(self) -> None:
        while not self.closing:
            for rank, proc in enumerate(self.followers, start=1):
                code = proc.poll()
                if code is not None and not self.closing:
                    msg = f"expert-parallel rank {rank} exited (status {code}); the group cannot go on"
                    log.error(msg)
                    print(f"tiermoe: error: {msg}", file=sys.stderr, flush=True)
                    self.abandon()
                    os._exit(2)
            time.sleep(0.2)

    def close(self, engine) -> None:
        """After serving (`engine`: the AsyncEngine): once its thread has ended, so no step runs beside this,
        tell the followers to stop, wait for them, leave the group; a thread still in a step after
        STOP_WAIT_S (a collective that never completes) gets the followers killed instead."""
        from tiermoe.parallel import leave

        self.closing = True
        deadline = time.monotonic() + STOP_WAIT_S
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine.alive:
            log.error("the engine thread is still in a step: the other ranks are ended without it")
            self.abandon()
            return
        try:
            engine.core.ranks.stop()
        except Exception:
            log.exception("could not tell the other ranks to stop")
        for proc in self.followers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._remove_settings()
        leave()

    def abandon(self) -> None:
        """Start-up failed here: end the followers."""
        self.closing = True
        for proc in self.followers:
            if proc.poll() is None:
                proc.kill()
        self._remove_settings()

    def _remove_settings(self) -> None:
        if self.settings_file is not None:
            try:
                os.unlink(self.settings_file)
            except OSError:
                pass


def main(settings_file: str) -> int:
    """A follower rank this server started: ignore the terminal's signals (the leader stops it once it has
    drained), die with the leader, then follow."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    with open(settings_file) as f:
        settings = json.load(f)
    cpus = settings.pop("rank_cpus", None)
    if cpus is not None:  # this rank's cores, before any thread (torch's, the lane's) is started
        os.sched_setaffinity(0, cpus[int(os.environ["RANK"])])
    args = argparse.Namespace(**settings)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return follow_as_launched(args)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the leader that started it dies, however it dies."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a dead leader still breaks this rank's connection
        pass


def follow_as_launched(args) -> int:
    """A follower rank: join as RANK says, build the leader's engine, repeat its steps until it stops."""
    from tiermoe.engine.gc_pauses import freeze_startup_heap
    from tiermoe.engine.settle import resolve_device
    from tiermoe.parallel import join_from_env, leave
    from tiermoe.server.cli import build_core

    parallel = join_from_env(resolve_device(args.device))
    core = build_core(args)
    freeze_startup_heap()  # as the leader does: its steps wait for this rank's (engine/gc_pauses.py)
    try:
        steps = follow(core, core.ranks)
        log.info("expert-parallel rank %d: the leader stopped after %d steps", parallel.rank, steps)
    finally:
        core.model.expert_backend.close()
        leave()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except UserError as exc:
        print(f"tiermoe: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
