"""DeepSeek-V2 / V3 (MLA attention, MoE) against Hugging Face `transformers` on the same weights (fp32).

The engine's per-step logits (paged latent cache, decodes by the absorbed path, prefills by the
up-projected one, chunked prefills) must equal transformers' logits over each whole sequence.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv import LLM, SamplingParams
from pagedkv.attention.mla.layer import MLAAttention
from pagedkv.models.configs import DeepseekV2Config
from pagedkv.models.deepseek_v2 import DeepseekV2Gate
from pagedkv.models.layers import RotaryEmbedding, rope_inv_freq
from pagedkv.models.loader import PRESETS, load_config
from tests.conftest import edit_config_json, write_hf_deepseek
from tests.reference import LogitsRecorder, reference_logits

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}  # mscale != mscale_all_dim: cos/sin and the softmax both scaled
V3_GROUPS = dict(n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
CASES = {  # name -> (version, overrides of write_hf_deepseek)
    "v2-dense-and-moe": (2, {}),
    "v2-q_lora-group_limited-yarn": (
        2,
        dict(
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            rope_scaling=YARN,
            max_position_embeddings=256,
        ),
    ),
    # 3 picks from the 2 experts of the one kept group: the third is an expert of a dropped group,
    # weighed 0 (DeepSeek-V2's code and transformers mask dropped groups' scores to 0).
    "v2-group_limited-more-picks-than-kept": (
        2,
        dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, num_experts_per_tok=3),
    ),
    "v3-bias-groups-norm": (3, V3_GROUPS),
    "v3-rope-halves": (3, dict(V3_GROUPS, rope_interleave=False, norm_topk_prob=False)),
    # transformers and DeepSeek's code raise the softmax scale by mscale_all_dim under any scaling type.
    "v3-linear-rope-mscale_all_dim": (
        3,
        dict(V3_GROUPS, rope_scaling={"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}),
    ),
    # 20 heads (two head blocks of the decode kernel, the second partly empty), a latent and a rope
    # part that are not powers of two, V wider than the no-rope part of K, biases, tied embeddings,
    # experts 30 wide (not a multiple of 4).
    "v2-odd-shapes": (
        2,
        dict(
            hidden_size=80,
            num_attention_heads=20,
            kv_lora_rank=48,
            qk_nope_head_dim=8,
            qk_rope_head_dim=12,
            v_head_dim=40,
            q_lora_rank=12,
            attention_bias=True,
            tie_word_embeddings=True,
            first_k_dense_replace=0,
            moe_intermediate_size=30,
        ),
    ),
}
PROMPTS = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate([1, 5, 12, 17, 33])]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def hf_model(path: Path, version: int) -> torch.nn.Module:
    cls = transformers.DeepseekV2ForCausalLM if version == 2 else transformers.DeepseekV3ForCausalLM
    # Eager experts: transformers' default grouped-mm experts fail on the CPU in float32 when
    # moe_intermediate_size is not a multiple of 4 ("strides should be multiple of 16 bytes").
    return cls.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def logit_errors(llm: LLM, hf: torch.nn.Module) -> tuple[float, bool]:
    """Greedy run of PROMPTS: (largest |engine - transformers| logit, every greedy token the argmax)."""
    recorder = LogitsRecorder(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    recorder.detach()
    worst, argmax = 0.0, True
    for out in outputs:
        tokens = out.outputs[0].token_ids
        expected = reference_logits(hf, out.prompt_token_ids, tokens)
        worst = max(worst, (torch.stack(recorder.rows[out.request_id]) - expected).abs().max().item())
        argmax &= expected.argmax(dim=-1).tolist() == tokens
    return worst, argmax


def engine(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path: Path, name: str) -> None:
    version, overrides = CASES[name]
    path = write_hf_deepseek(tmp_path / name, version=version, **overrides)
    assert load_config(str(path)).architecture == f"DeepseekV{version}ForCausalLM"
    error, argmax = logit_errors(engine(path), hf_model(path, version))
    assert error <= ATOL and argmax


def test_hub_style_config(tmp_path: Path) -> None:
    """config.json as DeepSeek's hub repositories have it (written for their remote code):
    rope_theta at the top, rope_scaling with "type", and keys this engine does not use."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, rope_scaling=YARN, max_position_embeddings=256, **V3_GROUPS)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
    for key in ("dtype", "head_dim", "qk_head_dim", "transformers_version", "mlp_bias", "output_router_logits"):
        config.pop(key, None)
    config.update(
        moe_layer_freq=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        aux_loss_alpha=0.001,
        seq_aux=True,
        ep_size=1,
        num_nextn_predict_layers=1,
        torch_dtype="bfloat16",
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    )
    (path / "config.json").write_text(json.dumps(config))
    hf = hf_model(path, 3)
    assert hf.config.rope_parameters["rope_type"] == "yarn"  # transformers read the old spelling too
    error, argmax = logit_errors(engine(path), hf)
    assert error <= ATOL and argmax


