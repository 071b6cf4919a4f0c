"""The Python client against real agents: a real etcd, two `kvfabric agent`
processes (prefill node A, decode node B, host memory, real NIXL), engines
attaching shm pools and handing blocks off by id.

Needs target/debug/kvfabric (or $KVFABRIC_BIN) and etcd; skips with the
reason printed when one is missing, fails instead under
KVFABRIC_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest

import kvfabric
from helpers import attach_engine, unique, until_found, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))

# 3 layers, K/V split, 8 KV heads of 16 bf16, 4 tokens a block: 1 KiB blocks.
BASE = kvfabric.Layout.for_model(
    layers=3, num_blocks=32, total_kv_heads=8, head_dim=16, block_tokens=4, dtype="bf16"
)
DECODE = BASE.with_(num_blocks=48)


def metric(agent, name: str) -> float:
    """A series of the agent's /metrics, summed over its label sets."""
    with urllib.request.urlopen(f"http://{agent.addr}/metrics", timeout=5) as r:
        found = [
            float(line.rsplit(" ", 1)[1])
            for line in r.read().decode().splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        ]
    assert found, f"{name} not in {agent.logical_id}'s /metrics"
    return sum(found)


def assert_blocks(src, dst, src_blocks, dst_blocks):
    """dst's `dst_blocks` hold src's `src_blocks` for every layer and plane;
    every other dst block is still zero."""
    np.testing.assert_array_equal(dst.view[:, :, dst_blocks], src.view[:, :, src_blocks])
    others = sorted(set(range(dst.layout.num_blocks)) - set(dst_blocks))
    assert not dst.view[:, :, others].any(), "bytes landed outside the destination blocks"


