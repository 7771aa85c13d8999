"""The developer benchmarks run on CPU through Triton's interpreter (chosen before triton is
imported), like the kernel tests; TIERMOE_KERNEL_TESTS_ON_GPU=1 runs them on a CUDA device."""

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
