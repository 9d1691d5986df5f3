"""The whole engine through `LLM` on a GPU: workload W1 against its peers, and decode step latency.

    python benchmarks/end_to_end.py [--hf] [--profile] [--json out.json]      # W1 + decode table
    python benchmarks/end_to_end.py --skip-decode --num-requests 48 --max-tokens 32 --profile  # quick

**W1** (issue 9): `llama3-8b` shapes with random bf16 weights, 128 requests with prompt lengths
uniform in [100, 1024] (`random.Random(0)`, see `w1_prompts`), 128 new tokens each, greedy, EOS
ignored. Rows: pagedkv with each backend (`--backends`; FLASH_ATTN needs `flash_attn.cute`) in
each mode (`--w1-modes`), then with `--hf` transformers' `generate_batch` and padded `generate`
on the same weights (`hf_peers.py`), all in this process on this GPU. Each pagedkv engine runs
once to warm up, on other prompts of W1's lengths (Triton / torch.compile compilation lands there:
its time is reported as the first run; prefix caching then finds nothing of W1's prompts), and
is timed on W1. The roofline beside them: every decode step streams
the weights and the KV cache at `--hbm-tbps`, prefill runs its FLOPs at `--tflops` (`roofline`).

**Decode step latency**: per model (`--decode-models`), batch size (`--decode-batches`) and mode
(`--modes`: eager, PIECEWISE, FULL, FULL_AND_PIECEWISE), the median wall time of `llm.step()`
over steps whose batch is a pure decode of every request. A mode the engine in this checkout
does not take (no `cudagraph_mode` / `compile` argument in `LLM`) is skipped with the reason.

`--profile` runs cProfile over the first and second W1 run of each engine and prints where the
time goes (top entries) and how much of it is compilation: Triton's `compile`, Dynamo's frame
compilation, Python's `compile` builtin (code generation) and the number of SHA-256 hashings
(compile cache keys). The timed run is then a third, unprofiled one.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import inspect
import json
import pstats
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH first: lets an older checkout be timed

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.models.fused_moe import FusedMoE  # noqa: E402
from pagedkv.models.loader import load_config  # noqa: E402

MODES = ("eager", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE")


def w1_prompts(num_requests: int = 128) -> list[list[int]]:
    """W1's prompts, exactly as issue 9 defines them (fewer requests: the first ones)."""
    rng = random.Random(0)
    return [[rng.randrange(3, 128000) for _ in range(rng.randint(100, 1024))] for _ in range(128)][:num_requests]


def mode_kwargs(mode: str) -> tuple[dict[str, object], str | None]:
    """`LLM` keyword arguments for a mode, or the reason this checkout cannot run it."""
    params = inspect.signature(LLM.__init__).parameters  # older checkouts lack some arguments
    if mode == "eager":
        return ({"enforce_eager": True} if "enforce_eager" in params else {}), None
    if "cudagraph_mode" not in params:
        return {}, "LLM takes no cudagraph_mode here (CUDA graphs not wired in this checkout)"
    piecewise = "PIECEWISE" in mode
    if piecewise and "compile" not in params:
        return {}, "LLM takes no compile argument here (no piecewise compilation)"
    try:
        from pagedkv.compilation import CUDAGraphMode

        value: object = CUDAGraphMode[mode]
    except (ImportError, KeyError):
        value = mode
    return {"cudagraph_mode": value, "enforce_eager": False, "compile": piecewise}, None


DEVICE = "cuda"
"""`--device cpu` smoke-tests this script on the tiny preset (TORCH_REF, float32)."""


def make_llm(model: str, backend: str, mode: str, **engine: object) -> LLM:
    kwargs, reason = mode_kwargs(mode)
    if reason:
        raise NotImplementedError(reason)
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    return LLM(model, device=DEVICE, dtype=dtype, attention_backend=backend, **engine, **kwargs)


def resolved_mode(llm: LLM) -> str:
    """The mode the engine runs after start-up (the runner's; the config's request if it has none)."""
    mode = getattr(llm.runner, "cudagraph_mode", llm.config.compilation_config.cudagraph_mode)
    return getattr(mode, "name", str(mode))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """Give back the memory of engines nothing refers to any more (callers drop theirs first)."""
    gc.collect()  # the model and its layers reference each other through the forward-context dict
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# --- profiling ------------------------------------------------------------------------------


