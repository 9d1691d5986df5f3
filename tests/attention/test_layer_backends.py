"""`LLM(layer_attention_backends=...)`: one layer on another backend, inside the same KV cache group.

Layers with equal KV cache specs share a KV cache group; inside it, layers on different backend
classes get separate attention groups, hence separate builders and metadata objects each step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.selector import register_backend, unregister_backend

LAYER = "model.layers.{}.self_attn.attn"
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class TwinBackend(TorchRefBackend):
    """TORCH_REF's kernels under another name: a different backend class, so its own attention group."""

    @staticmethod
    def get_name() -> str:
        return "TORCH_REF_TWIN"


@pytest.fixture
def twin() -> Iterator[str]:
    register_backend(TwinBackend)
    yield TwinBackend.get_name()
    unregister_backend(TwinBackend.get_name())


def engine(**kwargs: object) -> LLM:
    return LLM("tiny-hybrid", device="cpu", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, **kwargs)


def test_two_attention_groups_in_one_kv_cache_group(twin: str) -> None:
    llm = engine(layer_attention_backends={LAYER.format(3): twin})
    assert llm.runner.attn_layers[LAYER.format(3)].attn_backend is TwinBackend
    assert llm.runner.attn_layers[LAYER.format(1)].attn_backend is TorchRefBackend
    # tiny-hybrid: layers 0, 2 sliding (group 0), layers 1, 3 full (group 1); layer 3 leaves 1's attention group.
    groups = [[(g.backend.get_name(), g.layer_names) for g in groups] for groups in llm.runner.attn_groups]
    assert groups == [
        [("TORCH_REF", [LAYER.format(0), LAYER.format(2)])],
        [("TORCH_REF", [LAYER.format(1)]), (twin, [LAYER.format(3)])],
    ]
    metadata = []
    llm.add_step_listener(lambda event: metadata.append(event.result.attn_metadata))
    reference = engine().generate(["paged attention"], PARAMS)[0].outputs[0].token_ids
    assert llm.generate(["paged attention"], PARAMS)[0].outputs[0].token_ids == reference  # same kernels
    for step in metadata:
        assert step[LAYER.format(0)] is step[LAYER.format(2)]  # one build for the sliding group
        assert step[LAYER.format(1)] is not step[LAYER.format(3)]  # two builds in the full group


def test_layer_attention_backends_errors(twin: str) -> None:
    with pytest.raises(TypeError, match="layer_attention_backends must map layer names"):
        engine(layer_attention_backends=[LAYER.format(3)])
    with pytest.raises(ValueError, match=r"names no attention layer \['layers.3'\]"):
        engine(layer_attention_backends={"layers.3": twin})
    with pytest.raises(ValueError, match="Unknown attention backend 'NOPE'"):
        engine(layer_attention_backends={LAYER.format(3): "NOPE"})
