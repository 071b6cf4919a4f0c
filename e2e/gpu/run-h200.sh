#!/usr/bin/env bash
# The H200 runs of the engine API (issue 12) and the real-model hand-off
# (issue 13), in one call on the GPU machine (nothing can be fetched there).
# Expects, carried from the build machine (see e2e/gpu/pack.sh):
#   .gpu/bundle.tar.xz   kvfabric and kvfabric-gpu (--features cuda, stripped),
#                        etcd, and the nixl-cu13 runtime set (nixl/)
#   .whl/                grpcio and protobuf wheels for the GPU machine's python3
# Writes JSON reports and logs into $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out" /tmp/kvf
tar xJf .gpu/bundle.tar.xz -C /tmp/kvf || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/agent/python
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KVFABRIC_NIXL_DIR=/tmp/kvf/nixl
export NIXL_PLUGIN_DIR=/tmp/kvf/nixl/plugins
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "grpc", grpc.__version__, "protobuf", p.__version__)'
rc=0
# A private MPS control daemon (own pipe and log directories; no GPU
# setting changed), quit when the call ends: issue 18's "MPS on".
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/kvf-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/kvf-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
}
mps_off() {
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; trap - EXIT
}
# Issue 18's seed-shaped load: gpt-oss-120b geometry, TP 4, block 16, K/V
# split (4 KiB descriptors), 8,192-token prompts (151 MB per transfer).
seed_args=(bench --fixed-prompt 8192 --model gpt-oss-120b --tp 4 --pool 48GiB)
# The build to compare against, carried as .gpu/before.xz (ab17, loadab).
# Builds before 94f0c56 measure the open loop differently (descriptors
# built after the arrival, copied before each transfer: +0.1-0.3 ms per
# request): compare open-loop numbers only between builds that share it.
# before_exe NAME: another build carried as .gpu/NAME.xz (default "before").
before_exe() {
  local n=${1:-before}
  [ -x /tmp/kvf/kvfabric-gpu-$n ] || { xz -dc .gpu/$n.xz > /tmp/kvf/kvfabric-gpu-$n \
    && chmod +x /tmp/kvf/kvfabric-gpu-$n; }
  echo /tmp/kvf/kvfabric-gpu-$n
}
# KVF_CONFIGS entries: "GRANT_POLICY=oldestFirst,ARENA_SIZE_BYTES=1GiB" →
# the KVFABRIC_BOUNCE_ variables (cfg_env) and a file-name tag (cfg_tag);
# SPIN_ keys are the spin experiment switches (KVFABRIC_SPIN_ADAPTIVE,
# KVFABRIC_SPIN_WORKERS, KVFABRIC_SPIN_WAITERS; agent/src/runtime/spin.rs);
# SOLO_CHUNK_BYTES=16MiB sets KVFABRIC_SOLO_CHUNK_BYTES (solo chunks),
# BLOCK_GATHER=0 sets KVFABRIC_BLOCK_GATHER (the block gather off),
# NIXL_REPOST=0 sets KVFABRIC_NIXL_REPOST (landed writes not reposted).
# A BOOST=POLICY entry (nice:-15, fifo:10) is no variable: boost_start runs
# e2e/gpu/boost_threads.py beside the bench (the agents' IO threads and
# copy workers get that priority), boost_stop waits for it.
cfg_env() { [ "$1" = - ] || echo "$1" | tr ',' '\n' | grep -v '^BOOST=' | sed 's/^/KVFABRIC_BOUNCE_/; s/^KVFABRIC_BOUNCE_SPIN_/KVFABRIC_SPIN_/; s/^KVFABRIC_BOUNCE_SOLO_/KVFABRIC_SOLO_/; s/^KVFABRIC_BOUNCE_BLOCK_GATHER/KVFABRIC_BLOCK_GATHER/; s/^KVFABRIC_BOUNCE_NIXL_/KVFABRIC_NIXL_/'; }
boost_pid=""
boost_start() {
  local p; p=$(echo "$1" | tr ',' '\n' | sed -n 's/^BOOST=//p')
  [ -n "$p" ] || return 0
  python3 e2e/gpu/boost_threads.py --pattern kvfabric-gpu --policy "$p" --timeout 300 & boost_pid=$!
}
# A thread the helper could not change fails the step (the run's numbers
# are then the default's).
boost_stop() { [ -z "$boost_pid" ] || { wait "$boost_pid" || rc=1; boost_pid=""; }; }
cfg_tag() { [ "$1" = - ] && echo default || echo "$1" | tr ',=' '_-'; }
# KVF_WARMUP=N: `--warmup N` for a build that knows it (load and openloop;
# with the 13 req/s runs' standard path too, ≈ 0.3 s a warm-up request
# there); a "before" build without it runs cold, with a warning.
warmup_args() {
  [ -n "${KVF_WARMUP:-}" ] || return 0
  if "$1" bench --help 2>&1 | grep -q -- --warmup; then echo "--warmup $KVF_WARMUP"
  else echo "warning: $1 has no --warmup: this run is cold" >&2; fi
}
for step in ${KVF_STEPS:-engines model vram}; do
  case "$step" in
    uuid)
      # Issue 12: GPU engines matched to their agent by GPU UUID (the
      # per-GPU socket, an engine whose ordinal differs, another GPU's UUID).
      timeout 120 python3 e2e/gpu/gpu_uuid.py --bin /tmp/kvf/kvfabric --out "$out/gpu_uuid.json" 2>&1 | tail -n 40 || rc=1 ;;
    engines)
      timeout 240 python3 e2e/gpu/engines_gpu.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
        --out "$out/engines_gpu.json" 2>&1 | tee "$out/engines_gpu.log" | tail -n 60 || rc=1 ;;
    bulkprof)
      # The direct path's host cost: the bulk hand-off alone, run table
      # read from pinned host memory (default) and copied to the GPU first.
      # blocks = the block-id kernel (default); runs = the run-table kernel.
      for src in ${KVF_DIRECT_KERNELS:-blocks runs}; do
        KVFABRIC_DIRECT_KERNEL=$src KVFABRIC_DIRECT_MERGE=${KVF_MERGE:-0} \
        KVFABRIC_LOG=info,kvfabric_agent::service::engines=debug,kvfabric_agent::runtime::cuda=trace \
          timeout 200 python3 e2e/gpu/engines_gpu.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
          --only bulk --bulk-repeats 20 --log-dir "$out" --out "$out/bulk_$src.json" 2>&1 \
          | grep -v '^ ' | tail -n 5 || rc=1
        grep -h "direct copy\|direct block copy\|cuda block copy\|dir=Scatter" "$out"/bulk_$src.json.node-a.log | tail -n 6
      done ;;
    rollout)
      # Issue 14 on the GPU: a config rollout (bigger arena) applied in
      # process by both agents while GPU engines hand blocks off.
      timeout 240 python3 e2e/gpu/engines_gpu.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
        --only rollout --log-dir "$out" --out "$out/rollout_gpu.json" 2>&1 | grep -v '^ ' | tail -n 30 || rc=1 ;;
    edge)
      # Issue 19's byte-exact edge cases of the direct path.
      timeout 240 python3 e2e/gpu/engines_gpu.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
        --only edge --out "$out/direct_edge.json" 2>&1 | grep -v '^ ' | tail -n 20 || rc=1 ;;
    directbench)
      # Issue 19: the direct path's kernels alone vs a contiguous DtoD
      # memcpy of the same bytes (CUDA events), byte-exact.
      timeout 180 /tmp/kvf/kvfabric-gpu direct-bench --big --json "$out/direct_bench.json" 2>&1 \
        | tail -n 60 || rc=1 ;;
    bulk)
      # Issue 19: 64 MiB as 16,384 x 4 KiB, direct vs bounce, engine API.
      timeout 200 python3 e2e/gpu/engines_gpu.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
        --only bulk --bulk-repeats 20 --out "$out/direct_bulk.json" 2>&1 | grep -v '^ ' | tail -n 30 || rc=1 ;;
    trace)
      # Issue 19: the Mooncake conversation trace, 128 in flight, direct
      # (one agent) vs bounce (two agents, same GPU). The trace is carried
      # in .trace/ (3 MB, not in git): KVF_TRACE overrides.
      timeout 560 python3 e2e/gpu/engines_gpu.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
        --only trace --trace "${KVF_TRACE:-.trace/mooncake_conversation_trace.jsonl}" \
        --trace-requests ${KVF_TRACE_REQUESTS:-500} --concurrency 128 --pool-gib ${KVF_POOL_GIB:-32} \
        --out "$out/direct_trace.json" 2>&1 | grep -v '^ ' | tail -n 40 || rc=1 ;;
    faults)
      # Issue 13's fault cases with the real model (test-only fault hooks).
      timeout 300 python3 e2e/model/faults.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd \
        --out "$out/model_faults.json" 2>&1 | tee "$out/model_faults.log" | tail -n 80 || rc=1 ;;
    ab17)
      # Issue 17: vram-bench, one GPU, the build before the reactor
      # (.gpu/before.xz, c2fc7d1) and this one, alternating.
      for i in 1 2 3; do
        for b in before after; do
          exe=/tmp/kvf/kvfabric-gpu; [ $b = before ] && exe=$(before_exe)
          timeout 120 $exe vram-bench --skip-standard --iterations 11 --json "$out/ab17_${b}_$i.json" \
            > "$out/ab17_${b}_$i.log" 2>&1 || rc=1
          echo "$b $i: $(grep -E '^ *(bounce|one descriptor)' "$out/ab17_${b}_$i.log" | tr -s ' ' | tr '\n' ';')"
        done
      done ;;
    load|loadab)
      # Issue 18's table: closed loop at each KVF_CONC, MPS on, TCP control.
      # KVF_CONFIGS: bounce settings to compare, alternated within each
      # concurrency; each KEY=VALUE[,KEY=VALUE...] sets KVFABRIC_BOUNCE_KEY
      # (both agents), "-" for the defaults. loadab puts the build in
      # .gpu/before.xz (defaults) first in each concurrency.
      mps_on
      variants="${KVF_CONFIGS:--}"; [ $step = loadab ] && variants="before - ${KVF_CONFIGS:-}"
      for c in ${KVF_CONC:-1 8 32 128}; do
        for v in $variants; do
          exe=/tmp/kvf/kvfabric-gpu; cfg=$v; b=after
          va=(--verify-every "${KVF_VERIFY_EVERY:-1}")
          [ $v = before ] && { exe=$(before_exe); cfg=-; b=before; }
          # A "before" build older than --verify-every checks every hand-off.
          $exe bench --help 2>&1 | grep -q -- --verify-every || va=()
          wu=$(warmup_args $exe)
          tag="${b}_$(cfg_tag "$cfg")_c$c"
          boost_start "$cfg"
          env $(cfg_env "$cfg") KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 150 $exe "${seed_args[@]}" \
            --requests ${KVF_REQUESTS:-256} --concurrency $c --paths bounce "${va[@]}" $wu ${KVF_BENCH_ARGS:-} \
            --json "$out/load_$tag.json" > "$out/load_$tag.log" 2>&1 || rc=1
          boost_stop
          echo "load $tag: $(grep -E '^ *bounce' "$out/load_$tag.log" | tail -n 1 | tr -s ' ')"
          grep -E '^(all \(|slowest |submitted #)' "$out/load_$tag.log" | cut -c1-400
        done
      done
      mps_off ;;
    openloop)
      # Issue 18: Poisson arrivals at each KVF_RATES (req/s), >= 500
      # requests, at most 128 in flight, MPS on, TCP control; KVF_CONFIGS
      # as in load, plus "before" (the build in .gpu/before.xz).
      # KVF_BENCH_ARGS (load and openloop): more bench flags, e.g.
      # --timeline (a "before" build must know them). KVF_WARMUP=N: N
      # warm-up requests before each measured run (--warmup).
      mps_on
      for r in ${KVF_RATES:-13}; do
        for cfg in ${KVF_CONFIGS:--}; do
          # "before": the build in .gpu/before.xz, defaults.
          exe=/tmp/kvf/kvfabric-gpu; b=""
          va=(--verify-every "${KVF_VERIFY_EVERY:-1}")
          [ "$cfg" = before ] && { exe=$(before_exe); cfg=-; b=before_; }
          $exe bench --help 2>&1 | grep -q -- --verify-every || va=()
          wu=$(warmup_args $exe)
          tag="$b$(cfg_tag "$cfg")_r$r"
          paths=bounce; [ "$r" = 13 ] && paths=${KVF_OL_PATHS:-bounce,standard}
          boost_start "$cfg"
          # KVF_OL_CPUPROF=1: each thread's CPU share and run-queue wait
          # (e2e/gpu/thread_cpu.py) through the run, into open_threads_*.txt.
          tp=""; [ -n "${KVF_OL_CPUPROF:-}" ] && { python3 e2e/gpu/thread_cpu.py --pattern kvfabric-gpu \
            --delay 0.5 --window 0.5 --windows 400 --top 8 > "$out/open_threads_$tag.txt" 2>&1 & tp=$!; }
          env $(cfg_env "$cfg") KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 200 $exe "${seed_args[@]}" --requests ${KVF_OL_REQUESTS:-500} --rate $r --concurrency 128 "${va[@]}" $wu ${KVF_BENCH_ARGS:-} \
            --paths $paths --json "$out/open_$tag.json" > "$out/open_$tag.log" 2>&1 || rc=1
          boost_stop
          [ -z "$tp" ] || { wait $tp; grep '^window' "$out/open_threads_$tag.txt" | awk '{print $14, $22}' | sort -n | tail -n 1 | sed 's/^/  busiest window: CPUs busy, runnable mean: /'; }
          echo "open $tag:"; grep -E '^ *(bounce|standard) ' "$out/open_$tag.log" | grep -v 'slowest 50' | tail -n 4
          grep -E '^(all \(|slowest )|slowest 50 ms windows' "$out/open_$tag.log" | cut -c1-400
        done
      done
      mps_off ;;
    traceol)
      # Issue 18: the Mooncake traces (prompts of every length) replayed by
      # their timestamps on the GPU, MPS on, TCP control, at most 128 in
      # flight. KVF_TRACE_RUNS: FILE@SPEED entries, FILE under .gpu/traces
      # (copied from ../shared/data/traces); KVF_CONFIGS as in load. Prints
      # the latency from arrival of all requests and of the smallest quarter
      # of prompts. KVF_REPEAT: runs of each (configs alternated).
      mps_on
      for run in ${KVF_TRACE_RUNS:-}; do
        f=${run%@*}; sp=${run#*@}
        for n in $(seq "${KVF_REPEAT:-1}"); do
        for cfg in ${KVF_CONFIGS:--}; do
          tag="$(basename "$f" .jsonl)_x${sp}_$(cfg_tag "$cfg")_n$n"
          env $(cfg_env "$cfg") KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 200 /tmp/kvf/kvfabric-gpu bench \
            --trace ".gpu/traces/$f" --model gpt-oss-120b --tp 4 --pool 48GiB --requests ${KVF_OL_REQUESTS:-2000} \
            --speed "$sp" --concurrency 128 --verify-every "${KVF_VERIFY_EVERY:-1}" --paths bounce ${KVF_BENCH_ARGS:-} \
            --json "$out/trace_$tag.json" > "$out/trace_$tag.log" 2>&1 || rc=1
          echo "trace $tag:"; grep -E '^ *bounce|arrival rate' "$out/trace_$tag.log" | tail -n 4
        done
        done
      done
      mps_off ;;
    cpuprof)
      # Issue 18: which thread saturates at the closed-loop peak — each
      # thread's CPU share of both agent processes over a window in the
      # middle of a KVF_CONC run (MPS on, TCP control), and the run's own
      # numbers. KVF_CONFIGS as in load.
      mps_on
      for c in ${KVF_CONC:-8 32}; do
        for v in ${KVF_CONFIGS:--}; do
          tag="$(cfg_tag "$v")_c$c"
          env $(cfg_env "$v") KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 150 /tmp/kvf/kvfabric-gpu \
            "${seed_args[@]}" --requests ${KVF_REQUESTS:-2048} --concurrency $c --paths bounce --verify-every ${KVF_VERIFY_EVERY:-1} \
            --json "$out/cpu_$tag.json" > "$out/cpu_$tag.log" 2>&1 &
          pid=$!
          python3 e2e/gpu/thread_cpu.py --pattern kvfabric-gpu --delay 1 --window 1.5 --windows 60 \
            > "$out/cpu_threads_$tag.txt" 2>&1
          wait $pid || rc=1
          echo "cpuprof $tag: $(grep -E '^ *bounce' "$out/cpu_$tag.log" | tail -n 1 | tr -s ' ')"
          cat "$out/cpu_threads_$tag.txt"
        done
      done
      mps_off ;;
    ucxmps)
      # Issue 18: which transport UCX used under MPS (the report said
      # cuda_ipc=false while one descriptor ran at 397 GB/s): the raw log.
      mps_on
      KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 120 /tmp/kvf/kvfabric-gpu vram-bench --skip-standard \
        --iterations 5 --json "$out/ucx_mps.json" > "$out/ucx_mps.log" 2>&1 || rc=1
      grep -n 'transport report\|cuda_ipc\|WARNING\|by ucp_\|cfg#' "$out/ucx_mps.log" | head -n 60
      mps_off ;;
    timeline)
      # Issue 18: 64 MiB as 16,384 x 4 KiB, bounce vs one descriptor, one
      # GPU, without and with MPS; the report's per-request timeline.
      for m in nomps mps; do
        [ $m = mps ] && mps_on
        KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 120 /tmp/kvf/kvfabric-gpu vram-bench --skip-standard \
          --iterations 21 --json "$out/timeline_$m.json" > "$out/timeline_$m.log" 2>&1 || rc=1
        echo "$m:"; grep -E '^ *(bounce|one-desc)|timeline|transport report' "$out/timeline_$m.log" | grep -v '^\['
        [ $m = mps ] && mps_off
      done ;;
    profile)
      # Issue 18 step 3: where an isolated 64 MiB request's time goes on
      # both agents (sender and receiver trace logs, microsecond clock),
      # MPS on; KVF_PROFILE_CHUNKS chunk sizes (default 16MiB 4MiB),
      # KVF_PROFILE_ARGS more vram-bench flags (e.g. --fill device).
      mps_on
      for c in ${KVF_PROFILE_CHUNKS:-16MiB 4MiB}; do
        KVFABRIC_LOG=warn,kvfabric_agent::runtime=trace,kvfabric_core::protocol=trace \
        KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp timeout 120 /tmp/kvf/kvfabric-gpu vram-bench --skip-standard \
          --chunks $c --iterations ${KVF_PROFILE_ITERS:-5} ${KVF_PROFILE_ARGS:-} --json "$out/profile_$c.json" > "$out/profile_$c.log" 2>&1 || rc=1
        grep -E '^ *(bounce|one-desc)|timeline' "$out/profile_$c.log" | grep -v '^\[' | head
      done
      mps_off ;;
    sweep)
      # vram-bench variants side by side in one call, MPS on: KVF_SWEEP is
      # a ';'-separated list of extra arguments (with optional leading
      # VAR=value environment words), e.g. "--chunks 16MiB;--workers 8";
      # a variant starting with "before" runs the build in .gpu/before.xz,
      # one starting with "build:NAME" the build in .gpu/NAME.xz.
      mps_on
      IFS=';' read -ra variants <<< "${KVF_SWEEP:---chunks 16MiB}"
      for i in "${!variants[@]}"; do
        v="${variants[$i]}"; exe=/tmp/kvf/kvfabric-gpu
        case "$v" in
          before*) exe=$(before_exe); v="${v#before}" ;;
          build:*) b="${v#build:}"; b="${b%% *}"; exe=$(before_exe "$b"); v="${v#build:$b}" ;;
        esac
        echo "== variant $i: ${variants[$i]}"
        env KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp ${v%%--*} timeout 120 $exe vram-bench --skip-standard \
          --iterations ${KVF_SWEEP_ITERS:-21} --json "$out/sweep_$i.json" --${v#*--} > "$out/sweep_$i.log" 2>&1 || rc=1
        grep -E '^ *(bounce|one-desc)|timeline|one-descriptor =' "$out/sweep_$i.log" | grep -v '^\['
      done
      mps_off ;;
    floor)
      # Issue 18: one GPU's floor for a bounce transfer (its three HBM
      # passes alone, CUDA events, no protocol) beside one contiguous copy;
      # MPS on as the vram-bench runs. KVF_FLOOR_ARGS: more flags.
      mps_on
      timeout 300 /tmp/kvf/kvfabric-gpu floor-bench ${KVF_FLOOR_ARGS:-} --json "$out/floor.json" \
        > "$out/floor.log" 2>&1 || rc=1
      cat "$out/floor.log"
      mps_off ;;
    kerneltest)
      # Byte-exact kernel tests, the uniform gather / scatter included
      # (kvfabric-gpu kernel-test; every byte of both buffers compared).
      timeout 300 /tmp/kvf/kvfabric-gpu kernel-test --json "$out/kernel_test.json" 2>&1 \
        | tee "$out/kernel_test.log" | grep -E '^(FAIL|kernel-test)|MISMATCH|error' | tail -n 40 || rc=1 ;;
    vram)
      # standard / bounce / one descriptor, 64 MiB as 16,384 x 4 KiB, two
      # processes on GPU 0 (issue 19's side-by-side reference).
      timeout 180 /tmp/kvf/kvfabric-gpu vram-bench --json "$out/vram_bench.json" 2>&1 \
        | tee "$out/vram_bench.log" | tail -n 30 || rc=1 ;;
    model)
      # KVF_MODEL_PATHS: transfer paths to run the hand-off on, in order
      # (bounce, standard, auto); one report per path.
      for p in ${KVF_MODEL_PATHS:-bounce}; do
        suffix=""; [ "$p" = bounce ] || suffix="_$p"
        timeout 330 python3 e2e/model/handoff.py --bin /tmp/kvf/kvfabric --etcd /tmp/kvf/etcd --path "$p" \
          --out "$out/model_handoff$suffix.json" --sdpa-backend ${KVF_SDPA:-efficient,default} 2>&1 \
          | tee "$out/model_handoff$suffix.log" | tail -n 40 || rc=1
      done ;;
  esac
done
exit $rc
