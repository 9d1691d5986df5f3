"""Paged attention on the GPU: TRITON_ATTN over a bf16 and an fp8 cache vs flash-attn 4 vs dense SDPA.

    python benchmarks/attention.py [--json results.json] [--quick] [--targets]
    python benchmarks/attention.py --targets results.json   # issue 45's targets of an earlier run (no GPU)
    python benchmarks/attention.py --sweep decode|fp8-decode|prefill --json sweep.json   # tuning search
    python benchmarks/attention.py --tuning sweep_decode.json sweep_prefill.json  # use the winners

bf16, 32 query heads / 8 KV heads / head size 128, block size 16, random page tables. Every case
(decode, prefill, mixed) runs, in this one process: TRITON_ATTN over the bf16 cache, TRITON_ATTN
over an fp8 (e4m3) copy of it (K/V at 1 byte per value, per-tensor scales), flash-attn 4
(`flash_attn.cute`, when importable, with `num_splits=1`: its split-KV path asserts "SplitKV not
supported on SM 9.0" in 4.0.0b36), the reference backend, and dense SDPA over contiguous K/V (no
paging: the ceiling). flash-attn 4 has no fp8 path on Hopper and SDPA none at all, so the fp8 lines
are compared with the same case's bf16 flash-attn 4 and SDPA. Prints a table; `--targets` adds
issue 45's targets, met or missed; the JSON holds every number, the card and the versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_batch import BLOCK, DTYPE, HKV, HQ, D, batch_config, llama_batch  # noqa: E402
from pagedkv.attention.backends.torch_ref import paged_attention_reference  # noqa: E402
from pagedkv.kernels import SplitKVWorkspace, reshape_and_cache, unified_attention  # noqa: E402
from pagedkv.kernels.attention_config import Tiles, Tuning  # noqa: E402
from pagedkv.kernels.testing import PagedBatch  # noqa: E402
from pagedkv.kv_cache.fp8 import K_SCALE_CONSTANT, V_SCALE_CONSTANT, kv_scale, quantize_fp8  # noqa: E402
from timing import bench_us, copies_for, copy_bandwidth_gbps, graph1_us, graph_us, kernel_us  # noqa: E402

ATTENTION_KINDS = ("decode", "prefill", "mixed")
TIME_KEYS = ("graph_us", "graph1_us", "kernel_us")  # how a time was taken, the preferred way first
FP8_TARGET_TOKENS = 128 * 1024  # issue 45's fp8 target counts from B*L = 128K cached tokens on


@dataclass(frozen=True)
class Case:
    """One batch shape: every request's new (query) tokens and cached (context) tokens."""

    name: str
    kind: str  # decode | prefill | mixed
    query_lens: list[int]
    context_lens: list[int]
    block_size: int = BLOCK
    """Keys per cache page. Pages of 128 hold whole 128-key tiles, which TRITON_ATTN then loads with
    TMA copies; issue 45's targets are for pages of BLOCK (16)."""


def cases(quick: bool) -> list[Case]:
    """The shapes timed: decode B x L, prefill B x N, and a mixed batch (one 2K prompt among 63 decodes)."""
    decode = [(1, 4096), (8, 4096), (32, 4096), (128, 2048), (64, 8192), (8, 32768), (256, 1024)]
    prefill = [(1, 4096), (8, 1024), (4, 8192)]
    if quick:
        decode, prefill = decode[:3], prefill[:1]
    out = [Case(f"decode {b}x{n}", "decode", [1] * b, [n - 1] * b) for b, n in decode]
    out += [Case(f"prefill {b}x{n}", "prefill", [n] * b, [0] * b) for b, n in prefill]
    out.append(Case("mixed 2K+63x4K", "mixed", [1] * 63 + [2048], [4095] * 63 + [0]))
    if not quick:  # the same prompts in pages of 128: K/V tiles by TMA copies
        out += [Case(f"prefill {b}x{n} p128", "prefill", [n] * b, [0] * b, 128) for b, n in prefill]
    return out


def kv_tokens(case: Case) -> int:
    """Tokens whose K and V the case reads, summed over requests: B*L for a decode batch."""
    return sum(q + c for q, c in zip(case.query_lens, case.context_lens))


