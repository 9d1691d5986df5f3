"""The whole engine through `LLM` on a GPU: workloads W1 and W2 in every mode, against their peers.

    python benchmarks/end_to_end.py --tables w1 --hf --json w1.json                 # W1 + transformers
    python benchmarks/end_to_end.py --tables w2 --w2-models qwen3-0.6b --json w2.json
    python benchmarks/end_to_end.py --tables w2 --w2-models qwen3-8b --modes default --startup --json s.json
    python benchmarks/end_to_end.py --device cpu --tables w1 w2 --w1-model tiny --w2-models tiny \\
        --w1-kv-cache-gib 0.25 --w2-kv-cache-gib 0.25 --num-requests 4 --max-tokens 8 --backends TORCH_REF \
        --modes default eager --startup   # smoke test
    python benchmarks/readme_figures.py w1.json w2.json s.json       # the README's markdown tables
    python benchmarks/end_to_end.py --tables w1 --modes default default+invariant --matmul-tiles bim.json ...

Workloads (`workloads.py`): **W1** (issue 9: `llama3-8b`, 128 requests, prompts of 100-1024
tokens, 128 new tokens each, greedy, EOS ignored, 128 sequences and 4,096 tokens a step, 16 GiB
of KV cache) and **W2** (nano-vllm's bench.py, call for call: 256 sequences, prompts and outputs
of 100-1024 tokens, temperature 0.6, EOS ignored, 512 sequences and 16,384 tokens a step; KV
cache `--w2-kv-cache-gib`) on each model of `--w2-models`. Random weights (the presets).

One row per engine and mode (`--modes`; `engine_bench.mode_kwargs`: `default` gives `LLM` only
the model, the KV cache size and the batch limits; `all` is default, eager, FULL_DECODE_ONLY and
FULL_AND_PIECEWISE with async scheduling on and off). Each row, in this process unless said:

* start-up (`--startup`): cold and warm, each `LLM(...)` in a fresh subprocess (`startup.py`;
  cold: empty compile caches), printed as each finishes; `init_s`: this process's own `LLM(...)`.
* warm-up: one `generate` of the workload drawn from seed 1 (same distribution, other prompts;
  outputs capped at `--warmup-max-tokens`, 0: the whole workload); compilation lands there.
* timed `generate` on the workload's own prompts (text made once, at the end), and timed
  streaming: the same lengths and sampling parameters with other token ids, all requests added,
  then `llm.step()` until done, reading each output's new text every step as a server would
  stream it. Prefix caching stays on (the default) and neither run finds anything of its prompts
  cached (`cached_prompt_tokens`, 0). Output tok/s = output tokens / wall time of the run.
* decode-step breakdown (`step_timing.decode_breakdown`): the workload's batch in pure decode;
  median wall ms of `llm.step()`, GPU-busy ms per step (summed kernel time, torch.profiler,
  after the timed runs) and the host's share of the step.

Beside the rows: the roofline of each workload (`workloads.roofline`: prefill at `--tflops`,
decode steps at `--hbm-tbps`); with `--hf`, transformers' `generate_batch` and padded `generate`
on W1 with the same weights (`hf_peers.py`); on W2 nano-vllm when it is staged (`nano_peer.py`:
`bash benchmarks/stage_peers.sh`, flash-attn 4 and xxhash importable), after the pagedkv rows and
in the same order of steps: its engine on the last pagedkv engine's weights and KV cache bytes, a
warm-up on the same warm-up workload, then the timed `generate` (`--no-nano` leaves it out). With
`--nano-export DIR` this process only writes the weights, and `nano_peer.py --into <the JSON>`
runs nano-vllm in a second process once this one has exited (no pagedkv memory left on the GPU)
and adds its row. Every ratio to a peer is to its run in the same invocation.

`--tables decode`: the older decode latency table (median `llm.step()` by model, batch and mode).
`--profile` cProfiles each warm-up run (compile counters); `--kernel-profile` prints the top GPU
kernels of one more run. `--json PATH` writes everything with the date, command line, versions and
GPU, again after every row (a run cut short keeps its rows); `readme_figures.py` turns that JSON
into the README's markdown tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file, as are the next ones)
import nano_peer  # noqa: E402
import readme_figures  # noqa: E402
import startup  # noqa: E402
import workloads  # noqa: E402
from engine_bench import describe, engine_kwargs, error_text, generate_s, release, sync  # noqa: E402
from pagedkv import LLM  # noqa: E402
from pagedkv.models.loader import load_config  # noqa: E402
from profiling import kernel_profile, profiled  # noqa: E402
from step_timing import decode_breakdown, decode_latency  # noqa: E402
from workloads import Workload  # noqa: E402


def counters(llm: LLM) -> tuple[int, int, int]:
    return llm.stats.num_steps, llm.stats.num_prefill_tokens, llm.stats.num_cached_tokens


def rates(llm: LLM, seconds: float, tokens: int, steps0: int, cached0: int) -> dict[str, object]:
    """A timed run's wall time, output tokens (and their rate), and the steps and cached prompt
    tokens it added to `llm`'s counters since they read `steps0` and `cached0`."""
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "steps": llm.stats.num_steps - steps0,
        "cached_prompt_tokens": llm.stats.num_cached_tokens - cached0,
    }


