import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from store_fixtures import expert_weights, make_checkpoint
from tiermoe.cli import main
from tiermoe.errors import StoreIntegrityError, UserError
from tiermoe.store import pack as pack_mod
from tiermoe.store.facade import ExpertStore
from tiermoe.store.pack import pack
from tiermoe.store.records import load_manifest

QUIET = dict(progress=False, log=lambda s: None)


def _fetch_all(store_dir, dtype=None):
    with ExpertStore.open(store_dir, host_expert_gb=0, gpu_expert_gb=0, dtype=dtype, reader_threads=2) as st:
        return {(L, e): st.fetch(L, [e])[e] for L in st.moe_layers for e in range(st.num_experts)}


@pytest.mark.parametrize("style", ["qwen", "mixtral", "fused"])
def test_pack_bf16_round_trip_is_exact(tmp_path, style):
    t = make_checkpoint(tmp_path / "src", style=style, first_dense=1, layers=3)
    res = pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert res.records == 16 and res.written == 16
    m = load_manifest(tmp_path / "st")
    assert m.moe_layers == [1, 2] and m.experts_per_layer == {1: 8, 2: 8}
    assert m.data["quantization"] == {"kind": "bf16", "group_size": None}
    assert m.config["hidden_size"] == 64 and m.data["num_layers"] == 3
    assert all(r.offset % 4096 == 0 and r.length % 4096 == 0 for r in m.records)
    for (L, e), (gu, dn) in _fetch_all(tmp_path / "st").items():
        gate, up, down = expert_weights(t, L, e)
        assert gu.dtype == torch.bfloat16
        assert torch.equal(gu, torch.cat([gate, up])) and torch.equal(dn, down)
    # non-expert tensors: all present, byte-identical; no routed expert among them
    idx = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())["weight_map"]
    dense = {k for k in t if ".experts." not in k or "shared_experts" in k}
    assert set(idx) == dense
    for k, shard in idx.items():
        with safe_open(str(tmp_path / "st" / shard), "pt") as f:
            assert torch.equal(f.get_tensor(k), t[k])
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "st" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()


@pytest.mark.parametrize("quant,tol", [("int8", 0.01), ("int4", 0.16), ("int3", 0.3)])
def test_pack_quantized_error_bound(tmp_path, quant, tol):
    t = make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", quant=quant, group_size=16, **QUIET)
    m = load_manifest(tmp_path / "st")
    assert m.data["quantization"] == {"kind": quant, "group_size": 16}
    assert m.layout.length == (8192 if quant == "int8" else 4096)  # vs 12288 bytes as bf16
    if quant == "int3":  # 3K/8 bytes of bit planes per row (docs/store-format.md)
        assert m.layout.section("gate_up_q").shape == (64, 24) and m.layout.section("down_q").shape == (64, 12)
    for (L, e), (gu, dn) in _fetch_all(tmp_path / "st", torch.float32).items():
        gate, up, down = expert_weights(t, L, e)
        for got, ref in ((gu, torch.cat([gate, up]).float()), (dn, down.float())):
            rel = (got - ref).abs().max() / ref.abs().max()
            assert rel < tol, rel


def test_pack_splits_dense_shards(tmp_path):
    t = make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", shard_bytes=20_000, **QUIET)
    m = load_manifest(tmp_path / "st")
    shards = m.data["dense"]["shards"]
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    idx = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    assert sorted(set(idx["weight_map"].values())) == sorted(shards)
    assert idx["metadata"]["total_size"] == sum(v.numel() * v.element_size() for k, v in t.items() if k in idx["weight_map"])


def test_pack_user_errors(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        pack(tmp_path, tmp_path / "out", **QUIET)
    src = tmp_path / "dense"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4)}, str(src / "model.safetensors"))
    with pytest.raises(UserError, match="no routed expert"):
        pack(src, tmp_path / "out", **QUIET)
    make_checkpoint(tmp_path / "i32", dtype=torch.float32)
    f8 = tmp_path / "f8"
    f8.mkdir()
    (f8 / "config.json").write_text("{}")
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(4, 4, dtype=torch.int8)}, str(f8 / "model.safetensors"))
    with pytest.raises(UserError, match="unsupported dtype"):
        pack(f8, tmp_path / "out", **QUIET)
    assert main(["pack", str(tmp_path / "nope"), str(tmp_path / "out"), "--quiet"]) == 2


def test_pack_fp32_source_keeps_its_values_in_fp32_store(tmp_path):
    t = make_checkpoint(tmp_path / "src", dtype=torch.float32)
    pack(tmp_path / "src", tmp_path / "st", quant="fp32", **QUIET)
    got = _fetch_all(tmp_path / "st")
    gate, up, down = expert_weights(t, 1, 5)
    assert got[(1, 5)][0].dtype == torch.float32 and torch.equal(got[(1, 5)][1], down)