def test_v3_config_json_with_keys_left_out(tmp_path: Path) -> None:
    """A trimmed V3 config.json means what transformers makes of it: V3's defaults for the routing
    keys left out (not V2's), and YaRN's pretraining length taken from max_position_embeddings."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, rope_scaling=YARN, max_position_embeddings=256, **V3_GROUPS)
    config = json.loads((path / "config.json").read_text())
    for key in ("norm_topk_prob", "routed_scaling_factor"):  # V3_GROUPS sets them to V3's defaults
        del config[key]
    del config["rope_parameters"]["original_max_position_embeddings"]  # was YARN's 64
    (path / "config.json").write_text(json.dumps(config))
    ours = load_config(str(path))
    assert isinstance(ours, DeepseekV2Config) and ours.rope_scaling is not None
    assert (ours.norm_topk_prob, ours.routed_scaling_factor, ours.rope_scaling["original_max_position_embeddings"]) == (
        True,
        2.5,
        256,
    )
    hf = hf_model(path, 3)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 256
    error, argmax = logit_errors(engine(path), hf)
    assert error <= ATOL and argmax


def test_v3_defaults_are_transformers() -> None:
    """Every DeepSeek field a V3 config.json may leave out defaults to transformers' DeepseekV3Config value."""
    ours, theirs = DeepseekV2Config.from_hf_dict({}, "deepseek_v3"), transformers.DeepseekV3Config()
    names = [f.name for f in dataclasses.fields(DeepseekV2Config) if hasattr(theirs, f.name)]
    assert len(names) > 20
    for name in set(names) - {"rope_scaling", "eos_token_id"}:  # compared in their own tests
        assert getattr(ours, name) == getattr(theirs, name), name


