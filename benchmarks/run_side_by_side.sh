#!/usr/bin/env bash
# Issue 44 on one GPU (H100 or H200), in three back-to-back device calls on one warm machine: flash-attn 4, which
# nano-vllm runs on, travels in three parts (../shared/gpu/README.md), so the first two calls stage a part each and
# do the work that needs no flash-attn. Once, on the development machine, before the calls:
#     bash ../shared/gpu/stage-flash-attn4.sh     # .whl/fa4a, .whl/fa4b, .whl/fa4c
#     bash benchmarks/stage_peers.sh              # peers/ (nano-vllm + shim + launcher), .whl/xxhash/
# Then, from the repository root there:
#   bash benchmarks/run_side_by_side.sh stage1   carry .whl/fa4a
#       host work per decode step on that machine's CPU (host_overhead.py, model stubbed out);
#       W1 (llama3-8b) through pagedkv alone, with the decode step's wall vs GPU-busy time
#   bash benchmarks/run_side_by_side.sh stage2   carry .whl/fa4b
#       W2 (qwen3-0.6b) through pagedkv alone: generate's wall vs GPU-busy time (kernels summed under
#       torch.profiler over one more run of the same lengths) and a decode step's wall vs GPU time
#   bash benchmarks/run_side_by_side.sh run      carry .whl/fa4c peers .whl/xxhash
#       W2 side by side with nano-vllm, on qwen3-0.6b (48 GiB of KV cache each) and on qwen3-8b (40 GiB each;
#       nano-vllm serves the Qwen3 class only, so not llama3-8b): pagedkv's generate() and its step() loop with
#       text streamed every step, then nano-vllm's generate
#   bash benchmarks/run_side_by_side.sh w2 MODEL KV_GIB   carry as `run` (a later call on the warm machine)
#       one W2 side by side of `run` again, e.g. when `run` ran out of time before qwen3-8b
#   bash benchmarks/run_side_by_side.sh cpu-check
#       the whole path at toy size on a CPU (tiny presets, a few requests; nano-vllm is skipped with its reason)
#
# Side by side means: the same random weights (the pagedkv engine's, written out as a Hugging Face Qwen3
# directory), the same KV cache bytes, the same workload and warm-up workload (W2 drawn from seed 1, whole: every
# request to its full length), and the same order for both engines: start-up, warm-up, timed run. pagedkv runs
# in one process (end_to_end.py --nano-export: it writes the weights, then exits, so none of its GPU memory is
# left), nano-vllm in the next one (nano_peer.py --into, which adds its row to the same JSON). Every ratio is
# to the nano-vllm run of the same call. JSON and logs land in $OUT (/tmp/pagedkv-side-by-side without it); the
# markdown tables for the README are readme_figures.py over them.
set -uo pipefail
part=${1:?usage: run_side_by_side.sh stage1|stage2|run|w2 MODEL KV_GIB|cpu-check}
out=${OUT:-/tmp/pagedkv-side-by-side}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
pp0=${PYTHONPATH-}  # before flash-attn 4's activate.sh adds to it
py=${PYTHON:-python3}  # the GPU image's python3; PYTHON=.venv/bin/python for cpu-check here
# Never NVLink multicast on the shared hosts (../shared/gpu/README.md); nano-vllm starts a one-rank NCCL group.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
deadline=$((SECONDS + ${BUDGET_S:-560}))  # the device tool stops a command at 600 s: leave room for the copies
# Seconds a step may take: its own cap, or what is left of the call's budget (at least 10).
cap() { local left=$((deadline - SECONDS)); ((left < 10)) && left=10; echo $((left < $1 ? left : $1)); }
quiet() { grep -v -e '^{' -e 'Warning' -e 'warn(' -e 'generate_mlir'; }  # row JSON lines stay in the logs
gpu() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; }

