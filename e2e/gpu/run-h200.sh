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
for step in ${KVF_STEPS:-engines model vram}; do
  case "$step" in
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