def test_chunked_prefills_mixed_with_decodes(tmp_path: Path) -> None:
    """A 16-token budget: long prompts go in chunks, in the same steps as other requests' decodes."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    llm = engine(path, max_num_batched_tokens=16)
    query_lens: list[list[int]] = []
    llm.add_step_listener(lambda e: query_lens.append(e.result.batch.query_start_loc_cpu.diff().tolist()))
    error, argmax = logit_errors(llm, hf_model(path, 3))
    assert error <= ATOL and argmax
    assert any(1 in lens and max(lens) > 1 for lens in query_lens), "no step mixed decodes and prefills"
    assert max(map(len, PROMPTS)) > 16  # so some prompt was chunked


def test_correction_bias_chooses_experts_but_never_weighs_them() -> None:
    """V3's router: experts 0 and 1 get a large bias, so they are always chosen, with their plain
    sigmoid scores as weights (renormalised), not the biased ones."""
    config = DeepseekV2Config(
        hidden_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        topk_method="noaux_tc",
        n_group=2,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    gate = DeepseekV2Gate(config)
    gate.weight.copy_(torch.randn(8, 16))
    gate.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 0, 0, 0, 0, 0, 0]))
    x = torch.randn(5, 16)
    weights, ids = gate(x)
    assert (ids.sort(dim=-1).values == torch.tensor([0, 1])).all()
    scores = (x @ gate.weight.T).sigmoid().gather(1, ids)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) * 2.5)


def test_logit_check_catches_misused_correction_bias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The V3 comparison fails for a router that ignores the bias or also weighs experts by it."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    hf = hf_model(path, 3)
    llm = engine(path)
    for gate in (m for m in llm.model.modules() if isinstance(m, DeepseekV2Gate)):
        gate.e_score_correction_bias.zero_()  # the bug: choices without the bias
    assert logit_errors(llm, hf)[0] > 100 * ATOL
    real_forward = DeepseekV2Gate.forward

    def weighs_by_bias(self: DeepseekV2Gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = real_forward(self, x)
        return weights + self.e_score_correction_bias[ids] * self.routed_scaling_factor, ids

    monkeypatch.setattr(DeepseekV2Gate, "forward", weighs_by_bias)
    assert logit_errors(engine(path), hf)[0] > 100 * ATOL


def test_v2_lite_yarn_matches_transformers() -> None:
    """deepseek-v2-lite's YaRN (factor 40, mscale = mscale_all_dim = 0.707): transformers' frequencies
    and cos/sin, and its softmax scale, which mscale_all_dim raises 1.59 times."""
    ours = PRESETS["deepseek-v2-lite"]
    assert isinstance(ours, DeepseekV2Config)
    hf_config = transformers.DeepseekV2Config(
        **{
            k: getattr(ours, k)
            for k in (
                "hidden_size",
                "num_attention_heads",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "max_position_embeddings",
                "rope_scaling",
            )
        }
    )
    hf_rope = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2RotaryEmbedding(hf_config)
    # Ours are computed in float64, transformers' in float32: equal to float32's rounding.
    torch.testing.assert_close(
        rope_inv_freq(64, ours.rope_theta, ours.rope_scaling), hf_rope.inv_freq, rtol=2.5e-7, atol=0
    )
    positions = torch.tensor([0, 1, 100, 1000])  # farther on, that rounding grows into the angles
    freqs_cis = hf_rope(torch.zeros(1), positions[None])[0]  # complex: attention factor * e^(i angle)
    rope = RotaryEmbedding(64, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling, interleaved=True)
    torch.testing.assert_close(
        rope.cos_sin_cache[positions], torch.cat([freqs_cis.real, freqs_cis.imag], dim=-1), atol=2e-5, rtol=0
    )
    with torch.device("meta"):
        hf_attention = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention(hf_config, 0)
    assert ours.softmax_scale == pytest.approx(hf_attention.scaling, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(1.5895 * 192**-0.5, rel=1e-4)


def test_config_from_transformers_4_and_5(tmp_path: Path) -> None:
    """The same model read from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    path = write_hf_deepseek(tmp_path / "v2", rope_scaling=YARN, max_position_embeddings=256, rope_theta=5000.0)
    new = load_config(str(path))
    hf = json.loads((path / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    hf.update(rope_theta=rope.pop("rope_theta"), rope_scaling=dict(rope, type=rope.pop("rope_type")))
    (path / "config.json").write_text(json.dumps(hf))
    old = load_config(str(path))
    assert isinstance(new, DeepseekV2Config) and isinstance(old, DeepseekV2Config)
    assert (old.rope_theta, old.softmax_scale) == (new.rope_theta, new.softmax_scale) == (5000.0, new.softmax_scale)
    assert new.rope_scaling is not None and new.rope_scaling["factor"] == 4.0 and new.softmax_scale != 24**-0.5
    # What the engine reads off any model config: the cache holds one latent row (32 + 8) per token.
    assert (new.num_key_value_heads, new.head_dim, new.sliding_window, new.q_lora_rank) == (1, 40, None, None)


@pytest.mark.parametrize("spelling", ["theta_beside_rope_parameters", "rope_scaling_beside_rope_parameters"])
def test_rope_keys_are_read_as_transformers_reads_them(tmp_path: Path, spelling: str) -> None:
    """A `rope_theta` next to `rope_parameters` fills in the theta those lack; a `rope_scaling`
    (the older spelling) wins over `rope_parameters`. Either, ignored, moves every position."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, max_position_embeddings=256, **V3_GROUPS)
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    if spelling == "theta_beside_rope_parameters":
        edit_config_json(path, rope_parameters={k: v for k, v in rope.items() if k != "rope_theta"}, rope_theta=100.0)
        expected = (100.0, None)
    else:
        edit_config_json(
            path,
            rope_scaling={"type" if k == "rope_type" else k: v for k, v in YARN.items()},
            rope_theta=rope["rope_theta"],
        )
        expected = (rope["rope_theta"], "yarn")
    ours = load_config(str(path))
    assert isinstance(ours, DeepseekV2Config)
    assert (ours.rope_theta, ours.rope_scaling and ours.rope_scaling["type"]) == expected
    error, argmax = logit_errors(engine(path), hf_model(path, 3))
    assert error <= ATOL and argmax


def test_null_flags_read_as_false(tmp_path: Path) -> None:
    """`"rope_interleave": null` and `"norm_topk_prob": null` are False to transformers (`if config.flag`)."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"rope_interleave": None, "norm_topk_prob": None}))
    ours = load_config(str(path))
    assert isinstance(ours, DeepseekV2Config) and (ours.rope_interleave, ours.norm_topk_prob) == (False, False)
    error, argmax = logit_errors(engine(path), hf_model(path, 3))
    assert error <= ATOL and argmax


def test_null_shared_experts_mean_none(tmp_path: Path) -> None:
    """`"n_shared_experts": null` is "no shared experts" to DeepSeek's own code (`if config.n_shared_experts
    is not None`); transformers refuses the null, so the reference is its model with n_shared_experts=0."""
    path = write_hf_deepseek(tmp_path / "v2", n_shared_experts=0)
    reference = hf_model(path, 2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"n_shared_experts": None}))
    assert load_config(str(path)).n_shared_experts == 0
    error, argmax = logit_errors(engine(path), reference)
    assert error <= ATOL and argmax


