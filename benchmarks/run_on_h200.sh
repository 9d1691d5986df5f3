#!/usr/bin/env bash
# The GPU session behind benchmarks/README.md, in three calls on one warm machine (the device
# tool carries at most 64 MiB per call, and flash-attn 4 comes as three parts; see
# ../shared/gpu/README.md and stage-flash-attn4.sh, run once on the development machine):
#
#   bash benchmarks/run_on_h200.sh 1   (carry .whl/fa4a)  GPU tests (flash-attn ones skip)
#   bash benchmarks/run_on_h200.sh 2   (carry .whl/fa4b)  tuning sweeps (decode splits, prefill tiles)
#   bash benchmarks/run_on_h200.sh 3   (carry .whl/fa4c)  flash-attn 4 tests + the benchmark
#
# Everything worth keeping lands in $OUT (or /tmp/pagedkv-bench when OUT is unset).
set -uo pipefail
step=${1:?usage: run_on_h200.sh 1|2|3}
out=${OUT:-/tmp/pagedkv-bench}
mkdir -p "$out" /root/stage
export PYTHONUNBUFFERED=1
case $step in
  1)
    cp .whl/fa4a/* /root/stage/
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.log" | tail -25 ;;
  2)
    cp .whl/fa4b/* /root/stage/
    for kind in decode prefill; do
      timeout 200 python3 benchmarks/attention.py --sweep $kind --json /root/stage/sweep_$kind.json \
        > "$out/sweep_$kind.log" 2>&1; cut -c1-240 "$out/sweep_$kind.log" | tail -11
      cp /root/stage/sweep_$kind.json "$out/"
    done ;;
  3)
    source .whl/fa4c/activate.sh || exit 1
    [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs -k "flash or backend" 2>&1 | tee "$out/gpu_tests_fa4.log" | tail -8
    tuned=$(ls /root/stage/sweep_*.json 2>/dev/null)
    timeout 400 python3 benchmarks/attention.py --json "$out/attention.json" ${tuned:+--tuning $tuned} \
      2>&1 | tee "$out/attention.log" | grep -v '^{' | grep -v Warning | grep -v generate_mlir ;;
esac
