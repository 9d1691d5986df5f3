#!/usr/bin/env bash
# The GPU session behind benchmarks/README.md, in three calls on one warm machine (the device
# tool carries at most 64 MiB per call, and flash-attn 4 comes as three parts; see
# ../shared/gpu/README.md and stage-flash-attn4.sh, run once on the development machine):
#
#   bash benchmarks/run_on_h200.sh 1   (carry .whl/fa4a)  GPU tests (flash-attn ones skip)
#   bash benchmarks/run_on_h200.sh 2   (carry .whl/fa4b)  tuning sweeps (decode splits, prefill tiles)
#   bash benchmarks/run_on_h200.sh 3   (carry .whl/fa4c)  flash-attn 4 tests + the benchmark
#
# Issue 35, three calls that need no flash-attn (each under the tool's 10 minutes):
#
#   bash benchmarks/run_on_h200.sh fp8        fp8 decode sweep (speed-ups over bf16, same run),
#                                             fp8 accuracy on tiny-pydoc, the fp8 GPU tests
#   bash benchmarks/run_on_h200.sh invariant  whether wider attention tiles keep a row's bits,
#                                             matmul tiles per M, then W1 in the mode
#                                             (uncompiled and compiled)
#   bash benchmarks/run_on_h200.sh tests35    (carry .whl/nb: Jupyter) the batch-invariance and
#                                             kernel GPU tests, notebook 14
#
# Everything worth keeping lands in $OUT (or /tmp/pagedkv-bench when OUT is unset).
set -uo pipefail
step=${1:?usage: run_on_h200.sh 1|2|3|fp8|invariant|tests35}
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
  fp8)
    timeout 240 python3 benchmarks/attention.py --sweep fp8-decode --quick --json "$out/sweep_fp8-decode.json" \
      > "$out/sweep_fp8-decode.log" 2>&1; tail -2 "$out/sweep_fp8-decode.log"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['bf16_us']);
[print(x['knobs'], {k: round(v, 2) for k, v in x.get('speedup_over_bf16', {}).items()}) for x in r['ranked'][:6]]" \
      "$out/sweep_fp8-decode.json"
    timeout 90 python3 benchmarks/fp8_kv_cache.py --dtype bfloat16 --json "$out/fp8_kv_cache.json" 2>&1 | tail -5
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fp8_kv_cache_cuda.py 2>&1 | tail -5 ;;
  invariant)
    timeout 45 python3 benchmarks/invariant_attention_tiles.py --json "$out/invariant_attention_tiles.json" | tail -11
    timeout 100 python3 benchmarks/batch_invariant_matmul.py --json "$out/bim.json" 2>&1 | tee "$out/bim.log" | grep -v '^{'
    timeout 420 python3 benchmarks/end_to_end.py --tables w1 --modes default default+invariant FULL_AND_PIECEWISE+invariant \
      --json "$out/w1_invariant.json" 2>&1 | grep -v '^{' | tail -12 ;;  # the tiles by M (--matmul-tiles would pin one per weight)
  tests35)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nb/*.whl && export PYTHONPATH=/tmp/site:$PWD
    timeout 540 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_batch_invariant_cuda.py \
      tests/gpu/test_kernels_cuda.py tests/gpu/test_notebooks_cuda.py -k "not notebook or 14_" \
      2>&1 | tee "$out/gpu_tests_35.log" | tail -8 ;;
esac
