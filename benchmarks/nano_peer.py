"""nano-vllm as a peer on W2, on the pagedkv model's own random weights, when `import nanovllm` works.

`export(model, path)` writes the model as a Hugging Face directory (`pagedkv.models.hf_export`,
then `save_pretrained`) with a word-level tokenizer of its vocabulary (nano-vllm loads one);
nano-vllm serves `Qwen3ForCausalLM` only, so other models are skipped with the reason.
`run(path, workload)` then times nano-vllm's `LLM.generate` on the workload, as its bench.py
does (a one-prompt warm-up, then every prompt at once), after the pagedkv engine is gone.

`RECORDED` holds nano-vllm's figure measured for the issue (not by this script).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from workloads import Workload

RECORDED = {"qwen3-0.6b": {"output_tokens_per_s": 14836.0, "gpu": "H200", "date": "2026-12-02"}}
"""nano-vllm's bench.py (W2) output tok/s, measured for the issue: "recorded, not this run"."""


def unavailable() -> str | None:
    """Why nano-vllm cannot run here, or None."""
    return None if importlib.util.find_spec("nanovllm") else "not importable"


def export(model: torch.nn.Module, path: Path) -> str | None:
    """Write `model` as a Hugging Face Qwen3 directory nano-vllm can load; the reason when it cannot."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pagedkv.models.hf_export import to_transformers

    weight = model.lm_head.weight
    hf = to_transformers(model, dtype=weight.dtype, device=weight.device, attn_implementation="sdpa")
    if type(hf).__name__ != "Qwen3ForCausalLM":
        return f"nano-vllm serves Qwen3 only; this model exports as {type(hf).__name__}"
    hf.save_pretrained(path)
    vocab = {str(i): i for i in range(model.config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")), eos_token=str(model.config.eos_token_id[0])
    )
    tokenizer.save_pretrained(path)
    return None


def run(path: Path, workload: Workload) -> dict[str, object]:
    """nano-vllm's bench.py on `workload` (its engine limits are W2's: 512 sequences, 16384 tokens a step)."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(
        str(path),
        enforce_eager=False,
        max_model_len=4096,
        max_num_seqs=workload.engine["max_num_seqs"],
        max_num_batched_tokens=workload.engine["max_num_batched_tokens"],
    )
    params = [
        SamplingParams(temperature=p.temperature, ignore_eos=True, max_tokens=p.max_tokens) for p in workload.params
    ]
    llm.generate([[1, 2, 3]], SamplingParams(), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start  # (nano-vllm ends its engine at exit: it runs last in the process)
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {
        "engine": "nano-vllm",
        "mode": "its defaults (CUDA graphs)",
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
    }
