"""The end-to-end workloads W1 and W2, their uncached variants, and their rooflines.

**W1** (issue 9): `llama3-8b`, 128 requests, prompt lengths uniform in [100, 1024] from
`random.Random(0)`, 128 new tokens each, greedy, EOS ignored; `max_num_seqs=128`,
`max_num_batched_tokens=4096`, 16 GiB of KV cache.

**W2** (nano-vllm's `bench.py`): 256 sequences, `random.seed(0)`, then every prompt
(`randint(100, 1024)` tokens of `randint(0, 10000)`), then every sampling parameter
(temperature 0.6, EOS ignored, `max_tokens=randint(100, 1024)`), in that order;
`max_num_seqs=512`, `max_num_batched_tokens=16384`, KV cache bytes given by the caller.

Timed runs never reuse prompts the engine has cached (prefix caching is on by default):
`Workload.with_other_ids` keeps the lengths and sampling parameters and draws other token ids,
`Workload.resampled` draws the whole workload again from another seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pagedkv import SamplingParams
from pagedkv.models.fused_moe import FusedMoE


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    engine: dict[str, object]
    """The `LLM` arguments the workload fixes: batch limits and the KV cache size."""
    draw: Callable[[int], tuple[list[list[int]], list[SamplingParams]]]
    """The workload drawn from a seed (seed 0: the workload itself)."""
    id_range: tuple[int, int]
    """Token ids are drawn in [low, high] (then taken modulo the model's vocabulary)."""
    vocab_size: int

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)  # EOS is ignored: every request runs to max_tokens

    def with_other_ids(self, seed: int) -> Workload:
        """The same lengths and sampling parameters, other token ids (nothing of it in the prefix cache)."""
        rng = random.Random(seed)
        low, high = self.id_range
        prompts = [[rng.randint(low, high) % self.vocab_size for _ in p] for p in self.prompts]
        return replace(self, prompts=prompts)

    def resampled(self, seed: int, max_tokens: int | None = None) -> Workload:
        """The workload drawn from another seed (other lengths of the same distribution), outputs capped."""
        prompts, params = self.draw(seed)
        return self._fitted(prompts, params, len(self.prompts), max_tokens)

    def _fitted(
        self, prompts: list[list[int]], params: list[SamplingParams], num: int, max_tokens: int | None
    ) -> Workload:
        prompts = [[t % self.vocab_size for t in p] for p in prompts[:num]]
        params = [replace(p, max_tokens=min(p.max_tokens, max_tokens or p.max_tokens)) for p in params[:num]]
        return replace(self, prompts=prompts, params=params)


def w1_prompts(num_requests: int = 128, seed: int = 0) -> list[list[int]]:
    """W1's prompts, exactly as issue 9 defines them (fewer requests: the first ones)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 128000) for _ in range(rng.randint(100, 1024))] for _ in range(128)][:num_requests]


def w1(
    model: str, vocab_size: int, num_requests: int = 128, max_tokens: int = 128, kv_cache_bytes: int = 16 << 30
) -> Workload:
    def draw(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return w1_prompts(128, seed), [params] * 128

    engine = dict(max_num_seqs=num_requests, max_num_batched_tokens=4096, kv_cache_memory=kv_cache_bytes)
    base = Workload("W1", model, [], [], engine, draw, (3, 127999), vocab_size)
    return base._fitted(*draw(0), num_requests, None)


def w2_draw(
    seed: int, num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024
) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py, call for call (`random.seed(s)` seeds the same generator as `Random(s)`)."""
    rng = random.Random(seed)
    prompt_token_ids = [
        [rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)
    ]
    sampling_params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, max_output_len))
        for _ in range(num_seqs)
    ]
    return prompt_token_ids, sampling_params


def w2(
    model: str, vocab_size: int, kv_cache_bytes: int, num_requests: int = 256, max_tokens: int | None = None
) -> Workload:
    """W2; fewer requests are the first ones of the 256 (and `max_tokens` caps outputs): for smoke tests."""
    engine = dict(max_num_seqs=512, max_num_batched_tokens=16384, kv_cache_memory=kv_cache_bytes)
    base = Workload("W2", model, [], [], engine, w2_draw, (0, 10000), vocab_size)
    return base._fitted(*w2_draw(0), num_requests, max_tokens)


def roofline(model: torch.nn.Module, workload: Workload, hbm_tbps: float, tflops: float) -> dict[str, float]:
    """Lower bound on a workload's time: prefill at peak FLOP/s, then one decode step per further token.

    Prefill: 2 FLOPs per weight and prompt token (embedding gather and LM head excluded; the
    head runs once per request; a MoE counts the experts its FusedMoE layers run per token: the
    top_k routed ones in the grouped way, every one in the dense way) plus causal attention,
    2 * L(L+1)/2 * heads * (q.k width + p.v width) per layer. Decode step j (j = 1 ..
    max(max_tokens) - 1) runs the requests still generating: the longer of streaming every weight
    once and their KV caches at `hbm_tbps`, and their FLOPs (weights + attention over their
    context) at `tflops`.
    """
    c = model.config
    weights = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.model.embed_tokens.weight.numel(), model.lm_head.weight.numel()
    body = weights - embed - (0 if c.tie_word_embeddings else head)
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE) and m.use_grouped_mm):
        body -= (moe.w13_weight.numel() + moe.w2_weight.numel()) * (1 - c.num_experts_per_tok / moe.num_experts)
    item = model.lm_head.weight.element_size()
    if getattr(c, "use_mla", False):  # per head: q.k over qk_head_dim, p.v over v_head_dim; one latent row per token
        attn_width, kv_per_token = c.qk_head_dim + c.v_head_dim, c.num_hidden_layers * c.head_dim * item
    else:
        attn_width, kv_per_token = 2 * c.head_dim, 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * item
    attn_per_pair = 2 * c.num_attention_heads * attn_width * c.num_hidden_layers  # FLOPs per (query, key) pair
    lens = [len(p) for p in workload.prompts]
    outs = [p.max_tokens for p in workload.params]
    prefill_flops = 2 * body * sum(lens) + 2 * head * len(lens) + sum(n * (n + 1) / 2 for n in lens) * attn_per_pair
    decode_s = decode_bytes = 0.0
    for j in range(1, max(outs)):
        context = [n + j for n, m in zip(lens, outs, strict=True) if m > j]
        step_bytes = weight_bytes + kv_per_token * sum(context)
        step_flops = 2 * (body + head) * len(context) + attn_per_pair * sum(context)
        decode_bytes += step_bytes
        decode_s += max(step_bytes / (hbm_tbps * 1e12), step_flops / (tflops * 1e12))
    seconds = prefill_flops / (tflops * 1e12) + decode_s
    return {
        "weight_gb": weight_bytes / 1e9,
        "prefill_tflop": prefill_flops / 1e12,
        "decode_gb": decode_bytes / 1e9,
        "hbm_tbps": hbm_tbps,
        "tflops": tflops,
        "seconds": seconds,
        "output_tokens_per_s": workload.output_tokens / seconds,
    }
