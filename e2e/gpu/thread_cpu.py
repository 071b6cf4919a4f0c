#!/usr/bin/env python3
"""Per-thread CPU share of a process tree over a window (issue 18).

Samples /proc/PID/task/*/stat (utime + stime, clock ticks) of every process
whose command line contains PATTERN at the ends of consecutive windows of
WINDOW seconds (after DELAY, until no such process is left or WINDOWS
windows passed), and prints per window each thread's CPU share (100 % =
one core busy the whole window), busiest first, with the share of the
window it spent runnable but waiting for a CPU (run queue delay, from
/proc/.../schedstat: a thread that spins needs a core of its own, so a
large wait on the IO threads means the host is oversubscribed), and the
whole host's busy CPUs and runnable threads (/proc/stat), and each thread's
context switches a second, voluntary (it blocked: a wake-up later) and
involuntary (preempted, or a sched_yield that let another thread run: the
task stays runnable), from /proc/.../status, with their sum
by thread name. Used on the GPU machine during a closed-loop run to see
which thread saturates first and which threads' hand-overs cost the
wake-ups.

    python3 thread_cpu.py --pattern kvfabric-gpu --delay 1 --window 1.5 --windows 20
"""

import argparse
import os
import re
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
        # Not the helpers watching the same processes (they name it too).
        if pattern in cmd and not any(h in cmd for h in ("boost_threads.py", "thread_cpu.py")):
            out.append(int(d))
    return out


def host() -> tuple[int, int, int]:
    """(busy ticks, all ticks, runnable threads now) of the whole host."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    cpu = [int(x) for x in lines[0].split()[1:]]
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)
    running = next((int(l.split()[1]) for l in lines if l.startswith("procs_running")), 0)
    return sum(cpu) - idle, sum(cpu), running


def sched(pid: int, tid: str) -> tuple[int, int]:
    """(on-CPU ns, run-queue wait ns) of one thread, (0, 0) if unknown."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            on, wait, _ = f.read().split()
        return int(on), int(wait)
    except (OSError, ValueError):
        return 0, 0


def switches(pid: int, tid: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of one thread so far."""
    vol = invol = 0
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return vol, invol


def sample(pattern: str) -> dict[tuple[int, int], tuple]:
    """(pid, tid) -> (thread name, utime + stime ticks, run-queue wait ns,
    voluntary switches, involuntary switches)."""
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
            vol, invol = switches(pid, tid)
            res[(pid, int(tid))] = (name, int(rest[11]) + int(rest[12]), sched(pid, tid)[1], vol, invol)
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
    t0, s0, h0 = time.monotonic(), sample(a.pattern), host()
    for w in range(a.windows):
        # The runnable count, sampled every 10 ms through the window.
        runnable = []
        end = time.monotonic() + a.window
        while time.monotonic() < end:
            runnable.append(host()[2])
            time.sleep(0.01)
        t1, s1, h1 = time.monotonic(), sample(a.pattern), host()
        if not s1:
            break
        rows = []
        waits = {}
        cs = {}
        dt = t1 - t0
        for key, (name, ticks, wait, vol, invol) in s1.items():
            # A thread born inside the window: all its ticks are new.
            before, wait0, vol0, invol0 = s0[key][1:5] if key in s0 else (0, 0, 0, 0)
            share = (ticks - before) / hz / dt * 100
            waited = (wait - wait0) / 1e9 / dt * 100
            vps, ips = (vol - vol0) / dt, (invol - invol0) / dt
            rows.append((share, waited, key[0], key[1], name, vps, ips))
            # Run-queue wait and switches summed by thread name with
            # numbers masked (workers, process ids).
            group = re.sub(r"\d+", "#", name)
            waits[group] = waits.get(group, 0.0) + waited
            v, i = cs.get(group, (0.0, 0.0))
            cs[group] = (v + vps, i + ips)
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        busy = (h1[0] - h0[0]) / max(1, h1[1] - h0[1]) * os.cpu_count()
        mean_run = sum(runnable) / max(1, len(runnable))
        print(
            f"window {w} ({t1 - t0:.2f} s): {len(rows)} threads, total {total:.0f} % of one core; "
            f"host {busy:.1f} of {os.cpu_count()} CPUs busy, runnable threads mean {mean_run:.1f} "
            f"max {max(runnable, default=0)}"
        )
        for share, waited, pid, tid, name, vps, ips in rows[: a.top]:
            print(
                f"  {share:6.1f} %  wait {waited:5.1f} %  switches/s {vps:8.0f} vol {ips:7.0f} invol"
                f"  pid {pid:>7} tid {tid:>7}  {name}"
            )
        top_waits = sorted(waits.items(), key=lambda kv: -kv[1])[:6]
        print("  run-queue wait by name: " + ", ".join(f"{n} {v:.0f} %" for n, v in top_waits))
        total_cs = sum(v + i for v, i in cs.values())
        top_cs = sorted(cs.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:8]
        print(
            f"  context switches/s {total_cs:.0f}, by name: "
            + ", ".join(f"{n} {v:.0f}+{i:.0f}" for n, (v, i) in top_cs)
        )
        t0, s0, h0 = t1, s1, h1


if __name__ == "__main__":
    main()
