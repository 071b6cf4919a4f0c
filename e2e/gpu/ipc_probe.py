#!/usr/bin/env python3
"""Diagnostic for issue 19: is GPU memory imported through CUDA IPC (the
way an agent maps an engine's pool) slower for the block copy than memory
allocated in the same process? Process A allocates two 64 MiB tensors and
shares them (torch.multiprocessing: cudaIpcGetMemHandle); process B times,
with CUDA events, on the imported pair and on a pair it allocated itself:
a contiguous copy, and 16,384 random 4 KiB blocks (and 1,024 x 64 KiB)
gathered/scattered with index_select + index_copy_ (the temporary is local
in both cases). Prints JSON (p50 µs)."""
import json
import sys

import torch
import torch.multiprocessing as mp


def child(q, r):
    src, dst = q.get()
    torch.cuda.synchronize()
    loc_src = src.clone()
    loc_dst = torch.zeros_like(dst)
    g = torch.Generator(device="cuda").manual_seed(3)

    def time_us(f, n=50):
        f()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        v = []
        for _ in range(n):
            e0.record()
            f()
            e1.record()
            e1.synchronize()
            v.append(e0.elapsed_time(e1) * 1e3)
        v.sort()
        return round(v[len(v) // 2], 1)

    out = {}
    for name, (s, d) in {"imported (CUDA IPC)": (src, dst), "local": (loc_src, loc_dst)}.items():
        row = {"contiguous 64 MiB copy": time_us(lambda: d.copy_(s))}
        for bs in (4096, 65536):
            n = s.numel() // bs
            si = torch.randperm(n, device="cuda", generator=g)
            di = torch.randperm(n, device="cuda", generator=g)
            sv, dv = s.view(n, bs), d.view(n, bs)
            tmp = torch.empty_like(sv)
            row[f"gather {n} x {bs // 1024} KiB (index_select)"] = time_us(lambda: torch.index_select(sv, 0, si, out=tmp))
            row[f"scatter {n} x {bs // 1024} KiB (index_copy_)"] = time_us(lambda: dv.index_copy_(0, di, tmp))
        out[name] = row
    r.put(out)


def main():
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    p = ctx.Process(target=child, args=(q, r))
    p.start()
    q.put((src, dst))
    res = r.get(timeout=300)
    p.join(timeout=60)
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