@pytest.fixture
def engines(pair):
    """Engines attached in a test, closed at its end."""
    made = []

    def make(node, prefix, role, layout, seed=None, **kw):
        e = attach_engine(node.socket_path, prefix, role, layout, seed=seed, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("path", ["auto", "bounce", "standard"])
def test_transfer_blocks_byte_exact(pair, engines, path):
    a, b = pair
    p = engines(a, "prefill", "prefill", BASE, seed=7)
    d = engines(b, "decode", "decode", DECODE)
    assert p.session.is_open and d.session.is_open
    assert p.session.layout_fingerprint == BASE.fingerprint()
    assert d.session.layout_fingerprint == DECODE.fingerprint()
    assert p.session.status().pool_len == BASE.pool_bytes()

    src_blocks, dst_blocks = [3, 17, 4, 31], [40, 2, 9, 11]
    r = until_found(lambda: p.session.transfer_blocks(7, d.id, src_blocks, dst_blocks, path=path))
    assert r.ok, r
    assert r.outcome == "success" and r.reason == ""
    assert r.bytes == len(src_blocks) * BASE.layers * BASE.planes * BASE.block_bytes
    if path != "auto":
        assert r.path == path, r
    else:
        assert r.path in ("bounce", "standard"), r
    arrival = d.session.await_arrival(7, p.id, timeout=10)
    assert arrival.ok, arrival
    assert arrival.bytes == r.bytes and arrival.src_engine == p.id

    assert_blocks(p, d, src_blocks, dst_blocks)
    # The same, through the proto's offset formula on the raw buffers.
    for layer in range(BASE.layers):
        for plane in range(BASE.planes):
            for s, t in zip(src_blocks, dst_blocks):
                so, do = BASE.block_offset(layer, plane, s), DECODE.block_offset(layer, plane, t)
                assert p.pool.buf[so : so + BASE.block_bytes] == d.pool.buf[do : do + BASE.block_bytes]

    st = p.session.status()
    assert st.transfers_succeeded == 1 and st.bytes_sent == r.bytes and st.in_flight == []
    assert d.session.status().arrivals == 1


def test_dst_incarnation_refuses_a_re_attached_destination(pair, engines):
    a, b = pair
    p = engines(a, "prefill-inc", "prefill", BASE, seed=9)
    d = engines(b, "decode-inc", "decode", DECODE)
    inc = d.session.incarnation
    assert inc != 0
    r = until_found(lambda: p.session.transfer_blocks(1, d.id, [1], [2], dst_incarnation=inc))
    assert r.ok, r
    # A request naming another incarnation (the engine re-attached since
    # its blocks were allocated) is refused; nothing is written.
    before = bytes(d.pool.buf)
    with pytest.raises(kvfabric.FailedPrecondition, match="re-attached"):
        p.session.transfer_blocks(2, d.id, [3], [4], dst_incarnation=inc ^ 1)
    assert bytes(d.pool.buf) == before


def test_transfer_async_and_extents(pair, engines):
    a, b = pair
    p = engines(a, "prefill", "prefill", BASE, seed=8)
    d = engines(b, "decode", "decode", DECODE)
    until_found(lambda: p.session.transfer_blocks(1, d.id, [0], [0]))
    futs = [p.session.transfer_async(10 + i, d.id, [i + 1], [i + 1]) for i in range(8)]
    results = [f.result(timeout=30) for f in futs]
    assert all(r.ok for r in results), results
    assert_blocks(p, d, list(range(9)), list(range(9)))

    # The non-paged form: byte extents relative to the pools' bases.
    extents = [(5000, 100_000, 1000), (0, 150_000, 123)]
    r = p.session.transfer_blocks(30, d.id, extents=extents)
    assert r.ok and r.bytes == 1123, r
    src, dst = p.pool.buf, d.pool.buf
    for so, do, n in extents:
        assert src[so : so + n] == dst[do : do + n]


def test_await_arrival_resolves_only_after_the_transfer(pair, engines):
    a, b = pair
    p = engines(a, "prefill", "prefill", BASE, seed=9)
    d = engines(b, "decode", "decode", DECODE)
    until_found(lambda: p.session.transfer_blocks(1, d.id, [0], [0]))  # route warm

    pending = d.session.await_arrival_async(2, p.id, timeout=30)
    time.sleep(0.5)
    assert not pending.done(), "AwaitArrival resolved before anything was sent"
    assert not d.view[:, :, 5].any()
    r = p.session.transfer_blocks(2, d.id, [20, 21], [5, 6])
    assert r.ok, r
    arrival = pending.result(timeout=10)
    assert arrival.ok and arrival.bytes == r.bytes and arrival.src_engine == p.id, arrival
    np.testing.assert_array_equal(d.view[:, :, [5, 6]], p.view[:, :, [20, 21]])

    # Asked after the bytes landed: resolves at once.
    r = p.session.transfer_blocks(3, d.id, [22], [7])
    assert r.ok, r
    t0 = time.monotonic()
    late = d.session.await_arrival(3, timeout=10)  # any source
    assert late.ok and late.bytes == r.bytes, late
    assert time.monotonic() - t0 < 2.0

    # Never sent: the wait times out (an outcome, not an exception).
    t0 = time.monotonic()
    never = d.session.await_arrival(999, p.id, timeout=0.5)
    assert never.outcome == "timeout" and not never.ok, never
    assert time.monotonic() - t0 < 4.0


def test_cancel_of_an_unknown_request_returns_false(pair, engines):
    a, _ = pair
    p = engines(a, "prefill", "prefill", BASE)
    assert p.session.cancel(424242) is False
    assert p.session.is_open


def test_cancel_in_flight(fresh_pair):
    a, b = fresh_pair
    p = attach_engine(a.socket_path, "prefill", "prefill", BASE, seed=10)
    d = attach_engine(b.socket_path, "decode", "decode", DECODE)
    try:
        assert until_found(lambda: p.session.transfer_blocks(1, d.id, [0], [0], path="bounce")).ok
        b.signal(signal.SIGSTOP)  # B grants no credits: the next request stays in flight
        try:
            f = p.session.transfer_async(2, d.id, [1, 2], [1, 2], path="bounce", timeout_ms=20_000)
            wait_for(
                lambda: [x.request_id for x in p.session.status().in_flight] == [2],
                timeout=5, what="request 2 in flight",
            )
            assert p.session.cancel(2) is True
            r = f.result(timeout=10)
            assert r.outcome == "cancelled" and not r.ok, r
            assert p.session.cancel(2) is False
        finally:
            b.signal(signal.SIGCONT)
        r = p.session.transfer_blocks(3, d.id, [3], [3], path="bounce")
        assert r.ok, r
        np.testing.assert_array_equal(d.view[:, :, 3], p.view[:, :, 3])
    finally:
        p.close()
        d.close()


def test_engine_death_detaches_it_and_others_keep_transferring(pair, engines):
    a, b = pair
    d = engines(b, "decode", "decode", DECODE)
    survivor = engines(a, "prefill", "prefill", BASE, seed=11)
    assert until_found(lambda: survivor.session.transfer_blocks(1, d.id, [0], [0])).ok

    eid = unique("doomed")
    layout_json = json.dumps(BASE.__dict__)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "engine_proc.py"), a.socket_path, eid, "prefill", layout_json, "12"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pool_name = None
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"engine process said nothing: {proc.stderr.read() if proc.poll() is not None else ''}"  # type: ignore[union-attr]
        info = json.loads(line)
        pool_name = info["pool"]
        observer = kvfabric.Client(a.socket_path)
        assert observer.status(info["session"]).engine_id == eid
        engines_before = metric(a, "kvfabric_engines")
        pool_bytes_before = metric(a, "kvfabric_engine_pool_bytes")
        assert pool_bytes_before >= 2 * BASE.pool_bytes()

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()

        def gone():
            try:
                observer.status(info["session"])
                return False
            except kvfabric.NotFound:
                return True

        wait_for(gone, timeout=2.5, what="the killed engine's session gone from the agent", step=0.05)
        detach_s = time.monotonic() - t0
        print(f"killed engine's session gone after {detach_s:.2f} s")
        # Its registration is let go on the agent (the pool is unmapped once
        # nothing writes into it).
        wait_for(lambda: metric(a, "kvfabric_engines") <= engines_before - 1, timeout=3, what="engine count")
        wait_for(
            lambda: metric(a, "kvfabric_engine_pool_bytes") <= pool_bytes_before - BASE.pool_bytes(),
            timeout=5, what="the killed engine's pool released",
        )
        # The other engine on the same agents keeps transferring.
        for i in range(2, 6):
            r = survivor.session.transfer_blocks(i, d.id, [i], [i])
            assert r.ok, r
        assert_blocks(survivor, d, [0, 2, 3, 4, 5], [0, 2, 3, 4, 5])
        assert survivor.session.is_open and d.session.is_open
        observer.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pool_name:
            kvfabric.unlink_shm(pool_name)


