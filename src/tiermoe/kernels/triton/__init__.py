"""Triton kernels: fused MoE over pointer tables (fused_moe) and the device-side expert cache
(cache_manager).

Without a CUDA device Triton can only run kernels through its interpreter, which must be
chosen before any kernel is defined; so on such machines importing this package switches
TRITON_INTERPRET on (unless the variable is already set). That keeps every kernel usable on a
CPU machine - slowly, for tests and tiny shapes.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
