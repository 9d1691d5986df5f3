#!/usr/bin/env bash
# The GPU session behind benchmarks/README.md, in three calls on one warm machine (the device
# tool carries at most 64 MiB per call, and flash-attn 4 comes as three parts; see
# ../shared/gpu/README.md and stage-flash-attn4.sh, run once on the development machine):
#
#   bash benchmarks/run_on_h200.sh 1   (carry .whl/fa4a)  GPU tests + decode tile sweep
#   bash benchmarks/run_on_h200.sh 2   (carry .whl/fa4b)  prefill tile sweep
#   bash benchmarks/run_on_h200.sh 3   (carry .whl/fa4c)  flash-attn 4 tests + the benchmark
#
# Everything worth keeping lands in $OUT (or benchmarks/out when OUT is unset).
set -uo pipefail
step=${1:?usage: run_on_h200.sh 1|2|3}
out=${OUT:-benchmarks/out}
mkdir -p "$out" /root/stage
export PYTHONUNBUFFERED=1
case $step in
  1)
    cp .whl/fa4a/* /root/stage/
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.log" | tail -25
    timeout 240 python3 benchmarks/attention.py --sweep decode --json /root/stage/sweep_decode.json \
      > "$out/sweep_decode.log" 2>&1; tail -4 "$out/sweep_decode.log"
    cp /root/stage/sweep_decode.json "$out/" ;;
  2)
    cp .whl/fa4b/* /root/stage/
    timeout 420 python3 benchmarks/attention.py --sweep prefill --json /root/stage/sweep_prefill.json \
      > "$out/sweep_prefill.log" 2>&1; tail -4 "$out/sweep_prefill.log"
    cp /root/stage/sweep_prefill.json "$out/" ;;
  3)
    source .whl/fa4c/activate.sh || exit 1
    [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest tests/gpu -q -p no:cacheprovider -rs -k "flash or backend" 2>&1 | tee "$out/gpu_tests_fa4.log" | tail -8
    tuned=$(ls /root/stage/sweep_*.json 2>/dev/null)
    timeout 400 python3 benchmarks/attention.py --json "$out/attention.json" ${tuned:+--tuning $tuned} \
      2>&1 | tee "$out/attention.log" | grep -v '^{' ;;
esac
