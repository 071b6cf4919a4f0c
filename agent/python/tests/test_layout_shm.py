"""Layout arithmetic, shm pools and the lazy torch path: no services."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvfabric


def test_layout_formula_and_for_model():
    l = kvfabric.Layout.for_model(
        layers=32, num_blocks=100, total_kv_heads=8, head_dim=128, block_tokens=16, tp_size=4, tp_rank=3
    )
    assert l.kv_heads == 2
    assert l.block_bytes == 16 * 2 * 128 * 2
    assert l.planes == 2
    assert l.pool_bytes() == 32 * 2 * 100 * l.block_bytes
    assert l.block_offset(0, 0, 0) == 0
    assert l.block_offset(0, 0, 1) == l.block_bytes
    assert l.block_offset(0, 1, 0) == 100 * l.block_bytes
    assert l.block_offset(1, 0, 0) == 2 * 100 * l.block_bytes
    assert l.block_offset(31, 1, 99) == l.pool_bytes() - l.block_bytes
    with pytest.raises(IndexError):
        l.block_offset(0, 0, 100)
    with pytest.raises(IndexError):
        l.block_offset(0, 2, 0)
    unsplit = l.with_(kv_split=False)
    assert unsplit.planes == 1 and unsplit.block_offset(1, 0, 0) == 100 * l.block_bytes
    assert kvfabric.Layout.from_proto(l.to_proto()) == l


def test_layout_validation_names_the_field():
    good = kvfabric.Layout.for_model(layers=2, num_blocks=4, total_kv_heads=4, head_dim=8)
    good.validate()
    for bad, word in [
        (good.with_(layers=0), "layers"),
        (good.with_(dtype="int4"), "dtype"),
        (good.with_(tp_rank=1), "tp_rank"),
        (good.with_(block_bytes=good.block_bytes + 1), "block_bytes"),
        (good.with_(device=-2), "device"),
    ]:
        with pytest.raises(kvfabric.InvalidArgument) as e:
            bad.validate()
        assert word in str(e.value)
    with pytest.raises(kvfabric.InvalidArgument):
        kvfabric.Layout.for_model(layers=2, num_blocks=4, total_kv_heads=6, head_dim=8, tp_size=4)


UUID = "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d"


def test_gpu_uuid_forms_and_layout_field():
    for text in (UUID, "GPU-" + UUID.upper(), "MIG-" + UUID, UUID.replace("-", "")):
        assert kvfabric.canonical_gpu_uuid(text) == UUID
    for bad in ("", "GPU-", "0", "{" + UUID + "}", UUID[:-1] + "x", "NVD-" + UUID, UUID + "0"):
        with pytest.raises(kvfabric.InvalidArgument, match="8-4-4-4-12"):
            kvfabric.canonical_gpu_uuid(bad)
    l = kvfabric.Layout.for_model(layers=2, num_blocks=4, total_kv_heads=4, head_dim=8, device=0, device_uuid="GPU-" + UUID)
    assert kvfabric.Layout.from_proto(l.to_proto()) == l
    assert str(l).endswith("device=0 device_uuid=GPU-" + UUID)
    with pytest.raises(kvfabric.InvalidArgument, match="host pool"):
        l.with_(device=-1).validate()
    with pytest.raises(kvfabric.InvalidArgument, match="GPU-zz"):
        l.with_(device_uuid="GPU-zz").validate()


def test_engine_socket_by_gpu_uuid(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFABRIC_ENGINE_SOCKET", raising=False)
    monkeypatch.delenv("KVFABRIC_SOCKET_DIR", raising=False)
    assert kvfabric.engine_socket() == "/run/kvfabric/engine.sock"
    d = str(tmp_path)
    # Neither socket yet (the agent not up): no guess; waits, bounded.
    t0 = time.monotonic()
    with pytest.raises(kvfabric.Unavailable, match="neither"):
        kvfabric.engine_socket("GPU-" + UUID, d, timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 5
    assert kvfabric.engine_socket("", d) == os.path.join(d, "engine.sock")
    # One agent per node: its socket.
    (tmp_path / "engine.sock").touch()
    assert kvfabric.engine_socket("GPU-" + UUID, d) == os.path.join(d, "engine.sock")
    (tmp_path / (UUID + ".sock")).touch()
    assert kvfabric.engine_socket("GPU-" + UUID.upper(), d) == os.path.join(d, UUID + ".sock")
    monkeypatch.setenv("KVFABRIC_SOCKET_DIR", d)
    assert kvfabric.engine_socket(UUID) == os.path.join(d, UUID + ".sock")
    monkeypatch.setenv("KVFABRIC_ENGINE_SOCKET", "/x/chosen.sock")
    assert kvfabric.engine_socket(UUID) == "/x/chosen.sock"
    monkeypatch.setenv("KVFABRIC_ENGINE_SOCKET", "/x/{gpu_uuid}.sock")
    assert kvfabric.engine_socket("GPU-" + UUID) == f"/x/{UUID}.sock"
    with pytest.raises(kvfabric.InvalidArgument, match="gpu_uuid"):
        kvfabric.engine_socket()
    with pytest.raises(kvfabric.InvalidArgument):
        monkeypatch.delenv("KVFABRIC_ENGINE_SOCKET")
        kvfabric.engine_socket("not-a-uuid", d)


def test_fingerprint_ignores_per_rank_fields():
    a = kvfabric.Layout.for_model(layers=4, num_blocks=10, total_kv_heads=8, head_dim=64)
    b = kvfabric.Layout.for_model(layers=4, num_blocks=99, total_kv_heads=8, head_dim=64, tp_size=4, tp_rank=2)
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() != a.with_(dtype="fp16").fingerprint()
    assert a.fingerprint() != a.with_(kv_split=False).fingerprint()


def test_numpy_view_is_the_layout():
    l = kvfabric.Layout.for_model(layers=2, num_blocks=3, total_kv_heads=2, head_dim=4, block_tokens=2, dtype="fp16")
    with kvfabric.ShmPool.for_layout(l) as pool:
        v = l.numpy_view(pool.buf)
        assert v.shape == (2, 2, 3, 2, 2, 8)
        v[1, 0, 2, 1, 1, :] = 7
        off = l.block_offset(1, 0, 2) + 1 * l.token_bytes + 1 * l.head_bytes
        assert bytes(pool.buf[off : off + 8]) == b"\x07" * 8
        assert sum(pool.buf) == 7 * 8
        typed = l.numpy_view(pool.buf, raw=False)
        assert typed.dtype == np.float16 and typed.shape[-1] == 4
        del v, typed


def test_shm_pool_name_size_and_close():
    pool = kvfabric.ShmPool("kvf-test-%d" % os.getpid(), 4096)
    assert pool.name == "/kvf-test-%d" % os.getpid() and pool.size == 4096 and len(pool) == 4096
    assert os.path.exists("/dev/shm" + pool.name)
    arr = pool.numpy()
    arr[:] = 3
    with pytest.raises(BufferError):
        pool.close()
    assert not os.path.exists("/dev/shm" + pool.name)  # unlinked already
    del arr
    pool.close()
    assert pool.closed
    pool.close()  # idempotent
    with pytest.raises(kvfabric.InvalidArgument):
        kvfabric.ShmPool("a/b", 10)
    with pytest.raises(kvfabric.InvalidArgument):
        kvfabric.ShmPool(None, 0)
    with kvfabric.ShmPool("/kvf-dup-%d" % os.getpid(), 10):
        with pytest.raises(kvfabric.KvfabricError):
            kvfabric.ShmPool("/kvf-dup-%d" % os.getpid(), 10)


def test_shm_pool_is_not_unlinked_by_the_resource_tracker():
    # A child creates a pool and exits without closing it (like an engine
    # that dies): Python's resource tracker must neither unlink it nor warn;
    # whoever owns the name removes it (here: unlink_shm).
    name = "/kvf-child-%d" % os.getpid()
    code = (
        "import kvfabric, sys; p = kvfabric.ShmPool(%r, 4096); p.buf[0] = 42; "
        "import os; os._exit(0) if sys.argv[1:] == ['hard'] else None" % name
    )
    for mode in ("hard", "soft"):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "leaked" not in r.stderr and "resource_tracker" not in r.stderr, r.stderr
        if mode == "hard":
            assert os.path.exists("/dev/shm" + name)
            assert kvfabric.unlink_shm(name)
        assert not os.path.exists("/dev/shm" + name)
    assert not kvfabric.unlink_shm(name)


def test_torch_is_imported_lazily():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, kvfabric; print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.stdout.strip() == "False", r.stderr


def test_torch_ipc_handle_formats():
    from kvfabric.torch_pool import _raw_handle

    raw = bytes(range(64))
    assert _raw_handle(raw) == raw
    assert _raw_handle(b"\x02c" + raw) == raw
    assert _raw_handle(b"\x03c" + raw) == raw
    with pytest.raises(kvfabric.InvalidArgument) as e:
        _raw_handle(b"\x02e" + b"\x00" * 100)
    assert "expandable" in str(e.value)
    with pytest.raises(kvfabric.InvalidArgument):
        _raw_handle(b"\x00" * 10)


def test_torch_pool_without_torch_or_gpu():
    try:
        import torch
    except ImportError:
        with pytest.raises(ImportError):
            kvfabric.torch_pool_from_tensor(object())
        return
    if not torch.cuda.is_available():
        with pytest.raises(kvfabric.InvalidArgument):
            kvfabric.torch_pool_from_tensor(torch.zeros(4))
        return
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    p = kvfabric.torch_pool_from_tensor(t[4096:])
    assert len(p.handle) == 64 and p.len == (1 << 20) - 4096 and p.offset >= 4096


def test_gpu_uuid_needs_torch_and_the_device():
    try:
        import torch
    except ImportError:
        with pytest.raises(kvfabric.InvalidArgument, match="needs torch"):
            kvfabric.gpu_uuid(0)
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(kvfabric.InvalidArgument, match=f"device {n}"):
        kvfabric.gpu_uuid(n)
    for d in range(n):
        assert kvfabric.canonical_gpu_uuid(kvfabric.gpu_uuid(d)) == kvfabric.gpu_uuid(d)