side_by_side() {  # MODEL KV_GIB: pagedkv, then nano-vllm, in two processes one after the other
  local model=$1 kv=$2 json="$out/w2_$1.json" log="$out/w2_$1.log"
  mkdir -p /root/stage
  # pagedkv without flash-attn 4 on its path (unless PAGEDKV_FA4=1): its default backend is then TRITON_ATTN, its
  # own kernels, as in stage2 and wherever flash-attn is not installed (with it, FLASH_ATTN comes first).
  local pp=$pp0
  [ -n "${PAGEDKV_FA4:-}" ] && pp=${PYTHONPATH-}
  PYTHONPATH=$pp timeout "$(cap 330)" "$py" benchmarks/end_to_end.py --tables w2 --w2-models "$model" \
    --w2-kv-cache-gib "$kv" --modes default --breakdown-steps 0 --warmup-max-tokens 0 \
    --nano-export /root/stage/nano --json "$json" 2>&1 | tee "$log" | quiet | tail -4
  timeout "$(cap 240)" "$py" benchmarks/nano_peer.py --into "$json" 2>&1 | tee -a "$log" | quiet | tail -8
  rm -rf /root/stage/nano
}

case $part in
  stage1)
    mkdir -p /root/stage && cp .whl/fa4a/* /root/stage/
    gpu
    OMP_NUM_THREADS=1 timeout "$(cap 150)" "$py" benchmarks/host_overhead.py \
      --json "$out/host_overhead_gpu_machine_cpu.json" 2>&1 | tail -5
    timeout "$(cap 400)" "$py" benchmarks/end_to_end.py --tables w1 --modes default --json "$out/w1.json" \
      2>&1 | tee "$out/w1.log" | quiet | tail -8
    ;;
  stage2)
    mkdir -p /root/stage && cp .whl/fa4b/* /root/stage/
    gpu
    timeout "$(cap 450)" "$py" benchmarks/end_to_end.py --tables w2 --w2-models qwen3-0.6b --modes default \
      --no-nano --kernel-profile --top 12 --json "$out/w2_profile.json" 2>&1 | tee "$out/w2_profile.log" | quiet \
      | tail -30
    ;;
  run | w2)
    source .whl/fa4c/activate.sh || exit 1
    if ! "$py" -c 'import xxhash' 2>/dev/null; then  # the image has had it; the staged wheel otherwise
      python3 -m zipfile -e .whl/xxhash/*.whl /tmp/xxsite && export PYTHONPATH=/tmp/xxsite:$PYTHONPATH
    fi
    gpu
    if [ "$part" = w2 ]; then
      side_by_side "${2:?w2 MODEL KV_GIB}" "${3:?w2 MODEL KV_GIB}"
    else
      side_by_side qwen3-0.6b 48
      side_by_side qwen3-8b 40
    fi
    "$py" benchmarks/readme_figures.py "$out"/w2_*.json
    ;;
  cpu-check)
    export OMP_NUM_THREADS=1
    tiny=(--device cpu --w1-model tiny --w2-models tiny --w1-kv-cache-gib 0.05 --w2-kv-cache-gib 0.05
      --num-requests 2 --max-tokens 4 --backends TORCH_REF --breakdown-steps 2)
    "$py" benchmarks/host_overhead.py --smoke --json "$out/host_overhead_smoke.json" | tail -3
    "$py" benchmarks/end_to_end.py "${tiny[@]}" --tables w1 --json "$out/w1_cpu.json" | quiet | tail -4
    "$py" benchmarks/end_to_end.py "${tiny[@]}" --tables w2 --warmup-max-tokens 0 --kernel-profile \
      --nano-export "$out/nano" --json "$out/w2_cpu.json" | quiet | tail -4
    "$py" benchmarks/nano_peer.py --into "$out/w2_cpu.json" | quiet | tail -6
    rm -rf "$out/nano"
    ;;
  *)
    echo "run_side_by_side.sh: unknown part '$part'" >&2
    exit 2
    ;;
esac
