#!/usr/bin/env bash
# Stage the benchmark peers for the GPU machine (run here, from the repository root, once per session):
#   - ../shared/peers (nano-vllm, its flash-attn shim and launcher) copied into peers/, which git ignores and the
#     device tool's `carry` takes (../shared does not travel to the GPU machine);
#   - xxhash (nano-vllm hashes its prefix-cache blocks with it) as a CPython 3.12 manylinux wheel in .whl/xxhash/,
#     which run_side_by_side.sh unpacks there (the GPU machine cannot download).
# flash-attn 4 is staged apart: bash ../shared/gpu/stage-flash-attn4.sh (.whl/fa4a, fa4b, fa4c).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
src=${1:-../shared/peers}
[ -f "$src/nanovllm_launch.py" ] || { echo "stage_peers.sh: $src has no nanovllm_launch.py" >&2; exit 1; }
rm -rf peers && mkdir peers
cp -r "$src"/. peers/
chmod -R u+w peers            # the shared copy is read-only; a later re-stage must be able to delete this one
find peers -name __pycache__ -prune -exec rm -rf {} +
rm -rf .whl/xxhash && mkdir -p .whl/xxhash
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl/xxhash "xxhash==4.1.0"
du -sh peers .whl/xxhash
