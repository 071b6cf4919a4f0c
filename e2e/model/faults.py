#!/usr/bin/env python3
"""Issue 13's fault cases with the real model (e2e/model/handoff.py's model,
paged pools and decode), through two GPU agents with the test-only fault
hooks (agent/src/runtime/faults.rs: ``KVFABRIC_TEST_FAULTS=1`` and
``--debug-api``, armed with ``POST /v1/debug/faults``; an agent given the
variable without the debug API refuses to start, checked here first).

  * ``flip`` (in-flight negative control): one process with a prefill
    engine on agent A and a decode engine on agent B. The prompt is
    prefilled once; the monolithic reference decodes it on the native cache.
    A clean bounce hand-off, rebuilt and decoded, must be bit-identical to
    the reference at every step. Then agent B is armed to flip one byte
    (XOR 0xFF) of the next chunk in its bounce arena, after the sender's
    gather and before its own scatter; the same request handed off again
    arrives SUCCESS (the fabric does not checksum) with exactly one byte
    different in the decode pool, and its decode logits must differ.
  * ``kill`` (prefill engine SIGKILLed halfway through a hand-off): agent
    A is armed to delay each gather (so the hand-off of an 8,000-token
    prompt, many small chunks, takes about a second); the prefill engine
    process submits the hand-off and is SIGKILLed partway. The decode
    engine's AwaitArrival must resolve FAILURE within the request timeout;
    the decode engine never rebuilds a cache from a failed arrival (it
    reports how many of the request's blocks were partly written, i.e. the
    partial cache it did not use).

Usage (repo root, on the GPU machine):
  python3 e2e/model/faults.py --bin BIN --etcd ETCD --out OUT.json
Writes a JSON report; exit 0 when every check passed.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import handoff as H  # noqa: E402  (the model, pools and decode of issue 13)


def model_args(a, **kw):
    """The namespace handoff.py's helpers read (its defaults: 4 layers,
    GQA 16/4, head_dim 64, bf16, seed 1234)."""
    ns = argparse.Namespace(layers=4, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                            vocab=32000, max_positions=16384, dtype="bf16", seed=1234, device=a.device,
                            host_pools=False, num_blocks=a.num_blocks)
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read().decode())


def wait_file(path, t):
    end = time.time() + t
    while time.time() < end:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return open(path).read()
        time.sleep(0.01)
    raise RuntimeError("timed out waiting for " + path)


def case_of(tokens, seed):
    return dict(key=f"fault-{tokens}", variant="eager", attn="eager", backend=None, lens=[tokens],
                negative=False, rids=[1], seeds=[seed])


# --------------------------------------------------------------------------
# flip: one process, both engines


def role_flip(a):
    torch = H.setup_torch(a)
    import kvfabric

    m = model_args(a)
    case = case_of(a.tokens, 1234 * 1000003)
    nb = a.num_blocks
    pa = model_args(a, sock=a.sock_a, engine_id="flip-prefill")
    pb = model_args(a, sock=a.sock_b, engine_id="flip-decode")
    ps, ppool, _, keep_p = H.attach(pa, "prefill", nb)
    ds, dpool, _, keep_d = H.attach(pb, "decode", nb)
    model, wsha = H.build_model(m, "eager")
    H.warm_up(m, model, case)
    ids, mask = H.prompts(m, case)
    cache, _, first = H.prefill(model, ids, mask)
    n = a.tokens
    k = H.blocks_needed([n])
    alloc_p, alloc_d = H.BlockAllocator(nb, 7), H.BlockAllocator(nb, 8)
    src = alloc_p.alloc(k)
    ppool.write(H.cache_layers(cache), 0, 0, n, src)
    H.sync(m)
    ref_logits, ref_toks = H.decode(model, cache, mask, [n], first, a.steps)
    del cache
    rep = {"tokens": n, "blocks": k, "steps": a.steps, "weights_sha256": wsha}

    def handoff(rid, dst):
        fut = ds.await_arrival_async(rid, "flip-prefill", timeout=60)
        deadline = time.time() + 30
        while True:
            try:
                r = ps.transfer_blocks(rid, "flip-decode", src, dst, path="bounce", timeout_ms=30000)
                break
            except (kvfabric.NotFound, kvfabric.FailedPrecondition):
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        arr = fut.result(timeout=90)
        return {"outcome": r.outcome, "reason": r.reason, "path": r.path, "bytes": r.bytes,
                "transfer_us": r.transfer_us, "arrival": arr.outcome}

    def decode_from(dst):
        c = H.rebuild(model, dpool, case, [dst])
        lg, tk = H.decode(model, c, mask, [n], first, a.steps)
        return lg, tk

    def first_diff(x, y):
        for t in range(x.shape[1]):
            if not torch.equal(x[:, t], y[:, t]):
                return t
        return None

    d1 = alloc_d.alloc(k)
    rep["clean"] = handoff(11, d1)
    lg1, tk1 = decode_from(d1)
    rep["clean"].update(bit_identical=bool(torch.equal(lg1, ref_logits)), first_mismatch_step=first_diff(lg1, ref_logits),
                        tokens_identical=bool(torch.equal(tk1, ref_toks)))
    # Arm one flip on the decode agent, hand the same request off again.
    rep["armed"] = post(a.http_b + "/v1/debug/faults", {"flip_scatter_bytes": 1})
    d2 = alloc_d.alloc(k)
    rep["faulted"] = handoff(12, d2)
    rep["fault_state_after"] = post(a.http_b + "/v1/debug/faults", {})
    # Where the two arrived copies differ (byte level, every layer/plane).
    diffs = []
    bb = dpool.block_bytes
    for layer in range(dpool.layers):
        for plane in range(2):
            for j, (b1, b2) in enumerate(zip(d1, d2)):
                o1, o2 = dpool.block_offset(layer, plane, b1), dpool.block_offset(layer, plane, b2)
                x, y = dpool.raw[o1:o1 + bb], dpool.raw[o2:o2 + bb]
                ne = (x != y).nonzero().flatten()
                for off in ne.tolist()[:4]:
                    diffs.append({"layer": layer, "plane": "KV"[plane], "block_index": j, "byte": off,
                                  "clean": int(x[off]), "faulted": int(y[off])})
    rep["faulted"]["differing_bytes"] = len(diffs)
    rep["faulted"]["where"] = diffs[:4]
    lg2, tk2 = decode_from(d2)
    rep["faulted"].update(bit_identical=bool(torch.equal(lg2, ref_logits)),
                          first_mismatch_step=first_diff(lg2, ref_logits),
                          tokens_identical=bool(torch.equal(tk2, ref_toks)),
                          max_abs_logit_diff=float((lg2.float() - ref_logits.float()).abs().max()))
    rep["ok"] = (rep["clean"]["outcome"] == "success" and rep["clean"]["bit_identical"]
                 and rep["faulted"]["outcome"] == "success" and rep["faulted"]["arrival"] == "success"
                 and rep["faulted"]["differing_bytes"] == 1 and not rep["faulted"]["bit_identical"])
    with open(a.result, "w") as f:
        json.dump(rep, f)
    ps.close()
    ds.close()
    del keep_p, keep_d


# --------------------------------------------------------------------------
# kill: a prefill engine process (SIGKILLed) and a decode engine process


def role_kill_decode(a):
    torch = H.setup_torch(a)

    pb = model_args(a, sock=a.sock_b, engine_id="kill-decode")
    n = a.kill_tokens
    k = H.blocks_needed([n])
    ds, dpool, _, keep = H.attach(pb, "decode", a.num_blocks)
    dst = H.BlockAllocator(a.num_blocks, 9).alloc(k)
    fut = ds.await_arrival_async(21, "kill-prefill", timeout=a.await_timeout)
    with open(os.path.join(a.workdir, "kill.dst.json"), "w") as f:
        json.dump({"dst_blocks": dst}, f)
    rep = {"tokens": n, "blocks": k}
    try:
        arr = fut.result(timeout=a.await_timeout + 30)
        rep.update(outcome=arr.outcome, reason=arr.reason)
    except Exception as e:  # noqa: BLE001 - reported
        rep.update(outcome="error", reason=f"{type(e).__name__}: {e}")
    rep["resolved_at"] = time.time()
    torch.cuda.synchronize()
    # What landed: per (layer, plane), how many of the request's blocks are
    # non-zero (the pool started zeroed). Never rebuilt unless SUCCESS.
    idx = torch.tensor(dst, device=dpool.raw.device)
    written = []
    for layer in range(dpool.layers):
        for plane in range(2):
            x = dpool.view[layer, plane].index_select(0, idx).reshape(len(dst), -1)
            written.append(int((x != 0).any(dim=1).sum()))
    rep["blocks_written_per_plane"] = written
    rep["planes_x_blocks"] = len(written) * len(dst)
    rep["block_planes_written"] = sum(written)
    rep["rebuilt"] = False
    if rep["outcome"] == "success":
        rep["rebuilt"] = True  # would be used: the check below fails the run
    with open(a.result, "w") as f:
        json.dump(rep, f)
    ds.close()
    del keep


def role_kill_prefill(a):
    H.setup_torch(a)

    m = model_args(a)
    n = a.kill_tokens
    case = case_of(n, 1234 * 1000003 + 7)
    pa = model_args(a, sock=a.sock_a, engine_id="kill-prefill")
    ps, ppool, _, keep = H.attach(pa, "prefill", a.num_blocks)
    model, _ = H.build_model(m, "eager")
    ids, mask = H.prompts(m, case)
    t0 = time.perf_counter()
    cache, _, _ = H.prefill(model, ids, mask)
    H.sync(m)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    src = H.BlockAllocator(a.num_blocks, 10).alloc(H.blocks_needed([n]))
    ppool.write(H.cache_layers(cache), 0, 0, n, src)
    H.sync(m)
    dst = json.loads(wait_file(os.path.join(a.workdir, "kill.dst.json"), 120))["dst_blocks"]
    with open(os.path.join(a.workdir, "kill.prefilled"), "w") as f:
        json.dump({"prefill_ms": prefill_ms}, f)
    wait_file(os.path.join(a.workdir, "kill.go"), 60)
    fut = ps.transfer_async(21, "kill-decode", src, dst, path="bounce", timeout_ms=a.request_timeout_ms)
    with open(os.path.join(a.workdir, "kill.submitted"), "w") as f:
        f.write(repr(time.time()))
    r = fut.result(timeout=120)  # killed before this returns (else reported)
    with open(os.path.join(a.workdir, "kill.prefill_result.json"), "w") as f:
        json.dump({"outcome": r.outcome, "reason": r.reason, "transfer_us": r.transfer_us}, f)
    time.sleep(60)
    del keep


# --------------------------------------------------------------------------
# coordinator


def run(a):
    tmp = tempfile.mkdtemp(prefix="kvf-faults-")
    report = {"workdir": tmp, "ok": False}
    procs, logs = [], {}
    cport, pport = H.free_port(), H.free_port()
    base_env = dict(os.environ, KVFABRIC_BOUNCE_ENABLE="1", KVFABRIC_BOUNCE_ARENA_SIZE_BYTES="256MiB",
                    KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT="1",
                    KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES=str(a.chunk_bytes),
                    KVFABRIC_LOG="info", UCX_CUDA_IPC_ENABLE_SAME_PROCESS="y", NO_COLOR="1")
    try:
        # 0. The gate: the variable without the debug API stops start-up.
        env = dict(base_env, KVFABRIC_TEST_FAULTS="1")
        g = subprocess.run([a.bin, "agent", "--gpu", "0", "--listen", "127.0.0.1:0", "--control-bind", "loopback",
                            "--etcd", f"http://127.0.0.1:{cport}", "--fabric", "faults", "--logical-id", "gate"],
                           env=env, capture_output=True, text=True, timeout=60)
        report["gate"] = {"exit": g.returncode, "stderr_tail": (g.stderr or g.stdout)[-600:],
                          "refused": g.returncode != 0 and "KVFABRIC_TEST_FAULTS" in (g.stderr + g.stdout)}
        etcd = subprocess.Popen([a.etcd, "--name", "f", "--data-dir", os.path.join(tmp, "etcd"),
                                 "--listen-client-urls", f"http://127.0.0.1:{cport}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-cluster", f"f=http://127.0.0.1:{pport}", "--log-level", "error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(etcd)
        time.sleep(1.5)
        agents = {}
        for name, role in (("node-a", "prefill"), ("node-b", "decode")):
            sock = os.path.join(tmp, name + ".sock")
            log = open(os.path.join(tmp, name + ".log"), "w")
            logs[name] = log.name
            p = subprocess.Popen([a.bin, "agent", "--gpu", "0", "--engine-socket", sock, "--debug-api",
                                  "--listen", "127.0.0.1:0", "--control-bind", "loopback",
                                  "--pool-size", "16MiB", "--etcd", f"http://127.0.0.1:{cport}",
                                  "--fabric", "faults", "--logical-id", name, "--role", role],
                                 env=env, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            line = p.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"{name} did not start: {line!r}; log {open(log.name).read()[-3000:]}")
            agents[name] = {"sock": sock, "http": line.strip().split("listening on ", 1)[1]}
        report["agents"] = {k: v["http"] for k, v in agents.items()}
        common = ["--bin", a.bin, "--etcd", a.etcd, "--out", a.out, "--device", a.device,
                  "--num-blocks", str(a.num_blocks), "--tokens", str(a.tokens), "--steps", str(a.steps),
                  "--kill-tokens", str(a.kill_tokens), "--request-timeout-ms", str(a.request_timeout_ms),
                  "--await-timeout", str(a.await_timeout), "--workdir", tmp,
                  "--sock-a", agents["node-a"]["sock"], "--sock-b", agents["node-b"]["sock"],
                  "--http-a", agents["node-a"]["http"], "--http-b", agents["node-b"]["http"]]

        def child(role, result):
            log = open(os.path.join(tmp, role + ".log"), "w")
            logs[role] = log.name
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *common, "--role", role,
                                  "--result", result], stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            return p

        def wait_result(p, path, t, name):
            end = time.time() + t
            while time.time() < end:
                if os.path.exists(path):
                    return json.load(open(path))
                if p.poll() is not None and not os.path.exists(path):
                    raise RuntimeError(f"{name} exited {p.returncode}: {open(logs[name]).read()[-3000:]}")
                time.sleep(0.05)
            raise RuntimeError(f"{name}: no result in {t} s")

        # (a) flip
        if "flip" in a.cases:
            fr = os.path.join(tmp, "flip.json")
            fp = child("flip", fr)
            try:
                report["flip"] = wait_result(fp, fr, 400, "flip")
            except Exception as e:  # noqa: BLE001 - reported
                report["flip"] = {"ok": False, "error": str(e)}
            fp.wait(timeout=30)
        # (b) kill
        if "kill" in a.cases:
            dr = os.path.join(tmp, "kill_decode.json")
            dp = child("kill-decode", dr)
            pp = child("kill-prefill", os.path.join(tmp, "unused.json"))
            pre = json.loads(wait_file(os.path.join(tmp, "kill.prefilled"), 300))
            armed = post(agents["node-a"]["http"] + "/v1/debug/faults",
                         {"gather_delay_ms": a.gather_delay_ms, "delayed_gathers": 100000})
            open(os.path.join(tmp, "kill.go"), "w").write("go")
            t_sub = float(wait_file(os.path.join(tmp, "kill.submitted"), 60))
            time.sleep(a.kill_after_ms / 1000.0)
            pp.send_signal(signal.SIGKILL)
            t_kill = time.time()
            kd = wait_result(dp, dr, a.await_timeout + 60, "kill-decode")
            after = post(agents["node-a"]["http"] + "/v1/debug/faults", {"delayed_gathers": 0})
            pp.wait(timeout=10)
            pres = os.path.join(tmp, "kill.prefill_result.json")
            kd.update(prefill_ms=pre["prefill_ms"], armed=armed, fault_state_after=after,
                      killed_after_submit_ms=round((t_kill - t_sub) * 1e3, 1),
                      resolved_after_kill_ms=round((kd["resolved_at"] - t_kill) * 1e3, 1),
                      resolved_after_submit_ms=round((kd["resolved_at"] - t_sub) * 1e3, 1),
                      request_timeout_ms=a.request_timeout_ms,
                      prefill_saw_result=json.load(open(pres)) if os.path.exists(pres) else None,
                      prefill_signal=-pp.returncode if pp.returncode is not None and pp.returncode < 0 else None)
            kd["ok"] = (kd["outcome"] == "failure" and kd["resolved_after_submit_ms"] < a.request_timeout_ms
                        and not kd["rebuilt"] and kd["prefill_saw_result"] is None)
            kd["partial"] = 0 < kd["block_planes_written"] < kd["planes_x_blocks"]
            report["kill"] = kd
            # The pair still works after the kill: the flip role's engines
            # are gone; the decode engine of the kill case detached itself.
        report["ok"] = bool(report["gate"]["refused"]
                            and all(report[c].get("ok") for c in a.cases if c in report))
    except Exception as e:  # noqa: BLE001 - reported
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in reversed(procs):
            try:
                p.send_signal(signal.SIGTERM)
            except Exception:  # noqa: BLE001
                pass
        for p in procs:
            try:
                p.wait(timeout=15)
            except Exception:  # noqa: BLE001
                p.kill()
        report["log_tail"] = {k: open(v).read()[-2500:] for k, v in logs.items()}
        # Kept only when a case failed, or with KVF_KEEP_WORKDIR=1.
        if report.get("ok") and os.environ.get("KVF_KEEP_WORKDIR", "0") != "1":
            shutil.rmtree(tmp, ignore_errors=True)
            report["workdir_removed"] = True
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin")
    ap.add_argument("--etcd")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cases", default="flip,kill")
    ap.add_argument("--tokens", type=int, default=2048, help="flip: prompt tokens (a multiple of 16: no "
                    "unused block tail the flip could land in)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kill-tokens", type=int, default=8000)
    ap.add_argument("--num-blocks", type=int, default=1200)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20, help="KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES")
    ap.add_argument("--gather-delay-ms", type=int, default=100)
    ap.add_argument("--kill-after-ms", type=int, default=350)
    ap.add_argument("--request-timeout-ms", type=int, default=10000)
    ap.add_argument("--await-timeout", type=float, default=30.0)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    for k in ("sock-a", "sock-b", "http-a", "http-b"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.cases = [c for c in a.cases.split(",") if c]
    if a.role:
        {"flip": role_flip, "kill-decode": role_kill_decode, "kill-prefill": role_kill_prefill}[a.role](a)
        return
    if not a.bin or not a.etcd:
        ap.error("--bin and --etcd are needed")
    report = run(a)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    brief = {k: v for k, v in report.items() if k != "log_tail"}
    print(json.dumps(brief, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
