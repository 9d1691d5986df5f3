"""Speculative decoding with n-gram prompt lookup on a repeat-the-passage workload: output tokens/s and
acceptance with k = 0 (no speculation), 2 and 4 drafts, in one run (issue 34).

    python benchmarks/speculative.py --models llama3-8b qwen3-8b [--json out.json]   # H200, ~6 min
    python benchmarks/speculative.py --smoke                                           # CPU, tiny, < 1 min

Workload (token ids only, deterministic from `--seed`): request r's prompt is a shared instruction
(`--instruction-len` random ids), a passage of `--passage-len` random ids, a separator, then the
passage's first `--head-len` ids again: "repeat the passage". A trained model would continue by
copying the passage, which prompt lookup predicts. A random-weight preset does not copy: its
greedy continuation is whatever it computes. So the passage is made to hold that continuation,
measured on the engine under test itself (the one with k drafts, greedy, all B requests together):

    round 0   passage = head + A[head:]      (random ids)        -> greedy continuation G0
    round i   passage = head + G(i-1) + the rest of A            -> G(i)

Each round's prompt differs from the previous one only where the passage holds the continuation, but
a model reads its whole context, so G(i) need not equal G(i-1) (a random model need not settle on a
fixed point): the JSON records per round how many leading tokens of its passage's continuation the
model kept (`calibration`), and each request's timed prompt is the one of the round where it kept the
most. The rounds run per k and batch size: in bf16 a matmul rounds differently for another number of
rows (16 decodes of 1 token, or of 1 + k), so the continuation a k = 0 engine computes need not be
the one the k = 4 engine computes, and a request whose prompt no longer holds its continuation gets
no drafts (a batch-invariant mode would remove that). The k = 0 engine, kept alive
for the whole model, is then timed on exactly the prompts of each k (its speed does not depend on
what they hold; its row says which k's prompts it ran).
A random-weight preset copies nothing, so no round keeps its continuation; `--attention-out-scale 0`
zeroes every attention output projection after loading (every kernel still runs), which makes the
next token a function of the current one: the model then copies its passage exactly, as a trained
model asked to repeat one nearly does. Acceptance is then what the engine measures on those prompts:
nothing is assumed, and the drafts are the engine's own NgramProposer's. Greedy, EOS ignored, prefix
caching off (every run computes its whole prompt), each engine warmed up on the round-0 prompts of
another seed (kernels compiled, 1 + k-token decode batches run) before its timed runs.

Rows: per model, batch (the first B requests, all queued at once) and k: wall seconds from queueing to
the last token, output tokens/s and its ratio to k = 0 on the same prompts in the same run, how the
steps ran (`steps_by_graph_mode`: FULL graph replays or eager), decode tokens/s (after every
request has its first token), the engine's acceptance rate and mean accepted length (1 + accepted
drafts per verifying step), and whether the outputs equal k = 0's (greedy: they must in float32; in
bf16 the 1 + k-row batches round differently and random weights have near-ties, so
`identical_requests` counts them and `mean_tokens_as_k0` says how far they agree), and the mean number
of distinct token ids per output (`distinct`): a random model may fall into repeating one token, which
prompt lookup then predicts from the output itself, whatever the passage holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file: the device, modes, the timed run, metadata)
from engine_bench import engine_kwargs, error_text, release, timed_run  # noqa: E402
from pagedkv import LLM  # noqa: E402
from pagedkv.models.loader import load_config  # noqa: E402

SEPARATOR_LEN = 4


@dataclass(frozen=True)
class Passages:
    """One seed's requests: the shared instruction and separator, each request's random passage."""

    instruction: list[int]
    separator: list[int]
    passages: list[list[int]]
    head_len: int

    def continuations(self, num_tokens: int) -> list[list[int]]:
        """What each passage itself holds after its head: a copying model's continuation (round 0)."""
        return [p[self.head_len : self.head_len + num_tokens] for p in self.passages]

    def prompts(self, continuations: list[list[int]]) -> list[list[int]]:
        """Instruction + passage + separator + the passage's head, with the passage's tokens after its
        head replaced by each request's continuation (the rest of the passage unchanged)."""
        prompts = []
        for passage, continuation in zip(self.passages, continuations, strict=True):
            head, rest = passage[: self.head_len], passage[self.head_len + len(continuation) :]
            prompts.append(self.instruction + head + continuation + rest + self.separator + head)
        return prompts


