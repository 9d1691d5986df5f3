"""Record the profile notebook 16 shows: decode steps of a Llama-sized model, async scheduling off and on.

    python benchmarks/profile_step.py                 # a GPU: llama3-8b, ~1-2 min with start-up
    python benchmarks/profile_step.py --smoke --out /tmp/cpu.json      # CPU, tiny preset: a smoke test

One engine (the model's random weights, CUDA graphs as the engine's defaults capture them) serves
`--batch` requests of `--prompt-len` random tokens; once every prompt is in the KV cache, `--steps`
decode steps are profiled with async scheduling off, then again with it on (the same engine:
`pagedkv.trace.profile.profile_decode` flips the engine's switch for its run). The two records go
to one JSON file, by default notebooks/traces/profile_step_<card>.json (h100 for an H100), which
notebook 16 draws beside its live CPU profile. It needs only the installed package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time
from pathlib import Path

import torch

from pagedkv import LLM
from pagedkv.trace.profile import StepProfile, profile_decode, save_profiles

TRACES = Path(__file__).resolve().parents[1] / "notebooks" / "traces"


def card_slug(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "h100": the model number of the card, for the file name."""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return (found.group(1) if found else re.sub(r"\W+", "_", name)).lower()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, help="default: notebooks/traces/profile_step_<card>.json on a GPU")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny preset, 3 steps (tests)")
    p.add_argument("--json", type=Path, help="also write what was run and the summaries here")
    args = p.parse_args()
    if args.smoke:
        args.model, args.batch, args.prompt_len, args.steps, args.warmup = "tiny", 3, 16, 3, 1
        torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.out is None:
        if not cuda:
            p.error("--out is needed off a GPU (a CPU profile must not be saved as a GPU one)")
        args.out = TRACES / f"profile_step_{card_slug(torch.cuda.get_device_name())}.json"
    start = time.perf_counter()
    llm = LLM(
        args.model,
        device="cuda" if cuda else "cpu",
        max_num_seqs=args.batch,
        max_cudagraph_capture_size=args.batch if cuda else None,  # fewer graphs: a shorter start-up
        max_model_len=args.prompt_len + 2 * (args.steps + args.warmup) + 64,
        async_scheduling=False,
    )
    started = time.perf_counter() - start
    mode = getattr(llm.runner, "cudagraph_mode", llm.config.compilation_config.cudagraph_mode)
    date = datetime.date.today().isoformat()
    profiles: list[StepProfile] = []
    for async_scheduling in (False, True):
        profile = profile_decode(
            llm,
            batch=args.batch,
            prompt_len=args.prompt_len,
            steps=args.steps,
            warmup=args.warmup,
            async_scheduling=async_scheduling,
        )
        profile.note = (
            f"{profile.device_name}, {date}, torch {torch.__version__}, {args.model} random weights, "
            f"CUDA graphs {getattr(mode, 'name', mode)}; batch {args.batch}, prompts of {args.prompt_len} tokens"
        )
        profiles.append(profile)
        s = profile.summary
        print(
            f"async {'on ' if async_scheduling else 'off'}: {s.step_us:8.1f} us a step, device busy "
            f"{s.device_busy_us:8.1f}, idle {s.device_idle_us:8.1f}; host "
            + ", ".join(f"{k} {v:.0f}" for k, v in s.host_us.items())
        )
    path = save_profiles(args.out, profiles)
    took = time.perf_counter() - start
    print(f"{path} ({path.stat().st_size // 1024} kB); start-up {started:.1f} s, all {took:.1f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"out": str(path), "startup_s": started, "seconds": took, "note": profiles[0].note})
        )


if __name__ == "__main__":
    main()
