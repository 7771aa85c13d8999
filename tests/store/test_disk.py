import errno
import os

import pytest
import torch

from tiermoe.errors import UserError
from tiermoe.store import disk
from tiermoe.store.disk import DiskReader, StoreIOError, aligned_buffer, probe_direct_io
from tiermoe.store.facade import ExpertStore
from tiermoe.store.records import load_manifest


def test_aligned_buffer():
    for n in (4096, 12288, 5000):
        b = aligned_buffer(n)
        assert b.numel() == n and b.data_ptr() % 4096 == 0 and b.dtype == torch.uint8


def test_reader_reads_and_checks(packed_bf16):
    store, _ = packed_bf16
    m = load_manifest(store)
    with DiskReader(m.experts_path, threads=2) as r:
        buf = aligned_buffer(m.layout.length)
        futs = [r.submit(rec, aligned_buffer(rec.length)) for rec in m.records]
        assert all(f.result().numel() == m.layout.length for f in futs)
        assert r.reads == 16 and r.checks == 16 and r.in_flight == 0
        with pytest.raises(ValueError):
            r.submit(m.records[0], buf[1:])  # unaligned destination


def test_reader_verify_first_hashes_once(packed_bf16):
    store, _ = packed_bf16
    m = load_manifest(store)
    with DiskReader(m.experts_path, threads=1, verify="first") as r:
        buf = aligned_buffer(m.layout.length)
        for _ in range(3):
            r.read(m.records[4], buf)
        assert r.reads == 3 and r.checks == 1


def test_records_read_in_pieces_hash_in_order(packed_bf16, monkeypatch):
    """A record read as several preads in flight at once (4096-byte pieces of 12288-byte records) gives
    the file's bytes and the manifest's hash; a corrupt last piece fails its check; an I/O error in
    the middle piece fails the read only after every piece has finished (no write into the caller's
    buffer after the error reaches it)."""
    store, _ = packed_bf16
    m = load_manifest(store)
    raw = open(m.experts_path, "rb").read()
    with DiskReader(m.experts_path, threads=2, piece_bytes=4096) as r:
        for rec in m.records[:6]:
            buf = r.read(rec, aligned_buffer(rec.length))
            assert bytes(buf.numpy()[: rec.length]) == raw[rec.offset: rec.offset + rec.length]
        assert r.submit(m.records[3], aligned_buffer(m.layout.length), check=False).result() == m.records[3].sha256
        real = os.preadv
        rec = m.records[7]
        landed = []

        def flaky(fd, bufs, offset):
            if offset == rec.offset + 4096:
                raise OSError(errno.EIO, "Input/output error")
            n = real(fd, bufs, offset)
            if rec.offset <= offset < rec.offset + rec.length:
                landed.append(offset)
            return n

        monkeypatch.setattr(os, "preadv", flaky)
        with pytest.raises(StoreIOError, match="I/O error"):
            r.read(rec, aligned_buffer(rec.length))
        assert sorted(landed) == [rec.offset, rec.offset + 8192] and r.in_flight == 0
    with DiskReader(m.experts_path, threads=2, piece_bytes=4096) as r:
        bad = m.records[8]

        def corrupt_last(fd, bufs, offset):
            n = real(fd, bufs, offset)
            if offset == bad.offset + 8192:
                bufs[0][0] ^= 0xFF
            return n

        monkeypatch.setattr(os, "preadv", corrupt_last)
        with pytest.raises(disk.StoreIntegrityError, match="checksum mismatch"):
            r.read(bad, aligned_buffer(bad.length))
    with pytest.raises(ValueError):
        DiskReader(m.experts_path, piece_bytes=1000)


def test_short_read_is_a_clear_error(packed_bf16, monkeypatch):
    store, _ = packed_bf16
    real = os.preadv

    def short(fd, bufs, offset):
        if offset >= 2 * 12288:
            return 0  # as at end of file
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", short)
    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0, reader_threads=2) as st:
        st.fetch(0, [0, 1])
        with pytest.raises(StoreIOError, match=r"short read of layer 0 expert 2 \(offset 24576\).*got 0 of 12288"):
            st.fetch(0, [2])
        assert st.counters()["disk"]["reads_in_flight"] == 0


def test_partial_reads_are_completed(packed_bf16, monkeypatch):
    store, tensors = packed_bf16
    real = os.preadv

    def piecewise(fd, bufs, offset):  # the kernel may return fewer bytes than asked
        view = bufs[0]
        return real(fd, [view[: min(len(view), 4096)]], offset)

    monkeypatch.setattr(os, "preadv", piecewise)
    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0, reader_threads=2) as st:
        gu, dn = st.fetch(1, [6])[6]
        assert torch.equal(dn, tensors["model.layers.1.mlp.experts.6.down_proj.weight"])


def test_eio_is_a_clear_error(packed_bf16, monkeypatch):
    store, _ = packed_bf16

    def eio(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")

    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0, reader_threads=2) as st:
        monkeypatch.setattr(os, "preadv", eio)
        with pytest.raises(StoreIOError, match=r"I/O error reading layer 1 expert 4 .*Input/output error \(errno 5\)"):
            st.fetch(1, [4, 5])
        monkeypatch.undo()
        assert len(st.fetch(1, [4, 5])) == 2  # the store recovers once the disk does


def test_filesystem_without_odirect_is_refused(packed_bf16, monkeypatch):
    store, tensors = packed_bf16
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & disk.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    assert "Invalid argument" in probe_direct_io(store / "experts.bin")
    with pytest.raises(UserError, match="does not support O_DIRECT.*--no-direct-io"):
        ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0)
    with ExpertStore.open(store, gpu_expert_gb=0, host_expert_gb=0, direct_io=False, reader_threads=2) as st:
        gu, _ = st.fetch(0, [1])[1]
        assert torch.equal(gu[:32], tensors["model.layers.0.mlp.experts.1.gate_proj.weight"])


def test_later_reads_are_checked_by_the_verified_reads_piece_crcs(packed_bf16, tmp_path):
    """verify "always": a record's first read is hashed against the manifest; later reads are checked against
    the crc32s of that read's pieces (no sha256), and a record that changed on disk since fails with the
    store's error, once for each read that meets it, leaving other records readable."""
    import shutil

    store, _ = packed_bf16
    m = load_manifest(store)
    path = tmp_path / "experts.bin"
    shutil.copyfile(m.experts_path, path)
    rec, other = m.records[5], m.records[6]
    with DiskReader(path, threads=2, piece_bytes=4096) as r:
        first = r.read(rec, aligned_buffer(rec.length)).clone()
        assert r.checks == 1 and r._piece_crcs[rec.index] and len(r._piece_crcs[rec.index]) == 3
        again = r.read(rec, aligned_buffer(rec.length))
        assert torch.equal(first, again) and r.checks == 2
        with open(path, "r+b") as f:  # one byte of the record's last piece flips on disk
            f.seek(rec.offset + rec.length - 100)
            byte = f.read(1)
            f.seek(rec.offset + rec.length - 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(disk.StoreIntegrityError, match="checksum mismatch .* changed on disk since its first read"):
            r.read(rec, aligned_buffer(rec.length))
        assert torch.numel(r.read(other, aligned_buffer(other.length)))  # first read of another: sha256, fine
    with DiskReader(path, threads=2, piece_bytes=4096) as fresh:  # a new reader hashes it first: the manifest's error
        with pytest.raises(disk.StoreIntegrityError, match="checksum mismatch"):
            fresh.read(rec, aligned_buffer(rec.length))