def test_agent_restart_reattach(fresh_pair):
    a, b = fresh_pair
    p = attach_engine(a.socket_path, "prefill", "prefill", BASE, seed=13)
    m = attach_engine(a.socket_path, "manual", "prefill", BASE, seed=14, auto_reattach=False)
    d = attach_engine(b.socket_path, "decode", "decode", DECODE)
    try:
        assert until_found(lambda: p.session.transfer_blocks(1, d.id, [0], [0])).ok
        old = p.session.id

        # An in-flight request (B stopped: no credits) when A crashes.
        b.signal(signal.SIGSTOP)
        try:
            f = p.session.transfer_async(2, d.id, [1], [1], path="bounce", timeout_ms=20_000)
            wait_for(lambda: len(p.session.status().in_flight) == 1, timeout=5, what="request 2 in flight")
            a.kill()
            try:
                r = f.result(timeout=10)
            except kvfabric.KvfabricError as e:
                print(f"in-flight transfer failed with the agent: {e}")
            else:
                assert not r.ok, f"an in-flight transfer succeeded across the agent's death: {r}"
            wait_for(lambda: not p.session.is_open and not m.session.is_open, timeout=3, what="streams ended")
        finally:
            b.signal(signal.SIGCONT)

        # Same socket path (the crashed agent left its socket file behind).
        a.start()
        assert p.session.wait_open(timeout=20), f"no re-attach: {p.session.last_error}"
        assert p.session.id != old and p.session.generation == 2
        assert p.session.status().pool_len == BASE.pool_bytes(), "pool not registered again"
        assert not m.session.is_open, "auto_reattach=False re-attached"
        m.session.reattach(timeout=10)
        assert m.session.is_open and m.session.status().pool_len == BASE.pool_bytes()

        r = until_found(lambda: p.session.transfer_blocks(3, d.id, [5, 6], [5, 6]), within=10)
        assert r.ok, r
        r = until_found(lambda: m.session.transfer_blocks(4, d.id, [7], [8]), within=10)
        assert r.ok, r
        np.testing.assert_array_equal(d.view[:, :, [5, 6]], p.view[:, :, [5, 6]])
        np.testing.assert_array_equal(d.view[:, :, 8], m.view[:, :, 7])
        assert not d.view[:, :, 1].any(), "the failed in-flight request wrote its blocks"

        # A graceful shutdown says `closing`; the session comes back again.
        gen = p.session.generation
        t0 = time.monotonic()
        assert a.stop() == 0
        print(f"graceful stop took {time.monotonic() - t0:.2f} s")
        wait_for(lambda: not p.session.is_open, timeout=3, what="stream ended on SIGTERM")
        assert p.session.closing_reason, "no `closing` event before the stream ended"
        a.start()
        assert p.session.wait_open(timeout=20), p.session.last_error
        assert p.session.generation == gen + 1
        r = until_found(lambda: p.session.transfer_blocks(5, d.id, [9], [9]), within=10)
        assert r.ok, r
    finally:
        p.close()
        m.close()
        d.close()