def timed_generate(llm: LLM, workload: Workload) -> dict[str, object]:
    steps, _, cached = counters(llm)
    seconds, outs = generate_s(llm, workload.prompts, workload.params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return rates(llm, seconds, tokens, steps, cached) | {"first_tokens": outs[0].outputs[0].token_ids[:8]}


def timed_stream(llm: LLM, workload: Workload) -> dict[str, object]:
    """All requests added, then `llm.step()` until done; every output's new text read each step.

    Also the wall time per kind of step (stats counters read between steps: no step listener,
    which would make the engine run one step at a time).
    """
    steps0, _, cached = counters(llm)
    sent: dict[str, int] = {}  # characters of text streamed per request
    tokens = chars = 0
    kinds: dict[str, dict[str, float]] = {}
    sync()
    start = last = time.perf_counter()
    for prompt, params in zip(workload.prompts, workload.params, strict=True):
        sent[llm.add_request({"prompt_token_ids": prompt}, params)] = 0
    while llm.has_unfinished_requests():
        _, prefill, _ = counters(llm)
        for out in llm.step():
            text = out.outputs[0].text
            chars += len(text[sent[out.request_id] :])  # the delta a server would send
            sent[out.request_id] = len(text)
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        now = time.perf_counter()
        kind = kinds.setdefault(
            "prefill" if llm.stats.num_prefill_tokens > prefill else "decode", {"steps": 0, "seconds": 0.0}
        )
        kind["steps"] += 1
        kind["seconds"] += now - last
        last = now
    sync()
    seconds = time.perf_counter() - start
    return rates(llm, seconds, tokens, steps0, cached) | {"text_chars_streamed": chars, "step_kinds": kinds}


def run_row(
    workload: Workload, backend: str | None, mode: str, row: dict[str, object], args: argparse.Namespace
) -> LLM:
    """Fill `row` with one engine's figures on `workload` (see the module docstring); returns the engine."""
    kwargs = engine_kwargs(mode, backend, workload.engine)
    row["kwargs"] = kwargs
    if args.startup:
        row["startup"] = startup.measure(workload.model, kwargs)
    start = time.perf_counter()
    llm = LLM(workload.model, **kwargs)
    row["init_s"] = time.perf_counter() - start
    row["resolved"] = describe(llm)
    warm = workload.resampled(1, args.warmup_max_tokens)
    label = f"{workload.name} {workload.model} {mode}"
    if args.profile:
        row["warmup_profile"] = profiled(lambda: generate_s(llm, warm.prompts, warm.params), args.top, label)
        row["warmup_s"] = row["warmup_profile"]["wall_s"]  # type: ignore[index]
    else:
        row["warmup_s"], _ = generate_s(llm, warm.prompts, warm.params)
    row["generate"] = timed_generate(llm, workload)
    row["stream"] = timed_stream(llm, workload.with_other_ids(2))
    if args.breakdown_steps:
        row["decode_breakdown"] = decode_breakdown(llm, workload.with_other_ids(3), args.breakdown_steps)
    if args.kernel_profile and engine_bench.DEVICE == "cuda":
        extra = workload.with_other_ids(4)
        row["kernels"] = kernel_profile(lambda: generate_s(llm, extra.prompts, extra.params), args.top, label)
    return llm


def run_workload(
    workload: Workload, args: argparse.Namespace, record: dict[str, object], save: Callable[[], None]
) -> None:
    """Every backend x mode row, then the roofline and the peers on the last engine's weights, into
    `record` (`save` after each row: a run cut short keeps what it measured)."""
    rows: list[dict[str, object]] = []
    record.update(
        name=workload.name,
        model=workload.model,
        num_requests=len(workload.prompts),
        prompt_tokens=sum(map(len, workload.prompts)),
        output_tokens=workload.output_tokens,
        full_size=workload.name == "W2" and len(workload.prompts) == 256 and args.max_tokens is None,
        temperature=workload.params[0].temperature,
        engine_args=workload.engine,
        roofline=None,
        rows=rows,
    )
    kept: LLM | None = None  # the last engine: its model gives the roofline and the peers' weights
    for backend in args.backends:
        for mode in args.modes:
            row: dict[str, object] = {"engine": f"pagedkv {backend or ''}".strip(), "mode": mode}
            rows.append(row)
            if backend == "FLASH_ATTN" and importlib.util.find_spec("flash_attn") is None:
                row["skipped"] = "flash_attn (flash-attn 4, flash_attn.cute) is not installed here"
                continue
            kept = None  # one engine at a time on the GPU
            release()
            try:
                kept = run_row(workload, backend, mode, row, args)
            except Exception as exc:  # a row that fails says why in the table (traceback on stderr)
                row["error"] = error_text(exc)
            release()
            print(json.dumps(row, default=str)[:800], flush=True)
            save()
    if kept is not None:
        try:
            record["roofline"] = workloads.roofline(kept.model, workload, args.hbm_tbps, args.tflops)
        except Exception as exc:
            record["roofline"] = {"error": error_text(exc)}
        if workload.name == "W1" and (args.hf_batch or args.hf_padded):
            rows += hf_rows(kept.model, workload, args)
            save()
    if workload.name == "W2" and args.nano_export:
        # nano-vllm runs in its own process after this one exits (nano_peer.py --into): only the weights here.
        where = args.nano_export / workload.model
        record["nano_export"] = {"dir": str(where)}
        try:
            reason = "no pagedkv engine ran (no weights)" if kept is None else nano_peer.export(kept.model, where)
        except Exception as exc:
            reason = error_text(exc)
        if reason:
            record["nano_export"]["error"] = reason  # type: ignore[index]
        save()
        return
    with tempfile.TemporaryDirectory(prefix="pagedkv-nano-") as nano_dir:
        reason = None
        if workload.name == "W2":
            reason = (
                ("--no-nano" if args.no_nano else None)
                or nano_peer.unavailable()
                or ("no pagedkv engine ran (no weights)" if kept is None else None)
            )
            try:
                reason = reason or nano_peer.export(kept.model, Path(nano_dir))  # type: ignore[union-attr]
            except Exception as exc:
                reason = error_text(exc)
        kept = None  # before nano-vllm starts: the pagedkv engine's memory goes first
        release()
        if workload.name == "W2":
            rows.append(nano_row(reason, Path(nano_dir), workload, workload.resampled(1, args.warmup_max_tokens)))
            save()


def hf_rows(model: torch.nn.Module, workload: Workload, args: argparse.Namespace) -> list[dict[str, object]]:
    import hf_peers  # beside this file; needs transformers

    hf = hf_peers.export(model)
    prompts, max_tokens = workload.prompts, workload.params[0].max_tokens  # W1: greedy, one length
    runs = []
    if args.hf_batch:
        runs.append(
            ("transformers generate_batch", "paged sdpa", lambda: hf_peers.generate_batch(hf, prompts, max_tokens))
        )
    if args.hf_padded:
        runs.append(
            (
                f"transformers generate (padded, batch {args.hf_batch_size})",
                "sdpa",
                lambda: hf_peers.generate_padded(hf, prompts, max_tokens, args.hf_batch_size),
            )
        )
    rows = []
    for name, mode, run in runs:
        row: dict[str, object] = {"engine": name, "mode": mode}
        try:
            timed = run()
            row["generate"] = {**timed, "output_tokens_per_s": timed["output_tokens"] / timed["seconds"]}
        except Exception as exc:
            row["error"] = error_text(exc)
        print(json.dumps(row, default=str)[:800], flush=True)
        rows.append(row)
        release()
    return rows


def nano_row(reason: str | None, path: Path, workload: Workload, warmup: Workload) -> dict[str, object]:
    """nano-vllm on the weights exported to `path` (warm-up: `warmup`, the pagedkv rows' own), or the
    reason it was skipped (printed either way)."""
    row: dict[str, object] = {"engine": "nano-vllm", "mode": nano_peer.MODE, "process": "this one"}
    if reason is None:
        try:
            row.update(nano_peer.run(path, workload, warmup, int(workload.engine["kv_cache_memory"])))
        except Exception as exc:
            reason = error_text(exc)
    if reason:
        row["skipped"] = reason
        print(f"nano-vllm: skipped ({reason})", flush=True)
    else:
        print(json.dumps(row, default=str), flush=True)
    return row


def decode_table(args: argparse.Namespace) -> list[dict[str, object]]:
    """Median `llm.step()` of pure decode steps per model, mode and batch (512-token prompts)."""
    rows = []
    for model in args.decode_models:
        for mode in args.modes:
            engine = dict(
                max_num_seqs=max(args.decode_batches),
                max_num_batched_tokens=4096,
                max_model_len=args.decode_prompt_len + 1024,
                kv_cache_memory=8 * 2**30,
            )
            llm = None
            try:
                llm = LLM(model, **engine_kwargs(mode, args.backends[0], engine))
                for batch in args.decode_batches:
                    rows.append(
                        {
                            "model": model,
                            "mode": mode,
                            "resolved_mode": describe(llm)["cudagraph_mode"],
                            **decode_latency(llm, batch, args.decode_prompt_len, args.decode_steps),
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
            except Exception as exc:
                rows.append({"model": model, "mode": mode, "error": error_text(exc)})
            llm = None
            release()
    return rows


def mode_arg(value: str) -> list[str]:
    if value == "all":
        return list(engine_bench.ALL_MODES)
    engine_bench.mode_kwargs(value)  # a typo fails here, before any engine starts
    return [value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (tiny models)")
    p.add_argument("--tables", nargs="+", default=["w1", "w2"], choices=["w1", "w2", "decode"])
    p.add_argument(
        "--modes",
        nargs="+",
        type=mode_arg,
        default=[["default"]],
        help="default, eager, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE, each optionally "
        "+async / +sync; 'all' = " + " ".join(engine_bench.ALL_MODES),
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=["default"],
        help="attention backends (TRITON_ATTN, FLASH_ATTN, ...); 'default': the engine's choice",
    )
    p.add_argument("--w1-model", default="llama3-8b")
    p.add_argument("--w1-kv-cache-gib", type=float, default=16.0, help="KV cache of W1's engines")
    p.add_argument("--w2-models", nargs="+", default=["qwen3-0.6b"], help="any preset or model directory")
    p.add_argument("--w2-kv-cache-gib", type=float, default=48.0, help="KV cache of W2's engines")
    p.add_argument("--num-requests", type=int, help="fewer requests (the first ones): smoke tests")
    p.add_argument("--max-tokens", type=int, help="cap every request's new tokens: smoke tests")
    p.add_argument(
        "--warmup-max-tokens", type=int, default=128, help="cap of the warm-up run's new tokens; 0: uncapped"
    )
    p.add_argument("--breakdown-steps", type=int, default=20, help="decode steps timed per window; 0: no breakdown")
    p.add_argument("--startup", action="store_true", help="cold and warm start-up of every row in subprocesses")
    p.add_argument("--hf", action="store_true", help="both transformers peers on W1")
    p.add_argument("--hf-batch", action="store_true", help="transformers generate_batch on W1")
    p.add_argument("--hf-padded", action="store_true", help="transformers padded generate on W1")
    p.add_argument("--hf-batch-size", type=int, default=128)
    p.add_argument("--no-nano", action="store_true", help="leave nano-vllm out of W2 even where it is staged")
    p.add_argument(
        "--nano-export",
        type=Path,
        metavar="DIR",
        help="W2: write the weights for nano-vllm into DIR/<model> instead of running it here; then "
        "`nano_peer.py --into <this --json>` runs it in its own process and adds its row",
    )
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    p.add_argument("--tflops", type=float, default=790.0)
    p.add_argument("--decode-models", nargs="+", default=["tiny", "llama3-8b"])
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--decode-prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="cProfile each warm-up run (compile counters)")
    p.add_argument("--kernel-profile", action="store_true", help="torch.profiler over one more run: top GPU kernels")
    p.add_argument("--top", type=int, default=25, help="profile entries printed")
    p.add_argument(
        "--matmul-tiles",
        type=Path,
        help="a batch_invariant_matmul.py JSON: its per-shape winners become the batch-invariant "
        "matmul's MATMUL_TILES_BY_SHAPE in this process (measure, then try, in one GPU call)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.matmul_tiles:
        from pagedkv.kernels.batch_invariant_triton import MATMUL_TILES_BY_SHAPE

        try:
            best = json.loads(args.matmul_tiles.read_text())["best_per_shape"]
            tiles = {tuple(b["shape"]): tuple(b["tiles"]) for b in best.values()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(
                f"--matmul-tiles {args.matmul_tiles}: not a batch_invariant_matmul.py JSON with per-shape "
                f"winners ({type(exc).__name__}: {exc})"
            )
        MATMUL_TILES_BY_SHAPE.update(tiles)
        print(f"batch-invariant matmul tiles by (N, K): {MATMUL_TILES_BY_SHAPE}", flush=True)
    args.modes = list(dict.fromkeys(m for group in args.modes for m in group))
    args.backends = [None if b == "default" else b for b in args.backends]
    args.hf_batch |= args.hf
    args.hf_padded |= args.hf
    engine_bench.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/end_to_end.py needs a CUDA GPU (or --device cpu for a smoke test)")
    result: dict[str, object] = {"meta": engine_bench.run_metadata(), "args": vars(args), "workloads": []}
    print(json.dumps(result["meta"]), flush=True)
    todo: list[Workload] = []
    if "w1" in args.tables:
        todo.append(
            workloads.w1(
                args.w1_model,
                load_config(args.w1_model).vocab_size,
                args.num_requests or 128,
                args.max_tokens or 128,
                int(args.w1_kv_cache_gib * 2**30),
            )
        )
    for model in args.w2_models if "w2" in args.tables else []:
        todo.append(
            workloads.w2(
                model,
                load_config(model).vocab_size,
                int(args.w2_kv_cache_gib * 2**30),
                args.num_requests or 256,
                args.max_tokens,
            )
        )

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))

    for workload in todo:
        record: dict[str, object] = {}
        result["workloads"].append(record)  # type: ignore[attr-defined]
        run_workload(workload, args, record, save)
    if "decode" in args.tables:
        result["decode"] = decode_table(args)
    save()
    print()
    print(readme_figures.render(result, markdown=False))


if __name__ == "__main__":
    main()
