"""Forward context, layer registration by name, custom ops, KV sharing validation."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import Attention, get_attention_context
from pagedkv.config import EngineConfig, ModelConfig, set_current_engine_config
from pagedkv.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)


@pytest.fixture
def config() -> EngineConfig:
    cfg = EngineConfig(ModelConfig(model="test"))
    with set_current_engine_config(cfg):
        yield cfg


def test_get_outside_context_fails_with_hint() -> None:
    with pytest.raises(RuntimeError, match=r"Forward context is not set\. Please use `set_forward_context`"):
        get_forward_context()


def test_set_restores_previous_context(config: EngineConfig) -> None:
    assert not is_forward_context_available()
    with set_forward_context({"a": 1}, config, batch_descriptor=BatchDescriptor(4)) as outer:
        assert get_forward_context() is outer
        assert outer.no_compile_layers is config.compilation_config.static_forward_context
        with set_forward_context({"b": 2}, config) as inner:
            assert get_forward_context().attn_metadata == {"b": 2}
        assert get_forward_context() is outer
        with pytest.raises(KeyError), set_forward_context(None, config):
            raise KeyError("boom")  # an exception inside still restores
        assert get_forward_context() is outer
    assert inner is not outer and not is_forward_context_available()


def test_layer_registers_by_name_and_rejects_duplicates(config: EngineConfig) -> None:
    layer = Attention(4, 8, 0.35, 2, prefix="model.layers.0.self_attn.attn")
    assert config.compilation_config.static_forward_context["model.layers.0.self_attn.attn"] is layer
    assert layer.kv_cache.numel() == 0  # placeholder until bound
    with pytest.raises(ValueError, match=r"^Duplicate layer name: model.layers.0.self_attn.attn$"):
        Attention(4, 8, 0.35, 2, prefix="model.layers.0.self_attn.attn")


def test_heads_must_divide(config: EngineConfig) -> None:
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"):
        Attention(6, 8, 0.35, 4, prefix="x.0.attn")


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((4, 16, 0.25, 0), {}, ValueError, r"num_kv_heads must be an int >= 1, got 0"),  # was a ZeroDivisionError
        ((-4, 16, 0.25), {}, ValueError, r"num_heads must be an int >= 1, got -4"),  # was accepted
        (("4", 16, 0.25), {}, TypeError, r"num_heads must be an int, got '4' \(str\)"),
        ((4, 12.5, 0.25), {}, TypeError, r"head_size must be an int, got 12.5 \(float\)"),
        ((4, True, 0.25), {}, TypeError, r"head_size must be an int, got True \(bool\)"),
        ((4, 16, 0.25), dict(sliding_window=-5), ValueError, r"sliding_window must be an int >= 1, got -5"),
    ],
)
def test_sizes_must_be_positive_ints(
    config: EngineConfig, args: tuple, kwargs: dict, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^Attention layer 'x\.0\.attn': " + message):
        Attention(*args, prefix="x.0.attn", **kwargs)


def test_kv_sharing_errors(config: EngineConfig) -> None:
    Attention(4, 8, 0.35, prefix="model.layers.0.attn")
    config.compilation_config.static_forward_context["model.layers.1.mlp"] = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="must come before the current layer"):
        Attention(4, 8, 0.35, prefix="model.layers.2.attn", kv_sharing_target_layer_name="model.layers.5.attn")
    with pytest.raises(ValueError, match="is not a valid Attention layer in the model"):
        Attention(4, 8, 0.35, prefix="model.layers.3.attn", kv_sharing_target_layer_name="model.layers.1.attn")
    with pytest.raises(ValueError, match="is not a valid Attention layer in the model"):
        Attention(4, 8, 0.35, prefix="model.layers.3.attn", kv_sharing_target_layer_name="model.layers.1.mlp")

    class OtherAttention(Attention):
        pass

    with pytest.raises(ValueError, match="must be the same type as the current layer"):
        OtherAttention(4, 8, 0.35, prefix="model.layers.4.attn", kv_sharing_target_layer_name="model.layers.0.attn")
    shared = Attention(4, 8, 0.35, prefix="model.layers.6.attn", kv_sharing_target_layer_name="model.layers.0.attn")
    assert shared.get_kv_cache_spec() is None


def test_custom_ops_are_registered() -> None:
    assert hasattr(torch.ops.pagedkv, "unified_kv_cache_update")
    assert hasattr(torch.ops.pagedkv, "unified_attention_with_output")
    # The fake (meta) implementations let torch.compile trace shapes without running attention.
    q = torch.empty(3, 4, 8, device="meta")
    dep = torch.ops.pagedkv.unified_kv_cache_update(q, q, "nowhere")
    assert dep.shape == (0,) and dep.device.type == "meta"


def test_attention_context_resolves_name(config: EngineConfig) -> None:
    layer = Attention(2, 4, 0.5, prefix="m.0.attn")
    cache = torch.zeros(2, 3, 4, 2, 4)
    layer.bind_kv_cache(cache)
    slots = torch.tensor([0, 1])
    with set_forward_context({"m.0.attn": "META"}, config, slot_mapping={"m.0.attn": slots}):
        assert get_attention_context("m.0.attn") == ("META", layer, cache, slots)
    with set_forward_context(None, config):  # profile run: no metadata, no slots
        metadata, _, _, slot_mapping = get_attention_context("m.0.attn")
        assert metadata is None and slot_mapping is None
        out = layer(torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8))
        assert torch.equal(out, torch.zeros(5, 8))  # the profile run fills zeros
    assert cache.abs().sum() == 0  # and writes nothing


def test_opaque_op_and_direct_call_agree() -> None:
    from pagedkv import LLM, SamplingParams

    def tokens(opaque: bool) -> list[int]:
        llm = LLM("tiny", device="cpu", num_kv_blocks=32)
        assert all(not layer.use_direct_call for layer in llm.runner.attn_layers.values())  # CPU: opaque ops
        for layer in llm.runner.attn_layers.values():
            layer.use_direct_call = not opaque
        out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=5))
        return out[0].outputs[0].token_ids

    assert tokens(opaque=False) == tokens(opaque=True)


def test_model_outside_forward_context_fails() -> None:
    from pagedkv import LLM

    llm = LLM("tiny", device="cpu", num_kv_blocks=8)
    with pytest.raises(RuntimeError, match="Forward context is not set"):
        llm.model(torch.tensor([1, 2]), torch.tensor([0, 1]))


def test_lookups_of_unknown_names_explain_themselves() -> None:
    """An op naming an unregistered layer, or a registered layer without this step's metadata,
    fails with the message that says which table lacks it (not a bare KeyError('name'))."""
    from pagedkv.attention import get_attention_context
    from pagedkv.forward_context import set_forward_context

    cfg = EngineConfig(ModelConfig(model="test"))
    with set_current_engine_config(cfg):
        Attention(2, 4, 0.5, prefix="m.0.attn")
    with set_forward_context(None, cfg), pytest.raises(KeyError, match="No layer named 'm.9.attn' is registered"):
        get_attention_context("m.9.attn")
    with set_forward_context({"other": 1}, cfg), pytest.raises(KeyError, match="No layer named 'm.9.attn'"):
        get_attention_context("m.9.attn")
    with (
        set_forward_context({"other": 1}, cfg),
        pytest.raises(
            KeyError, match="The forward context has no attention metadata for layer 'm.0.attn' \\(it has 1 entries\\)"
        ),
    ):
        get_attention_context("m.0.attn")


def test_lookups_take_a_list_of_per_micro_batch_dicts() -> None:
    """Dual-batch overlap (and speculative decoding) hand the ops a list of per-ubatch dicts:
    index 0 is the one (vllm/model_executor/layers/attention/attention.py:713)."""
    cfg = EngineConfig(ModelConfig(model="test"))
    with set_current_engine_config(cfg):
        layer = Attention(2, 4, 0.5, prefix="m.0.attn")
    with set_forward_context([{"m.0.attn": "UBATCH0"}, {"m.0.attn": "UBATCH1"}], cfg) as context:
        assert context.attn_metadata == [{"m.0.attn": "UBATCH0"}, {"m.0.attn": "UBATCH1"}]
        assert get_attention_context("m.0.attn")[:2] == ("UBATCH0", layer)
    with (
        set_forward_context([{"other": 1}], cfg),
        pytest.raises(KeyError, match="no attention metadata for layer 'm.0.attn' \\(it has 1 entries\\)"),
    ):
        get_attention_context("m.0.attn")


@pytest.mark.parametrize(
    ("slot_mapping", "got"),
    [([torch.tensor([3, 4])], "list"), (torch.tensor([3, 4]), "Tensor"), ((), "tuple")],
)
def test_a_slot_mapping_that_is_no_dict_is_refused_when_the_context_is_set(
    config: EngineConfig, slot_mapping: object, got: str
) -> None:
    """One slot mapping per layer name, as vLLM asserts in get_attention_context; a bare list or
    tensor used to pass and fail later, inside the op, as "AttributeError: ... has no attribute 'get'"."""
    expected = rf"^Expected slot_mapping to be a dict \(layer name -> slots\), got {got}\.$"
    with pytest.raises(TypeError, match=expected), set_forward_context(None, config, slot_mapping=slot_mapping):
        pytest.fail("a context with this slot mapping was installed")
    assert not is_forward_context_available()


@pytest.mark.parametrize(
    ("metadata", "got"),
    [
        ("m.0.attn", "got str"),
        (("m.0.attn",), "got tuple"),
        ([], "got an empty list"),
        ([{"m.0.attn": 1}, "m.0.attn"], "got a list holding str"),
    ],
)
def test_metadata_other_than_a_dict_a_list_of_dicts_or_none_is_refused(
    config: EngineConfig, metadata: object, got: str
) -> None:
    expected = (
        r"^Expected attn_metadata to be a dict \(layer name -> metadata\), a non-empty list of such dicts or None, "
        + got
        + r"\.$"
    )
    with pytest.raises(TypeError, match=expected), set_forward_context(metadata, config):
        pytest.fail("a context with this metadata was installed")
    assert not is_forward_context_available()
