"""Paged attention on the GPU: TRITON_ATTN vs flash-attn 4 vs the reference backend vs dense SDPA.

    python benchmarks/attention.py [--json results.json] [--quick]
    python benchmarks/attention.py --sweep decode|fp8-decode|prefill --json sweep.json   # tuning search
    python benchmarks/attention.py --tuning sweep_decode.json sweep_prefill.json  # use the winners

bf16, 32 query heads / 8 KV heads / head size 128, block size 16, random page tables.
flash-attn 4 (`flash_attn.cute`) is used when importable, with `num_splits=1` (its split-KV
path asserts "SplitKV not supported on SM 9.0" in 4.0.0b36). Dense SDPA reads contiguous K/V
(no paging): the ceiling. Prints a table; writes every number as JSON. Decode shapes also run
TRITON_ATTN over an fp8 (e4m3) copy of the cache ("triton_fp8": K/V at 1 byte per value, per-tensor
scales; GB/s of the bytes it actually reads) beside the bf16 cache of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_batch import BLOCK, DTYPE, HKV, HQ, D, batch_config, llama_batch  # noqa: E402
from pagedkv.attention.backends.torch_ref import paged_attention_reference  # noqa: E402
from pagedkv.kernels import SplitKVWorkspace, reshape_and_cache, unified_attention  # noqa: E402
from pagedkv.kernels.attention_config import Tiles, Tuning  # noqa: E402
from pagedkv.kernels.testing import PagedBatch  # noqa: E402
from pagedkv.kv_cache.fp8 import K_SCALE_CONSTANT, V_SCALE_CONSTANT, kv_scale, quantize_fp8  # noqa: E402
from timing import bench_us, copies_for, copy_bandwidth_gbps, graph1_us, graph_us, kernel_us  # noqa: E402

HBM_GBPS = 4800.0


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # decode | prefill | mixed
    query_lens: list[int]
    context_lens: list[int]


def cases(quick: bool) -> list[Case]:
    decode = [(1, 4096), (8, 4096), (32, 4096), (128, 2048), (64, 8192), (8, 32768), (256, 1024)]
    prefill = [(1, 4096), (8, 1024), (4, 8192)]
    if quick:
        decode, prefill = decode[:3], prefill[:1]
    out = [Case(f"decode {b}x{n}", "decode", [1] * b, [n - 1] * b) for b, n in decode]
    out += [Case(f"prefill {b}x{n}", "prefill", [n] * b, [0] * b) for b, n in prefill]
    out.append(Case("mixed 2K+63x4K", "mixed", [1] * 63 + [2048], [4095] * 63 + [0]))
    return out


def kv_bytes(case: Case, cache_bytes: int = 2) -> int:
    """What one pass reads and writes: K and V at `cache_bytes` per value (1: an fp8 cache) + q, out at 2."""
    seq = sum(q + c for q, c in zip(case.query_lens, case.context_lens))
    return 2 * seq * HKV * D * cache_bytes + 2 * sum(case.query_lens) * HQ * D * 2


def causal_flops(case: Case) -> float:
    pairs = sum(q * c + q * (q + 1) / 2 for q, c in zip(case.query_lens, case.context_lens))
    return 4.0 * pairs * HQ * D


# --- providers: each returns a no-argument callable over one input copy -----------------------


def triton_fn(batch: PagedBatch, tuning: Tuning | None, fp8: bool = False) -> Callable[[], object]:
    """TRITON_ATTN over the batch's cache, or (`fp8`) over an fp8 copy of it, with scales from its amax
    as the profile run sets them."""
    k_cache, v_cache, scales = batch.k_cache, batch.v_cache, {}
    if fp8:
        k_scale, v_scale = kv_scale(k_cache, K_SCALE_CONSTANT), kv_scale(v_cache, V_SCALE_CONSTANT)
        k_cache, v_cache = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(batch.q)
    kwargs = batch.attention_kwargs()
    workspace = SplitKVWorkspace(batch.q.shape[0] * 64, HQ, D, "cuda")
    config = None if tuning is None else batch_config(batch, tuning, kv_bytes=1 if fp8 else 2)
    return lambda: unified_attention(
        batch.q, k_cache, v_cache, out, **kwargs, workspace=workspace, config=config, **scales
    )


def fa4_fn(batch: PagedBatch, num_splits: int) -> Callable[[], object]:
    from flash_attn.cute import flash_attn_varlen_func

    # The Python ints are read here, not inside the call: `batch.max_seq_len` reads seq_lens back
    # from the GPU, a synchronisation that is illegal while a CUDA graph is being captured (what
    # once looked like "flash-attn 4 cannot be captured").
    max_seqlen_q, max_seqlen_k = batch.max_query_len, batch.max_seq_len
    return lambda: flash_attn_varlen_func(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        cu_seqlens_q=batch.query_start_loc,
        seqused_k=batch.seq_lens,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        page_table=batch.block_table,
        causal=True,
        softmax_scale=D**-0.5,
        num_splits=num_splits,
    )


def reference_fn(batch: PagedBatch) -> Callable[[], object]:
    out = torch.empty_like(batch.q)
    starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    return lambda: paged_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, out, starts, seq_lens, batch.block_table, D**-0.5
    )


def sdpa_fn(case: Case, seed: int) -> Callable[[], object]:
    """Dense SDPA over contiguous K/V of the same lengths (requests of one kind at a time)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=DTYPE)

    calls = []
    decodes = [c + 1 for q, c in zip(case.query_lens, case.context_lens) if q == 1]
    prefills = [q for q in case.query_lens if q > 1]
    if decodes:  # the G query heads of one KV head are G query rows: GQA decode, K/V read once
        dq, dk, dv = (
            randn(len(decodes), HKV, HQ // HKV, D),
            randn(len(decodes), HKV, decodes[0], D),
            randn(len(decodes), HKV, decodes[0], D),
        )
        calls.append(lambda: F.scaled_dot_product_attention(dq, dk, dv))
    if prefills:  # compute-bound: K/V repeated per query head, so any fused SDPA kernel applies
        pq, pk, pv = (
            randn(len(prefills), HQ, prefills[0], D),
            randn(len(prefills), HQ, prefills[0], D),
            randn(len(prefills), HQ, prefills[0], D),
        )
        calls.append(lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True))
    return lambda: [call() for call in calls]