def test_resume_after_interruption(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "fresh", **QUIET)
    real = pack_mod.encode_expert
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt  # as if Ctrl-C during the 7th record
        return real(*a, **kw)

    monkeypatch.setattr(pack_mod, "encode_expert", flaky)
    monkeypatch.setattr(pack_mod, "SYNC_BYTES", 1)  # journal after every record
    with pytest.raises(KeyboardInterrupt):
        pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert not (tmp_path / "st" / "manifest.json").exists()  # incomplete stores have no manifest
    monkeypatch.setattr(pack_mod, "encode_expert", real)
    res = pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert res.written == 16 - 6 and res.rewritten == 0
    assert (tmp_path / "st" / "experts.bin").read_bytes() == (tmp_path / "fresh" / "experts.bin").read_bytes()
    fresh = json.loads((tmp_path / "fresh" / "manifest.json").read_text())
    assert json.loads((tmp_path / "st" / "manifest.json").read_text())["records"] == fresh["records"]
    # a journaled record whose bytes were damaged meanwhile is rewritten by the read-back check
    with open(tmp_path / "st" / "experts.bin", "r+b") as f:
        f.seek(3 * 12288 + 100)
        f.write(b"\xff")
    res = pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert res.written == 0 and res.rewritten == 1
    assert (tmp_path / "st" / "experts.bin").read_bytes() == (tmp_path / "fresh" / "experts.bin").read_bytes()
    # other options: the directory holds another pack, which pack refuses to overwrite
    with pytest.raises(UserError, match="another source or other settings"):
        pack(tmp_path / "src", tmp_path / "st", quant="int8", group_size=16, **QUIET)
    assert (tmp_path / "st" / "experts.bin").read_bytes() == (tmp_path / "fresh" / "experts.bin").read_bytes()


def _flip(store, record, at=10):
    m = load_manifest(store)
    r = m.records[record]
    with open(m.experts_path, "r+b") as f:
        f.seek(r.offset + at)
        b = f.read(1)
        f.seek(r.offset + at)
        f.write(bytes([b[0] ^ 0x01]))
    return r


def test_verify_flags_flipped_byte_and_fetch_refuses(tmp_path, capsys):
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", **QUIET)
    assert main(["verify", str(tmp_path / "st"), "--quiet"]) == 0
    assert "ok: 16 records" in capsys.readouterr().out
    r = _flip(tmp_path / "st", 11)
    assert main(["verify", str(tmp_path / "st"), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"BAD layer 1 expert 3 offset {r.offset}" in out and out.count("BAD") == 1
    with ExpertStore.open(tmp_path / "st", gpu_expert_gb=0, host_expert_gb=0, reader_threads=2) as st:
        st.fetch(1, [2])  # good records still serve
        with pytest.raises(StoreIntegrityError, match="layer 1 expert 3"):
            st.fetch(1, [2, 3])
    # a store that preloads the bad record refuses to start
    with pytest.raises(StoreIntegrityError):
        ExpertStore.open(tmp_path / "st", host_expert_gb=1, reader_threads=2)


def test_verify_missing_or_truncated_store(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "manifest.json: not found" in capsys.readouterr().err
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", **QUIET)
    with open(tmp_path / "st" / "experts.bin", "r+b") as f:
        f.truncate(5 * 12288)
    assert main(["verify", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and err.count("\n") == 1 and "Traceback" not in err
    (tmp_path / "st" / "experts.bin").unlink()
    assert main(["verify", str(tmp_path / "st")]) == 2


def test_pack_refuses_when_disk_is_too_small(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    make_checkpoint(tmp_path / "src")
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(UserError, match="more disk space"):
        pack(tmp_path / "src", tmp_path / "st", **QUIET)


@pytest.mark.slow  # importing transformers dominates (6-12 s)
def test_pack_real_transformers_checkpoint(tmp_path):
    """A checkpoint written by transformers' own save_pretrained (Qwen3-MoE naming)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", **QUIET)
    m = load_manifest(tmp_path / "st")
    assert m.moe_layers == [0, 1] and m.experts_per_layer == {0: 4, 1: 4}
    experts = model.model.layers[1].mlp.experts
    with ExpertStore.open(tmp_path / "st", host_expert_gb=0, gpu_expert_gb=0, reader_threads=2) as st:
        gu, dn = st.fetch(1, [3])[3]
    assert torch.equal(gu, experts.gate_up_proj[3]) and torch.equal(dn, experts.down_proj[3])
    idx = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.gate.weight" in idx and "lm_head.weight" in idx or "model.embed_tokens.weight" in idx
    assert not any(".experts." in k for k in idx)
