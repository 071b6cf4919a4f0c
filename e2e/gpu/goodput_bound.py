#!/usr/bin/env python3
"""Goodput an ideal single FIFO server reaches at a p99 latency SLO (issue 18).

Models the transfer engine at load as one ideal server: Poisson arrivals,
every request served in D = 1 / peak seconds (the closed-loop peak
throughput, requests/s), first come first served, no overhead — an M/D/1
queue. An estimate, not a bound: FIFO minimises the largest wait, not
the p99, and an engine that serves several requests at once can beat it;
it fits when the lone-request latency is about 1 / peak (on the H200, 151 MB requests:
1 / 836 req/s = 1.2 ms against a lone request's 1.3-1.7 ms).

Prints, for each peak: the highest load (fraction of peak, and req/s) at
which the p99 sojourn time (queueing + service) stays within the SLO, and
what the peak would have to be for a given target fraction to meet it.

    python3 e2e/gpu/goodput_bound.py --peak 836 787 695 --slo-ms 6 --target 0.7

Monte-Carlo (seeded), 1,000,000 requests per point; under a minute.
"""

import argparse
import random


def p99_sojourn(rho: float, n: int, seed: int) -> float:
    """p99 of (wait + service) in units of the service time at load rho."""
    if not 0.0 < rho < 1.0:
        raise ValueError(f"load must be in (0, 1), got {rho}")
    rng = random.Random(seed)
    t = free = 0.0
    soj = []
    for _ in range(n):
        t += rng.expovariate(rho)
        free = max(t, free) + 1.0
        soj.append(free - t)
    soj.sort()
    return soj[int(0.99 * n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peak", type=float, nargs="+", required=True, help="closed-loop peak, requests/s")
    ap.add_argument("--slo-ms", type=float, default=6.0, help="p99 latency SLO, ms (default 6.0, the seed's)")
    ap.add_argument("--target", type=float, default=0.7, help="goodput target as a fraction of peak (default 0.7)")
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=2)
    a = ap.parse_args()
    if any(p <= 0 for p in a.peak) or a.slo_ms <= 0 or not 0 < a.target < 1 or a.requests < 1000:
        ap.error("--peak and --slo-ms must be > 0, --target in (0, 1), --requests >= 1000")
    at_target = p99_sojourn(a.target, a.requests, a.seed)
    for peak in a.peak:
        d_ms = 1000.0 / peak
        lo, hi = 0.01, 0.99
        for _ in range(14):
            mid = (lo + hi) / 2
            if p99_sojourn(mid, a.requests, a.seed) * d_ms <= a.slo_ms:
                lo = mid
            else:
                hi = mid
        # The search keeps lo / hi inside [0.01, 0.99]: say so at the ends
        # rather than print a clamped value as if it were found.
        if p99_sojourn(0.01, a.requests, a.seed) * d_ms > a.slo_ms:
            print(f"peak {peak:g} req/s (service {d_ms:.3f} ms): p99 > {a.slo_ms:g} ms at every load (none)")
            continue
        if p99_sojourn(0.99, a.requests, a.seed) * d_ms <= a.slo_ms:
            print(f"peak {peak:g} req/s (service {d_ms:.3f} ms): p99 <= {a.slo_ms:g} ms up to >= 0.99 of peak")
            continue
        print(
            f"peak {peak:g} req/s (service {d_ms:.3f} ms): p99 <= {a.slo_ms:g} ms up to "
            f"{lo:.3f} of peak = {lo * peak:.0f} req/s"
        )
    print(
        f"at {a.target:g} of peak the p99 is {at_target:.2f} service times: the SLO needs a service "
        f"time <= {a.slo_ms / at_target:.3f} ms, a peak >= {at_target / a.slo_ms * 1000:.0f} req/s"
    )


if __name__ == "__main__":
    main()
