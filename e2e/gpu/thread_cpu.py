#!/usr/bin/env python3
"""Per-thread CPU share of a process tree over a window (issue 18).

Samples /proc/PID/task/*/stat (utime + stime, clock ticks) of every process
whose command line contains PATTERN at the ends of consecutive windows of
WINDOW seconds (after DELAY, until no such process is left or WINDOWS
windows passed), and prints per window each thread's CPU share (100 % =
one core busy the whole window), busiest first. Used on the GPU machine
during a closed-loop run to see which thread saturates first.

    python3 thread_cpu.py --pattern kvfabric-gpu --delay 1 --window 1.5 --windows 20
"""

import argparse
import os
import time


def pids(pattern: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmd and "thread_cpu.py" not in cmd:
            out.append(int(d))
    return out


def sample(pattern: str) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (thread name, utime + stime ticks)."""
    res = {}
    for pid in pids(pattern):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            # The name is in parentheses and may hold spaces.
            name = s[s.index("(") + 1 : s.rindex(")")]
            rest = s[s.rindex(")") + 2 :].split()
            res[(pid, int(tid))] = (name, int(rest[11]) + int(rest[12]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", required=True, help="substring of the processes' command lines")
    ap.add_argument("--delay", type=float, default=2.0, help="seconds before the window opens")
    ap.add_argument("--window", type=float, default=2.0, help="window length, seconds")
    ap.add_argument("--windows", type=int, default=1, help="most windows")
    ap.add_argument("--top", type=int, default=12, help="threads printed a window")
    a = ap.parse_args()
    if a.delay < 0 or a.window <= 0 or a.windows < 1 or a.top < 1:
        ap.error("--delay must be >= 0, --window > 0, --windows and --top >= 1")
    time.sleep(a.delay)
    hz = os.sysconf("SC_CLK_TCK")
    t0, s0 = time.monotonic(), sample(a.pattern)
    for w in range(a.windows):
        time.sleep(a.window)
        t1, s1 = time.monotonic(), sample(a.pattern)
        if not s1:
            break
        rows = []
        for key, (name, ticks) in s1.items():
            # A thread born inside the window: all its ticks are new.
            before = s0[key][1] if key in s0 else 0
            share = (ticks - before) / hz / (t1 - t0) * 100
            rows.append((share, key[0], key[1], name))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"window {w} ({t1 - t0:.2f} s): {len(rows)} threads, total {total:.0f} % of one core")
        for share, pid, tid, name in rows[: a.top]:
            print(f"  {share:6.1f} %  pid {pid:>7} tid {tid:>7}  {name}")
        t0, s0 = t1, s1


if __name__ == "__main__":
    main()
