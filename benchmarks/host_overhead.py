"""The engine's host work per decode step, on the CPU, with the model's work stubbed out.

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py [--batches 64 256 512] [--steps 20] [--json out.json]
    PYTHONPATH=/tmp/old-checkout python benchmarks/host_overhead.py ...   # time another tree's pagedkv

What it times: `LLM.step()` through the public API while N requests all decode, and inside each
step the engine's own methods, wrapped with `time.perf_counter` from outside (pagedkv's code is
not changed). Sections are exclusive (a wrapped call inside another is taken out of its parent),
so they add up to the step; "rest" is what no wrapper covers (the step loop, copying samples to
the host, stop checks outside booking). A section whose method a tree lacks reads as absent and
its time lands in its parent or in "rest":

* schedule: `Scheduler.schedule`;
* runner inputs: `ModelRunner.execute_model` less the model (host lists, block tables, slot
  mappings, the attention metadata: everything the runner does to feed the model);
* forward (stub) and logits: the model's `forward` (replaced, see below) and `compute_logits`;
* sampler: the call of `LLM.sampler`;
* booking: `LLM._book` less `Scheduler.update` and `LLM._outputs` (each its own section).

The model: a "host-bench" preset registered in pagedkv's preset table for this process (a preset
gets the byte-level tokenizer, so each streamed output is detokenized as the GPU benchmarks'
presets are): one Llama layer of hidden size 8 (2 heads of 4, 1 KV head), the tiny preset's
320-token vocabulary, float32, the TORCH_REF backend, eager. Its `forward` is replaced on the
instance by one that returns zeros of the step's token count from a buffer made once: no
attention, no KV cache writes, no matmuls, so what is left is host work. Everything around it is
the real engine: the scheduler (admission, block allocation, prefix-cache hashing), the runner's
input preparation and metadata builders, `compute_logits` (8 x 320: negligible), the sampler's
launch (its per-request parameters; temperature 0.6 as in W2, over a 320-token vocabulary, so its
arithmetic stays small) and the booking of every step's tokens with text streamed to the caller.

The requests: N prompts drawn as W2 draws its lengths (uniform in [100, 1024] tokens, other
`--prompt-len` bounds allowed) of random ids (no two share a block: nothing hits the prefix cache),
`max_num_seqs` max(512, N) and W2's 16,384 tokens a step, a KV cache sized for every request's
whole context. The engine steps until all N decode, `--warmup` more steps, then `--steps` timed
steps, each checked to decode every request and prefill nothing. Per N: median / min wall ms per
step, and each section's median ms per step. `--profile N` prints cProfile's top entries over N's
timed steps. OMP_NUM_THREADS defaults to 1 here, as in CI.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file)
import pagedkv  # noqa: E402
from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.models import loader  # noqa: E402

PRESET = "host-bench"
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 16384  # W2's
SECTIONS = (
    "schedule",
    "runner inputs",
    "forward (stub)",
    "logits",
    "sampler",
    "booking",
    "scheduler.update",
    "outputs",
)


def register_preset() -> None:
    """The smallest Llama the engine builds, under a preset name (so it gets the byte tokenizer)."""
    tiny = loader.PRESETS["tiny"]
    loader.PRESETS[PRESET] = dataclasses.replace(
        tiny, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )


class Sections:
    """Exclusive wall time per section: a wrapped call made inside another is taken out of its parent's."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(SECTIONS, 0.0)
        self.present: list[str] = []
        self._children: list[float] = []  # per open call: seconds spent in wrapped calls inside it

    def wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[key] += elapsed - self._children.pop()
                if self._children:
                    self._children[-1] += elapsed

        return timed

    def patch(self, owner: object, attr: str, key: str) -> None:
        """Time `owner.attr` (a method, looked up on the instance) as `key`; absent in this tree: skipped."""
        fn = getattr(owner, attr, None)
        if callable(fn):
            setattr(owner, attr, self.wrap(fn, key))
            self.present.append(key)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(SECTIONS, 0.0)


