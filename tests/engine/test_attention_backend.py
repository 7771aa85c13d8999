"""The engine keeps SDPA off cuDNN attention on CUDA (per-shape, per-thread plan builds)."""

import torch

from tiermoe.engine.build import prefer_planless_attention


def test_cuda_engines_turn_cudnn_attention_off_and_cpu_ones_leave_it():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        prefer_planless_attention("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        prefer_planless_attention("cuda:0")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        # the other SDPA backends stay as they were
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