def kv_bytes(case: Case, cache_bytes: int = 2) -> int:
    """What one pass reads and writes: K and V at `cache_bytes` per value (1: an fp8 cache) + q, out at 2."""
    return 2 * kv_tokens(case) * HKV * D * cache_bytes + 2 * sum(case.query_lens) * HQ * D * 2


def causal_flops(case: Case) -> float:
    """The two matmuls (2 flops a multiply-add each) over every (query, visible key) pair and query head."""
    pairs = sum(q * c + q * (q + 1) / 2 for q, c in zip(case.query_lens, case.context_lens))
    return 4.0 * pairs * HQ * D


def fp8_name(provider: str) -> str:
    """The key of a TRITON_ATTN provider's run over the fp8 copy of the cache ("triton" -> "triton_fp8")."""
    return f"{provider}_fp8"


# --- providers: each returns a no-argument callable over one input copy -----------------------


def triton_fn(batch: PagedBatch, tuning: Tuning | None, fp8: bool = False) -> Callable[[], object]:
    """TRITON_ATTN over the batch's cache, or (`fp8`) over an fp8 copy of it, with per-tensor scales
    from its amax, as the engine's profile run sets them (vLLM: Attention.calc_kv_scales in
    vllm/attention/layer.py)."""
    k_cache, v_cache, scales = batch.k_cache, batch.v_cache, {}
    if fp8:
        k_scale, v_scale = kv_scale(k_cache, K_SCALE_CONSTANT), kv_scale(v_cache, V_SCALE_CONSTANT)
        k_cache, v_cache = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(batch.q)
    kwargs = batch.attention_kwargs()
    workspace = SplitKVWorkspace(batch.q.shape[0] * 64, HQ, D, batch.q.device)
    config = None if tuning is None else batch_config(batch, tuning, kv_bytes=1 if fp8 else 2)
    return lambda: unified_attention(
        batch.q, k_cache, v_cache, out, **kwargs, workspace=workspace, config=config, **scales
    )


def fa4_fn(batch: PagedBatch, num_splits: int) -> Callable[[], object]:
    """flash-attn 4 over the batch's paged bf16 cache, through the same page table and lengths."""
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
    """The TORCH_REF backend's paged attention (plain torch, a loop over requests)."""
    out = torch.empty_like(batch.q)
    starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    return lambda: paged_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, out, starts, seq_lens, batch.block_table, D**-0.5
    )