class _CallProxy:
    """Stands in for a callable object (the sampler): calls are timed, attributes are the object's.
    (Python looks `__call__` up on the type, so the instance's own method cannot be replaced.)"""

    def __init__(self, target: object, timed: Callable[..., Any]) -> None:
        self._target, self._timed = target, timed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def instrument(llm: LLM) -> Sections:
    """Stub the model's forward and wrap the engine's step methods (on the instances only)."""
    sections = Sections()
    model = llm.model
    hidden = torch.zeros(MAX_BATCHED_TOKENS + 1024, model.config.hidden_size)

    def stub_forward(input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        n = input_ids.shape[0]
        return hidden[:n] if n <= hidden.shape[0] else torch.zeros(n, hidden.shape[1])

    model.forward = sections.wrap(stub_forward, "forward (stub)")
    sections.present.append("forward (stub)")
    sections.patch(model, "compute_logits", "logits")
    sections.patch(llm.scheduler, "schedule", "schedule")
    sections.patch(llm.scheduler, "update", "scheduler.update")
    sections.patch(llm.runner, "execute_model", "runner inputs")
    sections.patch(llm, "_book", "booking")
    sections.patch(llm, "_outputs", "outputs")
    sampler = getattr(llm, "sampler", None)
    if callable(sampler):
        llm.sampler = _CallProxy(sampler, sections.wrap(sampler, "sampler"))  # type: ignore[assignment]
        sections.present.append("sampler")
    return sections


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One engine, N requests decoding: the timed steps' wall times and sections (ms)."""
    rng = random.Random(n)
    low, high = args.prompt_len
    lens = [rng.randint(low, high) for _ in range(n)]
    prefill_steps = -(-sum(lens) // MAX_BATCHED_TOKENS) + 2
    max_tokens = prefill_steps + args.warmup + args.steps + 8  # no request finishes before the timed steps end
    blocks = sum(-(-(length + max_tokens) // BLOCK_SIZE) for length in lens) + 64
    llm = LLM(
        PRESET,
        device="cpu",
        dtype="float32",
        attention_backend="TORCH_REF",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_kv_blocks=blocks,
        max_num_seqs=max(512, n),
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=high + max_tokens + BLOCK_SIZE,
        async_scheduling=args.async_scheduling,
    )
    sections = instrument(llm)
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.add_request({"prompt_token_ids": [rng.randrange(256) for _ in range(k)]}, params) for k in lens]

    def step() -> int:
        """One step, which makes each streamed output's text (as a server reads it); the outputs' count."""
        return len(llm.step())

    settled = 0
    for _ in range(prefill_steps + 64):
        prefilled = llm.stats.num_prefill_tokens
        count = step()
        settled = settled + 1 if count == n and llm.stats.num_prefill_tokens == prefilled else 0
        if settled > args.warmup:
            break
    else:
        raise RuntimeError(f"N={n}: the requests never all decoded together")
    cached = llm.stats.num_cached_tokens
    walls: list[float] = []
    per_section: dict[str, list[float]] = {k: [] for k in SECTIONS}
    profiler = cProfile.Profile() if args.profile == n else None
    gc.collect()
    for _ in range(args.steps):
        prefilled = llm.stats.num_prefill_tokens
        sections.reset()
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        count = step()
        walls.append(time.perf_counter() - start)
        if profiler:
            profiler.disable()
        if count != n or llm.stats.num_prefill_tokens != prefilled:
            raise RuntimeError(f"N={n}: a timed step returned {count} outputs or prefilled (not pure decode)")
        for key in SECTIONS:
            per_section[key].append(sections.seconds[key])
    for req_id in ids:
        llm.abort_request(req_id)
    llm.shutdown()
    if profiler:
        print(f"\ncProfile of N={n}'s {args.steps} timed steps (tottime, top {args.top}):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    timed = {k: 1e3 * statistics.median(v) for k, v in per_section.items() if k in sections.present}
    median = 1e3 * statistics.median(walls)
    return {
        "num_requests": n,
        "steps": args.steps,
        "step_ms_median": median,
        "step_ms_min": 1e3 * min(walls),
        "step_ms_mean": 1e3 * statistics.fmean(walls),
        "sections_ms_median": timed,
        "rest_ms_median": 1e3
        * statistics.median(w - sum(per_section[k][i] for k in sections.present) for i, w in enumerate(walls)),
        "absent_sections": [k for k in SECTIONS if k not in sections.present],
        "async_scheduling": getattr(llm, "async_scheduling", None),
        "prompt_tokens": sum(lens),
        "cached_prompt_tokens": cached,
    }


def pagedkv_commit() -> str | None:
    """The commit of the tree pagedkv was imported from (it may be another checkout than this script's)."""
    where = Path(pagedkv.__file__).resolve().parent
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=where)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            cwd=where,
        )
    except OSError:
        return None
    return (done.stdout.strip() + (" (pagedkv/ has uncommitted changes)" if dirty.stdout.strip() else "")) or None


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["N", "step ms", "min ms", *SECTIONS, "rest"]
    lines = ["  ".join(f"{c:>16}" if i else f"{c:>5}" for i, c in enumerate(columns))]
    for r in rows:
        cells = [f"{r['num_requests']:>5}", f"{r['step_ms_median']:>16.2f}", f"{r['step_ms_min']:>16.2f}"]
        cells += [
            f"{r['sections_ms_median'][k]:>16.2f}" if k in r["sections_ms_median"] else f"{'-':>16}" for k in SECTIONS
        ]
        cells.append(f"{r['rest_ms_median']:>16.2f}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256, 512], help="decoding requests N")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per N")
    p.add_argument("--warmup", type=int, default=5, help="decode steps of all N before the timed ones")
    p.add_argument("--prompt-len", nargs=2, type=int, default=[100, 1024], metavar=("LOW", "HIGH"))
    p.add_argument("--temperature", type=float, default=0.6, help="W2's; 0: greedy")
    p.add_argument(
        "--async-scheduling",
        type=lambda v: {"on": True, "off": False}[v],
        default=None,
        metavar="on|off",
        help="the engine's default (off on a CPU) unless given; recorded per row either way",
    )
    p.add_argument("--profile", type=int, metavar="N", help="cProfile N's timed steps")
    p.add_argument("--top", type=int, default=25, help="cProfile entries printed")
    p.add_argument("--smoke", action="store_true", help="N=4, 2 steps, short prompts: the script's path in seconds")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.batches, args.steps, args.warmup, args.prompt_len = [4], 2, 1, [8, 40]
    engine_bench.DEVICE = "cpu"
    register_preset()
    torch.manual_seed(0)
    meta = engine_bench.run_metadata()
    meta["benchmarks_commit"] = meta.pop("git_commit")  # this script's tree; pagedkv's may be another
    meta |= {
        "pagedkv_from": str(Path(pagedkv.__file__).resolve().parent),
        "pagedkv_commit": pagedkv_commit(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    print(json.dumps(meta), flush=True)
    rows = []
    for n in args.batches:
        rows.append(measure(n, args))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nhost work per decode step (ms; median of {args.steps} steps; sections exclusive, median each)")
    print(table(rows))
    if args.json:
        result = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