def measure(make: Callable[[int], Callable[[], object]], copies: int, graph: bool = True) -> dict[str, float | str]:
    """bench_us and, if `graph`, graph1_us and graph_us of one provider (no profiler: `profile_all`)."""

    def times(fns: list[Callable[[], object]], result: dict[str, float | str]) -> None:
        result["bench_us"] = bench_us(fns[0])
        if graph:
            result["graph1_us"] = graph1_us(fns[-1])
            result["graph_us"] = graph_us(fns)

    return _guarded(make, copies, times)


def profiled(make: Callable[[int], Callable[[], object]], copies: int) -> dict[str, float | str]:
    """kernel_us of one provider: the profiler's device records, for providers no graph captures."""
    return _guarded(make, copies, lambda fns, result: result.update(kernel_us=kernel_us(fns)))


def _guarded(
    make: Callable[[int], Callable[[], object]],
    copies: int,
    times: Callable[[list[Callable[[], object]], dict[str, float | str]], None],
) -> dict[str, float | str]:
    """What `times` measured; a provider that cannot run this shape says why in the table."""
    result: dict[str, float | str] = {}
    try:
        times([make(i) for i in range(copies)], result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    finally:
        torch.cuda.empty_cache()
    return result


def fa4_available() -> str | None:
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:
        return f"flash_attn.cute not importable ({type(exc).__name__})"
    return None


def paged_batches(case: Case) -> list[PagedBatch]:
    """The case's input copies (seeded: the profiler pass rebuilds the same ones)."""
    return [llama_batch(case.query_lens, case.context_lens, seed=i) for i in range(copies_for(kv_bytes(case)))]


def run_case(case: Case, tunings: dict[str, Tuning | None], with_peers: bool) -> dict[str, object]:
    batches = paged_batches(case)
    copies = len(batches)
    row: dict[str, object] = {
        "case": case.name,
        "kind": case.kind,
        "bytes": kv_bytes(case),
        "flops": causal_flops(case),
        "copies": copies,
    }
    for name, tuning in tunings.items():
        row[name] = measure(lambda i, tuning=tuning: triton_fn(batches[i], tuning), copies)
    if case.kind == "decode":
        row["bytes_fp8"] = kv_bytes(case, cache_bytes=1)
        row["triton_fp8"] = measure(lambda i: triton_fn(batches[i], None, fp8=True), copies)
    if with_peers:
        if fa4_available() is None:
            row["fa4"] = measure(lambda i: fa4_fn(batches[i], 1), copies)
            row["max_abs_diff_vs_fa4"] = max_diff(batches[0], tunings)
        else:
            row["fa4"] = {"error": fa4_available()}
        row["torch_ref"] = measure(lambda i: reference_fn(batches[i]), min(copies, 2), graph=case.kind != "prefill")
        row["sdpa_dense"] = measure(lambda i: sdpa_fn(case, i), copies)
    batches.clear()  # the tensors go now (the lambdas above keep the list itself)
    torch.cuda.empty_cache()
    return row


def profile_all(rows: list[dict[str, object]], chosen: list[Case], tunings: dict[str, Tuning | None]) -> None:
    """Add kernel_us for our kernels and FA4 to each row where FA4 ran but a graph could not hold it.

    This pass comes after every graph timing of the run: once the profiler has run in a process,
    graph timings taken after it read ~0.3 us a kernel slower (seen on the H200), which would
    favour the peer that launches fewer kernels.
    """
    for row, case in zip(rows, chosen):
        fa4 = row.get("fa4")
        if not isinstance(fa4, dict) or "bench_us" not in fa4 or "graph_us" in fa4:
            continue  # FA4 did not run at all, or it ran in a graph (compared by graph time)
        batches = paged_batches(case)
        fa4.update(profiled(lambda i, batches=batches: fa4_fn(batches[i], 1), len(batches)))
        for name, tuning in tunings.items():
            row[name].update(
                profiled(lambda i, batches=batches, tuning=tuning: triton_fn(batches[i], tuning), len(batches))
            )
        batches.clear()
        torch.cuda.empty_cache()


def max_diff(batch: PagedBatch, tunings: dict[str, Tuning | None]) -> float:
    ours = triton_fn(batch, next(iter(tunings.values())))()
    theirs = fa4_fn(batch, 1)()
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    return (ours.float() - theirs.float()).abs().max().item()


def run_reshape(tokens: int) -> dict[str, object]:
    num_blocks = max(tokens // BLOCK * 2, 64)
    kv_cache = torch.randn(2, num_blocks, BLOCK, HKV, D, device="cuda", dtype=DTYPE)
    key, value = (torch.randn(tokens, HKV, D, device="cuda", dtype=DTYPE) for _ in "kv")
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]
    dense = torch.empty(2, tokens, HKV, D, device="cuda", dtype=DTYPE)
    copies = copies_for(4 * key.numel() * 2)
    row: dict[str, object] = {"case": f"reshape_and_cache {tokens}", "kind": "reshape", "bytes": 4 * key.numel() * 2}
    row["triton"] = measure(lambda i: lambda: reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots), 1)
    flat = kv_cache.view(2, -1, HKV, D)
    row["torch_ref"] = measure(
        lambda i: lambda: (flat[0].index_copy_(0, slots, key), flat[1].index_copy_(0, slots, value)), 1
    )
    row["dense_copy"] = measure(lambda i: lambda: (dense[0].copy_(key), dense[1].copy_(value)), 1)
    row["copies"] = copies
    return row


