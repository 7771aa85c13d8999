"""Kernel tests and the developer benchmarks run on CPU through Triton's interpreter.

Importing this module chooses the interpreter (it must happen before triton is imported, so a
conftest imports it first); TIERMOE_KERNEL_TESTS_ON_GPU=1 runs the same tests compiled on a CUDA
device instead. `device` is the fixture both conftests share.
"""

import os

if os.environ.get("TIERMOE_KERNEL_TESTS_ON_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")
