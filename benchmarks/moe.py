"""DeepSeek-V2-Lite's routed experts on the GPU: FusedMoE's grouped and dense ways against two peers.

    python benchmarks/moe.py [--json results.json] [--tokens 1 128 512 4096]

One MoE layer of DeepSeek-V2-Lite (64 experts, hidden 2048, expert intermediate 1408, top-6),
bf16, random weights and routes, for a decode-sized and prefill-sized number of tokens:

* grouped: FusedMoE with `torch._grouped_mm` (each token through its own 6 experts)
* dense:   FusedMoE's fallback (every expert on every token, weight 0 where not routed)
* loop:    one SwiGLU MLP per expert on every token, one after another (pagedkv before FusedMoE)
* routed loop: each expert on the tokens routed to it, found with a host sync per expert
  (transformers' way; cannot be captured in a CUDA graph)

Times: `bench_us` (do_bench, host launches included) and, where the code can be captured,
`graph1_us` (one call replayed from a CUDA graph). Prints a table; writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagedkv.models.fused_moe import FusedMoE  # noqa: E402
from timing import bench_us, graph1_us  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 2048, 1408, 6


def peers(moe: FusedMoE) -> dict[str, tuple[Callable[..., torch.Tensor], bool]]:
    """name -> (fn(x, weights, ids), capturable)."""
    w13, w2 = moe.w13_weight, moe.w2_weight

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(moe.act_fn(F.linear(x, w13[e])), w2[e])

    def loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        combine = weights.new_zeros(x.shape[0], EXPERTS).scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            out = out + (expert(e, x) * combine[:, e, None]).to(x.dtype)
        return out

    def routed_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # host sync
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, (expert(e, x[token]) * weights[token, slot, None]).to(x.dtype))
        return out

    def way(grouped: bool) -> Callable[..., torch.Tensor]:
        def call(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            moe.use_grouped_mm = grouped
            return moe(x, weights, ids)

        return call

    return {
        "grouped": (way(True), True),
        "dense": (way(False), True),
        "loop": (loop, True),
        "routed_loop": (routed_loop, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 512, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe.py needs a CUDA GPU")
    torch.manual_seed(0)
    moe = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE).to("cuda", torch.bfloat16)
    for w in (moe.w13_weight, moe.w2_weight):
        w.data.normal_(0.0, 0.02)
    moe.process_weights_after_loading()
    if not moe.use_grouped_mm:
        sys.exit("this torch has no device-offset torch._grouped_mm for bf16 here: nothing to compare")
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.randn(tokens, EXPERTS, device="cuda").softmax(-1).topk(TOP_K, dim=-1)
        row: dict[str, object] = {"tokens": tokens}
        with torch.no_grad():
            reference = peers(moe)["routed_loop"][0](x, weights, ids).float()
            for name, (fn, capturable) in peers(moe).items():
                call = lambda fn=fn, x=x, weights=weights, ids=ids: fn(x, weights, ids)  # noqa: E731
                row[name] = {
                    "bench_us": bench_us(call),
                    "graph1_us": graph1_us(call) if capturable else None,
                    "max_abs_diff": (call().float() - reference).abs().max().item(),
                }
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = list(peers(moe))
    print(f"\n{'tokens':>7}" + "".join(f"{n + ' us':>16}" for n in names) + f"{'loop / grouped':>16}")
    for row in rows:
        time = {n: row[n]["graph1_us"] or row[n]["bench_us"] for n in names}  # type: ignore[index]
        print(
            f"{row['tokens']:>7}"
            + "".join(f"{time[n]:16.1f}" for n in names)
            + f"{time['loop'] / time['grouped']:16.1f}"
        )
    print("us: one call replayed from a CUDA graph; routed_loop (host syncs): do_bench")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "shape": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "top_k": TOP_K},
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