# --- reporting --------------------------------------------------------------------------------


def fp8_summary(rows: list[dict[str, object]]) -> list[str]:
    """One line per decode shape: bf16 and fp8 cache times, fp8's speed-up and bandwidth."""
    lines = [f"{'case':<18} {'B*L':>8} {'bf16 us':>9} {'fp8 us':>9} {'speed-up':>9} {'fp8 GB/s':>9}"]
    for row in rows:
        bf16, fp8 = us(row.get("triton")), us(row.get("triton_fp8"))
        if bf16 is None or fp8 is None:
            continue
        b, n = (int(x) for x in str(row["case"]).split()[1].split("x"))
        gbps = float(row["bytes_fp8"]) / fp8 / 1e3  # type: ignore[arg-type]
        lines.append(f"{row['case']:<18} {b * n:>8} {bf16:>9.1f} {fp8:>9.1f} {bf16 / fp8:>8.2f}x {gbps:>9.0f}")
    return lines


def us(entry: object, key: str = "graph_us") -> float | None:
    return entry.get(key) if isinstance(entry, dict) else None


def versus(row: dict[str, object], ours: str, peer: str) -> tuple[float | None, float | None, str]:
    """(our time, the peer's time, method) by the same method: many calls per graph if the peer
    could be captured that way, else single-call graphs, else profiler kernel time, for both."""
    for key in ("graph_us", "graph1_us", "kernel_us"):
        if us(row.get(peer), key) and us(row.get(ours), key):
            return us(row.get(ours), key), us(row.get(peer), key), key
    return None, None, ""


