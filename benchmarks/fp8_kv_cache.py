"""What an fp8 (e4m3) KV cache costs in accuracy: logits against a float64 oracle, greedy agreement.

    python benchmarks/fp8_kv_cache.py [--model tiny-pydoc] [--dtype float32] [--json out.json] [--smoke]
    TRITON_INTERPRET=1 python benchmarks/fp8_kv_cache.py --attention-backend TRITON_ATTN ...  # its kernels, on the CPU

Three engines on the same prompts (passages of Python's pydoc topics, the text tiny-pydoc was
trained on): the oracle (the model in float64, its cache float64, TORCH_REF), the model dtype with
its own cache ("auto"), and the model dtype with an fp8 cache ("fp8": per-layer scales computed from
the profile run, `calculate_kv_scales=True`, as in the figures of benchmarks/README.md; the engine's
default is 1.0). For each prompt the logits after its prefill (which reads every K/V back from the
cache) are compared with the oracle's: max and mean absolute error over the vocabulary and prompts.
Greedy agreement with the "auto" cache is counted twice: the first token of every prompt (a
position-wise comparison), and every token of `--max-tokens` continuations, position by position
(one flip changes the rest, so this is the stricter). Runs on the CPU (TORCH_REF) or a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file: the run's metadata)
from pagedkv import LLM, SamplingParams, StepEvent  # noqa: E402
from pagedkv.models.train_tiny_pydoc import pydoc_topics  # noqa: E402


def pydoc_prompts(count: int, length: int) -> list[str]:
    """`count` passages of `length` characters, one from each of `count` topics spread over the sorted list."""
    topics, _ = pydoc_topics()
    keys = sorted(k for k, text in topics.items() if len(text) > 2 * length)
    step = max(len(keys) // count, 1)
    return [topics[k][length // 2 : length // 2 + length] for k in keys[::step][:count]]


def last_logits(llm: LLM, prompts: list[str]) -> torch.Tensor:
    """[prompts, vocab] float64: each prompt's logits after its prefill (one request at a time)."""
    rows: list[torch.Tensor] = []

    def keep(event: StepEvent) -> None:
        if event.result.logits.shape[0]:
            rows.append(event.result.logits[-1].double().cpu())

    remove = llm.add_step_listener(keep)
    for prompt in prompts:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    remove()
    return torch.stack(rows)


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-pydoc")
    parser.add_argument(
        "--dtype", default=None, help="the model dtype (default: float32 on the CPU, bfloat16 on a GPU)"
    )
    parser.add_argument(
        "--attention-backend", default=None, help="of the two tested engines (default: the selector's choice)"
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="a few short prompts: a quick check that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.prompt_chars, args.max_tokens = 4, 32, 8
    prompts = pydoc_prompts(args.prompts, args.prompt_chars)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    common = dict(max_num_seqs=len(prompts), enforce_eager=True, device=device)
    start = time.perf_counter()
    oracle = LLM(args.model, dtype="float64", attention_backend="TORCH_REF", **common)
    reference = last_logits(oracle, prompts)
    oracle.shutdown()
    rows, tokens = {}, {}
    for cache in ("auto", "fp8"):
        llm = LLM(
            args.model,
            dtype=dtype,
            kv_cache_dtype=cache,
            calculate_kv_scales=cache == "fp8",
            attention_backend=args.attention_backend,
            **common,
        )
        err = (last_logits(llm, prompts) - reference).abs()
        tokens[cache] = greedy(llm, prompts, args.max_tokens)
        layers = list(llm.runner.attn_layers.values())
        rows[cache] = dict(
            backend=layers[0].attn_backend.get_name(),
            max_logit_error=err.max().item(),
            mean_logit_error=err.mean().item(),
            bytes_per_block=llm.runner.kv_cache_config.bytes_per_block,
            k_scales=[round(layer._k_scale.item(), 6) for layer in layers],
            v_scales=[round(layer._v_scale.item(), 6) for layer in layers],
        )
        llm.shutdown()
    first = sum(a[0] == b[0] for a, b in zip(tokens["auto"], tokens["fp8"]) if a and b)
    same = sum(x == y for a, b in zip(tokens["auto"], tokens["fp8"]) for x, y in zip(a, b))
    total = sum(min(len(a), len(b)) for a, b in zip(tokens["auto"], tokens["fp8"]))
    engine_bench.DEVICE = device  # what run_metadata names
    result = dict(
        meta=engine_bench.run_metadata(),
        model=args.model,
        dtype=dtype,
        device=device,
        prompts=len(prompts),
        prompt_chars=args.prompt_chars,
        max_tokens=args.max_tokens,
        caches=rows,
        greedy_first_token_agreement=first / len(prompts),
        greedy_token_agreement=same / max(total, 1),
        seconds=round(time.perf_counter() - start, 1),
    )
    print(f"{args.model} {dtype} on {device}, {len(prompts)} pydoc prompts of {args.prompt_chars} characters")
    print(f"{'cache':<6} {'backend':<12} {'max |logit err|':>16} {'mean |logit err|':>17} {'bytes/block':>12}")
    for cache, row in rows.items():
        print(
            f"{cache:<6} {row['backend']:<12} {row['max_logit_error']:>16.3e} {row['mean_logit_error']:>17.3e} "
            f"{row['bytes_per_block']:>12}"
        )
    print(
        f"greedy agreement fp8 vs auto: first tokens {first}/{len(prompts)} "
        f"({result['greedy_first_token_agreement']:.1%}), {args.max_tokens}-token continuations {same}/{total} "
        f"({result['greedy_token_agreement']:.1%}) position by position"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
