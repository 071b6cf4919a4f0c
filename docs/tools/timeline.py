#!/usr/bin/env python3
"""Per-request bounce timeline from KVFABRIC_LOG=...runtime=trace logs.
Usage: timeline.py LOG [skip_first_n_rids]"""
import re, sys, statistics, datetime, collections
ansi = re.compile(r'\x1b\[[0-9;]*m')
line_re = re.compile(r'^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z\s+(\w+)\s+([\w:]+):\s+(.*)$')
kv_re = re.compile(r'(\w+)=("[^"]*"|\S+)')
def ts(s):
    d = datetime.datetime.strptime(s[:26], '%Y-%m-%dT%H:%M:%S.%f')
    return d.timestamp()*1e6
ev = collections.defaultdict(list)   # rid -> [(t, msg, fields)]
copies = collections.defaultdict(list)
for raw in open(sys.argv[1], errors='replace'):
    l = ansi.sub('', raw.strip())
    m = line_re.match(l)
    if not m: continue
    t = ts(m.group(1)); rest = m.group(4)
    fields = dict(kv_re.findall(rest))
    msg = kv_re.sub('', rest).strip()
    if msg == 'cuda copy':
        copies[fields.get('dir','?')].append(fields)
    rid = fields.get('rid')
    if rid is not None:
        ev[rid].append((t, msg, fields))
skip = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rids = sorted(ev, key=lambda r: ev[r][0][0])[skip:]
rows = collections.defaultdict(lambda: ([], []))
for r in rids:
    evs = sorted(ev[r]); t0 = None
    for t, msg, f in evs:
        # 'sized' is logged by the submitting thread, before the IO thread's 'submit'.
        if msg in ('sized', 'submit'): t0 = t; break
    if t0 is None: continue
    seen = {}
    for t, msg, f in evs:
        first, last = rows[msg]
        if msg not in seen:
            first.append(t - t0); seen[msg] = True
    lastseen = {}
    for t, msg, f in evs: lastseen[msg] = t - t0
    for msg, v in lastseen.items(): rows[msg][1].append(v)
print(f"{len(rids)} requests (first {skip} skipped); median µs after submit")
print(f"{'event':<20}{'first':>10}{'last':>10}")
for msg, (first, last) in sorted(rows.items(), key=lambda kv: statistics.median(kv[1][0])):
    print(f"{msg:<20}{statistics.median(first):>10.0f}{statistics.median(last):>10.0f}")
for d, fs in copies.items():
    print(f"cuda copy {d}: n={len(fs)}", end='')
    for k in ('acquired_us','enqueued_us','done_us','runs'):
        vals = [int(f[k]) for f in fs if k in f]
        if vals: print(f"  {k} med {statistics.median(vals):.0f} p90 {sorted(vals)[int(len(vals)*0.9)]}", end='')
    print()