def profiled(fn: Callable[[], object], top: int, title: str) -> dict[str, float]:
    """Run `fn` under cProfile; print its top entries; return compile counters and the wall time."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(fn)
    sync()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    found = compile_counters(stats)
    found["wall_s"] = wall
    compiling = found["triton_compile_s"] + found["dynamo_compile_s"] + found["builtins_compile_s"]
    found["compile_share_upper"] = compiling / wall  # an upper bound: nested compile calls count twice
    print(f"\n--- {title}: {wall:.2f} s under cProfile; " + ", ".join(f"{k} {v:.3g}" for k, v in found.items()))
    stats.sort_stats("tottime").print_stats(top)
    if found["builtins_compile_calls"]:
        stats.print_callers("builtins.compile")
    return found


def compile_counters(stats: pstats.Stats) -> dict[str, float]:
    """Calls and seconds of the compilation entry points, from cProfile's table."""
    out = dict.fromkeys(("triton_compile_calls", "triton_compile_s", "dynamo_compile_calls", "dynamo_compile_s",
                         "builtins_compile_calls", "builtins_compile_s", "sha256_calls"), 0.0)
    for (file, _, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if file.endswith("triton/compiler/compiler.py") and func == "compile":
            out["triton_compile_calls"] += calls
            out["triton_compile_s"] += cumtime
        elif file.endswith("torch/_dynamo/convert_frame.py") and func == "_compile":
            out["dynamo_compile_calls"] += calls
            out["dynamo_compile_s"] += cumtime
        elif func == "<built-in method builtins.compile>":
            out["builtins_compile_calls"] += calls
            out["builtins_compile_s"] += tottime
        elif "sha256" in func:
            out["sha256_calls"] += calls
    return out


# --- W1 -------------------------------------------------------------------------------------


def generate_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    return time.perf_counter() - start, outs


def run_w1(llm: LLM, prompts: list[list[int]], args: argparse.Namespace, label: str) -> dict[str, object]:
    """Warm-up run, then the timed run (with --profile: two profiled runs, then the timed one).

    Every run before the timed one gets fresh prompts of W1's lengths: prefix caching (on by
    default) then finds nothing of W1's prompts, and the timed run prefills all their tokens.
    """
    rng = random.Random(1)
    id_limit = max(max(p) for p in prompts) + 1  # W1's ids already fit the model's vocabulary

    def other_prompts() -> list[list[int]]:
        return [[rng.randrange(3, id_limit) for _ in p] for p in prompts]

    row: dict[str, object] = {}
    if args.profile:
        for run in ("first", "second"):
            row[f"{run}_run_profile"] = profiled(lambda: generate_s(llm, other_prompts(), args.max_tokens), args.top,
                                                 f"{label}, {run} run")
        row["first_run_s"] = row["first_run_profile"]["wall_s"]  # type: ignore[index]
    else:
        row["first_run_s"], _ = generate_s(llm, other_prompts(), args.max_tokens)
    if args.kernel_profile:
        row["kernels"] = kernel_profile(lambda: generate_s(llm, other_prompts(), args.max_tokens), args.top, label)
    steps_before = llm.stats.num_steps
    steps: list[tuple[float, int, str]] = []
    detach = llm.add_step_listener(lambda ev: steps.append(
        (time.perf_counter(), ev.scheduler_output.num_prefill_tokens, getattr(ev.result.cudagraph_mode, "name", "?"))))
    try:
        start = time.perf_counter()
        seconds, outs = generate_s(llm, prompts, args.max_tokens)
    finally:
        detach()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    row.update(seconds=seconds, output_tokens=generated, output_tokens_per_s=generated / seconds,
               steps=llm.stats.num_steps - steps_before, first_tokens=outs[0].outputs[0].token_ids[:8],
               step_breakdown=step_breakdown(start, steps))
    return row


def step_breakdown(start: float, steps: list[tuple[float, int, str]]) -> dict[str, dict[str, float]]:
    """Wall time per kind of step: those that prefill (possibly with decodes mixed in) and pure decodes.

    A step's time runs from the previous step's end (the listener call) to its own: the model,
    sampling (which waits for the GPU) and the engine's bookkeeping.
    """
    out: dict[str, dict[str, float]] = {}
    for (end, prefill_tokens, mode), before in zip(steps, [start] + [t for t, _, _ in steps]):
        kind = f"{'prefill' if prefill_tokens else 'decode'} ({mode})"
        entry = out.setdefault(kind, {"steps": 0, "seconds": 0.0, "prefill_tokens": 0})
        entry["steps"] += 1
        entry["seconds"] += end - before
        entry["prefill_tokens"] += prefill_tokens
    return out


def kernel_profile(fn: Callable[[], object], top: int, title: str) -> dict[str, float]:
    """Run `fn` under torch.profiler; print the GPU kernels that take the most time.

    Returns the GPU time summed over kernels and the wall time: a sum well below the wall time
    means the GPU waited for the host.
    """
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    gpu_s = sum(e.self_device_time_total for e in events) / 1e6
    print(f"\n--- {title}, kernels: {gpu_s:.2f} s of GPU time in {wall:.2f} s of wall time (under the profiler)")
    for e in events[:top]:
        print(f"  {e.self_device_time_total / 1e3:10.1f} ms {e.count:7d}x  {e.key[:110]}")
    return {"gpu_s": gpu_s, "wall_s": wall}


def roofline(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, hbm_tbps: float, tflops: float) -> dict:
    """Lower bound on W1's time: prefill at peak FLOP/s, then one decode step per further token.

    Prefill: 2 FLOPs per weight and prompt token (embedding gather and LM head excluded; the
    head runs once per request; a MoE counts the experts its FusedMoE layers run per token: the
    top_k routed ones in the grouped way, every one in the dense way) plus causal attention, 2 * L(L+1)/2 * heads * (q.k width + p.v width) per layer. Decode: max_tokens - 1 steps of all requests, each streaming every weight once
    (the issue's "16 GB") and every request's KV cache at `hbm_tbps`.
    """
    c = model.config
    weights = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.model.embed_tokens.weight.numel(), model.lm_head.weight.numel()
    body = weights - embed - (0 if c.tie_word_embeddings else head)
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE) and m.use_grouped_mm):
        body -= (moe.w13_weight.numel() + moe.w2_weight.numel()) * (1 - c.num_experts_per_tok / moe.num_experts)
    lens = [len(p) for p in prompts]
    item = model.lm_head.weight.element_size()
    if c.use_mla:  # per head: q.k over qk_head_dim, p.v over v_head_dim; one latent row cached per token
        attn_width, kv_per_token = c.qk_head_dim + c.v_head_dim, c.num_hidden_layers * c.head_dim * item
    else:
        attn_width, kv_per_token = 2 * c.head_dim, 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * item
    attn = sum(2 * n * (n + 1) / 2 for n in lens) * c.num_attention_heads * attn_width * c.num_hidden_layers
    prefill_flops = 2 * body * sum(lens) + 2 * head * len(lens) + attn
    decode_bytes = sum(weight_bytes + kv_per_token * sum(n + j for n in lens) for j in range(1, max_tokens))
    seconds = prefill_flops / (tflops * 1e12) + decode_bytes / (hbm_tbps * 1e12)
    return {"weight_gb": weight_bytes / 1e9, "prefill_tflop": prefill_flops / 1e12, "decode_gb": decode_bytes / 1e9,
            "seconds": seconds, "output_tokens_per_s": len(lens) * max_tokens / seconds}


