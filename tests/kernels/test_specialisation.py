"""Kernels whose integer arguments follow a step's token count compile once for every count.

Triton specialises an integer argument by value class (1, divisible by 16, other) unless it is listed in
`do_not_specialize`: a launch with a new class compiles the kernel again, in the middle of a request. Step
pick counts are only compared inside these kernels, so they are never specialised (kernels/README.md).
"""

from __future__ import annotations

import pytest
from triton.runtime.jit import JITFunction

from tiermoe.kernels.triton import cache_manager, common, fused_moe

STEP_COUNTS = [
    (fused_moe._moe_gemm_kernel, {"P"}),
    (common._align_small_kernel, {"P", "NB"}),
    (cache_manager._cache_step_kernel, {"P"}),
]


@pytest.mark.parametrize("kernel, names", STEP_COUNTS, ids=["moe_gemm", "align_small", "cache_step"])
def test_step_counts_are_not_specialised(kernel, names):
    if isinstance(kernel, JITFunction):  # compiled kernels
        unspecialised = {p.name for p in kernel.params if p.do_not_specialize}
    else:  # Triton's interpreter (CI) keeps the decorator's arguments
        unspecialised = set(kernel.kwargs["do_not_specialize"] or ())
    assert names <= unspecialised, f"{kernel.fn.__name__}: {sorted(names - unspecialised)} specialised"
