"""tiermoe.kernels: pure tensor-in, tensor-out compute kernels.

layout.py     byte layout of one expert record (shared format with the store)
reference.py  plain-torch twins of the expert-path kernels (the test oracles)
reference_mhc.py, reference_norm.py, reference_router.py, reference_kda.py
              twins of the hybrid layers' kernels (also their CPU code path)
triton/       fused MoE over pointer tables, device-side expert cache, mHC, norms, router, KDA decode
              (import on demand)
cpu/          the CPU lane's compiled kernel (C++ built on first use, loaded through ctypes)

Nothing here imports other tiermoe packages.
"""
