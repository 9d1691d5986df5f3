"""Online serving: requests arriving at a rate against `pagedkv serve`, and what the server costs
over offline `LLM.generate`.

    python benchmarks/online.py [--model qwen3-0.6b] [--rates 4 16 inf] [--json out.json]
    python benchmarks/online.py --model tiny --num-requests 8 --max-tokens 8 --rates 2 inf   # CPU smoke run

The workload is W2 (benchmarks/workloads.py: nano-vllm's bench.py, 256 requests of 100-1,024
prompt tokens, temperature 0.6, 100-1,024 new tokens, EOS ignored). Every timed run draws other
token ids with the same lengths, so nothing of it is in the prefix cache.

1. Offline: `LLM.generate` on the workload in this process (after a warm-up run): output tokens/s.
   The engine is then shut down and its memory given back.
2. Online: `python -m pagedkv serve MODEL` in a subprocess with the same engine arguments, on a free
   loopback port. After a warm-up run, for each rate the requests are sent by the `openai` client,
   streamed, with exponential gaps between arrivals (a Poisson process of `rate` requests per
   second; `inf` sends them all at once: saturation). Per request: TTFT (send -> first chunk),
   TPOT ((last chunk - first chunk) / (tokens - 1)), end-to-end latency; per run: their median,
   p90 and p99, and output tokens/s (all tokens / first send -> last response).

The ratio the issue asks for is online tokens/s at saturation / offline tokens/s, both measured in
this run on this machine. Every response is checked to carry exactly its `max_tokens` tokens (EOS
is ignored): a lost or short response counts as an error in the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.arg_utils import cli_flag
from pagedkv.entrypoints.openai.api_server import free_port, wait_until_healthy
from pagedkv.models.loader import load_config
from workloads import Workload, w2

if TYPE_CHECKING:
    import openai


@dataclass
class Timing:
    """One streamed response, as the client saw it."""

    ttft_s: float
    tpot_s: float | None
    latency_s: float
    tokens: int
    expected: int


def engine_flags(engine: dict[str, object]) -> list[str]:
    """`LLM` keyword arguments as `pagedkv serve` flags, named as the CLI names them (`cli_flag`);
    None is left out (the default)."""
    flags = []
    for name, value in engine.items():
        flag = cli_flag(name)
        if flag is None:
            raise SystemExit(f"online: engine argument {name} has no command-line flag for pagedkv serve")
        if value is not None:
            flags += [flag, str(value)]
    return flags


def start_server(model: str, engine: dict[str, object], port: int, timeout_s: float) -> subprocess.Popen[bytes]:
    """`pagedkv serve` in a subprocess, returned once its /health answers (start-up compiles and
    captures CUDA graphs on a GPU: minutes are allowed)."""
    command = [sys.executable, "-m", "pagedkv", "serve", model, "--port", str(port), "--log-level", "warning"]
    command += engine_flags(engine)
    print("$", " ".join(command), flush=True)
    server = subprocess.Popen(command)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s, lambda: server.poll() is None)
    except RuntimeError as error:
        server.terminate()
        raise SystemExit(f"online: {error}") from None
    return server


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], params: SamplingParams) -> Timing:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": params.ignore_eos},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None or last is None:
        return Timing(float("nan"), None, time.perf_counter() - start, 0, params.max_tokens)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Timing(first - start, tpot, last - start, tokens, params.max_tokens)


async def run_online(port: int, model: str, workload: Workload, rate: float, seed: int) -> tuple[list[Timing], float]:
    """Send the workload at `rate` requests/s; each response's timing, and the run's wall seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="pagedkv", max_retries=0, timeout=3600)
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    for prompt, params in zip(workload.prompts, workload.params):
        tasks.append(asyncio.create_task(one_request(client, model, prompt, params)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - start
    await client.close()
    timings = [
        r if isinstance(r, Timing) else Timing(float("nan"), None, float("nan"), 0, p.max_tokens)
        for r, p in zip(results, workload.params)
    ]
    return timings, wall


def percentiles(values: list[float]) -> dict[str, float | None]:
    values = sorted(v for v in values if v == v)  # NaN: a failed request, counted in "errors"
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": statistics.median(values), "p90": pick(0.9), "p99": pick(0.99)}


def offline_tokens_per_s(workload: Workload, warmup: Workload) -> float:
    llm = LLM(workload.model, **workload.engine)
    try:
        llm.generate([{"prompt_token_ids": p} for p in warmup.prompts], warmup.params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], workload.params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="any preset or model directory")
    p.add_argument("--rates", nargs="+", type=float, default=[4.0, 16.0, float("inf")], help="requests/s; inf: all")
    p.add_argument("--num-requests", type=int, default=256, help="fewer requests (the first ones): smoke tests")
    p.add_argument("--max-tokens", type=int, help="cap every request's new tokens: smoke tests")
    p.add_argument("--kv-cache-gib", type=float, default=48.0, help="KV cache of both engines (GPU)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds the server may take to start")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    gpu = torch.cuda.is_available()
    kv_bytes = int(args.kv_cache_gib * 2**30) if gpu else None  # the CPU: the engine's default
    workload = w2(args.model, load_config(args.model).vocab_size, kv_bytes, args.num_requests, args.max_tokens)
    workload = replace(workload, engine={k: v for k, v in workload.engine.items() if v is not None})
    warmup = workload.resampled(1, max_tokens=min(128, args.max_tokens or 128))
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"online: {args.model} on {device}, {len(workload.prompts)} requests", flush=True)

    offline = offline_tokens_per_s(workload.with_other_ids(10), warmup)
    print(f"offline generate: {offline:,.1f} output tokens/s", flush=True)

    port = free_port()
    server = start_server(args.model, workload.engine, port, args.startup_timeout)
    rows = []
    try:
        asyncio.run(run_online(port, args.model, warmup, float("inf"), 0))
        for i, rate in enumerate(args.rates):
            timings, wall = asyncio.run(run_online(port, args.model, workload.with_other_ids(20 + i), rate, i))
            tokens = sum(t.tokens for t in timings)
            rows.append(
                {
                    "rate": "inf" if rate == float("inf") else rate,
                    "requests": len(timings),
                    "errors": sum(t.tokens != t.expected for t in timings),
                    "output_tokens_per_s": tokens / wall,
                    "ttft_s": percentiles([t.ttft_s for t in timings]),
                    "tpot_s": percentiles([t.tpot_s for t in timings if t.tpot_s is not None]),
                    "latency_s": percentiles([t.latency_s for t in timings]),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)

    saturated = next((r for r in rows if r["rate"] == "inf"), None)
    ratio = saturated["output_tokens_per_s"] / offline if saturated else None
    print(
        f"\n{'rate (req/s)':>12} {'errors':>6} {'tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'TPOT p50 ms':>12}"
    )
    for r in rows:
        ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
        print(
            f"{r['rate']!s:>12} {r['errors']:>6} {r['output_tokens_per_s']:>10,.1f} {ms(r['ttft_s']['p50']):>12} "
            f"{ms(r['ttft_s']['p99']):>12} {ms(r['tpot_s']['p50']):>12}"
        )
    if ratio is not None:
        print(f"server at saturation / offline generate: {ratio:.3f} ({device})")
    if args.json:
        result = {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(sys.argv),
            "device": device,
            "model": args.model,
            "offline_output_tokens_per_s": offline,
            "online": rows,
            "saturation_over_offline": ratio,
        }
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