def test_tp1_to_tp4_head_slices(pair, engines):
    a, b = pair
    total_heads = 8
    src_layout = kvfabric.Layout.for_model(
        layers=2, num_blocks=16, total_kv_heads=total_heads, head_dim=16, block_tokens=4
    )
    p = engines(a, "prefill-tp1", "prefill", src_layout, seed=15)
    ranks = []
    for j in range(4):
        lj = kvfabric.Layout.for_model(
            layers=2, num_blocks=12, total_kv_heads=total_heads, head_dim=16, block_tokens=4,
            tp_size=4, tp_rank=j,
        )
        assert lj.kv_heads == 2
        ranks.append(engines(b, f"decode-tp4r{j}", "decode", lj))
    src_blocks, dst_blocks = [2, 9, 15], [0, 7, 11]
    h = total_heads // 4
    for j, d in enumerate(ranks):
        rid = 100 + j
        r = until_found(lambda: p.session.transfer_blocks(rid, d.id, src_blocks, dst_blocks))
        assert r.ok, r
        assert r.bytes == 2 * 2 * len(src_blocks) * d.layout.block_bytes, r
        assert d.session.await_arrival(rid, p.id, timeout=10).ok
    for j, d in enumerate(ranks):
        # [layers, planes, blocks, tokens, heads, head bytes]: rank j holds
        # heads [j*h, (j+1)*h) of every token.
        want = p.view[:, :, src_blocks][:, :, :, :, j * h : (j + 1) * h, :]
        np.testing.assert_array_equal(d.view[:, :, dst_blocks], want, err_msg=f"rank {j}")
        others = sorted(set(range(12)) - set(dst_blocks))
        assert not d.view[:, :, others].any()