def sdpa_fn(case: Case, seed: int, device: str = "cuda") -> Callable[[], object]:
    """Dense SDPA over contiguous K/V of the same lengths (requests of one kind at a time)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE)

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
    """None if flash-attn 4 imports here, else why not (said once in the table, kept in every row's JSON)."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:
        return f"flash_attn.cute not importable ({type(exc).__name__})"
    return None


def fa4_version() -> str | None:
    """The installed flash-attn 4 wheel's version (its package imports as `flash_attn`), if any."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def paged_batches(case: Case, device: str = "cuda") -> list[PagedBatch]:
    """The case's input copies (seeded: the profiler pass rebuilds the same ones)."""
    copies = copies_for(kv_bytes(case))
    return [
        llama_batch(case.query_lens, case.context_lens, block_size=case.block_size, seed=i, device=device)
        for i in range(copies)
    ]


def run_case(case: Case, tunings: dict[str, Tuning | None], device: str = "cuda") -> dict[str, object]:
    """Every provider on one case, one after the other in this process: TRITON_ATTN over the bf16 cache
    and over its fp8 copy (for each tuning), flash-attn 4 (or why not), the reference, dense SDPA.

    `device` is "cuda" but for tests, which run the providers through Triton's interpreter on the CPU."""
    batches = paged_batches(case, device)
    copies = len(batches)
    row: dict[str, object] = {
        "case": case.name,
        "kind": case.kind,
        "block_size": case.block_size,
        "kv_tokens": kv_tokens(case),
        "bytes": kv_bytes(case),
        "bytes_fp8": kv_bytes(case, cache_bytes=1),
        "flops": causal_flops(case),
        "copies": copies,
    }
    for name, tuning in tunings.items():
        for fp8 in (False, True):
            row[fp8_name(name) if fp8 else name] = measure(
                lambda i, tuning=tuning, fp8=fp8: triton_fn(batches[i], tuning, fp8), copies
            )
    missing = fa4_available()
    if missing is None:
        row["fa4"] = measure(lambda i: fa4_fn(batches[i], 1), copies)
        ours = next(iter(tunings.values()))
        row["max_abs_diff_vs_fa4"] = max_diff(batches[0], ours, fp8=False)
        row["max_abs_diff_fp8_vs_fa4"] = max_diff(batches[0], ours, fp8=True)
    else:
        row["fa4"] = {"skipped": missing}
    row["torch_ref"] = measure(lambda i: reference_fn(batches[i]), min(copies, 2), graph=case.kind != "prefill")
    row["sdpa_dense"] = measure(lambda i: sdpa_fn(case, i, device), copies)
    batches.clear()  # the tensors go now (the lambdas above keep the list itself)
    torch.cuda.empty_cache()
    return row


def profile_all(rows: list[dict[str, object]], chosen: list[Case], tunings: dict[str, Tuning | None]) -> None:
    """Add kernel_us for our kernels (both caches) and FA4 to each row where FA4 ran but a graph could not hold it.

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
            for fp8 in (False, True):
                row[fp8_name(name) if fp8 else name].update(
                    profiled(
                        lambda i, batches=batches, tuning=tuning, fp8=fp8: triton_fn(batches[i], tuning, fp8),
                        len(batches),
                    )
                )
        batches.clear()
        torch.cuda.empty_cache()


def max_diff(batch: PagedBatch, tuning: Tuning | None, fp8: bool) -> float:
    """Largest |TRITON_ATTN - flash-attn 4| over the batch's outputs (ours over the fp8 copy if `fp8`)."""
    ours = triton_fn(batch, tuning, fp8)()
    theirs = fa4_fn(batch, 1)()
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    return (ours.float() - theirs.float()).abs().max().item()


def run_reshape(tokens: int) -> dict[str, object]:
    """reshape_and_cache of `tokens` new K/V rows into random slots, against index_copy_ and a dense copy."""
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


# --- reporting: pure functions of the rows (tested on the CPU) ----------------------------------

LABELS = {"fa4": "flash-attn 4", "sdpa_dense": "dense SDPA", "torch_ref": "reference"}
METHODS = {"graph_us": "", "graph1_us": "1-call graphs", "kernel_us": "profiler kernel time", "bench_us": "eager"}


def label(provider: str, ours: str) -> str:
    """The table's name for a provider key (`ours`: the TRITON_ATTN key on show, e.g. "triton_tuned")."""
    return {ours: "TRITON_ATTN bf16", fp8_name(ours): "TRITON_ATTN fp8"}.get(provider) or LABELS[provider]


def us(entry: object, key: str = "graph_us") -> float | None:
    """One timing of a provider's entry (None where it has none, or is no entry)."""
    return entry.get(key) if isinstance(entry, dict) else None


def timed(entry: object) -> tuple[float | None, str]:
    """A provider's time per call and the way it was taken: the first of TIME_KEYS that it has, else its
    eager time (the reference backend's prefill, which no graph holds, has only that)."""
    for key in (*TIME_KEYS, "bench_us"):
        if us(entry, key):
            return us(entry, key), key
    return None, ""


def versus(row: dict[str, object], ours: str, peer: str) -> tuple[float | None, float | None, str]:
    """(our time, the peer's time, method) by the same method: many calls per graph if the peer
    could be captured that way, else single-call graphs, else profiler kernel time, for both."""
    for key in TIME_KEYS:
        if us(row.get(peer), key) and us(row.get(ours), key):
            return us(row.get(ours), key), us(row.get(peer), key), key
    return None, None, ""


def speedup(row: dict[str, object], ours: str, peer: str) -> tuple[float | None, str]:
    """How many times faster `ours` ran than `peer` on this row (peer time / our time, one method for
    both), and the method; (None, "") where either has no time."""
    mine, theirs, method = versus(row, ours, peer)
    return (theirs / mine, method) if mine and theirs else (None, "")


def why_not(row: dict[str, object], *providers: str) -> str:
    """Why a comparison of these providers has no number: the first one's skip reason or error."""
    for provider in providers:
        entry = row.get(provider)
        if not isinstance(entry, dict):
            return f"no {provider} in this run"
        if entry.get("skipped") or entry.get("error"):
            return str(entry.get("skipped") or entry.get("error"))
    return "no common timing method"


def table(rows: list[dict[str, object]], ours: str = "triton") -> list[dict[str, object]]:
    """The attention table as data, a line per case and provider: time per call, TB/s (decode: of the
    bytes that provider reads, K/V at 1 byte for fp8) or TFLOP/s (prefill, mixed) and, on TRITON_ATTN's
    two lines, how many times faster it is than dense SDPA, flash-attn 4 and (fp8) the bf16 cache.
    flash-attn 4 where it was not importable has no lines (`skipped_reasons` says why, once)."""
    lines: list[dict[str, object]] = []
    fp8 = fp8_name(ours)
    for row in rows:
        if row["kind"] not in ATTENTION_KINDS:
            continue
        for provider in (ours, fp8, "fa4", "sdpa_dense", "torch_ref"):
            entry = row.get(provider)
            if not isinstance(entry, dict) or "skipped" in entry:
                continue
            t, method = timed(entry)
            line: dict[str, object] = {"case": row["case"], "provider": provider, "us": t, "method": method}
            if t and row["kind"] == "decode":  # bytes / us / 1e6 = TB/s
                line["tbps"] = float(row["bytes_fp8" if provider == fp8 else "bytes"]) / t / 1e6
            elif t:
                line["tflops"] = float(row["flops"]) / t / 1e6
            if provider in (ours, fp8):
                peers = [("x_sdpa", "sdpa_dense"), ("x_fa4", "fa4")] + ([("x_bf16", ours)] if provider == fp8 else [])
                for key, peer in peers:
                    line[key], line[f"{key}_method"] = speedup(row, provider, peer)
            if "error" in entry:
                line["error"] = entry["error"]
            lines.append(line)
    return lines


def skipped_reasons(rows: list[dict[str, object]]) -> list[str]:
    """Each distinct reason a provider was skipped in this run (flash-attn 4 not importable), once."""
    reasons = [
        entry["skipped"] for row in rows for entry in row.values() if isinstance(entry, dict) and "skipped" in entry
    ]
    return list(dict.fromkeys(reasons))


def format_table(lines: list[dict[str, object]], ours: str = "triton") -> list[str]:
    """`table`'s lines as text, with the header; blank cells where a number does not apply."""

    def cell(value: object, width: int, spec: str) -> str:
        return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else " " * width

    out = [f"{'case':<18}{'provider':<18}{'us':>10}{'TB/s':>7}{'TFLOP/s':>8}{'x SDPA':>8}{'x FA4':>7}{'x bf16':>8}"]
    for line in lines:
        notes = [str(line["error"])] if "error" in line else []
        if line["method"] not in ("graph_us", ""):
            notes.append(f"us: {METHODS[str(line['method'])]}")
        notes += [
            f"{name}: {METHODS[str(line[f'{key}_method'])]}"
            for key, name in (("x_sdpa", "x SDPA"), ("x_fa4", "x FA4"), ("x_bf16", "x bf16"))
            if line.get(f"{key}_method") not in (None, "", "graph_us")
        ]
        out.append(
            f"{line['case']:<18}{label(str(line['provider']), ours):<18}{cell(line['us'], 10, '.1f')}"
            f"{cell(line.get('tbps'), 7, '.2f')}{cell(line.get('tflops'), 8, '.0f')}{cell(line.get('x_sdpa'), 8, '.2f')}"
            f"{cell(line.get('x_fa4'), 7, '.2f')}{cell(line.get('x_bf16'), 8, '.2f')}"
            + (f"  ({'; '.join(notes)})" if notes else "")
        )
    return out


def reshape_lines(rows: list[dict[str, object]], copy_gbps: float) -> list[str]:
    """reshape_and_cache's rows: ours, index_copy_ and a dense copy of the same bytes; GB/s and % of copy bandwidth."""
    out = [f"{'case':<24}{'ours us':>9}{'ref us':>9}{'copy us':>9}{'GB/s':>7}{'of copy':>9}"]
    for row in rows:
        if row["kind"] != "reshape":
            continue
        t = us(row.get("triton"))
        gbps = float(row["bytes"]) / t / 1e3 if t else float("nan")
        out.append(
            f"{row['case']:<24}{t or float('nan'):9.1f}{us(row.get('torch_ref')) or float('nan'):9.1f}"
            f"{us(row.get('dense_copy')) or float('nan'):9.1f}{gbps:7.0f}{100 * gbps / copy_gbps:8.0f}%"
        )
    return out


def targets(
    rows: list[dict[str, object]], ours: str = "triton", copy_gbps: float | None = None
) -> list[dict[str, object]]:
    """Issue 45's targets, each measured in this run against its goal (speed-ups, the same timing method
    on both sides), then issue 4's two that issue 45 does not tighten. One entry per target and shape."""
    found: list[dict[str, object]] = []

    def add(issue: int, case: str, what: str, measured: float | None, goal: float, why: str, unit: str = "x") -> None:
        status = "not measured" if measured is None else "met" if measured >= goal else "missed"
        entry = {"issue": issue, "case": case, "what": what, "measured": measured, "goal": goal, "unit": unit}
        found.append(entry | {"status": status} | ({"why": why} if measured is None else {}))

    fp8 = fp8_name(ours)
    goals = {
        "prefill": [("sdpa_dense", 0.9), ("fa4", 0.9)],
        "mixed": [("sdpa_dense", 1.0)],
        "decode": [("sdpa_dense", 0.98)],
    }
    attention = [row for row in rows if row["kind"] in ATTENTION_KINDS and row.get("block_size", BLOCK) == BLOCK]
    for row in attention:
        for peer, goal in goals[str(row["kind"])]:
            x, _ = speedup(row, ours, peer)
            add(45, str(row["case"]), f"bf16 vs {LABELS[peer]}", x, goal, why_not(row, ours, peer))
        if row["kind"] == "decode" and int(row["kv_tokens"]) >= FP8_TARGET_TOKENS:
            x, _ = speedup(row, fp8, ours)
            add(45, str(row["case"]), "fp8 cache vs bf16 cache", x, 1.8, why_not(row, fp8, ours))
    decodes = [row for row in attention if row["kind"] == "decode"]
    if decodes:  # issue 4: the geometric mean over every decode shape, so only if each has its ratio
        vs_fa4 = [speedup(row, ours, "fa4")[0] for row in decodes]
        known = [x for x in vs_fa4 if x is not None]
        geomean = math.exp(sum(map(math.log, known)) / len(known)) if len(known) == len(vs_fa4) else None
        why = next((why_not(row, ours, "fa4") for row, x in zip(decodes, vs_fa4) if x is None), "")
        shapes = f"{len(decodes)} shape{'s' if len(decodes) > 1 else ''}"
        add(4, f"decode ({shapes})", "geomean vs flash-attn 4", geomean, 1.2, why)
    for row in rows:  # issue 4: reshape_and_cache of 8192 tokens at >= 70% of a plain copy's bandwidth
        if row["case"] == "reshape_and_cache 8192" and copy_gbps:
            t = us(row.get("triton"))
            share = float(row["bytes"]) / t / 1e3 / copy_gbps if t else None  # bytes / us / 1e3 = GB/s
            add(4, str(row["case"]), "of copy bandwidth", share, 0.7, why_not(row, "triton"), unit="%")
    return found


def shown(value: float, unit: str) -> str:
    """A target's number as printed: a speed-up as 0.94x, a share as 84%."""
    return f"{100 * value:.0f}%" if unit == "%" else f"{value:.2f}x"


def format_targets(found: list[dict[str, object]]) -> list[str]:
    """`targets` as text: one line each (measured, goal, met / missed / not measured and why), then the tally."""
    out = [f"{'issue':<6}{'case':<24}{'what':<28}{'measured':>9}{'target':>10}  status"]
    for t in found:
        unit = str(t["unit"])
        measured = "-" if t["measured"] is None else shown(float(t["measured"]), unit)  # type: ignore[arg-type]
        out.append(
            f"{t['issue']:<6}{t['case']:<24}{t['what']:<28}{measured:>9}{'>= ' + shown(float(t['goal']), unit):>10}"  # type: ignore[arg-type]
            f"  {t['status']}" + (f" ({t['why']})" if "why" in t else "")
        )
    tally = {s: sum(t["status"] == s for t in found) for s in ("met", "missed", "not measured")}
    out.append(f"{tally['met']} met, {tally['missed']} missed, {tally['not measured']} not measured, of {len(found)}")
    return out


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
            dict(fp8_decode=(16, n, 4, st, regs), decode_programs_per_sm=4)
            for n, st, regs in itertools.product((64, 128), (1, 2), (None, 128))
        ]  # 1 stage: tiles load straight into registers, cast there (no staging copy of the fp8 bytes)
    else:
        longs = [(128, 128, 8, 3), (64, 64, 4, 3)]
        shorts = [(64, 64, 4, 3), (64, 32, 4, 2)]
        grid = [
            dict(long_prefill=a, short_prefill=b, split_mixed=m)
            for a, b, m in itertools.product(longs, shorts, (True, False))
        ]
    chosen = [c for c in cases(quick) if (c.kind == "decode") == kind.endswith("decode") and c.block_size == BLOCK]
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


