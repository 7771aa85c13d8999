"""The engines of an expert-parallel group kept in step (moe/expert_parallel.py, tiermoe/parallel.py).

Every rank runs a whole LLMEngine: the same scheduler over the same requests gives the same steps, and each
MoE layer's all-reduce is a collective, so the ranks must run exactly the same forwards. Rank 0 (the leader)
serves HTTP; the others (followers) serve nothing and repeat what the leader's engine does:

    leader, LLMEngine.step():     drain its queues -> publish (the requests added, the aborts) -> schedule, run
    follower, follow():           receive -> add those requests, abort those -> step() the same way

and after each step's sampling every rank takes the leader's tokens (`agree_tokens`), so sampling, grammar
masks or a logit that rounds differently on another rank cannot make the engines part. Both messages go over a
gloo group (Python objects on the CPU, tiermoe/parallel.step_group), each checked on receipt for its kind. The
leader publishes STOP when it closes, after its engine thread has ended.

Failures: the ranks agree on a failure of the experts' part at the step's end (moe/expert_parallel.py), and
every engine fails that step's requests alike. Any other failure in a step (an allocation in attention, a
device fault) happened on one rank only: the others wait in that step's collectives, so the failing rank ends
its process with one line (`abandon`); the leader's watchdog (server/ranks.py) or the broken connection ends
the rest.
"""

from __future__ import annotations

import logging
import os
import sys
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
        if got == STOP:
            return None
        if not isinstance(got, StepInputs):
            raise RuntimeError(f"expert-parallel rank {self.rank}: expected the leader's step inputs, got {got!r:.80}")
        return got

    def agree_tokens(self, tokens: list[int]) -> list[int]:
        """The leader's sampled tokens of this step, on every rank."""
        got = broadcast(("tokens", tokens) if self.leader else None, self.group)
        if not (isinstance(got, tuple) and got[0] == "tokens" and len(got[1]) == len(tokens)):
            raise RuntimeError(f"expert-parallel rank {self.rank}: expected {len(tokens)} tokens, got {got!r:.80}")
        return got[1]

    def abandon(self, exc: BaseException) -> None:
        """A failure the other ranks did not agree on: end this process with one line (module doc)."""
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        log.critical("expert-parallel rank %d: a step failed outside the experts' part (%s: %s); the ranks "
                     "cannot stay in step", self.rank, type(exc).__name__, first, exc_info=exc)
        print(f"tiermoe: error: expert-parallel rank {self.rank}: a step failed ({type(exc).__name__}: {first}); "
              "the ranks cannot stay in step", file=sys.stderr, flush=True)
        os._exit(3)

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
        engine.step()  # a failure the ranks agreed on fails its requests inside; any other ends this process
        steps += 1
    return steps
