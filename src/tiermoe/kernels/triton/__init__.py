"""Triton kernels: fused MoE over pointer tables (fused_moe) and the device-side expert cache
(cache_manager).

Without a CUDA device Triton runs kernels only through its interpreter, which must be chosen
before any kernel is defined (the decorators read TRITON_INTERPRET). Importing this package no
longer sets it: the user does (TRITON_INTERPRET=1, tests and tiny shapes on a CPU), or a CPU
entry point calls tiermoe.env.use_triton_interpreter() before importing a kernel module.
"""
