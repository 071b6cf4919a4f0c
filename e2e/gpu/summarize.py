#!/usr/bin/env python3
"""One line per `kvfabric-gpu bench` JSON report given: requests/s and the
latency from arrival (open loop) of all requests and of the smallest
quarter of prompts, p50 / p99 ms. Usage: summarize.py REPORT.json..."""
import json
import os
import sys


def pair(stats):
    if not stats:
        return "-"
    return f"{stats['p50_ms']:.1f}/{stats['p99_ms']:.1f}"


def main(paths):
    for path in sorted(paths):
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{path}: unreadable: {e}", file=sys.stderr)
            continue
        name = os.path.basename(path).removesuffix(".json")
        for p in report.get("paths", []):
            print(
                f"{name:<64} {p['path']:<8} {p['requests_per_s']:>8.1f} req/s  "
                f"service p50/p99 {p['p50_ms']:.1f}/{p['p99_ms']:.1f}  "
                f"arrival {pair(p.get('from_arrival'))}  small {pair(p.get('from_arrival_small'))}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