@pytest.mark.parametrize(
    "src_changes,dst_layout,words",
    [
        # Same block bytes, different tokens per block.
        ({}, BASE.with_(block_tokens=8, kv_heads=4), ("block_tokens=4", "block_tokens=8")),
        # Same element size, different dtype.
        ({}, BASE.with_(dtype="fp16"), ("dtype=bf16", "dtype=fp16")),
        # Destination TP 1 is not a multiple of source TP 2.
        ({"tp_size": 2, "kv_heads": 4, "block_bytes": BASE.block_bytes // 2}, BASE, ("tp=0/2", "tp=0/1")),
    ],
    ids=["block_tokens", "dtype", "tp_not_multiple"],
)
def test_mismatched_layouts_refused(pair, engines, src_changes, dst_layout, words):
    a, b = pair
    src_layout = BASE.with_(**src_changes)
    p = engines(a, "prefill", "prefill", src_layout, seed=16)
    d = engines(b, "decode", "decode", dst_layout)
    with pytest.raises(kvfabric.FailedPrecondition) as e:
        until_found(lambda: p.session.transfer_blocks(1, d.id, [0], [0]))
    msg = e.value.message
    for w in words:
        assert w in msg, f"{w!r} not in the refusal: {msg}"
    assert not d.view.any()
    # Nothing broke: a matching pair on the same agents still transfers.
    ok_src = engines(a, "prefill", "prefill", BASE, seed=17)
    ok_dst = engines(b, "decode", "decode", DECODE)
    assert until_found(lambda: ok_src.session.transfer_blocks(2, ok_dst.id, [1], [1])).ok


def test_bad_requests_answered_and_agent_keeps_running(pair, engines):
    a, b = pair
    p = engines(a, "prefill", "prefill", BASE, seed=18)
    d = engines(b, "decode", "decode", DECODE)
    until_found(lambda: p.session.transfer_blocks(1, d.id, [0], [0]))

    with pytest.raises(kvfabric.InvalidArgument):
        p.session.transfer_blocks(2, d.id, [BASE.num_blocks], [0])  # source block out of range
    with pytest.raises(kvfabric.InvalidArgument):
        p.session.transfer_blocks(3, d.id, [0], [DECODE.num_blocks])  # destination block out of range
    with pytest.raises(kvfabric.InvalidArgument):
        p.session.transfer_blocks(4, d.id, [0, 1], [0])  # lists of different lengths
    with pytest.raises(kvfabric.NotFound):
        p.session.transfer_blocks(5, unique("no-such-engine"), [0], [0])
    with pytest.raises(kvfabric.NotFound):
        p.client.status("no-such-session")
    with pytest.raises(kvfabric.AlreadyExists):
        p.client.attach(p.id, "", "prefill", BASE)
    with pytest.raises(kvfabric.InvalidArgument):
        p.client.attach(unique("bad-layout"), "", "prefill", BASE.with_(block_bytes=BASE.block_bytes + 1))
    with pytest.raises(kvfabric.FailedPrecondition):
        p.session.register_shm(p.pool)  # one pool per session

    # Pools the agent cannot use.
    q = p.client.attach(unique("poolless"), "", "prefill", BASE)
    with pytest.raises(kvfabric.InvalidArgument):
        q.register_shm("/kvfabric-no-such-object", BASE.pool_bytes())
    with kvfabric.ShmPool(None, BASE.pool_bytes() // 2) as small:
        with pytest.raises(kvfabric.InvalidArgument):
            q.register_shm(small)
    q.close()

    # A detached session.
    gone = attach_engine(a.socket_path, "detached", "prefill", BASE, seed=19)
    gone_id = gone.session.id
    gone.session.detach()
    with pytest.raises(kvfabric.NotFound):
        gone.client.status(gone_id)
    with pytest.raises(kvfabric.NotFound):
        gone.client._unary(  # the raw call, as a stale engine would send it
            "Transfer",
            kvfabric._proto.engine_pb2.TransferRequest(
                session=gone_id, request_id=1, dst_engine=d.id, src_blocks=[0], dst_blocks=[0]
            ),
        )
    gone.close()

    # Socket garbage.
    for junk in (os.urandom(512), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(64), b"GET / HTTP/1.1\r\n\r\n"):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(2)
        raw.connect(a.socket_path)
        raw.sendall(junk)
        try:
            raw.recv(1024)
        except OSError:
            pass
        raw.close()

    assert a.alive() and b.alive()
    r = p.session.transfer_blocks(6, d.id, [2], [3])
    assert r.ok, r
    np.testing.assert_array_equal(d.view[:, :, 3], p.view[:, :, 2])
    assert p.session.is_open and d.session.is_open


def test_pending_futures_fail_when_the_session_detaches(pair, engines):
    a, b = pair
    d = engines(b, "decode", "decode", DECODE)
    pending = d.session.await_arrival_async(77, timeout=30)
    time.sleep(0.2)
    d.session.detach()
    try:
        res = pending.result(timeout=10)
    except kvfabric.KvfabricError:
        pass
    except FutureTimeout:
        pytest.fail("AwaitArrival still pending 10 s after its session detached")
    else:
        assert not res.ok, res
