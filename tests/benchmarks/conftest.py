"""The developer benchmarks run on CPU through Triton's interpreter, like the kernel tests
(testkit/kernel_device.py); TIERMOE_KERNEL_TESTS_ON_GPU=1 runs them on a CUDA device."""

from testkit.kernel_device import device  # noqa: F401  (the fixture)
