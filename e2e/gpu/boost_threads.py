#!/usr/bin/env python3
"""Raise the CPU priority of an agent's hot threads during a bench (issue 18).

An experiment, not a product setting: the ninth session's timelines put
the open-loop tail in threads with work waiting for a CPU. This script
finds, every INTERVAL seconds, the threads of every process whose command
line contains PATTERN and whose name (comm) matches THREADS (default: the
IO threads `io:*` and copy workers `cp*`), and gives each once either a
nice value (`nice:-15`, SCHED_OTHER with a larger CFS weight) or a
real-time policy (`fifo:10`, SCHED_FIFO priority 10; the kernel's RT
throttling still leaves 5 % of each CPU to the rest). It stops when the
processes it saw are gone, or after --timeout seconds, and prints the
threads it changed. Needs root (or CAP_SYS_NICE) on the GPU machine.

    python3 boost_threads.py --pattern kvfabric-gpu --policy nice:-15 &
"""

import argparse
import os
import re
import sys
import time

# The processes: the same rule as the thread profile's (not the helpers).
from thread_cpu import pids


def apply(tid: int, policy: str, value: int) -> None:
    if policy == "nice":
        os.setpriority(os.PRIO_PROCESS, tid, value)
    elif policy == "fifo":
        os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(value))
    else:
        raise ValueError(policy)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="kvfabric-gpu")
    ap.add_argument("--threads", default=r"^(io:|cp\d)")
    ap.add_argument("--policy", required=True, help="nice:N (-20..19) or fifo:N (1..99)")
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    try:
        policy, value = a.policy.split(":")
        value = int(value)
        if policy not in ("nice", "fifo"):
            raise ValueError
    except ValueError:
        print(f"--policy {a.policy!r}: expected nice:N or fifo:N", file=sys.stderr)
        return 2
    names = re.compile(a.threads)
    done: dict[int, str] = {}
    seen = False
    end = time.monotonic() + a.timeout
    while time.monotonic() < end:
        ps = pids(a.pattern)
        if ps:
            seen = True
        elif seen:
            break
        for pid in ps:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for t in tids:
                tid = int(t)
                if tid in done:
                    continue
                try:
                    with open(f"/proc/{pid}/task/{t}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    continue
                if not names.search(comm):
                    continue
                try:
                    apply(tid, policy, value)
                    done[tid] = comm
                except OSError as e:
                    done[tid] = f"{comm} (failed: {e})"
        time.sleep(a.interval)
    print(f"boost {a.policy}: {len(done)} threads: " + ", ".join(sorted(set(done.values()))))
    failed = [c for c in done.values() if "(failed" in c]
    if failed or not done:
        print(f"boost {a.policy}: NOT APPLIED to {len(failed) if done else 'any'} thread(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
