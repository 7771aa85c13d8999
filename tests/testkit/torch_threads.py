"""Torch intra-op threading for tests on tiny tensors."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for the importing module's tests, restored afterwards. Tiny tensors:
    intra-op threading only adds overhead (and contention on shared CI).

    Autouse at module scope: importing it into a test module applies it to that module only."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
