#!/usr/bin/env bash
# Stops the control plane that e2e/kube/up.sh started in DIR.
#
#   e2e/kube/down.sh [DIR] [--purge]     # default DIR: <repo>/target/kube
#
# Stops kwok, scheduler, controller-manager, apiserver, etcd in that order:
# SIGTERM, then SIGKILL after 10 s. Only processes whose command line names
# DIR are signalled (a recycled pid is left alone). Keeps logs/ for a look
# afterwards; --purge removes DIR entirely. Exits 0 when nothing is left
# running, also when nothing was running.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
purge=0
DIR=""
for a in "$@"; do
  case "$a" in
    --purge) purge=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) [ -z "$DIR" ] || { echo "down.sh: one DIR only" >&2; exit 2; }; DIR="$a" ;;
  esac
done
DIR="${DIR:-$repo/target/kube}"
if [ ! -d "$DIR" ]; then
  echo "down.sh: $DIR does not exist; nothing to stop" >&2
  exit 0
fi
DIR="$(cd "$DIR" && pwd)"

ours() { # ours PID: alive, and started by up.sh for this DIR
  kill -0 "$1" 2>/dev/null && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF "$DIR/"
}

left=()
for c in kwok scheduler controller-manager apiserver etcd; do
  f="$DIR/$c.pid"
  [ -f "$f" ] || continue
  pid="$(cat "$f")"
  if [ -n "$pid" ] && ours "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do ours "$pid" || break; sleep 0.1; done
    if ours "$pid"; then
      echo "down.sh: $c (pid $pid) ignored SIGTERM for 10 s; SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
      for _ in $(seq 50); do ours "$pid" || break; sleep 0.1; done
    fi
    if ours "$pid"; then left+=("$c:$pid"); continue; fi
    echo "down.sh: stopped $c (pid $pid)" >&2
  fi
  rm -f "$f"
done
rm -f "$DIR/env"
[ "${#left[@]}" -eq 0 ] || { echo "down.sh: error: still running: ${left[*]}" >&2; exit 1; }
if [ "$purge" = 1 ]; then
  rm -rf "$DIR"
  echo "down.sh: removed $DIR" >&2
fi