# --- command line ---------------------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """End the script with one line on stderr, `attention: error: ...`, and exit status 1 (no traceback)."""
    sys.exit(f"attention: error: {message}")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are `fail`'s one line (argparse would print its usage before them)."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def read_json(path: Path, flag: str, expected: str) -> object:
    """The JSON in `path`, or `fail` naming the flag, the file and what it should be."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        fail(f"{flag} {path}: cannot read it ({exc.strerror or exc}); pass {expected}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fail(f"{flag} {path}: not JSON ({exc}); pass {expected}")


def load_tunings(paths: list[Path]) -> dict[str, Tuning | None]:
    """The TRITON_ATTN variants to time: the default tiles ("triton") and, with sweep results, their
    winners merged into one Tuning ("triton_tuned")."""
    tunings: dict[str, Tuning | None] = {"triton": None}
    if not paths:
        return tunings
    expected = "the JSON that `--sweep KIND --json FILE` wrote"
    knobs: dict[str, object] = {}
    for path in paths:
        result = read_json(path, "--tuning", expected)
        best = result.get("best") if isinstance(result, dict) else None
        if not isinstance(best, dict):
            fail(f"--tuning {path}: no 'best' knobs in it; pass {expected}")
        knobs.update(best)
    fields = [field.name for field in dataclasses.fields(Tuning)]
    unknown = sorted(set(knobs) - set(fields))
    if unknown:
        fail(f"--tuning: unknown knob(s) {', '.join(unknown)}; Tuning's knobs are {', '.join(fields)}")
    try:
        tunings["triton_tuned"] = make_tuning(knobs)
    except TypeError as exc:
        fail(f"--tuning: knobs {json.dumps(knobs)} make no Tuning ({exc}); tiles are [block_m, block_n, warps, stages]")
    return tunings


def load_run(path: Path) -> dict[str, object]:
    """An earlier run's JSON for `--targets RUN.json`, checked to have what `targets` reads."""
    expected = "the JSON that `attention.py --json FILE` wrote"
    run = read_json(path, "--targets", expected)
    rows = run.get("rows") if isinstance(run, dict) else None
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "kind" in row for row in rows):
        fail(f"--targets {path}: no 'rows' list of cases in it; pass {expected}")
    if any(row["kind"] in ATTENTION_KINDS and "kv_tokens" not in row for row in rows):
        fail(f"--targets {path}: rows without 'kv_tokens' (an attention.py older than the fp8 rows); rerun it")
    return run  # type: ignore[return-value]


