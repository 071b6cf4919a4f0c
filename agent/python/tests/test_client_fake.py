"""The client's own mechanics against an in-process fake of the engine API
(tests/fake_agent.py): no Rust agent, etcd or NIXL needed."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import tempfile
import time

import numpy as np
import pytest

import kvfabric
from kvfabric._proto import engine_pb2 as pb

from fake_agent import FakeAgent

LAYOUT = kvfabric.Layout.for_model(
    layers=2, num_blocks=8, total_kv_heads=2, head_dim=16, block_tokens=4, dtype="fp16"
)


def wait_for(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvf-fake-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fake(sock_dir):
    agent = FakeAgent(os.path.join(sock_dir, "engine.sock")).start()
    yield agent
    agent.stop()


@pytest.fixture
def client(fake):
    c = kvfabric.Client(fake.socket_path, timeout=2.0)
    yield c
    c.close()


def test_attach_stream_keeps_the_session(fake, client):
    s = client.attach("e0", "pod-1", "prefill", LAYOUT)
    assert s.is_open and not s.closed
    assert s.id.startswith("s1-")
    assert s.agent == "fake-1"
    assert s.layout_fingerprint == LAYOUT.fingerprint()
    assert s.generation == 1
    time.sleep(0.5)  # heartbeats flow; the session stays
    assert fake.live_engines() == ["e0"]
    with pytest.raises(kvfabric.AlreadyExists):
        client.attach("e0", "", "prefill", LAYOUT)
    s.detach()
    assert not s.is_open and s.closed
    wait_for(lambda: fake.live_engines() == [], what="detach on the agent")
    with pytest.raises(kvfabric.NotFound):
        s.status()
    with pytest.raises(kvfabric.SessionClosed):
        s.detach()


def test_context_manager_and_gc_end_the_stream(fake, client):
    with client.attach("e1", "", "decode", LAYOUT) as s:
        assert fake.live_engines() == ["e1"]
    assert s.closed
    wait_for(lambda: fake.live_engines() == [], what="detach after with")
    s2 = client.attach("e2", "", "decode", LAYOUT)
    assert fake.live_engines() == ["e2"]
    del s2
    gc.collect()
    wait_for(lambda: fake.live_engines() == [], what="stream end after GC")


def test_register_transfer_await_byte_exact(fake, client):
    with kvfabric.ShmPool.for_layout(LAYOUT) as src_pool, kvfabric.ShmPool(None, LAYOUT.pool_bytes()) as dst_pool:
        assert src_pool.name.startswith("/kvfabric-")
        src = src_pool.numpy(LAYOUT)
        src[...] = np.random.default_rng(1).integers(1, 256, src.shape, dtype=np.uint8)
        p = client.attach("p", "", "prefill", LAYOUT)
        d = client.attach("d", "", "decode", LAYOUT)
        assert p.register_shm(src_pool) == LAYOUT.pool_bytes()
        assert d.register_shm(dst_pool.name, dst_pool.size) == LAYOUT.pool_bytes()
        with pytest.raises(kvfabric.FailedPrecondition):
            p.register_shm(src_pool)
        arrival = d.await_arrival_async(7, timeout=5)
        time.sleep(0.2)
        assert not arrival.done()
        r = p.transfer_blocks(7, "d", [1, 5], [6, 0])
        assert r.ok and r.outcome == "success" and r.path == "direct"
        assert r.bytes == 2 * LAYOUT.layers * LAYOUT.planes * LAYOUT.block_bytes
        a = arrival.result(timeout=5)
        assert a.ok and a.bytes == r.bytes and a.request_id == 7
        dst = dst_pool.numpy(LAYOUT)
        np.testing.assert_array_equal(dst[:, :, 6], src[:, :, 1])
        np.testing.assert_array_equal(dst[:, :, 0], src[:, :, 5])
        assert not dst[:, :, [1, 2, 3, 4, 5, 7]].any()
        f = p.transfer_async(8, "d", [2], [3])
        assert f.result(timeout=5).ok
        assert p.status().transfers_succeeded == 2
        assert d.await_arrival(99, timeout=0.2).outcome == "timeout"
        del src, dst
        p.close()
        d.close()


def test_errors_are_typed(fake, client):
    with client.attach("p", "", "prefill", LAYOUT) as p, client.attach("d", "", "decode", LAYOUT) as d:
        with pytest.raises(kvfabric.NotFound) as e:
            p.transfer_blocks(1, "nobody", [0], [0])
        assert e.value.call == "Transfer" and "nobody" in e.value.message
        with pytest.raises(kvfabric.InvalidArgument):
            p.transfer_blocks(1, "d", [LAYOUT.num_blocks], [0])
        with pytest.raises(kvfabric.InvalidArgument):
            p.transfer_async(1, "d", [0, 1], [0]).result(timeout=5)
        other = LAYOUT.with_(head_dim=8, block_bytes=LAYOUT.block_bytes // 2)
        with client.attach("d2", "", "decode", other):
            with pytest.raises(kvfabric.FailedPrecondition) as e:
                p.transfer_blocks(2, "d2", [0], [0])
            assert str(LAYOUT) in e.value.message and str(other) in e.value.message
        assert p.cancel(12345) is False
        with pytest.raises(kvfabric.NotFound):
            client.status("no-such-session")
        with pytest.raises(kvfabric.InvalidArgument):
            client.attach("bad", "", "prefill", LAYOUT.with_(block_bytes=3))
        with pytest.raises(kvfabric.InvalidArgument):
            d.register_shm("/kvfabric-does-not-exist", LAYOUT.pool_bytes())
    assert isinstance(kvfabric.Timeout("x"), TimeoutError)
    assert isinstance(kvfabric.InvalidArgument("x"), ValueError)


def test_every_call_has_a_deadline(fake, client):
    with client.attach("p", "", "prefill", LAYOUT) as p:
        fake.delay_status = 3.0
        c = kvfabric.Client(fake.socket_path, timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(kvfabric.Timeout) as e:
            c.status(p.id)
        assert time.monotonic() - t0 < 2.0
        assert e.value.call == "Status"
        c.close()
        fake.delay_status = 0.0


def test_attach_first_event_is_bounded_and_checked(fake, sock_dir):
    fake.first_event = pb.SessionEvent(heartbeat=pb.Heartbeat())
    c = kvfabric.Client(fake.socket_path, timeout=1.0)
    with pytest.raises(kvfabric.ProtocolError):
        c.attach("p", "", "prefill", LAYOUT)
    c.close()
    fake.first_event = None
    # No agent at all: Unavailable (or Timeout), within the bound.
    c = kvfabric.Client(os.path.join(sock_dir, "nothing.sock"), timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises((kvfabric.Unavailable, kvfabric.Timeout)):
        c.attach("p", "", "prefill", LAYOUT)
    assert time.monotonic() - t0 < 3.0
    c.close()


def test_cancel_in_flight(fake, client):
    with kvfabric.ShmPool.for_layout(LAYOUT) as a, kvfabric.ShmPool.for_layout(LAYOUT) as b:
        with client.attach("p", "", "prefill", LAYOUT) as p, client.attach("d", "", "decode", LAYOUT) as d:
            p.register_shm(a)
            d.register_shm(b)
            fake.hold.set()
            f = p.transfer_async(5, "d", [0], [0], timeout_ms=10_000)
            wait_for(lambda: [x.request_id for x in p.status().in_flight] == [5], what="in flight")
            assert p.cancel(5) is True
            r = f.result(timeout=5)
            assert r.outcome == "cancelled" and not r.ok
            fake.hold.clear()


def test_auto_reattach_after_agent_restart(fake, client):
    with kvfabric.ShmPool.for_layout(LAYOUT) as a, kvfabric.ShmPool.for_layout(LAYOUT) as b:
        p = client.attach("p", "", "prefill", LAYOUT)
        m = client.attach("m", "", "prefill", LAYOUT, auto_reattach=False)
        p.register_shm(a)
        m.register_shm(b)
        old = p.id
        fake.hold.set()
        in_flight = p.transfer_async(1, "m", [0], [0], timeout_ms=20_000)
        wait_for(lambda: len(p.status().in_flight) == 1, what="in flight")
        fake.stop()
        try:
            r = in_flight.result(timeout=5)
        except kvfabric.KvfabricError:
            pass
        else:
            assert not r.ok, "an in-flight transfer must not succeed across an agent death"
        wait_for(lambda: not p.is_open and not m.is_open, what="streams ended")
        fake.hold.clear()
        fake.release.clear()
        time.sleep(0.3)
        fake.start()
        assert p.wait_open(timeout=10), p.last_error
        assert p.id != old and p.id.startswith("s2-") and p.generation == 2
        assert p.status().pool_len == LAYOUT.pool_bytes()  # registered again
        assert not m.is_open  # no auto re-attach for this one
        assert m.reattach(timeout=5).startswith("s2-")
        assert m.is_open and m.status().pool_len == LAYOUT.pool_bytes()
        assert p.transfer_blocks(2, "m", [1], [1]).ok
        p.close()
        m.close()


def test_client_close_ends_sessions(fake, sock_dir):
    c = kvfabric.Client(fake.socket_path, timeout=2.0)
    s = c.attach("p", "", "prefill", LAYOUT)
    c.close()
    assert s.closed and not s.is_open
    wait_for(lambda: fake.live_engines() == [], what="sessions gone")


def test_socket_garbage_does_not_hurt_the_client(fake, client):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(fake.socket_path)
    raw.sendall(os.urandom(256))
    raw.close()
    with client.attach("p", "", "prefill", LAYOUT) as s:
        assert s.is_open


def test_gpu_layout_carries_the_device_uuid(fake, client, monkeypatch):
    """A GPU layout reaches the agent with its GPU's UUID: the one given, or
    torch's for that device where torch and the device exist; else none
    (the agent then matches by ordinal)."""
    uuid = "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d"
    s = client.attach("g0", "", "decode", LAYOUT.with_(device=0, device_uuid="GPU-" + uuid))
    with fake.lock:
        got = [x.layout for x in fake.sessions.values() if x.engine_id == "g0"][0]
    assert (got.device, got.device_uuid) == (0, "GPU-" + uuid)
    s.detach()
    try:
        import torch

        have = torch.cuda.is_available() and torch.cuda.device_count() > 7
    except ImportError:
        have = False
    s = client.attach("g7", "", "decode", LAYOUT.with_(device=7))
    with fake.lock:
        got = [x.layout for x in fake.sessions.values() if x.engine_id == "g7"][0]
    assert got.device_uuid == (kvfabric.gpu_uuid(7) if have else "")
    assert s.layout.device_uuid == got.device_uuid
    s.detach()
    # The fill itself (torch stood in for): the UUID of that device.
    import kvfabric.torch_pool as tp

    monkeypatch.setattr(tp, "gpu_uuid", lambda d: f"{d:08x}-0e4f-4a1b-9c8d-7e6f5a4b3c2d")
    s = client.attach("g5", "", "decode", LAYOUT.with_(device=5))
    with fake.lock:
        got = [x.layout for x in fake.sessions.values() if x.engine_id == "g5"][0]
    assert (got.device, got.device_uuid) == (5, "00000005-0e4f-4a1b-9c8d-7e6f5a4b3c2d")
    s.detach()
