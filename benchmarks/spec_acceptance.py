"""What exact-match verification costs the draft model's acceptance against the rejection rule (issue 44), CPU.

    OMP_NUM_THREADS=1 python benchmarks/spec_acceptance.py [--requests 48] [--max-tokens 64] [--json out.json]

pagedkv keeps a draft x iff it equals the token the sampler draws at its position
(pagedkv/engine/rejection_sampler.py). The rejection rule of speculative sampling keeps it with
probability min(1, p(x) / q(x)), q the drafter's distribution. Per draft that reaches verification:

    greedy drafter (q one-hot at x, pagedkv's draft model and n-gram lookup):
        exact match keeps x with probability p(x); the rejection rule with min(1, p(x) / 1) = p(x): the same
    sampling drafter (x drawn from q):
        exact match keeps it with probability sum_x p(x) q(x); the rejection rule with sum_x min(p(x), q(x))

Target: tiny-pydoc (trained, byte vocabulary); draft: its first 2 of 4 layers (same embeddings and head),
written by transformers into a temporary directory and loaded as `speculative_config`'s model, k = 3,
greedy drafts as the engine proposes them. Prompts: the first 48 characters of pydoc_data's topics;
each request sampled at the temperature given (seeded, ignore_eos). The engine's own acceptance is
counted by a step listener (drafts reaching verification, drafts kept). Afterwards the target and the
draft are run by transformers (float32) over each request's final tokens, teacher-forced, which gives
p and q at every position a draft was verified at: the mean p(x) over the same drafts is the rejection
rule's expected acceptance with this greedy drafter, and the mean of sum p q and of sum min(p, q) what a
drafter sampling from q would get under each rule.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file)
from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.events import StepEvent  # noqa: E402
from pagedkv.models.loader import TRAINED_PRESETS  # noqa: E402

K = 3
DRAFT_LAYERS = 2


def write_draft(path: Path) -> None:
    """tiny-pydoc's first DRAFT_LAYERS layers as a checkpoint of its own (tokenizer files copied)."""
    import transformers

    source = TRAINED_PRESETS["tiny-pydoc"]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:DRAFT_LAYERS]
    model.config.num_hidden_layers = DRAFT_LAYERS
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)


def prompts(n: int) -> list[str]:
    import pydoc_data.topics

    texts = [t.strip() for t in pydoc_data.topics.topics.values()]
    return [t[:48] for t in texts[:n]]


def run(draft: Path, temperature: float, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        "tiny-pydoc",
        device="cpu",
        dtype="float32",
        attention_backend="TORCH_REF",
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": K},
    )
    verified: list[tuple[str, int, list[int], int]] = []  # (request id, output index of draft 0, drafts, kept)

    def listen(event: StepEvent) -> None:
        for s in event.scheduler_output.scheduled:
            request = s.request
            if s.draft_token_ids and request.finish_reason is None:
                start = len(request.output_token_ids) - (s.num_accepted_tokens + 1)
                verified.append((request.request_id, start, list(s.draft_token_ids), s.num_accepted_tokens))

    llm.add_step_listener(listen)
    texts = prompts(args.requests)
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(len(texts))
    ]
    ids = [llm.add_request(t, p) for t, p in zip(texts, params)]
    outputs: dict[str, Any] = {}
    while llm.has_unfinished_requests():
        outputs.update({o.request_id: o for o in llm.step() if o.finished})
    sequences = {r: outputs[r].prompt_token_ids + outputs[r].outputs[0].token_ids for r in ids}
    prompt_lens = {r: len(outputs[r].prompt_token_ids) for r in ids}
    return {"llm": llm, "verified": verified, "sequences": sequences, "prompt_lens": prompt_lens}


def distributions(model: torch.nn.Module, sequence: list[int], temperature: float) -> torch.Tensor:
    """[len(sequence), vocab] float64: the model's next-token distribution after each prefix, at `temperature`."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double()
    return (logits / temperature).softmax(-1)


def measure(draft: Path, temperature: float, args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    done = run(draft, temperature, args)
    target = transformers.AutoModelForCausalLM.from_pretrained(TRAINED_PRESETS["tiny-pydoc"], dtype=torch.float32)
    drafter = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    p_of = {r: distributions(target, s, temperature) for r, s in done["sequences"].items()}
    q_of = {r: distributions(drafter, s, temperature) for r, s in done["sequences"].items()}
    reached = kept = 0
    p_x, sum_pq, sum_min, greedy_match = [], [], [], 0
    for req_id, start, drafts, accepted in done["verified"]:
        for j, x in enumerate(drafts[: accepted + 1]):  # drafts up to the first rejected one reached the check
            row = done["prompt_lens"][req_id] + start + j - 1  # logits row predicting output index start + j
            p, q = p_of[req_id][row], q_of[req_id][row]
            reached += 1
            kept += j < accepted
            p_x.append(p[x].item())
            sum_pq.append((p * q).sum().item())
            sum_min.append(torch.minimum(p, q).sum().item())
            greedy_match += int(q.argmax()) == x  # the engine's draft is the draft model's argmax
    mean = sum(p_x) / reached
    # The engine's exact-match count is a sum of Bernoulli(p(x)) draws: its expected value and spread.
    sd = math.sqrt(sum(v * (1 - v) for v in p_x)) / reached
    return {
        "temperature": temperature,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "verifying_steps": len(done["verified"]),
        "drafts_reached": reached,
        "drafts_kept_exact_match": kept,
        "exact_match_acceptance": kept / reached,
        "rejection_rule_expected_acceptance_greedy_drafter": mean,
        "difference_in_sd": (kept / reached - mean) / sd,
        "engine_stats": {"num_draft_tokens": done["llm"].stats.num_draft_tokens,
                         "num_accepted_tokens": done["llm"].stats.num_accepted_tokens},
        "sampling_drafter_exact_match_sum_pq": sum(sum_pq) / reached,
        "sampling_drafter_rejection_rule_sum_min_pq": sum(sum_min) / reached,
        "drafts_equal_to_the_transformers_draft_argmax": greedy_match / reached,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    engine_bench.DEVICE = "cpu"
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with tempfile.TemporaryDirectory(prefix="pagedkv-draft-") as path:
        write_draft(Path(path))
        rows = [measure(Path(path), t, args) for t in args.temperatures]
    print(f"tiny-pydoc, draft = its first {DRAFT_LAYERS} layers, k = {K}, CPU; per draft reaching verification:")
    print(
        "  T     reached  exact match (engine)  rejection rule E[p(x)]  (diff, sd)   sampling drafter: sum pq / sum min"
    )
    for r in rows:
        print(
            f"  {r['temperature']:<5} {r['drafts_reached']:7d}  {r['exact_match_acceptance']:20.3f}  "
            f"{r['rejection_rule_expected_acceptance_greedy_drafter']:22.3f}  ({r['difference_in_sd']:+.1f})   "
            f"{r['sampling_drafter_exact_match_sum_pq']:.3f} / {r['sampling_drafter_rejection_rule_sum_min_pq']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"meta": engine_bench.run_metadata(), "k": K, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