def run_info() -> dict[str, object]:
    """What a figure taken from the JSON must name: the card, the versions, the date, the command."""
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flash_attn": fa4_version(),
        "flash_attn_missing": fa4_available(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
    }


def describe(info: dict[str, object]) -> str:
    """The run's one-line header: card, versions, date."""
    fa4 = info.get("flash_attn_missing") or f"flash-attn 4 {info.get('flash_attn') or '(version unknown)'}"
    return f"{info.get('device')}, torch {info.get('torch')}, triton {info.get('triton')}, {fa4}; {info.get('date')}"


LEGEND = """us: GPU time per call inside a CUDA graph of many calls (else as noted). x SDPA / x FA4 / x bf16:
how many times faster that TRITON_ATTN line ran than dense SDPA / flash-attn 4 / TRITON_ATTN over the bf16
cache, both sides timed the same way. flash-attn 4 has no fp8 path on Hopper and SDPA none at all: they
read bf16 K/V on every line, and the fp8 line is compared with them. TB/s (decode): K, V, q and out
bytes that provider reads (fp8: K/V at 1 byte). TFLOP/s (prefill, mixed): causal attention's matmuls."""


def report(run: dict[str, object], with_targets: bool) -> None:
    """Print a run's tables (one per TRITON_ATTN tuning) and, if asked, its targets."""
    rows = run["rows"]
    for reason in skipped_reasons(rows):  # type: ignore[arg-type]
        print(f"skipped on every case: {reason}")
    for name in run["tunings"]:  # type: ignore[union-attr]
        print(f"\n== TRITON_ATTN ({name}) vs flash-attn 4, dense SDPA and the reference ==\n{LEGEND}")
        print("\n".join(format_table(table(rows, name), name)))  # type: ignore[arg-type]
    if any(row["kind"] == "reshape" for row in rows):  # type: ignore[union-attr]
        print("\n== reshape_and_cache (GB/s: bytes read + written) ==")
        print("\n".join(reshape_lines(rows, run["copy_gbps"])))  # type: ignore[arg-type]
        print(f"device-to-device copy: {run['copy_gbps']:.0f} GB/s (read + write)")
    if with_targets:
        for name in run["tunings"]:  # type: ignore[union-attr]
            print(f"\n== targets, TRITON_ATTN ({name}): measured in this run vs issue 45's (and issue 4's) ==")
            print("\n".join(format_targets(targets(rows, name, run.get("copy_gbps")))))  # type: ignore[arg-type]


