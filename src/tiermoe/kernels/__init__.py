"""tiermoe.kernels: pure tensor-in, tensor-out compute kernels.

layout.py     byte layout of one expert record (shared format with the store)
reference.py  plain-torch twins of every kernel (the test oracles)
triton/       fused MoE over pointer tables, device-side expert cache (import on demand)
cpu/          the CPU lane's compiled kernel (C++ built on first use, loaded through ctypes)

Nothing here imports other tiermoe packages.
"""
