"""Time this checkout's paged-attention kernel against another version of its module, in one run.

    git show REV:pagedkv/kernels/unified_attention.py > build/baseline.py
    python benchmarks/compare_kernel.py build/baseline.py [--head-sizes 128 80] [--json out.json]

The baseline file is imported under a name of its own and launches through this checkout's
config and split-KV code, so only the attention kernel differs. bf16, 32 query / 8 KV heads,
block size 16, random page tables. Times are GPU time per call, the median of
`triton.testing.do_bench_cudagraph` (many calls in one CUDA graph); the two versions are timed
alternately, three rounds each, and each reports its median round. Every K/V tile here is
larger than the L2 except prefill's, which is bound by the tensor cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_batch import HKV, HQ, llama_batch  # noqa: E402
from pagedkv.kernels import SplitKVWorkspace  # noqa: E402
from pagedkv.kernels import unified_attention as current  # noqa: E402
from pagedkv.kernels.testing import PagedBatch  # noqa: E402

ROUNDS = 3
CASES = {
    "decode 8x4096": ([1] * 8, [4095] * 8),
    "decode 32x4096": ([1] * 32, [4095] * 32),
    "prefill 1x4096": ([4096], [0]),
}


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"baseline_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_call(kernel: Callable[..., torch.Tensor], batch: PagedBatch) -> Callable[[], torch.Tensor]:
    """One call of `kernel` on `batch` with its own output and split-KV scratch (no allocation)."""
    out = torch.empty_like(batch.q)
    workspace = SplitKVWorkspace(batch.q.shape[0] * 64, HQ, batch.q.shape[2], "cuda")
    kwargs = batch.attention_kwargs()
    return lambda: kernel(batch.q, batch.k_cache, batch.v_cache, out, **kwargs, workspace=workspace)


def compare(baseline: ModuleType, name: str, head_size: int) -> dict[str, object]:
    batch = llama_batch(*CASES[name], head_size=head_size, seed=head_size)
    calls = {"before": attention_call(baseline.unified_attention, batch), "after": attention_call(current, batch)}
    diff = (calls["before"]().float() - calls["after"]().float()).abs().max().item()
    rounds: dict[str, list[float]] = {version: [] for version in calls}
    for _ in range(ROUNDS):
        for version, call in calls.items():
            rounds[version].append(1e3 * triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median"))
    times = {version: statistics.median(us) for version, us in rounds.items()}
    seq = sum(q + c for q, c in zip(*CASES[name]))
    kv_bytes = 2 * seq * HKV * head_size * 2 + 2 * batch.q.numel() * 2  # K, V once + q, out
    return {
        "case": name,
        "head_size": head_size,
        "before_us": times["before"],
        "after_us": times["after"],
        "after/before": times["after"] / times["before"],
        "after_gbps": kv_bytes / times["after"] / 1e3,
        "max_abs_diff": diff,
        "rounds_us": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", type=Path, help="another version of pagedkv/kernels/unified_attention.py")
    parser.add_argument("--head-sizes", type=int, nargs="+", default=[128, 80])
    parser.add_argument("--json", type=Path, help="write all numbers here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/compare_kernel.py needs a CUDA GPU")
    baseline = load_module(args.baseline)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    print(f"{'case':<16}{'head':>5}{'before us':>11}{'after us':>10}{'after/before':>13}{'GB/s':>7}{'max|diff|':>11}")
    for head_size in args.head_sizes:
        for name in CASES:
            row = compare(baseline, name, head_size)
            rows.append(row)
            print(
                f"{name:<16}{head_size:>5}{row['before_us']:>11.1f}{row['after_us']:>10.1f}"
                f"{row['after/before']:>13.3f}{row['after_gbps']:>7.0f}{row['max_abs_diff']:>11.1e}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
