#!/usr/bin/env bash
# Issue 45's GPU figures, as measured on an H100 on 2026-12-07: two device calls on one warm machine,
# from the repository root there (JSON and logs land in $OUT, /tmp/pagedkv-issue45 without it):
#
#   bash benchmarks/run_issue45.sh 1
#       the attention table beside dense SDPA (and flash-attn 4 where `source .whl/fa4c/activate.sh`
#       put it on the path first; it was not, that day) with issue 45's targets; the prefill ladder
#       (notebook 15's JSON); the kernel GPU tests
#   bash benchmarks/run_issue45.sh 2
#       the other GPU tests (notebooks and tensor parallelism aside); W2 (qwen3-0.6b) over the bf16
#       and over the fp8 cache, the same KV memory
#
# W1 in the batch-invariant mode against the default (issue 45's third target) is
# `python3 benchmarks/end_to_end.py --tables w1 --modes default default+invariant --breakdown-steps 0`:
# not run that day (the session's device time ran out).
set -uo pipefail
step=${1:?usage: run_issue45.sh 1|2}
out=${OUT:-/tmp/pagedkv-issue45}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case $step in
  1)
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 270 python3 benchmarks/attention.py --targets --json "$out/attention.json" > "$out/attention.log" 2>&1
    grep -v '^{' "$out/attention.log" | grep -v Warning | tail -75
    timeout 75 python3 benchmarks/prefill_ladder.py --json "$out/prefill_ladder.json" > "$out/ladder.log" 2>&1
    tail -16 "$out/ladder.log"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_kernels_cuda.py 2>&1 | tail -6 ;;
  2)
    timeout 270 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu --ignore=tests/gpu/test_notebooks_cuda.py \
      --ignore=tests/gpu/test_tensor_parallel_cuda.py --ignore=tests/gpu/test_kernels_cuda.py > "$out/gpu_tests.log" 2>&1
    tail -25 "$out/gpu_tests.log"
    timeout 110 python3 benchmarks/end_to_end.py --tables w2 --modes default default+fp8 --no-nano --breakdown-steps 0 \
      --json "$out/w2_fp8.json" 2>&1 | grep -v '^{' | tail -6 ;;
  *) echo "run_issue45.sh: error: unknown step '$step' (1 or 2)"; exit 1 ;;
esac