def w1(args: argparse.Namespace) -> dict[str, object]:
    prompts = w1_prompts(args.num_requests)
    vocab = load_config(args.w1_model).vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]  # a no-op for llama3-8b (ids < 128000)
    engine = dict(max_num_seqs=len(prompts), max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
                  kv_cache_memory=args.kv_cache_gib * 2**30)
    rows: list[dict[str, object]] = []
    kept = None  # the last engine's model serves the transformers peers (same weights)
    for backend in args.backends:
        for mode in args.w1_modes:
            row: dict[str, object] = {"engine": f"pagedkv {backend}", "mode": mode}
            rows.append(row)
            reason = mode_kwargs(mode)[1]
            if backend == "FLASH_ATTN" and importlib.util.find_spec("flash_attn") is None:
                reason = "flash_attn (flash-attn 4, flash_attn.cute) is not installed here"
            if reason:
                row["skipped"] = reason
                continue
            kept = llm = None  # one engine at a time on the GPU
            release()
            try:
                llm = make_llm(args.w1_model, backend, mode, **engine)
                row["resolved_mode"] = resolved_mode(llm)
                row.update(run_w1(llm, prompts, args, f"{backend} {mode}"))
                kept, llm = llm, None
            except Exception as exc:  # a row that fails says why in the table (traceback on stderr)
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            llm = None
            release()
            print(json.dumps(row, default=str)[:600], flush=True)
    roof = None
    if kept is not None:
        roof = roofline(kept.model, prompts, args.max_tokens, args.hbm_tbps, args.tflops)
        if args.hf_batch or args.hf_padded:
            rows += hf_rows(kept.model, prompts, args)
    kept = None
    release()
    return {"model": args.w1_model, "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "max_tokens": args.max_tokens,
            "engine_args": engine, "roofline": roof, "rows": rows}


