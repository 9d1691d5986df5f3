"""Model configs: what a checkpoint's `config.json` says of its architecture, one dataclass per family.

A model config is a model file's blueprint: the sizes, head counts, RoPE and routing settings that
decide which modules the model builds and the shapes of their weights (how the engine runs it is
pagedkv/config.py's business). vLLM takes transformers' `PretrainedConfig` for this
(vllm/transformers_utils/config.py); pagedkv reads the JSON itself, in `from_hf_dict(hf, model_type)`
(`model_type`: the family, as the loader reads it off the file):

* a field takes the key of its name; a key left out takes the default of transformers' config class
  for the family: the dataclass's, or `FAMILY_DEFAULTS` / `V3_DEFAULTS` / Qwen3Config's where those
  differ (a null mostly means the same; DeepSeek reads some nulls as "none", see its `from_hf_dict`);
* transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling` become `rope_theta` and
  `rope_scaling` (`hf_rope_parameters`); `eos_token_id` becomes a list; sliding windows are read per
  family as transformers reads them (`_hf_windows`); keys no model here uses are ignored;
* the numbers are checked on construction (`check_config_numbers`): a wrong one is named here instead
  of surfacing as a shape error deep in a model.

Every config answers the names the engine reads: `architecture`, `use_mla`, `supports_tensor_parallel`,
`num_key_value_heads`, `head_dim`, `sliding_window` (DeepseekV2Config derives the last three: its
cache holds one latent row per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedkv.models.layers import rope_type, yarn_mscale


def check_config_numbers(
    config: object,
    *,
    positive: Sequence[str] = (),
    counts: Sequence[str] = (),
    floats: Sequence[str] = (),
) -> None:
    """The config.json numbers a model is built from, named when wrong (else a wrong type or a 0
    surfaces as a torch or ZeroDivisionError deep in the model's construction): `positive` ints
    >= 1, `counts` ints >= 0, `floats` numbers > 0. None (a field that may be absent) passes."""
    for names, low in ((positive, 1), (counts, 0)):
        for name in names:
            value = getattr(config, name)
            if value is not None and (type(value) is not int or value < low):
                raise ValueError(f"config.json: {name} must be an int >= {low}, got {value!r}.")
    for name in floats:
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"config.json: {name} must be a number > 0, got {value!r}.")


ROPE_POSITIVE = (
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
)
"""The keys of a RoPE scaling that are numbers > 0 (as transformers' rope_config_validation reads them)."""
ROPE_NUMBERS = ("attention_factor", "mscale", "mscale_all_dim")
"""The keys of a RoPE scaling that are numbers of any sign."""


def hf_rope_parameters(
    hf: dict[str, Any], default_theta: float, max_positions: int
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a `config.json`: transformers 5's `rope_parameters`, or 4's
    `rope_theta` and `rope_scaling`. The scaling is None for plain RoPE.

    Read as transformers 5 reads them: a `rope_scaling` (the older spelling, still in many hub
    configs) wins over `rope_parameters`, and a top-level `rope_theta` fills in a theta that the
    winner lacks. A Llama-3 or YaRN scaling without `original_max_position_embeddings` (the
    context the model was pretrained for) takes the config's top-level value of that name, or else
    `max_positions` (the config's max_position_embeddings); YaRN without a `factor` takes the
    ratio of the two lengths.
    """
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    given = hf.get(field) or {}
    if not isinstance(given, dict):
        raise ValueError(
            f'config.json: {field} must be an object such as {{"rope_type": "default", "rope_theta": 10000.0}} '
            f"(or null for plain RoPE), got {given!r}."
        )
    for key in (*ROPE_POSITIVE, *ROPE_NUMBERS):
        value, positive = given.get(key), key in ROPE_POSITIVE
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0)
        ):
            raise ValueError(
                f"config.json: {field}[{key!r}] must be a number{' > 0' if positive else ''}, got {value!r}."
            )
    rope = dict(given)
    if hf.get("rope_theta") is not None:
        rope.setdefault("rope_theta", hf["rope_theta"])
    kind = rope_type(rope)
    if kind in ("llama3", "yarn"):
        if hf.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        elif rope.get("original_max_position_embeddings") is None:
            rope["original_max_position_embeddings"] = max_positions
        if kind == "yarn" and rope.get("factor") is None:
            rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    return rope.get("rope_theta") or default_theta, rope if kind != "default" else None


@dataclass
class LlamaConfig:
    """The architecture fields of a Hugging Face Llama `config.json` that this model reads."""

    architecture: ClassVar[str] = "LlamaForCausalLM"
    """The model class that serves it (`loader.MODEL_REGISTRY`), for Mistral and Qwen2 too (Qwen3: its own)."""
    supports_tensor_parallel: ClassVar[bool] = True
    use_mla: ClassVar[bool] = False
    """Attention layers are MHA / GQA / MQA (`Attention`), not MLA: MHA backends serve them."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Biases on q/k/v and o_proj (Llama's flag)."""
    qkv_bias: bool | None = None
    """Biases on q/k/v only (Qwen2); None follows `attention_bias`."""
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    """Per layer "full_attention" or "sliding_attention" (with `sliding_window`)."""
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # fmt: off
        check_config_numbers(
            self,
            floats=("rms_norm_eps", "rope_theta"),
            positive=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "max_position_embeddings"),
        )
        # fmt: on
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:  # e.g. Qwen3's default of 32 KV heads
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}): each KV head serves the same "
                "number of query heads."
            )
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        for name in ("attention_bias", "qkv_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):  # "yes" would build biases the checkpoint lacks
                raise ValueError(f"config.json: {name} must be true or false, got {getattr(self, name)!r}.")
        if self.hidden_act != "silu":
            raise NotImplementedError(
                f"hidden_act={self.hidden_act!r} is not supported; Llama-family models use 'silu'."
            )
        self._check_windows()

    def _check_windows(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}.")
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must be a list with one entry per layer ({self.num_hidden_layers}), "
                f"got {self.layer_types!r}."
            )
        unknown = sorted({str(t) for t in self.layer_types} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types has unsupported entries {unknown}; supported: {list(LAYER_TYPES)}.")

    def layer_sliding_window(self, i: int) -> int | None:
        """Layer `i`'s window: `sliding_window` on the "sliding_attention" layers, or on all if no layer_types."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], model_type: str = "llama") -> LlamaConfig:
        """Read a `config.json` of transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters).

        `model_type` is the family ("llama", "mistral", "qwen2" or "qwen3"): it decides the biases
        and how the per-layer windows are read (see `_hf_windows`).
        """
        present = {k: hf[k] for k in cls.__dataclass_fields__ if k in hf and hf[k] is not None and k != "qkv_bias"}
        kwargs = {**FAMILY_DEFAULTS.get(model_type, {}), **present}
        kwargs["rope_theta"], kwargs["rope_scaling"] = hf_rope_parameters(
            hf, cls.rope_theta, kwargs.get("max_position_embeddings", cls.max_position_embeddings)
        )
        eos = hf.get("eos_token_id")
        kwargs["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if kwargs.get("hidden_act") == "swish":  # another name of SiLU (transformers' ACT2FN has both)
            kwargs["hidden_act"] = "silu"
        # Mistral has no biases and Qwen2 biases on q/k/v only, whatever bias keys the file has;
        # Qwen3 reads attention_bias (q/k/v and o_proj, as Llama) but never has MLP biases.
        if model_type == "mistral":
            kwargs.update(attention_bias=False, mlp_bias=False)
        elif model_type == "qwen2":
            kwargs.update(qkv_bias=True, attention_bias=False, mlp_bias=False)
        elif model_type == "qwen3":
            kwargs.update(mlp_bias=False)
        kwargs["sliding_window"], kwargs["layer_types"] = _hf_windows(hf, model_type)
        return cls(**kwargs)


FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers' defaults for keys a config.json leaves out, where Mistral's and Qwen2's differ
    # from Llama's (the dataclass defaults above); the windows are in `_hf_windows`.
    "mistral": dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072),
    "qwen2": dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768, bos_token_id=None),
}


LAYER_TYPES = ("full_attention", "sliding_attention")


def _hf_windows(hf: dict[str, Any], model_type: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) of a `config.json`, as the installed transformers reads them.

    llama:   no window, whatever the file says.
    mistral: `sliding_window` (4096 when the key is absent, none when null) on every layer; with
             `layer_types` (AutoModel then loads it as Ministral) only on the "sliding_attention" ones.
    qwen2, qwen3: windows only when `use_sliding_window` is true (default false); `layer_types` when
             present, else full attention on layers below `max_window_layers` (default 28) and
             the window from there on (what transformers 4 wrote had no layer_types).
    """
    if model_type == "llama":
        return None, None
    window = hf.get("sliding_window", 4096)
    layer_types = hf.get("layer_types")
    if model_type == "mistral":
        return window, layer_types
    if not hf.get("use_sliding_window", False):
        return None, None
    if layer_types is None and window is not None:
        num_layers = hf.get("num_hidden_layers", LlamaConfig.num_hidden_layers)
        first_windowed = hf.get("max_window_layers", 28)
        layer_types = [LAYER_TYPES[i >= first_windowed] for i in range(num_layers)]
    return window, layer_types


