#!/usr/bin/env python3
"""GPU engines through two kvfabric agents on one GPU (issue 12, H200 run).

Starts etcd, two `kvfabric agent --gpu 0` processes (prefill and decode
"nodes") serving the engine API, and two engine processes that allocate
their paged KV pools as torch tensors on cuda:0 and register them with the
Python client (CUDA IPC). Then:

  * hands blocks off by id (bounce: the only path for GPU pools), the
    decode engine awaits arrival and checks every destination block byte
    for byte on the GPU (and that other blocks stayed zero);
  * asks for the standard path (refused for GPU pools, with the reason);
  * measures the API itself: Transfer call -> submit (submit_us) and
    submit -> resolved (transfer_us), p50/p99 over many hand-offs;
  * SIGKILLs the prefill engine: its session is gone on agent A within a
    second and its GPU pool is released (the agent logs it), the decode
    engine's pool stays registered, a new prefill engine transfers again.

`--only rollout` (issue 14 on the GPU): a prefill engine hands blocks off
to a decode engine back to back (GPU pools: bounce only) while each agent
in turn is given a new bounce config (a bigger arena) through its rollout
document in etcd (`kvfabric config-doc`, put over etcd's JSON gateway):
every hand-off must succeed, every destination block verify, and both
agents end at generation 1 with the new arena, same processes, engines
still attached.

`--only trace --trace FILE` (issue 19): the Mooncake trace through the
engine API, 128 requests in flight, direct (both engines on agent A) and
then bounce (agent A -> agent B, same GPU); p50/p99 per path, every
destination block verified (see ``trace_main``).

Writes a JSON report (--out). Usage (repo root, on the GPU machine):
  python3 e2e/gpu/engines_gpu.py --bin BIN --etcd ETCD --out OUT.json
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "agent", "python"))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


LAYOUT = dict(layers=8, num_blocks=512, total_kv_heads=8, head_dim=128, block_tokens=16, dtype="bf16")


BULK = dict(layers=1, num_blocks=16384, total_kv_heads=1, head_dim=128, block_tokens=16, dtype="bf16")


def bulk_main(sock, sock_b, ready_path, out_path, repeats):
    """Issue 19: 64 MiB as 16,384 x 4 KiB random blocks from one engine to
    an engine on the SAME agent (direct path: one kernel) and to an engine
    on the other agent (bounce), timed inside the agent (transfer_us, submit
    -> destination's arrival resolved), every byte verified; plus a
    contiguous 64 MiB device-to-device copy for scale."""
    import random
    import torch
    import kvfabric

    layout = kvfabric.Layout.for_model(kv_split=False, device=0, **BULK)
    nbytes = layout.pool_bytes()
    assert layout.block_bytes == 4096 and nbytes == 64 << 20
    idx = torch.arange(nbytes, dtype=torch.int64, device="cuda:0")
    src_pool = ((idx * 2654435761) >> 13).remainder(255).to(torch.uint8) + 1
    del idx
    dst_a = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    dst_b = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ca, cb = kvfabric.Client(sock, timeout=10.0), kvfabric.Client(sock_b, timeout=10.0)
    src = ca.attach("bulk-src", "", "prefill", layout)
    src.register_tensor(src_pool)
    da = ca.attach("bulk-dst-a", "", "decode", layout)
    da.register_tensor(dst_a)
    db = cb.attach("bulk-dst-b", "", "decode", layout)
    db.register_tensor(dst_b)
    rng = random.Random(7)
    blocks = list(range(16384))
    report = {"bytes": nbytes, "descriptors": 16384}
    # direct-b2b: the same direct hand-offs back to back (the pool zeroed
    # only before the first; verified first and last): the GPU does no
    # other work between two kernels (issue 19 diagnostic).
    runs = (("direct", "bulk-dst-a", dst_a, da, 0), ("direct-b2b", "bulk-dst-a", dst_a, da, 200000),
            ("bounce", "bulk-dst-b", dst_b, db, 100000))
    for name, dst_engine, pool, sess, rid0 in runs:
        times, wall = [], []
        bad = 0
        for k in range(repeats):
            s_blocks = blocks[:]
            d_blocks = blocks[:]
            rng.shuffle(s_blocks)
            rng.shuffle(d_blocks)
            if name != "direct-b2b" or k == 0:
                pool.zero_()
                torch.cuda.synchronize()
            deadline = time.time() + 20
            while True:
                try:
                    t0 = time.perf_counter()
                    r = src.transfer_blocks(50000 + k + rid0, dst_engine, s_blocks, d_blocks)
                    wall.append((time.perf_counter() - t0) * 1e6)
                    break
                except kvfabric.NotFound:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.05)
            assert r.ok, (name, r.reason)
            a = sess.await_arrival(50000 + k + rid0, timeout=30)
            assert a.ok, (name, a.reason)
            times.append(r.transfer_us)
            if k == 0 or k == repeats - 1:
                sv = src_pool.view(16384, 4096)
                dv = pool.view(16384, 4096)
                si = torch.tensor(s_blocks, device="cuda:0")
                di = torch.tensor(d_blocks, device="cuda:0")
                if not torch.equal(dv[di], sv[si]):
                    bad += 1
        times.sort()
        wall.sort()
        report[name] = {"path": r.path, "repeats": repeats, "transfer_us_min": times[0],
                        "transfer_us_p50": times[len(times) // 2], "transfer_us_max": times[-1],
                        "call_wall_us_p50": wall[len(wall) // 2], "verify_bad": bad}
    # Contiguous device-to-device copy of the same bytes, for scale.
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(10):
        ev0.record()
        dst_a.copy_(src_pool)
        ev1.record()
        torch.cuda.synchronize()
        ms.append(ev0.elapsed_time(ev1))
    ms.sort()
    report["memcpy_64MiB_us_p50"] = ms[len(ms) // 2] * 1e3
    with open(out_path, "w") as f:
        json.dump(report, f)
    with open(ready_path, "w") as f:
        f.write("done")
    for sess in (src, da, db):
        sess.detach()


TRACE_MODEL = dict(layers=32, total_kv_heads=8, head_dim=128, tp_size=4, block_tokens=16, dtype="bf16")


def trace_main(sock, sock_b, ready_path, out_path, trace_path, n_requests, concurrency, pool_gib):
    """Issue 19: the Mooncake conversation trace through the engine API,
    ``concurrency`` requests in flight, Llama-3.1-8B TP 4 rank 0 geometry
    (32 layers, K/V split: 64 planes of 8 KiB blocks, 512 KiB a block of 16
    tokens). One source engine on agent A hands every request's blocks to
    a decode engine on the SAME agent (direct path), then, with a fresh
    destination pool, to a decode engine on agent B (bounce; both agents on
    one GPU). Per request: ceil(input_length / 16) blocks, source blocks a
    random sample of the source pool, destination blocks taken from the
    destination's free list (a request waits while too few are free, as a
    decode engine would), every destination block checked on the GPU
    against its source after the arrival. Timed per request: the agent's
    transfer_us (submit -> destination's arrival resolved), submit_us, and
    the engine's wall time of the Transfer call."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor
    import torch
    import kvfabric

    lines = [json.loads(x) for x in open(trace_path)][:n_requests]
    probe = kvfabric.Layout.for_model(num_blocks=1, device=0, **TRACE_MODEL)
    per_block = probe.pool_bytes()
    nb = min(int(pool_gib * (1 << 30)) // per_block, 0xFFFFFFFF)
    layout = kvfabric.Layout.for_model(num_blocks=nb, device=0, **TRACE_MODEL)
    nbytes = layout.pool_bytes()
    planes = layout.layers * layout.planes
    bb = layout.block_bytes
    reqs = [(i, max(1, -(-int(x["input_length"]) // 16))) for i, x in enumerate(lines)]
    reqs = [(i, k) for i, k in reqs if k <= nb]
    src_pool = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ca, cb = kvfabric.Client(sock, timeout=30.0), kvfabric.Client(sock_b, timeout=30.0)
    src = ca.attach("trace-src", "", "prefill", layout)
    src.register_tensor(src_pool)
    sv = src_pool.view(planes, nb, bb)
    report = {"trace": os.path.basename(trace_path), "requests": len(reqs), "concurrency": concurrency,
              "model": "Llama-3.1-8B TP4 rank 0 (32 layers, 2 KV heads, head_dim 128, bf16, 16-token blocks, K/V split)",
              "block_bytes": bb, "planes": planes, "bytes_per_block_all_planes": per_block,
              "pool_blocks": nb, "pool_gib": round(nbytes / (1 << 30), 2),
              "tokens_total": sum(int(x["input_length"]) for x in lines), "paths": {}}
    # The standard path for GPU pools: refused by design (the reason is reported).
    for name, client, node in (("direct", ca, "a"), ("bounce", cb, "b")):
        dst_pool = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        eid = f"trace-dst-{node}"
        dst = client.attach(eid, "", "decode", layout)
        dst.register_tensor(dst_pool)
        dv = dst_pool.view(planes, nb, bb)
        free = list(range(nb))
        random.Random(11).shuffle(free)
        cv = threading.Condition()
        vlock = threading.Lock()
        base = 1_000_000 * (1 if name == "direct" else 2)
        # Warm-up (and the bounce handshake): one small hand-off, retried
        # while the destination is not yet known.
        deadline = time.time() + 30
        while True:
            try:
                r = src.transfer_blocks(base - 1, eid, [0], [0])
                break
            except (kvfabric.NotFound, kvfabric.FailedPrecondition):
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        assert r.ok, r.reason
        dst.await_arrival(base - 1, timeout=30)
        if name == "bounce":
            try:
                rs = src.transfer_blocks(base - 2, eid, [0], [0], path="standard")
                report["standard"] = {"outcome": rs.outcome, "reason": rs.reason}
            except kvfabric.KvfabricError as e:
                report["standard"] = {"refused": type(e).__name__, "reason": str(e)}
        rng = random.Random(5)
        src_picks = [rng.sample(range(nb), k) for _, k in reqs]
        stats = {"transfer_us": [], "submit_us": [], "call_us": [], "wait_blocks_us": [], "bad": 0,
                 "failed": [], "paths": set(), "in_flight_max": 0}
        in_flight = [0]

        def one(j):
            i, k = reqs[j]
            t_w = time.perf_counter()
            with cv:
                while len(free) < k:
                    cv.wait()
                d = [free.pop() for _ in range(k)]
                in_flight[0] += 1
                stats["in_flight_max"] = max(stats["in_flight_max"], in_flight[0])
            wait_us = (time.perf_counter() - t_w) * 1e6
            s_blocks = src_picks[j]
            try:
                t0 = time.perf_counter()
                r = src.transfer_blocks(base + i, eid, s_blocks, d, timeout_ms=60000)
                call_us = (time.perf_counter() - t0) * 1e6
                ok = r.ok
                if ok:
                    a = dst.await_arrival(base + i, timeout=60)
                    ok = a.ok
                if ok:
                    si = torch.tensor(s_blocks, device="cuda:0")
                    di = torch.tensor(d, device="cuda:0")
                    with vlock:
                        good = torch.equal(dv.index_select(1, di), sv.index_select(1, si))
                        dv.index_fill_(1, di, 0)
                        torch.cuda.synchronize()
                with cv:
                    if ok:
                        stats["transfer_us"].append(r.transfer_us)
                        stats["submit_us"].append(r.submit_us)
                        stats["call_us"].append(call_us)
                        stats["wait_blocks_us"].append(wait_us)
                        stats["paths"].add(r.path)
                        stats["bad"] += int(not good)
                    else:
                        stats["failed"].append((i, r.outcome, r.reason))
            finally:
                with cv:
                    free.extend(d)
                    in_flight[0] -= 1
                    cv.notify_all()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as ex:
            list(ex.map(one, range(len(reqs))))
        wall = time.perf_counter() - t0

        def pc(v, p):
            v = sorted(v)
            return v[min(len(v) - 1, int(round(p * (len(v) - 1))))] if v else None

        moved = sum(k for _, k in reqs) * per_block
        report["paths"][name] = {
            "path": sorted(stats["paths"]), "ok": len(stats["transfer_us"]), "failed": stats["failed"][:10],
            "n_failed": len(stats["failed"]), "verify_bad": stats["bad"],
            "transfer_us_p50": pc(stats["transfer_us"], 0.5), "transfer_us_p99": pc(stats["transfer_us"], 0.99),
            "transfer_us_max": pc(stats["transfer_us"], 1.0),
            "submit_us_p50": pc(stats["submit_us"], 0.5), "submit_us_p99": pc(stats["submit_us"], 0.99),
            "call_us_p50": pc(stats["call_us"], 0.5), "call_us_p99": pc(stats["call_us"], 0.99),
            "wait_blocks_us_p50": pc(stats["wait_blocks_us"], 0.5),
            "wait_blocks_us_p99": pc(stats["wait_blocks_us"], 0.99),
            "in_flight_max": stats["in_flight_max"], "wall_s": round(wall, 3),
            "bytes": moved, "gbps_wall": round(moved / wall / 1e9, 1)}
        print(name, json.dumps(report["paths"][name]), flush=True)
        dst.detach()
        del dv, dst_pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(report, f)
    with open(ready_path, "w") as f:
        f.write("done")
    src.detach()


def edge_main(sock, ready_path, out_path):
    """Issue 19, byte-exact edge cases of the direct path (both engines on
    one agent): 1,072-byte blocks (u8, head_dim 67: every vector width and
    the byte path as the two bases' alignment varies), a destination pool
    registered 1 byte into its allocation (misaligned base), 100,000 block
    pairs in one hand-off, and the 10,000 destination blocks not named plus
    one guard byte before the pool left untouched."""
    import torch
    import kvfabric

    n = 100_000
    layout = kvfabric.Layout(layers=3, num_blocks=n, block_bytes=16 * 67, kv_split=True, dtype="u8",
                             block_tokens=16, kv_heads=1, head_dim=67, device=0)
    nbytes = layout.pool_bytes()
    idx = torch.arange(nbytes, dtype=torch.int64, device="cuda:0")
    src_pool = ((idx * 2654435761) >> 13).remainder(255).to(torch.uint8) + 1
    del idx
    raw = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda:0")
    dst_pool = raw[1:1 + nbytes]  # base misaligned by one byte
    torch.cuda.synchronize()
    c = kvfabric.Client(sock, timeout=30.0)
    src = c.attach("edge-src", "", "prefill", layout)
    src.register_tensor(src_pool)
    dst = c.attach("edge-dst", "", "decode", layout)
    dst.register_tensor(dst_pool)
    import random
    rng = random.Random(11)
    s_blocks = list(range(n))
    d_blocks = list(range(n))
    rng.shuffle(s_blocks)
    rng.shuffle(d_blocks)
    s_blocks, d_blocks = s_blocks[:90_000], d_blocks[:90_000]
    r = src.transfer_blocks(7, "edge-dst", s_blocks, d_blocks, timeout_ms=60000)
    a = dst.await_arrival(7, "edge-src", timeout=60)
    bb = layout.block_bytes
    sv = src_pool.view(3 * 2, n, bb)
    dv = dst_pool.view(3 * 2, n, bb)
    si = torch.tensor(s_blocks, device="cuda:0")
    di = torch.tensor(d_blocks, device="cuda:0")
    moved_ok = bool(torch.equal(dv[:, di, :], sv[:, si, :]))
    untouched = torch.ones(n, dtype=torch.bool, device="cuda:0")
    untouched[di] = False
    guard_ok = int(dv[:, untouched, :].count_nonzero()) == 0 and int(raw[0]) == 0 \
        and int(raw[1 + nbytes:].count_nonzero()) == 0
    report = {"outcome": r.outcome, "path": r.path, "arrival": a.outcome, "pairs": len(s_blocks),
              "planes": 6, "block_bytes": bb, "dst_base_misaligned_by": 1, "bytes": r.bytes,
              "transfer_us": r.transfer_us, "moved_exact": moved_ok, "guards_untouched": guard_ok}
    with open(out_path, "w") as f:
        json.dump(report, f)
    with open(ready_path, "w") as f:
        f.write("done")
    src.detach()
    dst.detach()


def roll_prefill_main(sock, peer, ready_path, out_path, stop_path):
    """Hands blocks off (AUTO: bounce for GPU pools) until `stop_path`
    exists; records every outcome and the last writer of each destination
    block."""
    import torch
    import kvfabric

    layout = kvfabric.Layout.for_model(device=0, **LAYOUT)
    nbytes = layout.pool_bytes()
    pool = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    idx = torch.arange(nbytes, dtype=torch.int64, device="cuda:0")
    pool.copy_(((idx * 2654435761) >> 13).remainder(255).to(torch.uint8) + 1)
    torch.cuda.synchronize()
    client = kvfabric.Client(sock, timeout=10.0)
    s = client.attach("roll-prefill", "uid-roll-prefill", "prefill", layout)
    s.register_tensor(pool)
    with open(ready_path, "w") as f:
        f.write(s.id)
    writer, outcomes, paths, slow = {}, {}, {}, []
    k = 0
    t0 = time.time()
    while not os.path.exists(stop_path) and time.time() - t0 < 120:
        src = [100 + (k * 5 + j) % 64 for j in range(4)]
        dst = [100 + (k * 7 + j * 3) % 300 for j in range(4)]
        try:
            r = s.transfer_blocks(10 + k, peer, src, dst)
            out = r.outcome if r.ok else f"{r.outcome}: {r.reason}"
            if r.ok:
                for sb, db in zip(src, dst):
                    writer[db] = sb
            paths[r.path] = paths.get(r.path, 0) + 1
            slow.append(r.transfer_us)
        except kvfabric.NotFound:
            out = "not found (decode engine not loaded yet)"
            time.sleep(0.05)
        except kvfabric.KvfabricError as e:
            out = "error: " + str(e)[:200]
        outcomes[out] = outcomes.get(out, 0) + 1
        k += 1
    slow.sort()
    q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))] if v else None
    with open(out_path, "w") as f:
        json.dump({"session": s.id, "handoffs": k, "outcomes": outcomes, "paths": paths,
                   "transfer_us_p50": q(slow, 0.5), "transfer_us_p99": q(slow, 0.99),
                   "transfer_us_max": slow[-1] if slow else None,
                   "writer": {str(d): sb for d, sb in writer.items()}}, f)
    time.sleep(3600)


def roll_decode_main(sock, ready_path, out_path, map_path):
    """Attaches, then once `map_path` (the prefill's report) exists checks
    every destination block against the block its last writer sent."""
    import torch
    import kvfabric

    layout = kvfabric.Layout.for_model(device=0, **LAYOUT)
    nbytes = layout.pool_bytes()
    pool = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    client = kvfabric.Client(sock, timeout=10.0)
    s = client.attach("roll-decode", "uid-roll-decode", "decode", layout)
    s.register_tensor(pool)
    with open(ready_path, "w") as f:
        f.write(s.id)
    while not (os.path.exists(map_path) and os.path.getsize(map_path) > 0):
        time.sleep(0.05)
    time.sleep(0.5)
    writer = json.load(open(map_path))["writer"]
    idx = torch.arange(nbytes, dtype=torch.int64, device="cuda:0")
    exp_pool = ((idx * 2654435761) >> 13).remainder(255).to(torch.uint8) + 1
    torch.cuda.synchronize()
    bb = layout.block_bytes
    bad = checked = 0
    for d, sb in writer.items():
        for layer in range(layout.layers):
            for plane in range(2):
                so = layout.block_offset(layer, plane, int(sb))
                do = layout.block_offset(layer, plane, int(d))
                checked += 1
                if not torch.equal(pool[do:do + bb], exp_pool[so:so + bb]):
                    bad += 1
    with open(out_path, "w") as f:
        json.dump({"session": s.id, "blocks_checked": checked, "bad": bad}, f)
    time.sleep(3600)


def engine_main(role, sock, engine_id, peer, ready_path, out_path, n_latency):
    import torch
    import kvfabric

    layout = kvfabric.Layout.for_model(device=0, **LAYOUT)
    nbytes = layout.pool_bytes()
    pool = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    if role == "prefill":
        # A deterministic pattern: byte i = hash(i) (never 0).
        idx = torch.arange(nbytes, dtype=torch.int64, device="cuda:0")
        pool.copy_(((idx * 2654435761) >> 13).remainder(255).to(torch.uint8) + 1)
        torch.cuda.synchronize()
    client = kvfabric.Client(sock, timeout=10.0)
    s = client.attach(engine_id, "uid-" + engine_id, role, layout)
    s.register_tensor(pool)
    with open(ready_path, "w") as f:
        f.write(s.id)
    report = {"engine": engine_id, "session": s.id, "pool_bytes": nbytes}
    src = [5, 77, 3, 400, 12, 13, 14, 15]
    dst = [100, 2, 50, 51, 300, 301, 302, 9]
    if role == "prefill":
        t_deadline = time.time() + 20
        while True:
            try:
                r = s.transfer_blocks(1, peer, src, dst)
                break
            except kvfabric.NotFound:
                if time.time() > t_deadline:
                    raise
                time.sleep(0.05)
        report["first"] = {"outcome": r.outcome, "path": r.path, "bytes": r.bytes, "reason": r.reason,
                           "submit_us": r.submit_us, "transfer_us": r.transfer_us}
        try:
            s.transfer_blocks(2, peer, [1], [1], path="standard")
            report["standard"] = "accepted"
        except kvfabric.KvfabricError as e:
            report["standard"] = "refused: " + str(e)
        # API latency: many small hand-offs (one block, every layer/plane).
        sub, xfer = [], []
        for k in range(n_latency):
            # Blocks 200..299 of the decode pool: disjoint from the blocks
            # the decode engine verifies (the first hand-off's and 0, 4, 511).
            r = s.transfer_blocks(1000 + k, peer, [200 + k % 64], [200 + (k * 7) % 100])
            assert r.ok, r.reason
            sub.append(r.submit_us)
            xfer.append(r.transfer_us)
        sub.sort()
        xfer.sort()
        q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]
        report["latency"] = {"n": n_latency, "submit_us_p50": q(sub, 0.5), "submit_us_p99": q(sub, 0.99),
                             "transfer_us_p50": q(xfer, 0.5), "transfer_us_p99": q(xfer, 0.99),
                             "block_bytes": layout.block_bytes, "descriptors": layout.layers * 2}
        with open(out_path, "w") as f:
            json.dump(report, f)
        time.sleep(3600)  # wait to be killed
    else:
        a = s.await_arrival(1, timeout=30)
        report["arrival"] = {"outcome": a.outcome, "bytes": a.bytes}
        # Verify on the GPU against the prefill pattern.
        bb = layout.block_bytes
        exp_pool = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        idx = torch.arange(nbytes, dtype=torch.int64, device="cuda:0")
        exp_pool.copy_(((idx * 2654435761) >> 13).remainder(255).to(torch.uint8) + 1)
        bad = 0
        for layer in range(layout.layers):
            for plane in range(2):
                for sb, db in zip(src, dst):
                    so = layout.block_offset(layer, plane, sb)
                    do = layout.block_offset(layer, plane, db)
                    if not torch.equal(pool[do:do + bb], exp_pool[so:so + bb]):
                        bad += 1
                for blk in (0, 4, 511):
                    o = layout.block_offset(layer, plane, blk)
                    if int(pool[o:o + bb].count_nonzero()) != 0:
                        bad += 1
        report["verify"] = {"blocks_checked": layout.layers * 2 * (len(src) + 3), "bad": bad}
        with open(out_path, "w") as f:
            json.dump(report, f)
        time.sleep(3600)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--latency-n", type=int, default=300)
    ap.add_argument("--bulk-repeats", type=int, default=10)
    ap.add_argument("--only", choices=["all", "bulk", "edge", "rollout", "trace"], default="all")
    ap.add_argument("--trace", default="", help="--only trace: Mooncake JSONL trace")
    ap.add_argument("--trace-requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--pool-gib", type=float, default=32.0, help="--only trace: bytes of each KV pool (GiB)")
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--engine", nargs=6, metavar=("ROLE", "SOCK", "ID", "PEER", "READY", "OUT"))
    a = ap.parse_args()
    if a.engine:
        role, sock, eid, peer, ready, out = a.engine
        if role == "bulk":
            bulk_main(sock, peer, ready, out, a.bulk_repeats)
        elif role == "trace":
            trace_main(sock, peer, ready, out, a.trace, a.trace_requests, a.concurrency, a.pool_gib)
        elif role == "roll-prefill":
            roll_prefill_main(sock, peer, ready, out, eid)
        elif role == "roll-decode":
            roll_decode_main(sock, ready, out, peer)
        elif role == "edge":
            edge_main(sock, ready, out)
        else:
            engine_main(role, sock, eid, peer, ready, out, a.latency_n)
        return
    tmp = tempfile.mkdtemp(prefix="kvf-gpu-")
    cport, pport = free_port(), free_port()
    etcd = subprocess.Popen([a.etcd, "--name", "g", "--data-dir", os.path.join(tmp, "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{cport}",
                             "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                             "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                             "--initial-cluster", f"g=http://127.0.0.1:{pport}", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [etcd]
    report = {"ok": False}
    env = dict(os.environ, KVFABRIC_BOUNCE_ENABLE="1", KVFABRIC_BOUNCE_ARENA_SIZE_BYTES="512MiB",
               KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT="1", KVFABRIC_LOG=os.environ.get("KVFABRIC_LOG", "info"),
               UCX_CUDA_IPC_ENABLE_SAME_PROCESS="y")
    logs = {}
    try:
        time.sleep(1.5)
        agents = {}
        for name, role in (("node-a", "prefill"), ("node-b", "decode")):
            sock = os.path.join(tmp, name + ".sock")
            log = open(os.path.join(tmp, name + ".log"), "w")
            logs[name] = log.name
            p = subprocess.Popen([a.bin, "agent", "--gpu", "0", "--engine-socket", sock,
                                  "--listen", "127.0.0.1:0", "--control-bind", "loopback",
                                  "--pool-size", "16MiB", "--etcd", f"http://127.0.0.1:{cport}",
                                  "--fabric", "gpu", "--logical-id", name, "--role", role],
                                 env=env, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            line = p.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"{name} did not start: {line!r}; log {open(log.name).read()[-3000:]}")
            agents[name] = (p, sock, line.split("listening on ")[1].strip())

        def engine(role, node, eid, peer):
            ready = os.path.join(tmp, eid + ".ready")
            out = os.path.join(tmp, eid + ".json")
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin, "--etcd", a.etcd,
                                  "--out", a.out, "--latency-n", str(a.latency_n),
                                  "--engine", role, agents[node][1], eid, peer, ready, out])
            procs.append(p)
            return p, ready, out

        def wait_file(path, t=60):
            end = time.time() + t
            while time.time() < end:
                if os.path.exists(path) and os.path.getsize(path) > 0:
                    return open(path).read()
                time.sleep(0.05)
            raise RuntimeError("timed out waiting for " + path)

        if a.only == "rollout":
            import base64
            import urllib.request

            def get_config(node):
                with urllib.request.urlopen(agents[node][2] + "/v1/config", timeout=5) as r:
                    v = json.load(r)
                return v["agent"], v["bounce_effective"]

            def put(key, value):
                body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                                   "value": base64.b64encode(value.encode()).decode()}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{cport}/v3/kv/put", data=body,
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=5).read()

            stop = os.path.join(tmp, "stop")
            d_ready, d_out = os.path.join(tmp, "rd.ready"), os.path.join(tmp, "rd.json")
            p_ready, p_out = os.path.join(tmp, "rp.ready"), os.path.join(tmp, "rp.json")
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin,
                                           "--etcd", a.etcd, "--out", a.out, "--engine", "roll-decode",
                                           agents["node-b"][1], "roll-decode", p_out, d_ready, d_out]))
            wait_file(d_ready)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin,
                                           "--etcd", a.etcd, "--out", a.out, "--engine", "roll-prefill",
                                           agents["node-a"][1], stop, "roll-decode", p_ready, p_out]))
            wait_file(p_ready)
            before = {n: get_config(n) for n in agents}
            time.sleep(2.0)
            doc_env = dict(env, KVFABRIC_BOUNCE_ARENA_SIZE_BYTES="768MiB")
            doc = subprocess.run([a.bin, "config-doc", "--generation", "1"], env=doc_env,
                                 capture_output=True, text=True, check=True).stdout.strip()
            steps = []
            for node in ("node-b", "node-a"):
                t = time.time()
                put(f"/kvfabric/gpu/config/agents/{node}", doc)
                while time.time() - t < 30:
                    _, be = get_config(node)
                    if be.get("config_generation") == 1 and not be.get("draining"):
                        break
                    time.sleep(0.02)
                steps.append({"agent": node, "applied_s": round(time.time() - t, 3)})
                time.sleep(1.0)
            time.sleep(2.0)
            open(stop, "w").write("stop")
            report["prefill"] = json.loads(wait_file(p_out, 60))
            report["decode"] = json.loads(wait_file(d_out, 60))
            after = {n: get_config(n) for n in agents}
            report["rollout"] = {
                "steps": steps,
                "before": {n: {"agent": v[0], "generation": v[1].get("config_generation"),
                               "arena_bytes": v[1].get("arena_usable_capacity_bytes")} for n, v in before.items()},
                "after": {n: {"agent": v[0], "generation": v[1].get("config_generation"),
                              "arena_bytes": v[1].get("arena_usable_capacity_bytes")} for n, v in after.items()},
                "same_processes": all(agents[n][0].poll() is None for n in agents),
            }
            report["prefill"].pop("writer", None)
            oc = report["prefill"]["outcomes"]
            r = report["rollout"]
            report["ok"] = (set(oc) == {"success"} and report["decode"]["bad"] == 0
                            and report["decode"]["blocks_checked"] > 0
                            and all(r["after"][n]["generation"] == 1 for n in agents)
                            and all(r["after"][n]["agent"] == r["before"][n]["agent"] for n in agents)
                            and all(r["after"][n]["arena_bytes"] > r["before"][n]["arena_bytes"] for n in agents)
                            and r["same_processes"])
            return
        if a.only == "edge":
            e_ready = os.path.join(tmp, "edge.ready")
            e_out = os.path.join(tmp, "edge.json")
            ep = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin, "--etcd", a.etcd,
                                   "--out", a.out, "--engine", "edge", agents["node-a"][1], "edge", "",
                                   e_ready, e_out])
            procs.append(ep)
            report["edge"] = json.loads(wait_file(e_out, 240))
            e = report["edge"]
            report["ok"] = e["outcome"] == "success" and e["arrival"] == "success" and e["moved_exact"] \
                and e["guards_untouched"] and e["path"] == "direct"
            return
        if a.only == "trace":
            t_ready = os.path.join(tmp, "trace.ready")
            t_out = os.path.join(tmp, "trace.json")
            tp = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin, "--etcd", a.etcd,
                                   "--out", a.out, "--trace", os.path.abspath(a.trace),
                                   "--trace-requests", str(a.trace_requests), "--concurrency", str(a.concurrency),
                                   "--pool-gib", str(a.pool_gib),
                                   "--engine", "trace", agents["node-a"][1], "trace", agents["node-b"][1],
                                   t_ready, t_out])
            procs.append(tp)
            end = time.time() + 900
            while not os.path.exists(t_out) and tp.poll() is None and time.time() < end:
                time.sleep(0.2)
            report["trace"] = json.loads(wait_file(t_out, 5))
            ps = report["trace"]["paths"]
            report["ok"] = all(v["n_failed"] == 0 and v["verify_bad"] == 0 and v["ok"] == report["trace"]["requests"]
                               for v in ps.values()) and set(ps) == {"direct", "bounce"}
            return
        if a.only == "bulk":
            bulk_ready = os.path.join(tmp, "bulk.ready")
            bulk_out = os.path.join(tmp, "bulk.json")
            bp = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin, "--etcd", a.etcd,
                                   "--out", a.out, "--bulk-repeats", str(a.bulk_repeats),
                                   "--engine", "bulk", agents["node-a"][1], "bulk", agents["node-b"][1],
                                   bulk_ready, bulk_out])
            procs.append(bp)
            report["bulk"] = json.loads(wait_file(bulk_out, 240))
            report["ok"] = report["bulk"]["direct"]["verify_bad"] == 0 and report["bulk"]["bounce"]["verify_bad"] == 0
            return
        dp, dready, dout = engine("decode", "node-b", "decode-0", "")
        wait_file(dready)
        pp, pready, pout = engine("prefill", "node-a", "prefill-0", "decode-0")
        report["prefill"] = json.loads(wait_file(pout, 180))
        report["decode"] = json.loads(wait_file(dout, 60))
        psession = open(pready).read()
        # SIGKILL the prefill engine: its session goes within a second.
        import kvfabric
        c = kvfabric.Client(agents["node-a"][1], timeout=5.0)
        pp.send_signal(signal.SIGKILL)
        t0 = time.time()
        gone = None
        while time.time() - t0 < 5:
            try:
                c.status(psession)
            except kvfabric.NotFound:
                gone = time.time() - t0
                break
            time.sleep(0.01)
        report["kill"] = {"session_gone_s": gone}
        time.sleep(1.0)
        alog = open(logs["node-a"]).read()
        report["kill"]["pool_released_logged"] = "pool released" in alog
        report["kill"]["detached_logged"] = "engine detached" in alog
        # A new prefill engine transfers again.
        pp2, pready2, pout2 = engine("prefill", "node-a", "prefill-1", "decode-0")
        rep2 = json.loads(wait_file(pout2, 180))
        report["after_kill"] = rep2.get("first")
        pp2.send_signal(signal.SIGKILL)
        # Issue 19: direct (same agent) vs bounce (two agents), 64 MiB.
        bulk_ready = os.path.join(tmp, "bulk.ready")
        bulk_out = os.path.join(tmp, "bulk.json")
        bp = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bin", a.bin, "--etcd", a.etcd,
                               "--out", a.out, "--bulk-repeats", str(a.bulk_repeats),
                               "--engine", "bulk", agents["node-a"][1], "bulk", agents["node-b"][1],
                               bulk_ready, bulk_out])
        procs.append(bp)
        try:
            report["bulk"] = json.loads(wait_file(bulk_out, 240))
        except Exception as e:
            report["bulk"] = {"error": str(e)}
        f = report["prefill"]["first"]
        report["ok"] = (f["outcome"] == "success" and report["decode"]["verify"]["bad"] == 0
                        and report["decode"]["arrival"]["outcome"] == "success"
                        and gone is not None and gone < 1.0
                        and report["after_kill"]["outcome"] == "success")
    finally:
        for p in reversed(procs):
            try:
                p.send_signal(signal.SIGTERM)
            except Exception:
                pass
        for p in procs:
            try:
                p.wait(timeout=15)
            except Exception:
                p.kill()
        report["agent_log_tail"] = {k: open(v).read()[-4000:] for k, v in logs.items()}
        if a.log_dir:
            import shutil
            for k, v in logs.items():
                shutil.copy(v, os.path.join(a.log_dir, os.path.basename(a.out) + "." + k + ".log"))
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps({k: v for k, v in report.items() if k != "agent_log_tail"}, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
