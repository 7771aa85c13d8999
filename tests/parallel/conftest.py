import json

import pytest


@pytest.fixture(scope="session")
def ep_store(tmp_path_factory):
    """The tiny glm4_moe with 4 picks a token (its checkpoint's 2 would add at most one pair across ranks,
    where the rounding cannot differ), packed as bf16 records."""
    from tiermoe.models.tiny import write_tiny
    from tiermoe.store.pack import pack

    base = tmp_path_factory.mktemp("ep")
    src = write_tiny("glm4_moe", base / "checkpoint")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 4}))
    pack(str(src), str(base / "store"), quant="bf16", progress=False, log=lambda _: None)
    return base / "store"
