"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and a mixture of experts (MoE).

MLA caches one small latent row per token instead of every head's K and V:

    hidden ─┬─ q_proj (or q_a_proj ─ q_a_layernorm ─ q_b_proj) ─ q: per head [nope | rope] ─ RoPE(rope) ─┐
            └─ kv_a_proj_with_mqa ─┬─ c_kv [kv_lora_rank] ─ kv_a_layernorm ─ kv_c_normed ───────────────┤
                                   └─ k_pe [rope], one for all heads ─ RoPE ─────────────────────────────┤
                                                                       self.attn(q, kv_c_normed, k_pe) ─ o_proj
                          cached per token: one row [ kv_c_normed | k_pe ]

`self.attn` (MLAAttention) writes that row into the paged cache and gets each head's K and V back
through kv_b_proj: [k_nope_h | v_h] = kv_b_proj_h(kv_c_normed), K_h = [k_nope_h | k_pe]. It owns the
cache and the attention; this file holds the projections a checkpoint defines, as llama.py does.

The MLP of the first `first_k_dense_replace` layers is dense; after that a router sends each token
to `num_experts_per_tok` of `n_routed_experts` experts, and every token also goes through the
shared experts. V3 is the same model with another router (sigmoid scores and a load-balancing
bias) and, optionally, RoPE on the two halves instead of neighbouring pairs. What a config.json
says of all this is read into `DeepseekV2Config` (pagedkv/models/configs.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.mla.layer import MLAAttention
from pagedkv.models.configs import DeepseekV2Config
from pagedkv.models.fused_moe import FusedMoE, expert_params_mapping
from pagedkv.models.layers import RMSNorm, get_rope, share_rotary_embeddings
from pagedkv.models.llama import LlamaMLP
from pagedkv.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_hf_weights,
)


class DeepseekV2Attention(nn.Module):
    """MLA's projections around `MLAAttention`: queries per head, one latent row per token for the cache."""

    def __init__(self, config: DeepseekV2Config, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank, self.qk_nope_head_dim = config.kv_lora_rank, config.qk_nope_head_dim
        self.qk_rope_head_dim, self.qk_head_dim = config.qk_rope_head_dim, config.qk_head_dim
        self.q_lora_rank = config.q_lora_rank
        q_size = self.num_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, [q_size])
        else:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, self.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # transformers keeps eps 1e-6 on both latent norms
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [q_size])
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, [self.num_heads * (self.qk_nope_head_dim + config.v_head_dim)]
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * config.v_head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.rotary_emb = get_rope(
            self.qk_rope_head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            interleaved=config.rope_interleave,
        )
        self.attn = MLAAttention(
            self.num_heads,
            config.softmax_scale,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            config.v_head_dim,
            self.kv_lora_rank,
            self.kv_b_proj,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # Position enters only through the rope dims: c_kv stays position-free, so kv_b_proj can be
        # folded into the query (MLAAttention's decode path) without touching RoPE.
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.qk_nope_head_dim :], k_pe)
        q[..., self.qk_nope_head_dim :] = q_pe
        return self.o_proj(self.attn(q.flatten(1), self.kv_a_layernorm(kv_c), k_pe))


class DeepseekV2Gate(nn.Module):
    """The router: scores every expert for each token and picks `num_experts_per_tok` of them, with weights.

    V2 ("greedy", "group_limited_greedy"): softmax scores choose and weigh. V3 ("noaux_tc"): sigmoid
    scores weigh, but the choice adds `e_score_correction_bias`, a per-expert offset trained to even
    out the experts' load: it decides WHICH experts, never HOW MUCH. The group-limited methods first
    keep the best `topk_group` of `n_group` groups of experts (V2 ranks a group by its best expert,
    V3 by its best two) and choose only among them.
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.top_k, self.method = config.num_experts_per_tok, config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(config.n_routed_experts), requires_grad=False)
            if self.method == "noaux_tc"
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (weights, expert ids), both [tokens, top_k]."""
        logits = F.linear(x.float(), self.weight.float())  # float32 like transformers: near-ties decide routes
        if self.e_score_correction_bias is not None:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.method != "greedy":
            # DeepseekV2Config refuses a grouped topk_method without n_group and topk_group.
            assert self.n_group is not None and self.topk_group is not None
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1) if self.method == "noaux_tc" else grouped.amax(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            if self.method == "noaux_tc":  # -inf: never chosen
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
            else:  # 0, and weighed by it, as in DeepSeek-V2's code: chosen only past the kept experts, with weight 0
                scores = choice = grouped.masked_fill(~keep[..., None], 0.0).flatten(1)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, method={self.method!r}"


class DeepseekV2MoE(nn.Module):
    """Shared experts for every token, plus each token's routed experts weighted by the gate
    (stacked in `FusedMoE`)."""

    def __init__(self, config: DeepseekV2Config, prefix: str) -> None:
        super().__init__()
        self.gate = DeepseekV2Gate(config)
        self.experts = FusedMoE(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, prefix=f"{prefix}.experts"
        )
        self.shared_experts = LlamaMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x) + self.experts(x, *self.gate(x))


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm residual block, as Llama's: x + attn(norm(x)), then + mlp(norm(.)); MLP dense or MoE."""

    def __init__(self, config: DeepseekV2Config, prefix: str, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV2Attention(config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            DeepseekV2MoE(config, f"{prefix}.mlp")
            if layer_idx >= config.first_k_dense_replace
            else LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DeepseekV2Model(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, config: DeepseekV2Config, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        with share_rotary_embeddings():  # one cos/sin table for all layers
            self.layers = nn.ModuleList(
                DeepseekV2DecoderLayer(config, f"{prefix}.layers.{i}", i) for i in range(config.num_hidden_layers)
            )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


# Hugging Face keeps gate and up separate (dense MLP, shared experts); we fuse them. Routed experts
# are stacked instead (`expert_params_mapping`).
_STACKED = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


class DeepseekV2ForCausalLM(nn.Module):
    """The whole model: tokens + positions -> hidden states -> logits."""

    keep_in_float32: ClassVar[tuple[str, ...]] = (".gate.weight", ".gate.e_score_correction_bias")
    """Parameters (name endings) that stay float32 when the model runs in bf16/fp16, as transformers
    keeps them: the router's. Rounded to bf16 (8 significant bits), the weight and the bias that is
    added to the scores before the top-k can change which experts a token is sent to."""

    def __init__(self, config: DeepseekV2Config, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config, prefix)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (all requests packed) -> hidden [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (gate/up fused, experts stacked). Every
        parameter must be set; the multi-token-prediction layers' tensors are skipped."""
        # Expert tensors first: their names also contain ".gate_proj." / ".up_proj.".
        stacked = {**expert_params_mapping(self.config.n_routed_experts), **_STACKED}
        first, count = self.config.num_hidden_layers, self.config.num_nextn_predict_layers
        mtp = tuple(f"model.layers.{i}." for i in range(first, first + count))
        load_hf_weights(
            self,
            ((name, t) for name, t in weights if not name.startswith(mtp)),
            stacked,
            tied_embeddings=self.config.tie_word_embeddings,
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: the same model; its config selects the router ("noaux_tc") and the RoPE layout."""
