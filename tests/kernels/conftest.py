"""Kernel tests run on CPU through Triton's interpreter (testkit/kernel_device.py chooses it before
triton is imported); TIERMOE_KERNEL_TESTS_ON_GPU=1 runs the same tests compiled on a CUDA device."""

from testkit.kernel_device import device  # noqa: F401  (the fixture)
