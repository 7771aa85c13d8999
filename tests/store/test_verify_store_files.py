"""`tiermoe verify` covers the manifest and the dense shards, not only the expert records."""

import json

from store_fixtures import make_checkpoint
from tiermoe.cli import main
from tiermoe.store.pack import pack

QUIET = dict(progress=False, log=lambda s: None)


def _store(tmp_path, shard_bytes=20_000):
    make_checkpoint(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "st", shard_bytes=shard_bytes, **QUIET)
    return tmp_path / "st"


def test_verify_ok_counts_records_and_dense_shards(tmp_path, capsys):
    st = _store(tmp_path)
    shards = json.loads((st / "manifest.json").read_text())["dense"]["shards"]
    assert len(shards) > 1
    assert main(["verify", str(st), "--quiet"]) == 0
    assert f"ok: 16 records and {len(shards)} dense shards verified" in capsys.readouterr().out


def test_verify_catches_a_missing_or_damaged_dense_shard(tmp_path, capsys):
    st = _store(tmp_path)
    shards = json.loads((st / "manifest.json").read_text())["dense"]["shards"]
    (st / shards[1]).unlink()
    assert main(["verify", str(st), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert f"BAD dense shard {shards[1]}: missing" in out
    assert f"0 of 16 expert records and 1 of {len(shards)} dense shards are missing or corrupt" in err
    # a flipped byte inside a tensor's data: the header still parses, the sha256 does not match
    path = st / shards[0]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    assert main(["verify", str(st), "--quiet"]) == 1
    assert f"BAD dense shard {shards[0]}: sha256 differs" in capsys.readouterr().out
    # a truncated shard is not a safetensors file any more
    path.write_bytes(bytes(data[:20]))
    assert main(["verify", str(st), "--quiet"]) == 1
    assert f"BAD dense shard {shards[0]}: unreadable safetensors file" in capsys.readouterr().out


def test_verify_names_a_missing_manifest(tmp_path, capsys):
    st = _store(tmp_path)
    (st / "manifest.json").unlink()
    assert main(["verify", str(st)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{st}: packed expert store without its manifest.json (its pack did not finish" in err
    (st / "pack.journal").unlink()
    assert main(["verify", str(st)]) == 2
    assert f"{st}: packed expert store without its manifest.json" in capsys.readouterr().err


def test_verify_checks_the_manifest_records(tmp_path, capsys):
    st = _store(tmp_path)
    m = json.loads((st / "manifest.json").read_text())
    m["records"][3]["offset"] = m["records"][2]["offset"]  # two records on the same bytes
    (st / "manifest.json").write_text(json.dumps(m))
    assert main(["verify", str(st)]) == 2
    assert "overlaps another" in capsys.readouterr().err
    del m["records"][3]
    (st / "manifest.json").write_text(json.dumps(m))
    assert main(["verify", str(st)]) == 2
    assert "layer 0 lacks the records of experts [3]" in capsys.readouterr().err
