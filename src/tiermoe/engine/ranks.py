"""The engines of an expert-parallel group kept in step (moe/expert_parallel.py, tiermoe/parallel.py).

Every rank runs a whole LLMEngine: the same scheduler over the same requests gives the same steps, and each
MoE layer's all-reduce is a collective, so the ranks must run exactly the same forwards. Rank 0 (the leader)
serves HTTP; the others (followers) serve nothing and repeat what the leader's engine does:

    leader, LLMEngine.step():     drain its queues -> publish (the requests added, the aborts) -> schedule, run
    follower, follow():           receive -> add those requests, abort those -> step() the same way

and after each step's sampling every rank takes the leader's tokens (`agree_tokens`), so sampling, grammar
masks or a logit that rounds differently on another rank cannot make the engines part. Both messages go over a
gloo group (Python objects on the CPU, tiermoe/parallel.step_group). The leader publishes STOP when it closes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tiermoe.config import ParallelConfig
from tiermoe.parallel import broadcast, step_group

log = logging.getLogger("tiermoe.engine")


@dataclass
class StepInputs:
    """What the leader's engine took from its queues for one step."""

    added: list[tuple] = field(default_factory=list)  # (request id, prompt token ids, SamplingParams)
    aborted: list[str] = field(default_factory=list)


STOP = "stop"


class RankGroup:
    """This engine's place in the group, and the two step messages."""

    def __init__(self, parallel: ParallelConfig) -> None:
        self.rank, self.world = parallel.rank, parallel.world
        self.group = step_group()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def publish(self, inputs: StepInputs) -> None:
        """The leader's step inputs to every follower (a follower received them before its step: no-op)."""
        if self.leader:
            broadcast(inputs, self.group)

    def receive(self) -> StepInputs | None:
        """A follower: the leader's next step inputs (None: the leader closed)."""
        got = broadcast(None, self.group)
        return None if got == STOP else got

    def agree_tokens(self, tokens: list[int]) -> list[int]:
        """The leader's sampled tokens of this step, on every rank."""
        return broadcast(tokens if self.leader else None, self.group)

    def stop(self) -> None:
        """The leader: tell the followers to end."""
        if self.leader:
            broadcast(STOP, self.group)


def follow(engine, group: RankGroup) -> int:
    """A follower's loop: repeat the leader's steps until it stops; returns the steps run."""
    steps = 0
    while (inputs := group.receive()) is not None:
        for request_id, prompt, params in inputs.added:
            engine.add_request(request_id, prompt, params)
        for request_id in inputs.aborted:
            engine.abort_request(request_id)
        try:
            engine.step()
        except Exception:  # the leader's step failed alike and fails those requests (it publishes the aborts)
            log.exception("rank %d: step failed", group.rank)
        steps += 1
    return steps