def summarize(rows: list[dict[str, object]], ours: str, copy_gbps: float) -> list[str]:
    lines = [
        f"{'case':<24}{'ours us':>9}{'FA4 us':>9}{'ref us':>10}{'SDPA us':>9}{'ours eager':>11}"
        f"{'GB/s':>7}{'%HBM':>6}{'TFLOP/s':>8}{'xFA4':>6}{'xSDPA':>6}"
    ]
    speedups, checks = [], []
    for row in rows:
        t = us(row.get(ours))
        if row["kind"] == "reshape":
            dense = us(row.get("dense_copy"))
            gbps = row["bytes"] / (t * 1e-6) / 1e9 if t else float("nan")
            lines.append(
                f"{row['case']:<24}{t or float('nan'):9.1f}{'':>9}{us(row.get('torch_ref')) or float('nan'):10.1f}"
                f"{dense or float('nan'):9.1f}{us(row.get(ours), 'bench_us') or float('nan'):11.1f}{gbps:7.0f}"
                f"{100 * gbps / copy_gbps:5.0f}%"
            )
            if row["case"].endswith(" 8192"):
                checks.append(
                    f"reshape_and_cache 8192: {100 * gbps / copy_gbps:.0f}% of copy bandwidth (target >= 70%)"
                )
            continue
        sdpa, ref = us(row.get("sdpa_dense")), us(row.get("torch_ref"))
        ours_vs_fa4, fa4, method = versus(row, ours, "fa4")
        gbps = row["bytes"] / (t * 1e-6) / 1e9 if t else float("nan")
        tflops = row["flops"] / (t * 1e-6) / 1e12 if t else float("nan")
        x_fa4 = fa4 / ours_vs_fa4 if fa4 and ours_vs_fa4 else float("nan")
        x_sdpa = sdpa / t if sdpa and t else float("nan")
        lines.append(
            f"{row['case']:<24}{t or float('nan'):9.1f}{fa4 or float('nan'):9.1f}{ref or float('nan'):10.1f}"
            f"{sdpa or float('nan'):9.1f}{us(row.get(ours), 'bench_us') or float('nan'):11.1f}{gbps:7.0f}"
            f"{100 * gbps / HBM_GBPS:5.0f}%{tflops:8.0f}{x_fa4:6.2f}{x_sdpa:6.2f}"
            f"{ {'graph1_us': ' (vs FA4: 1-call graphs)', 'kernel_us': ' (vs FA4: profiler kernel time)'}.get(method, '') }"
        )
        if row["kind"] == "decode":
            speedups.append(x_fa4)
            b, n = (int(v) for v in row["case"].split()[1].split("x"))
            if b * n >= 128 * 1024:
                checks.append(f"{row['case']}: {x_sdpa:.2f}x dense SDPA (target >= 0.9)")
        if row["kind"] == "prefill":
            fa4_tflops = row["flops"] / (fa4 * 1e-6) / 1e12 if fa4 else float("nan")
            checks.append(
                f"{row['case']}: {tflops:.0f} TFLOP/s, FA4 {fa4_tflops:.0f}: {x_fa4:.2f}x FA4 (target >= 0.7)"
            )
    valid = [s for s in speedups if s == s]
    if valid:
        geo = math.exp(sum(math.log(s) for s in valid) / len(valid))
        checks.insert(0, f"decode geomean speedup vs FA4: {geo:.2f}x over {len(valid)} shapes (target >= 1.2)")
    lines.append(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    return lines + checks


# --- tuning search ------------------------------------------------------------------------------


def make_tuning(knobs: dict[str, object]) -> Tuning:
    """A Tuning from JSON-style knobs (tile settings as [block_m, block_n, warps, stages])."""
    return dataclasses.replace(
        Tuning(), **{k: Tiles(*v) if isinstance(v, (list, tuple)) else v for k, v in knobs.items()}
    )


def sweep(kind: str, quick: bool) -> dict[str, object]:
    """Time candidate Tunings on every case of one kind; return them ranked by geometric mean."""
    if kind == "decode":
        grid = [
            dict(decode_programs_per_sm=p, split_overhead_tiles=o) for p, o in itertools.product((3, 4, 5), (1, 2, 4))
        ]
    elif kind == "fp8-decode":  # tiles [block_m, keys, warps, stages, register cap] x programs per SM
        grid = [
            dict(fp8_decode=(16, n, w, st, regs), decode_programs_per_sm=p)
            for n, w, st, regs, p in itertools.product((64, 128), (4, 8), (2, 3), (None, 128), (3, 4))
        ]
    else:
        longs = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)]
        shorts = [(64, 32, 4, 2), (64, 64, 4, 2)]
        grid = [dict(long_prefill=a, short_prefill=b) for a, b in itertools.product(longs, shorts)]
    chosen = [c for c in cases(quick) if (c.kind == "decode") == kind.endswith("decode")]
    fp8 = kind == "fp8-decode"
    results = []
    batches = {c.name: paged_batches(c) for c in chosen}
    if fp8:  # the bf16 cache with default tiles, same run: what each candidate's speed-up is over
        bf16 = {c.name: graph_us([triton_fn(b, None) for b in batches[c.name]], rep_ms=10) for c in chosen}
        print(f"{'bf16 cache, default tiles':<70} {json.dumps({k: round(v, 1) for k, v in bf16.items()})}", flush=True)
    for knobs in grid:
        tuning = make_tuning(knobs)
        times = {}
        for c in chosen:
            try:
                times[c.name] = graph_us([triton_fn(b, tuning, fp8) for b in batches[c.name]], rep_ms=10)
            except Exception as exc:
                times[c.name] = f"{type(exc).__name__}"
                break
        ok = all(isinstance(t, float) for t in times.values())
        geo = math.exp(sum(math.log(t) for t in times.values()) / len(times)) if ok else float("inf")
        results.append({"knobs": knobs, "geomean_us": geo, "times_us": times})
        if fp8 and ok:
            results[-1]["speedup_over_bf16"] = {k: bf16[k] / t for k, t in times.items()}
        print(
            f"{json.dumps(knobs):<70} geomean {geo:9.1f} us  {json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in times.items()})}",
            flush=True,
        )
    results.sort(key=lambda r: r["geomean_us"])
    return {"kind": kind, "best": results[0]["knobs"], "ranked": results} | ({"bf16_us": bf16} if fp8 else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write all numbers here")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--sweep", choices=["decode", "fp8-decode", "prefill"], help="search tile knobs instead")
    parser.add_argument("--tuning", type=Path, nargs="*", default=[], help="sweep results whose winners to use too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    if args.sweep:
        result = sweep(args.sweep, args.quick)
        print("best:", result["best"])
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return

    tunings: dict[str, Tuning | None] = {"triton": None}
    if args.tuning:
        knobs = {k: v for path in args.tuning for k, v in json.loads(path.read_text())["best"].items()}
        tunings["triton_tuned"] = make_tuning(knobs)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; FA4: {fa4_available() or 'yes'}", flush=True)
    copy_gbps = copy_bandwidth_gbps()
    chosen = cases(args.quick)
    rows = []
    for case in chosen:
        rows.append(run_case(case, tunings, with_peers=True))
        print(json.dumps(rows[-1]), flush=True)
    for tokens in (1, 256, 8192):
        rows.append(run_reshape(tokens))
        print(json.dumps(rows[-1]), flush=True)
    profile_all(rows, chosen, tunings)  # last: the profiler slows every graph timing after it
    for name in tunings:
        rows_for = [dict(r, triton=r.get(name, r.get("triton"))) for r in rows]
        print(f"\n== TRITON_ATTN ({name}) — GPU time under a CUDA graph; 'eager' = do_bench with L2 flush ==")
        print("\n".join(summarize(rows_for, "triton", copy_gbps)))
    print("\n== TRITON_ATTN decode, fp8 (e4m3) cache vs bf16 cache (graph time; GB/s of the bytes each reads) ==")
    print("\n".join(fp8_summary(rows)))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "copy_gbps": copy_gbps,
                    "device": torch.cuda.get_device_name(),
                    "tunings": {k: dataclasses.asdict(v) if v else None for k, v in tunings.items()},
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
