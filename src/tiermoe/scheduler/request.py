"""Per-request scheduling state (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tiermoe.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never past the context window
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # sequence slot while running
    status: Status = Status.WAITING
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    num_preemptions: int = 0
    reuse_prefix: bool = True  # False: compute every prompt position (e.g. prompt logprobs owed)
    page_hashes: list[int] = field(default_factory=list)  # prefix-cache chain hashes of its full pages so far

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