def hf_rows(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> list[dict[str, object]]:
    import hf_peers  # beside this file; needs transformers

    hf = hf_peers.export(model)
    runs = []
    if args.hf_batch:
        runs.append(("transformers generate_batch", "paged sdpa",
                     lambda: hf_peers.generate_batch(hf, prompts, args.max_tokens)))
    if args.hf_padded:
        runs.append((f"transformers generate (padded, batch {args.hf_batch_size})", "sdpa",
                     lambda: hf_peers.generate_padded(hf, prompts, args.max_tokens, args.hf_batch_size)))
    rows = []
    for name, mode, run in runs:
        row: dict[str, object] = {"engine": name, "mode": mode}
        try:
            row.update(run())
            row["output_tokens_per_s"] = row["output_tokens"] / row["seconds"]
        except Exception as exc:
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(json.dumps(row, default=str)[:600], flush=True)
        rows.append(row)
        release()
    return rows


# --- decode step latency --------------------------------------------------------------------


def decode_latency(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median wall time of `llm.step()` over `steps` steps that decode all `batch` requests."""
    seen: list[tuple[int, int]] = []
    detach = llm.add_step_listener(lambda ev: seen.append((ev.result.batch.num_tokens, ev.result.batch.max_query_len)))
    rng = random.Random(batch)
    # Requests whose prompts finish early decode while later prompts are prefilled: room for that.
    budget = steps + 16 + batch * prompt_len // 1024
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    ids = [llm.add_request({"prompt_token_ids": [rng.randrange(3, 250) for _ in range(prompt_len)]}, params)
           for _ in range(batch)]
    times: list[float] = []
    try:
        warm = 0
        while len(times) < steps:
            if len(seen) > budget:
                raise RuntimeError(f"batch {batch}: no {steps} pure decode steps in {budget} steps")
            start = time.perf_counter()
            llm.step()
            elapsed = time.perf_counter() - start
            if seen[-1] == (batch, 1):
                warm += 1
                if warm > 3:  # the first decode steps may still compile or capture
                    times.append(elapsed)
            elif warm:
                raise RuntimeError(f"batch {batch}: a step after decoding began was {seen[-1]}")
    finally:
        for req_id in ids:
            llm.abort_request(req_id)
        detach()
    return {"batch": batch, "step_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}


def decode_table(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for model in args.decode_models:
        for mode in args.modes:
            engine = dict(max_num_seqs=max(args.decode_batches), max_num_batched_tokens=4096,
                          max_model_len=args.decode_prompt_len + 1024, kv_cache_memory=8 * 2**30)
            llm = None
            try:
                llm = make_llm(model, args.decode_backend, mode, **engine)
                for batch in args.decode_batches:
                    rows.append({"model": model, "mode": mode, "resolved_mode": resolved_mode(llm),
                                 **decode_latency(llm, batch, args.decode_prompt_len, args.decode_steps)})
                    print(json.dumps(rows[-1]), flush=True)
            except NotImplementedError as exc:
                rows.append({"model": model, "mode": mode, "skipped": str(exc)})
            except Exception as exc:
                traceback.print_exc()
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append({"model": model, "mode": mode, "error": error})
            llm = None
            release()
    return rows


# --- tables ---------------------------------------------------------------------------------


def print_w1(result: dict) -> None:
    rows, roof = result["rows"], result["roofline"]
    hf = next((r["output_tokens_per_s"] for r in rows if "generate_batch" in r["engine"] and "seconds" in r), None)
    print(f"\nW1: {result['model']}, {result['num_requests']} requests, {result['prompt_tokens']} prompt tokens, "
          f"{result['max_tokens']} new tokens each")
    print(f"{'engine':<44}{'mode':<20}{'1st run s':>10}{'s':>8}{'out tok/s':>11}{'x HF batch':>11}{'% roof':>8}")
    for r in rows:
        if "seconds" not in r:
            print(f"{r['engine']:<44}{r['mode']:<20}  {r.get('skipped') or r.get('error')}")
            continue
        first = f"{r['first_run_s']:10.2f}" if "first_run_s" in r else f"{'':>10}"
        ratio = f"{r['output_tokens_per_s'] / hf:11.2f}" if hf else f"{'':>11}"
        pct = f"{100 * r['output_tokens_per_s'] / roof['output_tokens_per_s']:7.0f}%" if roof else ""
        print(f"{r['engine']:<44}{r['mode']:<20}{first}{r['seconds']:8.2f}{r['output_tokens_per_s']:11.0f}{ratio}{pct}")
        for kind, b in r.get("step_breakdown", {}).items():
            print(f"{'':<6}{kind:<38}{b['steps']:5d} steps {b['seconds']:7.2f} s  ({1e3 * b['seconds'] / b['steps']:.1f} ms/step, "
                  f"{b['prefill_tokens']} prefill tokens)")
    if roof:
        print(f"{'roofline':<44}{'':<20}{'':>10}{roof['seconds']:8.2f}{roof['output_tokens_per_s']:11.0f}"
              f"   ({roof['weight_gb']:.1f} GB weights + KV per decode step, {roof['prefill_tflop']:.0f} TFLOP prefill)")


def print_decode(rows: list[dict]) -> None:
    print("\ndecode step latency, ms (median wall time of llm.step())")
    for r in rows:
        if "step_ms" in r:
            print(f"  {r['model']:<10}{r['mode']:<20}batch {r['batch']:<4}{r['step_ms']:9.2f} ms"
                  f"   (resolved: {r['resolved_mode']})")
        else:
            print(f"  {r['model']:<10}{r['mode']:<20}{r.get('skipped') or r.get('error')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (tiny models, TORCH_REF)")
    p.add_argument("--w1-model", default="llama3-8b")
    p.add_argument("--backends", nargs="+", default=["TRITON_ATTN", "FLASH_ATTN"])
    p.add_argument("--w1-modes", nargs="+", default=["eager", "FULL", "FULL_AND_PIECEWISE"], choices=MODES)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=int, default=16)
    p.add_argument("--hf", action="store_true", help="both transformers peers")
    p.add_argument("--hf-batch", action="store_true", help="transformers generate_batch")
    p.add_argument("--hf-padded", action="store_true", help="transformers padded generate")
    p.add_argument("--hf-batch-size", type=int, default=128)
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    p.add_argument("--tflops", type=float, default=790.0)
    p.add_argument("--skip-w1", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--decode-models", nargs="+", default=["tiny", "llama3-8b"])
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--decode-backend", default="TRITON_ATTN")
    p.add_argument("--decode-prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="cProfile the first and second W1 run of each engine")
    p.add_argument("--kernel-profile", action="store_true",
                   help="torch.profiler over one more W1 run of each engine: the GPU kernels taking the most time")
    p.add_argument("--top", type=int, default=25, help="profile entries printed")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.hf_batch |= args.hf
    args.hf_padded |= args.hf
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/end_to_end.py needs a CUDA GPU (or --device cpu for a smoke test)")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result: dict[str, object] = {"device": name, "torch": torch.__version__,
                                 "args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_decode:
        result["decode"] = decode_table(args)
    if not args.skip_w1:
        result["w1"] = w1(args)
    if "decode" in result:
        print_decode(result["decode"])  # type: ignore[arg-type]
    if "w1" in result:
        print_w1(result["w1"])  # type: ignore[arg-type]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