def test_null_expert_groups_are_named_as_null() -> None:
    """A V3 config.json with null groups is refused naming the nulls, not V3's defaults (8, 4) that a
    key left out would mean: DeepSeek's own router cannot run without groups either."""
    with pytest.raises(ValueError, match=r"got n_group=None, topk_group=None"):
        DeepseekV2Config.from_hf_dict(
            dict(n_routed_experts=4, num_experts_per_tok=1, n_group=None, topk_group=None), "deepseek_v3"
        )


def test_multi_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    """DeepSeek-V3's checkpoints store the MTP module after the last layer (hub: model.layers.61.*):
    loaded like transformers, which drops it; a tensor of a layer past it is still an error."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    edit_config_json(path, num_nextn_predict_layers=1)
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    mtp = {
        name.replace("model.layers.2.", "model.layers.3."): t.clone()
        for name, t in tensors.items()
        if name.startswith("model.layers.2.")
    }
    mtp |= {
        "model.layers.3.eh_proj.weight": torch.randn(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.hnorm.weight": torch.ones(64),
        "model.layers.3.shared_head.norm.weight": torch.ones(64),
    }
    save_file(tensors | mtp, weights_file)
    error, argmax = logit_errors(engine(path), hf_model(path, 3))
    assert error <= ATOL and argmax
    save_file(tensors | mtp | {"model.layers.4.enorm.weight": torch.ones(64)}, weights_file)
    with pytest.raises(ValueError, match=r"'model\.layers\.4\.enorm\.weight' has no matching parameter"):
        engine(path)


def test_router_stays_float32_in_bfloat16(tmp_path: Path) -> None:
    """As transformers keeps them: the router's weight and correction bias are not rounded to bf16."""
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    tensors = load_file(path / "model.safetensors")
    llm = LLM(str(path), device="cpu", dtype="bfloat16", num_kv_blocks=16, block_size=4)
    gates = {name: m for name, m in llm.model.named_modules() if isinstance(m, DeepseekV2Gate)}
    assert len(gates) == 2 and llm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, gate in gates.items():
        assert torch.equal(gate.weight, tensors[f"{name}.weight"])  # float32, every bit
        assert torch.equal(gate.e_score_correction_bias, tensors[f"{name}.e_score_correction_bias"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(topk_method="noaux_tc", n_group=2, topk_group=1), "'noaux_tc' is DeepSeek-V3's router"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2: every layer from first_k_dense_replace on is a MoE layer"),
    ],
)
def test_v2_configs_this_model_cannot_serve_are_refused(tmp_path: Path, changes: dict, message: str) -> None:
    path = write_hf_deepseek(tmp_path / "v2")
    edit_config_json(path, **changes)
    with pytest.raises(NotImplementedError, match=message):
        load_config(str(path))