def draw(seed: int, args: argparse.Namespace, vocab_size: int) -> Passages:
    """The instruction, the separator, then each request's passage, from one generator in that order."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    return Passages(
        ids(args.instruction_len),
        ids(SEPARATOR_LEN),
        [ids(args.passage_len) for _ in range(max(args.batches))],
        args.head_len,
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _spec_counters(llm: LLM) -> tuple[int, int, int]:
    return llm.stats.num_draft_tokens, llm.stats.num_accepted_tokens, llm.stats.num_verified_steps


def measured_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
    """`engine_bench.timed_run` (greedy, EOS ignored), plus decode tokens/s and the drafts verified and accepted."""
    before, modes_before = _spec_counters(llm), dict(llm.stats.num_steps_by_graph_mode)
    row = timed_run(llm, prompts, max_tokens)
    # How the steps ran: FULL graph replays, or eager ("NONE") where a batch had no graph.
    modes = {m: n - modes_before.get(m, 0) for m, n in llm.stats.num_steps_by_graph_mode.items()}
    drafts, accepted, verified = (now - then for now, then in zip(_spec_counters(llm), before))
    # Once every request has its first token, all that is left is decoding (with drafts or not).
    decode_s = row["seconds"] - row["ttft_max_s"]  # type: ignore[operator]
    tokens: list[list[int]] = row["tokens"]  # type: ignore[assignment]
    decode_tokens = sum(len(t) - 1 for t in tokens)
    row.update(
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
        num_draft_tokens=drafts,
        num_accepted_tokens=accepted,
        acceptance_rate=accepted / drafts if drafts else 0.0,
        mean_accepted_length=1 + accepted / verified if verified else 0.0,
        steps_by_graph_mode={m: n for m, n in modes.items() if n},
        # A random model may repeat one token: prompt lookup then predicts its own output, not the passage.
        mean_distinct_tokens=sum(len(set(t)) for t in tokens) / len(tokens),
    )
    return row


def build(model: str, k: int, args: argparse.Namespace, prompt_len: int) -> LLM:
    spec = None
    if k:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
    engine = dict(
        max_num_seqs=max(args.batches),
        max_model_len=prompt_len + args.max_tokens + 16,
        kv_cache_memory=int(args.kv_cache_gib * 2**30),
        enable_prefix_caching=False,
    )
    kwargs = engine_kwargs(args.mode, args.backend, engine)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    llm = LLM(model, speculative_config=spec, **kwargs)  # type: ignore[arg-type]
    if args.attention_out_scale != 1.0:
        # Every kernel still runs (each KV write and read), but attention's share of the residual
        # stream shrinks: at 0 the next token depends on the current one only, a model that copies
        # exactly, as a trained one asked to repeat a passage nearly does (random weights do not).
        with torch.no_grad():
            for name, param in llm.model.named_parameters():
                if name.endswith("self_attn.o_proj.weight"):
                    param.mul_(args.attention_out_scale)
    return llm


def calibrate(llm: LLM, work: Passages, args: argparse.Namespace) -> tuple[list[list[int]], dict[str, object]]:
    """The timed prompts: `--rounds` greedy runs of all requests, each writing its continuations into
    the next round's passages. A request's timed prompt is the round's prompt whose continuation the
    model kept longest (the latest of equals): random weights need not settle on a fixed point."""
    continuations = work.continuations(args.max_tokens)
    best: list[tuple[int, int, list[int]]] = [(-1, -1, [])] * len(continuations)  # (kept, round, prompt)
    rounds = []
    for i in range(args.rounds):
        prompts = work.prompts(continuations)
        out: list[list[int]] = measured_run(llm, prompts, args.max_tokens)["tokens"]  # type: ignore[assignment]
        kept = [common_prefix(o, c) for o, c in zip(out, continuations, strict=True)]
        best = [max(b, (n, i, p)) for b, n, p in zip(best, kept, prompts, strict=True)]
        rounds.append({"mean_tokens_kept": sum(kept) / len(kept), "requests_kept_all": kept.count(args.max_tokens)})
        print(json.dumps({"calibration_round": i, **rounds[-1]}), flush=True)
        continuations = out
        if kept.count(args.max_tokens) == len(kept):  # a fixed point: later rounds would repeat this one
            break
    chosen = {
        "rounds": rounds,
        "chosen_round": [i for _, i, _ in best],
        "chosen_mean_tokens_kept": sum(n for n, _, _ in best) / len(best),
    }
    return [p for _, _, p in best], chosen


def _warm_up(llm: LLM, warm: Passages, args: argparse.Namespace) -> None:
    """Every batch size once, drafts proposed from the passages: kernels compiled, 1 + k-token batches run."""
    for batch in args.batches:
        measured_run(llm, warm.prompts(warm.continuations(args.max_tokens))[:batch], args.warmup_tokens)


def _compare(row: dict[str, object], ref: dict[str, object]) -> None:
    """Ratios to the k = 0 row on the same prompts, and how far the outputs agree with it."""
    same = [a == b for a, b in zip(row["tokens"], ref["tokens"])]  # type: ignore[call-overload]
    row["identical_outputs"] = all(same)
    row["identical_requests"] = sum(same)
    # Where a request first differs from k = 0 (its length where identical), averaged.
    row["mean_tokens_as_k0"] = sum(map(common_prefix, row["tokens"], ref["tokens"])) / len(same)  # type: ignore[call-overload]
    for key in ("output_tokens_per_s", "decode_tokens_per_s"):
        row[f"{key}_ratio"] = row[key] / ref[key]  # type: ignore[operator]


def measure_model(model: str, args: argparse.Namespace) -> dict[str, object]:
    """Per k > 0 and batch: calibrate the prompts on the engine with k drafts, then time it and the
    k = 0 engine (kept alive for the whole model) on those same prompts."""
    vocab = load_config(model).vocab_size
    work, warm = draw(args.seed, args, vocab), draw(args.seed + 1, args, vocab)
    prompt_len = len(work.prompts(work.continuations(args.max_tokens))[0])
    rows: list[dict[str, object]] = []
    record: dict[str, object] = {"model": model, "prompt_len": prompt_len, "calibration": {}, "rows": rows}

    def timed(llm: LLM, k: int, batch: int, prompts: list[list[int]], calibrated_on: int) -> dict[str, object]:
        row = {"batch": batch, "k": k, "calibrated_on_k": calibrated_on, **engines[k]}
        row.update(measured_run(llm, prompts, args.max_tokens))
        print(json.dumps({"model": model, **{key: v for key, v in row.items() if key != "tokens"}}), flush=True)
        rows.append(row)
        return row

    engines: dict[int, dict[str, object]] = {}  # k -> startup seconds and what the engine resolved
    base: LLM | None = None
    llm: LLM | None = None
    try:
        for k in args.ks:
            try:
                start = time.perf_counter()
                llm = build(model, k, args, prompt_len)
                engines[k] = {"startup_s": time.perf_counter() - start, "resolved": engine_bench.describe(llm)}
                _warm_up(llm, warm, args)
                if k == 0:
                    base = llm
                    if len(args.ks) > 1:
                        continue
                for batch in args.batches:
                    subset = dataclasses.replace(work, passages=work.passages[:batch])
                    prompts, record["calibration"][f"k={k} batch={batch}"] = calibrate(llm, subset, args)  # type: ignore[index]
                    ref = timed(base, 0, batch, prompts, k) if k and base is not None else None
                    row = timed(llm, k, batch, prompts, k)
                    if ref is not None:
                        _compare(row, ref)
            except Exception as exc:  # noqa: BLE001  (one engine failing leaves the others' rows)
                rows.append({"k": k, "error": error_text(exc)})
            if llm is not base:
                llm = None  # the next engine needs its memory
                release()
    finally:
        base = llm = None
        release()
    for row in rows:
        row.pop("tokens", None)
    return record


def _cell(row: dict[str, object], key: str, width: int, spec: str) -> str:
    """One table cell, blank where the row has no such value (ratios and acceptance of the k = 0 rows)."""
    return f"{row[key]:{width}{spec}}" if key in row and row["k"] else " " * width


def _graphs(resolved: dict[str, object]) -> str:
    """The engine's CUDA graph mode and scheduling: speculation turns async scheduling off (the host reads
    the accepted tokens before it proposes), so on a GPU the k = 0 rows run async unless --mode says +sync."""
    return f"{resolved['cudagraph_mode']}, {'async' if resolved['async_scheduling'] else 'sync'}"


def table(result: dict[str, object]) -> str:
    lines = [
        f"{'model':<11}{'batch':>6}{'k':>3}{'prompts':>9}  {'graphs, scheduling':<24}{'s':>7}{'out tok/s':>11}{'x k=0':>7}{'decode tok/s':>14}"
        f"{'x k=0':>7}{'accept':>8}{'mean len':>10}{'distinct':>10}  identical to k=0"
    ]
    for rec in result["models"]:  # type: ignore[attr-defined]
        for r in rec["rows"]:
            if "error" in r:
                lines.append(f"{rec['model']:<11}{'':>6}{r['k']:>3}  {r['error']}")
                continue
            same = f"{r['identical_requests']}/{r['batch']}" if "identical_requests" in r else ""
            lines.append(
                f"{rec['model']:<11}{r['batch']:>6}{r['k']:>3}{'k=' + str(r['calibrated_on_k']):>9}  {_graphs(r['resolved']):<24}{r['seconds']:7.2f}"
                f"{r['output_tokens_per_s']:11.0f}{_cell(r, 'output_tokens_per_s_ratio', 7, '.2f')}"
                f"{r['decode_tokens_per_s']:14.0f}{_cell(r, 'decode_tokens_per_s_ratio', 7, '.2f')}"
                f"{_cell(r, 'acceptance_rate', 8, '.2f')}{_cell(r, 'mean_accepted_length', 10, '.2f')}"
                f"{r['mean_distinct_tokens']:10.1f}  {same}"
            )
    return "\n".join(line.rstrip() for line in lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--ks", nargs="+", type=int, default=[0, 2, 4], help="drafts per step; 0 (no speculation) first")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--passage-len", type=int, default=512)
    p.add_argument("--head-len", type=int, default=32, help="passage tokens repeated after the separator")
    p.add_argument("--instruction-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4, help="calibration runs (1: the random passages themselves)")
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--mode",
        default="FULL",
        help="engine_bench mode (FULL: FULL CUDA graphs, no torch.compile; FULL+sync: k = 0 too)",
    )
    p.add_argument("--backend", default=None, help="attention backend (default: the platform's choice)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--kv-cache-gib", type=float, default=8)
    p.add_argument(
        "--attention-out-scale",
        type=float,
        default=1.0,
        help="multiply every attention output projection (o_proj) by this after loading; 0 makes a random-weight "
        "model copy exactly (its next token a function of the current one), 1 keeps the preset",
    )
    p.add_argument("--smoke", action="store_true", help="tiny on the CPU, small sizes: checks the script runs")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.models, args.device, args.mode, args.batches = ["tiny"], "cpu", "eager", [1, 4]
        args.max_tokens, args.passage_len, args.head_len, args.instruction_len = 16, 40, 8, 8
        args.rounds, args.warmup_tokens, args.kv_cache_gib = 2, 4, 0.0625
    if args.ks[0] != 0:
        p.error("--ks must start with 0: the rows without speculation are the baseline of the ratios")
    if args.rounds < 1:
        p.error("--rounds must be at least 1 (round 0 runs the random passages themselves)")
    if args.passage_len < args.head_len + args.max_tokens:
        p.error("--passage-len must hold the head and the continuation: >= --head-len + --max-tokens")
    engine_bench.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/speculative.py needs a CUDA GPU (or --smoke: tiny on the CPU)")
    started = time.perf_counter()
    result: dict[str, object] = {"meta": engine_bench.run_metadata(), "args": vars(args), "models": []}
    print(json.dumps(result["meta"]), flush=True)
    for model in args.models:
        result["models"].append(measure_model(model, args))  # type: ignore[attr-defined]
        result["wall_s"] = time.perf_counter() - started
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))
    print()
    print(table(result))


if __name__ == "__main__":
    main()