@dataclass
class Qwen3Config(LlamaConfig):
    """Llama's fields, with the defaults of transformers' Qwen3Config for keys a config.json leaves out.

    `head_dim` is a field of its own (128 by default), not hidden_size / num_attention_heads:
    Qwen3-0.6B has 16 heads of 128 on a hidden size of 1024. `attention_bias` (default False)
    puts biases on q/k/v and o_proj, as Llama's flag does; the MLP has none. Sliding windows are
    read as Qwen2's (`_hf_windows`).
    """

    architecture: ClassVar[str] = "Qwen3ForCausalLM"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None


TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# transformers' DeepseekV3Config defaults where they differ from V2's (the dataclass's): what a V3
# config.json means by leaving one of these keys out.
# fmt: off
V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
    n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096,
    bos_token_id=0, num_nextn_predict_layers=1,
)
# fmt: on


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
        # fmt: off
        check_config_numbers(
            self,
            counts=("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
            floats=("rms_norm_eps", "rope_theta", "routed_scaling_factor"),
            positive=("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings"),
        )
        # fmt: on
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={self.hidden_act!r} is not supported; DeepSeek models use 'silu'.")
        if self.topk_method not in TOPK_METHODS:
            raise NotImplementedError(f"topk_method={self.topk_method!r} is not supported; supported: {TOPK_METHODS}.")
        if self.topk_method != "greedy":
            groups, picked = self.n_group, self.topk_group
            if not groups or not picked or self.n_routed_experts % groups or picked > groups:
                raise ValueError(
                    f"topk_method={self.topk_method!r} needs n_group dividing n_routed_experts "
                    f"({self.n_routed_experts}) and 1 <= topk_group <= n_group; got n_group={groups}, "
                    f"topk_group={picked}."
                )
            if self.topk_method == "noaux_tc" and self.n_routed_experts // groups < 2:
                raise ValueError(
                    f"topk_method='noaux_tc' scores each group by its two best experts: n_group={groups} "
                    f"leaves {self.n_routed_experts // groups} of the {self.n_routed_experts} experts per "
                    f"group; use n_group <= {self.n_routed_experts // 2}."
                )
            if self.topk_method == "noaux_tc" and self.num_experts_per_tok > picked * self.n_routed_experts // groups:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                    f"topk_group ({picked}) groups it may choose from (noaux_tc would weigh experts of "
                    f"dropped groups by their scores): use num_experts_per_tok <= "
                    f"{picked * self.n_routed_experts // groups} or a larger topk_group."
                )

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
        present = {
            k: null_means[k] if hf[k] is None else hf[k]
            for k in cls.__dataclass_fields__
            if k in hf and (hf[k] is not None or k in null_means)
        }
        kwargs = {**(V3_DEFAULTS if model_type == "deepseek_v3" else {}), **present}
        kwargs["rope_theta"], kwargs["rope_scaling"] = hf_rope_parameters(
            hf, cls.rope_theta, kwargs.get("max_position_embeddings", cls.max_position_embeddings)
        )
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
