#!/usr/bin/env python3
"""GPU engines are matched to their agent by GPU UUID (issue 12), on the H200.

Ordinals are per process: an engine pod with one GPU sees it as device 0
whatever the node calls it. One agent with `--gpu 0` serving
`<dir>/{gpu_uuid}.sock` with `--require-device-uuid` (as the chart runs
one agent per GPU); the engine (this process, torch) then:

1. finds the socket with `kvfabric.engine_socket(kvfabric.gpu_uuid(0), dir)`
   and checks the UUID is the one `nvidia-smi -L` prints for the GPU;
2. attaches with device 0 (the client fills `device_uuid` from torch) and
   registers a CUDA tensor as its pool: accepted;
3. attaches with device 3 and the right UUID (a pod whose ordinal differs
   from the agent's): accepted;
4. attaches with device 0 and another GPU's UUID: refused
   (FailedPrecondition naming both UUIDs);
5. attaches with a device torch does not have (so no UUID is filled):
   refused, the message saying the UUID is missing.

Writes a JSON report (--out); exit 1 if any case went otherwise.

    python3 e2e/gpu/gpu_uuid.py --bin /tmp/kvf/kvfabric --out gpu_uuid.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="kvfabric (built with --features cuda)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    import kvfabric

    tmp = tempfile.mkdtemp(prefix="kvf-uuid-")
    report: dict = {"ok": False, "cases": {}}
    # Bounce on, as the chart runs agents (GPU pools move through bounce).
    env = dict(os.environ, KVFABRIC_LOG=os.environ.get("KVFABRIC_LOG", "info"), KVFABRIC_BOUNCE_ENABLE="1",
               KVFABRIC_BOUNCE_ARENA_SIZE_BYTES="256MiB")
    log = open(os.path.join(tmp, "agent.log"), "w")
    agent = subprocess.Popen(
        [a.bin, "agent", "--gpu", "0", "--engine-socket", os.path.join(tmp, "{gpu_uuid}.sock"),
         "--listen", "127.0.0.1:0", "--pool-size", "16MiB", "--fabric", "uuid", "--logical-id", "a",
         "--role", "both", "--require-device-uuid", "--control-bind", "loopback"],
        env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    ok = True
    try:
        line = agent.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"agent did not start: {line!r}; {open(log.name).read()[-3000:]}")
        uuid = kvfabric.gpu_uuid(0)
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        sock = kvfabric.engine_socket(uuid, tmp)
        end = time.time() + 10
        while not os.path.exists(sock) and time.time() < end:
            time.sleep(0.05)
            sock = kvfabric.engine_socket(uuid, tmp)
        c = report["cases"]
        c["socket"] = {"path": sock, "uuid": uuid, "in_nvidia_smi": ("GPU-" + uuid) in smi,
                       "ok": sock == os.path.join(tmp, uuid + ".sock") and ("GPU-" + uuid) in smi}
        client = kvfabric.Client(sock, timeout=10.0)
        layout = kvfabric.Layout.for_model(layers=2, num_blocks=64, total_kv_heads=8, head_dim=128, device=0)
        pool = torch.zeros(layout.pool_bytes(), dtype=torch.uint8, device="cuda:0")
        s = client.attach("uuid-0", "", "decode", layout)
        s.register_tensor(pool)
        c["own_gpu"] = {"session": s.id, "layout_uuid": s.layout.device_uuid, "ok": s.layout.device_uuid == uuid}
        s.detach()
        s3 = client.attach("uuid-3", "", "decode", layout.with_(device=3, device_uuid="GPU-" + uuid.upper()))
        c["other_ordinal_same_uuid"] = {"session": s3.id, "ok": True}
        s3.detach()
        other = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"
        for name, lay, want in (
            ("another_gpus_uuid", layout.with_(device_uuid=other), [other, uuid, "attach to the agent"]),
            ("no_uuid", layout.with_(device=torch.cuda.device_count()), ["device_uuid missing", uuid]),
        ):
            try:
                x = client.attach("uuid-" + name, "", "decode", lay)
                x.detach()
                c[name] = {"refused": False, "ok": False}
            except kvfabric.FailedPrecondition as e:
                c[name] = {"refused": str(e), "ok": all(w in str(e) for w in want)}
        ok = all(v["ok"] for v in c.values())
        report["ok"] = ok
    except Exception as e:  # the report says what broke
        report["error"] = repr(e)
        ok = False
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
        report["agent_log_tail"] = open(log.name).read()[-2000:]
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "agent_log_tail"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