def main() -> None:
    """Parse and check the arguments, then sweep, or run every case and report, or report an earlier run."""
    parser = Parser(prog="attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write all numbers here")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--sweep", choices=["decode", "fp8-decode", "prefill"], help="search tile knobs instead")
    parser.add_argument("--tuning", type=Path, nargs="*", default=[], help="sweep results whose winners to use too")
    parser.add_argument(
        "--targets",
        type=Path,
        nargs="?",
        const=True,
        metavar="RUN.json",
        help="print issue 45's targets, met or missed, at the end; with a file: those of that earlier run (no GPU)",
    )
    args = parser.parse_args()
    if isinstance(args.targets, Path):
        if args.sweep or args.tuning or args.quick or args.json:
            fail(f"--targets {args.targets} reports an earlier run: it takes no --sweep, --tuning, --quick or --json")
        run = load_run(args.targets)
        print(describe(run))
        report(run, with_targets=True)
        return
    if args.sweep and (args.tuning or args.targets):
        fail(f"--sweep {args.sweep} searches knobs itself: drop --tuning and --targets")
    if args.json and not args.json.parent.is_dir():
        fail(f"--json {args.json}: folder {args.json.parent} does not exist; create it or name another")
    tunings = load_tunings(args.tuning)
    if not torch.cuda.is_available():
        fail("needs a CUDA GPU (torch.cuda.is_available() is False); `--targets RUN.json` reports a run without one")
    if args.sweep:
        result = sweep(args.sweep, args.quick)
        print("best:", result["best"])
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return

    info = run_info()
    print(describe(info), flush=True)
    copy_gbps = copy_bandwidth_gbps()
    chosen = cases(args.quick)
    rows = []
    for case in chosen:
        rows.append(run_case(case, tunings))
        print(json.dumps(rows[-1]), flush=True)
    for tokens in (1, 256, 8192):
        rows.append(run_reshape(tokens))
        print(json.dumps(rows[-1]), flush=True)
    profile_all(rows, chosen, tunings)  # last: the profiler slows every graph timing after it
    run: dict[str, object] = {
        **info,
        "copy_gbps": copy_gbps,
        "tunings": {k: dataclasses.asdict(v) if v else None for k, v in tunings.items()},
        "rows": rows,
        "tables": {name: table(rows, name) for name in tunings},
        "targets": {name: targets(rows, name, copy_gbps) for name in tunings},
    }
    report(run, with_targets=args.targets is True)
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
