"""Every environment variable tiermoe reads, declared once, typed, read when asked.

Only what a user would set lives here: defaults for flags (`--expert-kernel`, `--api-key`),
where the default model is cached, and Triton's own interpreter switch. Values are read at the
moment `get()` is called, never at import, so a test that sets a variable sees its effect.
Diagnostic switches that only benchmarks used are fields of the typed configuration instead
(tiermoe/config.py).

TRITON_INTERPRET belongs to Triton: kernels decorated while it is "1" run in Triton's
interpreter on CPU tensors (tests, tiny shapes). Nothing in tiermoe sets it as a side effect of
an import; a CPU entry point that wants the Triton kernels calls `use_triton_interpreter()`
before the first kernel module is imported (the decorators read the variable then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: its name, how its text becomes a value, the value when it is unset or empty."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if raw is None or raw == "" else self.parse(raw)

    def is_set(self) -> bool:
        return self.name in os.environ


def _text(raw: str) -> str | None:
    return raw


def _path(raw: str) -> Path | None:
    return Path(raw).expanduser()


def _one(raw: str) -> bool:
    return raw == "1"


EXPERT_KERNEL = EnvVar("TIERMOE_EXPERT_KERNEL", _text, None, "default of --expert-kernel (auto, torch or triton)")
API_KEY = EnvVar("TIERMOE_API_KEY", _text, None, "default of `tiermoe serve --api-key`")
CACHE_DIR = EnvVar("TIERMOE_CACHE_DIR", _path, None, "where the embedded default model is unpacked")
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", _path, None, "the user's cache root (default ~/.cache)")
KERNEL_DIR = EnvVar("TIERMOE_KERNEL_DIR", _path, None,
                    "where the CPU lane's compiled kernel is built and kept (default: the cache root's kernels/)")
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", _one, False,
                          "Triton's switch: '1' runs the kernels in its interpreter (CPU tensors; tests)")

VARIABLES = (EXPERT_KERNEL, API_KEY, CACHE_DIR, XDG_CACHE_HOME, KERNEL_DIR, TRITON_INTERPRET)


def use_triton_interpreter() -> bool:
    """Switch Triton to its interpreter where no CUDA device exists and the user did not choose
    (TRITON_INTERPRET unset); returns whether the interpreter is on. Call it before any module
    of tiermoe.kernels.triton is imported: kernels decorated earlier keep their mode."""
    if not TRITON_INTERPRET.is_set():
        import torch

        if not torch.cuda.is_available():
            os.environ[TRITON_INTERPRET.name] = "1"
    return TRITON_INTERPRET.get()
