"""The sampler's cost in one engine step on the CPU: 128 decoding requests, a 151,936-token vocabulary.

    OMP_NUM_THREADS=1 python benchmarks/sampler_cpu.py [--rounds 4] [--steps 5] [--json out.json]

The model: a random 1-layer Llama of Qwen's vocabulary (151,936 tokens, hidden 256, 4 heads,
tied embeddings), written by `transformers` into a temporary Hugging Face directory and loaded
through pagedkv's config system like any local model; float32, the TORCH_REF attention backend.
Only the public API is used (`LLM`, `SamplingParams`, `LLM.step`). Per round and way of
sampling, 128 fresh requests (random 16-token prompts: nothing in the prefix cache) are added,
one step prefills them all, then `--steps` pure decode steps of all 128 are timed on the wall
clock, and the requests are aborted. The first round of each way is a warm-up; the later rounds
alternate the ways, so a drift of the machine is spread over all of them.

Ways of sampling: greedy; temperature 0.8 only; the same with a seed per request; temperature 0.8
+ top_k 50 + top_p 0.95; the same with a seed per request. Printed: the median step time of each,
its ratio to greedy and to the way it is measured against, with issue 44's targets: temperature
only <= 2x greedy, temperature + top-k + top-p <= 1.3x greedy, a seeded way <= 1.15x the same way
unseeded. OMP_NUM_THREADS defaults to 1 here, as in CI.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file)
from pagedkv import LLM, SamplingParams  # noqa: E402

BATCH = 128
PROMPT_LEN = 16
VOCAB = 151936
TARGETS: dict[str, tuple[str, float]] = {
    "temperature": ("greedy", 2.0),
    "temperature_seeded": ("temperature", 1.15),
    "top_k_top_p": ("greedy", 1.3),
    "top_k_top_p_seeded": ("top_k_top_p", 1.15),
}
"""Way -> (the way it is measured against, most step time as a multiple of that way's)."""

WAYS: dict[str, Callable[[int, int], SamplingParams]] = {
    "greedy": lambda i, n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    "temperature": lambda i, n: SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True),
    "temperature_seeded": lambda i, n: SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True),
    "top_k_top_p": lambda i, n: SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=n, ignore_eos=True),
    "top_k_top_p_seeded": lambda i, n: SamplingParams(
        temperature=0.8, top_k=50, top_p=0.95, seed=i, max_tokens=n, ignore_eos=True
    ),
}
"""Way of sampling -> the parameters of request i (a distinct seed per request) with n new tokens."""


def write_model(path: Path) -> None:
    """A random 1-layer Llama with Qwen's vocabulary, saved by transformers (weights wide enough
    that the next-token distributions are peaked, as a trained model's are)."""
    import transformers

    torch.manual_seed(0)
    # fmt: off
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, max_position_embeddings=512,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
    )
    # fmt: on
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def timed_steps(llm: LLM, way: str, steps: int, seeds: itertools.count, rng: random.Random) -> list[float]:
    """Fresh requests sampled `way`; one prefill step; the wall times of `steps` pure decode steps."""
    ids = [
        llm.add_request(
            {"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]},
            WAYS[way](next(seeds), steps + 2),
        )
        for _ in range(BATCH)
    ]
    try:
        llm.step()  # every prompt in one step
        times = []
        for _ in range(steps):
            prefill, decode = llm.stats.num_prefill_tokens, llm.stats.num_decode_tokens
            start = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - start)
            if llm.stats.num_prefill_tokens != prefill or llm.stats.num_decode_tokens - decode != BATCH:
                raise RuntimeError(f"{way}: a timed step was not a decode of all {BATCH} requests")
        return times
    finally:
        for req_id in ids:
            llm.abort_request(req_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per way (after one warm-up round)")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per round")
    p.add_argument("--json", type=Path)
    p.add_argument("--note", default=None, help="a line stored in the JSON (e.g. the machine's load)")
    args = p.parse_args()
    engine_bench.DEVICE = "cpu"
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rng, seeds = random.Random(0), itertools.count()
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="pagedkv-sampler-") as path:
        write_model(Path(path))
        llm = LLM(
            path,
            device="cpu",
            dtype="float32",
            attention_backend="TORCH_REF",
            max_num_seqs=BATCH,
            max_num_batched_tokens=BATCH * PROMPT_LEN,
            kv_cache_memory=256 << 20,
        )
        for round_ in range(args.rounds + 1):
            for way in WAYS if round_ % 2 else reversed(WAYS):
                taken = timed_steps(llm, way, args.steps, seeds, rng)
                if round_:  # round 0 warms up
                    times[way] += taken
    medians = {way: statistics.median(t) * 1e3 for way, t in times.items()}
    result = {
        "meta": engine_bench.run_metadata(),
        "batch": BATCH,
        "vocab_size": VOCAB,
        "prompt_len": PROMPT_LEN,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "targets": {way: {"against": against, "at_most_x": ratio} for way, (against, ratio) in TARGETS.items()},
        "ways": {
            way: {
                "median_ms": medians[way],
                "min_ms": min(times[way]) * 1e3,
                "x_greedy": medians[way] / medians["greedy"],
                **(
                    {
                        "against": TARGETS[way][0],
                        "x_against": medians[way] / medians[TARGETS[way][0]],
                        "target_met": medians[way] / medians[TARGETS[way][0]] <= TARGETS[way][1],
                    }
                    if way in TARGETS
                    else {}
                ),
            }
            for way in WAYS
        },
        "note": args.note,
    }
    print(
        f"one engine step, {BATCH} decoding requests, vocab {VOCAB}, 1 layer, CPU, "
        f"{torch.get_num_threads()} thread(s); median of {args.rounds} x {args.steps} steps"
    )
    for way, r in result["ways"].items():
        target = ""
        if way in TARGETS:
            against, ratio = TARGETS[way]
            met = "met" if r["target_met"] else "MISSED"
            target = f"   {r['x_against']:5.2f}x {against} (target <= {ratio}x: {met})"
        print(f"  {way:<20}{r['median_ms']:9.2f} ms  {r['x_greedy']:5.2f}x greedy{target}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
