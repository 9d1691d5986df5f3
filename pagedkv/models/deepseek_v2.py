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
bias) and, optionally, RoPE on the two halves instead of neighbouring pairs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.mla.layer import MLAAttention
from pagedkv.models.fused_moe import FusedMoE, expert_params_mapping
from pagedkv.models.layers import (
    RMSNorm, check_config_numbers, get_rope, hf_rope_parameters, rope_type, share_rotary_embeddings, yarn_mscale,
)
from pagedkv.models.llama import LlamaMLP
from pagedkv.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_hf_weights,
)

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# transformers' DeepseekV3Config defaults where they differ from V2's (the dataclass's): what a V3
# config.json means by leaving one of these keys out.
V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
    n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096,
    bos_token_id=0, num_nextn_predict_layers=1,
)


@dataclass
class DeepseekV2Config:
    """The fields of a Hugging Face DeepSeek-V2 / V3 `config.json` that this model reads, plus the
    names the engine reads off any model config (num_key_value_heads, head_dim, sliding_window)."""

    supports_tensor_parallel: ClassVar[bool] = False
    """MLA heads and experts are not split over ranks here: the engine refuses tensor_parallel_size > 1."""
    use_mla: ClassVar[bool] = True
    """Attention layers are `MLAAttention`: MLA backends (TORCH_REF_MLA, TRITON_MLA) serve them."""

    architecture: str = "DeepseekV2ForCausalLM"
    """The model class that serves it (`loader.MODEL_REGISTRY`): DeepseekV2ForCausalLM or DeepseekV3ForCausalLM."""
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    """Width of the dense MLP of the first `first_k_dense_replace` layers."""
    moe_intermediate_size: int = 1407
    """Width of one routed expert; the shared experts are one MLP `n_shared_experts` times as wide."""
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    q_lora_rank: int | None = 1536
    """Queries pass through a bottleneck this wide (q_a_proj -> q_a_layernorm -> q_b_proj); None: one q_proj."""
    kv_lora_rank: int = 512
    """Width of the latent c_kv, cached instead of K and V."""
    qk_nope_head_dim: int = 128
    """Per-head query and key dims that carry no position; the key part comes from c_kv through kv_b_proj."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with RoPE; the key side is one k_pe per token, shared by all heads."""
    v_head_dim: int = 128
    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    """Routed experts per token (top-k)."""
    n_shared_experts: int = 2
    first_k_dense_replace: int = 0
    """Layers below this index have a dense MLP, the others a MoE."""
    topk_method: str = "greedy"
    """V2: "greedy" or "group_limited_greedy" over softmax scores; V3: "noaux_tc" (sigmoid scores,
    group-limited, experts chosen with `e_score_correction_bias` added)."""
    n_group: int | None = None
    """Expert groups for the group-limited methods; only the best `topk_group` groups are searched."""
    topk_group: int | None = None
    norm_topk_prob: bool = False
    """Renormalise the chosen experts' weights to sum to 1 (before `routed_scaling_factor`)."""
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """Usually YaRN: it also scales the softmax (see `softmax_scale`)."""
    rope_interleave: bool = True
    """RoPE on neighbouring pairs (x0, x1), (x2, x3), ... (V2 always; V3's default); False: the two halves."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Biases on q_a_proj, kv_a_proj_with_mqa and o_proj."""
    mlp_bias: bool = False
    """Biases on the dense MLP and the shared experts (V2 only; routed experts never have one)."""
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction layers (V3) that the checkpoint stores after the last decoder layer, as
    `model.layers.{num_hidden_layers + i}.*`: for speculative decoding, which this engine does not
    do, so their tensors are skipped at loading."""
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_config_numbers(
            self, counts=("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
            floats=("rms_norm_eps", "rope_theta", "routed_scaling_factor"), positive=(
                "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings"))
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={self.hidden_act!r} is not supported; DeepSeek models use 'silu'.")
        if self.topk_method not in TOPK_METHODS:
            raise NotImplementedError(f"topk_method={self.topk_method!r} is not supported; supported: {TOPK_METHODS}.")
        if self.topk_method != "greedy":
            groups, picked = self.n_group, self.topk_group
            if not groups or not picked or self.n_routed_experts % groups or picked > groups:
                raise ValueError(f"topk_method={self.topk_method!r} needs n_group dividing n_routed_experts "
                                 f"({self.n_routed_experts}) and 1 <= topk_group <= n_group; got n_group={groups}, "
                                 f"topk_group={picked}.")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // groups < 2:
                raise ValueError(f"topk_method='noaux_tc' scores each group by its two best experts: n_group={groups} "
                                 f"leaves {self.n_routed_experts // groups} of the {self.n_routed_experts} experts per "
                                 f"group; use n_group <= {self.n_routed_experts // 2}.")
            if self.topk_method == "noaux_tc" and self.num_experts_per_tok > picked * self.n_routed_experts // groups:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                                 f"topk_group ({picked}) groups it may choose from (noaux_tc would weigh experts of "
                                 f"dropped groups by their scores): use num_experts_per_tok <= "
                                 f"{picked * self.n_routed_experts // groups} or a larger topk_group.")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:
        """KV heads of the cache: one latent row per token, shared by all query heads."""
        return 1

    @property
    def head_dim(self) -> int:
        """Width of that row: c_kv and k_pe (vLLM's get_head_size for MLA)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sliding_window(self) -> None:
        """Every layer attends to the whole context."""
        return None

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(qk_head_dim); under a RoPE scaling with `mscale_all_dim` (YaRN, in DeepSeek's own
        configs) times mscale(factor, mscale_all_dim)^2, as DeepSeek and transformers do for any
        scaling type: the slowed-down positions flatten attention, and this sharpens it back."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        return scale

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], model_type: str = "deepseek_v2") -> DeepseekV2Config:
        """Read a `config.json` of transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters),
        the way the installed transformers' DeepseekV2 / DeepseekV3 model (`model_type`) uses it."""
        if hf.get("moe_layer_freq", 1) != 1:  # DeepSeek's own code: MoE only where layer % freq == 0
            raise NotImplementedError(
                f"moe_layer_freq={hf['moe_layer_freq']}: every layer from first_k_dense_replace on is a MoE layer "
                "here (moe_layer_freq 1, as in every released DeepSeek-V2/V3 checkpoint; transformers ignores the key)."
            )
        # A null means what DeepSeek's own modelling code makes of it: no query bottleneck
        # (q_lora_rank, V2-Lite), no expert groups, no shared experts (`if n_shared_experts is not
        # None`), False for a flag (as transformers' `if config.flag:`); other nulls mean the default.
        null_means: dict[str, Any] = {"q_lora_rank": None, "n_group": None, "topk_group": None, "n_shared_experts": 0}
        null_means |= {k: False for k, f in cls.__dataclass_fields__.items() if isinstance(f.default, bool)}
        present = {k: null_means[k] if hf[k] is None else hf[k] for k in cls.__dataclass_fields__
                   if k in hf and (hf[k] is not None or k in null_means)}
        kwargs = {**(V3_DEFAULTS if model_type == "deepseek_v3" else {}), **present}
        kwargs["rope_theta"], kwargs["rope_scaling"] = hf_rope_parameters(
            hf, cls.rope_theta, kwargs.get("max_position_embeddings", cls.max_position_embeddings))
        eos = hf.get("eos_token_id")
        kwargs["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if model_type == "deepseek_v3":  # transformers' V3 routes so whatever topk_method says; no MLP biases
            kwargs.update(architecture="DeepseekV3ForCausalLM", topk_method="noaux_tc", mlp_bias=False)
        else:
            if kwargs.get("topk_method") == "noaux_tc":
                raise NotImplementedError(
                    "topk_method='noaux_tc' is DeepSeek-V3's router (sigmoid scores and e_score_correction_bias); "
                    "a deepseek_v2 config.json cannot use it: set model_type 'deepseek_v3' for a V3 checkpoint."
                )
            kwargs["rope_interleave"] = True  # V2 rotates neighbouring pairs (as complex numbers)
            if kwargs.get("norm_topk_prob"):
                raise NotImplementedError(
                    "DeepSeek-V2 with norm_topk_prob=true: transformers ignores the flag while DeepSeek's own code "
                    "renormalises (and then skips routed_scaling_factor); no released V2 checkpoint sets it."
                )
        return cls(**kwargs)


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
        self.kv_a_proj_with_mqa = ReplicatedLinear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                                   bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              [self.num_heads * (self.qk_nope_head_dim + config.v_head_dim)])
        self.o_proj = RowParallelLinear(self.num_heads * config.v_head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.rotary_emb = get_rope(self.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta,
                                   config.rope_scaling, interleaved=config.rope_interleave)
        self.attn = MLAAttention(
            self.num_heads, config.softmax_scale, self.qk_nope_head_dim, self.qk_rope_head_dim, config.v_head_dim,
            self.kv_lora_rank, self.kv_b_proj, prefix=f"{prefix}.attn",
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
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.qk_nope_head_dim:], k_pe)
        q[..., self.qk_nope_head_dim:] = q_pe
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
        self.e_score_correction_bias = (nn.Parameter(torch.empty(config.n_routed_experts), requires_grad=False)
                                        if self.method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (weights, expert ids), both [tokens, top_k]."""
        logits = F.linear(x.float(), self.weight.float())  # float32 like transformers: near-ties decide routes
        if self.e_score_correction_bias is not None:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.method != "greedy":
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
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                prefix=f"{prefix}.experts")
        self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                       bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x) + self.experts(x, *self.gate(x))


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm residual block, as Llama's: x + attn(norm(x)), then + mlp(norm(.)); MLP dense or MoE."""

    def __init__(self, config: DeepseekV2Config, prefix: str, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV2Attention(config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (DeepseekV2MoE(config, f"{prefix}.mlp") if layer_idx >= config.first_k_dense_replace
                               else LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias))

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

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config)
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
        load_hf_weights(self, ((name, t) for name, t in weights if not name.startswith(mtp)),
                        stacked, tied_embeddings=self.config.tie_word_embeddings)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: the same model; its config selects the router ("noaux_tc") and the RoPE layout."""