def test_v3_groups_of_one_expert_are_refused() -> None:
    message = r"two best experts: n_group=4 leaves 1 of the 4 experts per group; use n_group <= 2"
    with pytest.raises(ValueError, match=message):
        DeepseekV2Config.from_hf_dict(
            dict(n_routed_experts=4, num_experts_per_tok=1, n_group=4, topk_group=1), "deepseek_v3"
        )


def test_v3_more_picks_than_kept_experts_is_refused() -> None:
    """noaux_tc masks dropped groups to -inf but weighs by the unmasked scores: picks past the kept
    experts would be arbitrary experts with real weights."""
    message = (
        r"num_experts_per_tok \(3\) exceeds the experts of the topk_group \(1\) groups .* use num_experts_per_tok <= 2"
    )
    with pytest.raises(ValueError, match=message):
        DeepseekV2Config.from_hf_dict(
            dict(n_routed_experts=4, num_experts_per_tok=3, n_group=2, topk_group=1, topk_method="noaux_tc"),
            "deepseek_v3",
        )


def test_v2_norm_topk_prob_is_refused(tmp_path: Path) -> None:
    path = write_hf_deepseek(tmp_path / "v2", norm_topk_prob=True)
    with pytest.raises(NotImplementedError, match="norm_topk_prob=true: transformers ignores the flag"):
        load_config(str(path))


def test_checkpoint_missing_or_unknown_tensor_is_named(tmp_path: Path) -> None:
    path = write_hf_deepseek(tmp_path / "v3", version=3, **V3_GROUPS)
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    bias = tensors.pop("model.layers.2.mlp.gate.e_score_correction_bias")
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match=r"missing 1 tensors, e\.g\. \['model\.layers\.2\.mlp\.gate\.e_score_corr"):
        engine(path)
    tensors["model.layers.2.mlp.gate.e_score_correction_bias"] = bias
    tensors["model.layers.2.mlp.experts.4.up_proj.weight"] = torch.zeros(32, 64)  # there are 4 experts
    save_file(tensors, weights_file)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.2\.mlp\.experts\.4\.up_proj\.weight' has no matching "
        r"parameter in DeepseekV3ForCausalLM",
    ):
        engine(path)


def test_tensor_parallel_is_refused_by_name() -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"tensor_parallel_size=2: DeepseekV2ForCausalLM models run on "
        r"one rank only",
    ):
        LLM("tiny-mla", device="cpu", tensor_parallel_size=2)


def test_tiny_mla_preset_depends_on_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Like the tiny presets, tiny-mla's weights let attention decide the greedy tokens."""
    prompts = ["Hello", "def f(x):", "pagedkv"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def continuations() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in LLM("tiny-mla", device="cpu").generate(prompts, params)]

    normal = continuations()
    monkeypatch.setattr(
        MLAAttention,
        "forward",
        lambda self, q, kv_c_normed, k_pe: q.new_zeros(q.shape[0], self.num_heads * self.mla_dims.v_head_dim),
    )
    blind = continuations()
    assert all(a != b for a, b in zip(normal, blind))
