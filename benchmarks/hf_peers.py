"""Hugging Face `transformers` peers of the end-to-end benchmark, on pagedkv's own weights.

`to_transformers` (pagedkv.models.hf_export) turns the engine's model into a transformers
`LlamaForCausalLM` sharing its bf16 tensors on the GPU, so both engines serve exactly the same
model. Two ways transformers serves a batch of prompts:

* `generate_batch`: its continuous-batching engine (paged KV cache, the model's SDPA
  attention through its paged adapter), fed every prompt at once.
* `generate`: the classic padded batch: prompts left-padded to the longest, `batch_size`
  prompts per call, a dense KV cache.

Both are greedy with EOS disabled (the model's and the generation config's EOS ids are
cleared; `min_new_tokens` as well for `generate`), so every request produces `max_tokens`
tokens as pagedkv's `ignore_eos` does. Counts are read back from the outputs, not assumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from pagedkv.models.hf_export import to_transformers
from pagedkv.models.llama import LlamaForCausalLM


def export(model: LlamaForCausalLM) -> torch.nn.Module:
    """The engine's model as a transformers model in its dtype on its device (SDPA), EOS disabled."""
    weight = model.lm_head.weight
    hf = to_transformers(model, dtype=weight.dtype, device=weight.device, attn_implementation="sdpa")
    hf.config.eos_token_id = None
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _config(max_tokens: int, padded: bool) -> object:
    from transformers import GenerationConfig

    extra = {"min_new_tokens": max_tokens} if padded else {}
    return GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **extra)


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def generate_batch(hf: torch.nn.Module, prompts: Sequence[list[int]], max_tokens: int) -> dict[str, object]:
    """transformers' continuous batching over all prompts; a short warm-up call first.

    Not under `torch.inference_mode`: its generation loop runs in a thread of its own, which
    cannot update tensors made in inference mode (seen with transformers 5.17: every request
    failed and the call returned no tokens).
    """
    hf.generate_batch(inputs=[list(p) for p in prompts[:4]], generation_config=_config(4, padded=False))
    results, seconds = _timed(
        lambda: hf.generate_batch(
            inputs=[list(p) for p in prompts], generation_config=_config(max_tokens, padded=False)
        )
    )
    outputs = list(results.values())
    generated = [list(r.generated_tokens) for r in outputs]
    if not any(generated):
        raise RuntimeError("generate_batch returned no tokens (its log above says why)")
    return {
        "seconds": seconds,
        "requests_returned": len(outputs),
        "output_tokens": sum(map(len, generated)),
        "first_request": next(iter(results), None),
        "first_tokens": generated[0][:8] if generated else [],
    }


@torch.inference_mode()
def generate_padded(
    hf: torch.nn.Module, prompts: Sequence[list[int]], max_tokens: int, batch_size: int
) -> dict[str, object]:
    """transformers' `generate` on left-padded batches of `batch_size` prompts; a short warm-up first."""
    device = hf.lm_head.weight.device

    def padded(batch: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(device), mask.to(device)

    ids, mask = padded(prompts[:2])
    hf.generate(input_ids=ids, attention_mask=mask, generation_config=_config(4, padded=True))

    def run() -> list[torch.Tensor]:
        outs = []
        for start in range(0, len(prompts), batch_size):
            ids, mask = padded(prompts[start : start + batch_size])
            config = _config(max_tokens, padded=True)
            outs.append(hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :])
        return outs

    outs, seconds = _timed(run)
    return {"seconds": seconds, "output_tokens": sum(o.numel() for o in outs), "first_tokens": outs[0][0, :8].tolist()}
