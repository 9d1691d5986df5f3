"""Compilation and CUDA graph edges no model or runner path reaches today, checked against the
lowering rules of pagedkv/compilation/resolve.py and hand-worked cases: lowering logs, the compiled-piece key, decode graphs
of several tokens, attention groups by query-head count, what counts as split piecewise, and
lookups of unknown layer names."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx

from pagedkv.attention import Attention
from pagedkv.attention.backend import AttentionCGSupport as S
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.config import CUDAGraphMode as M
from pagedkv.compilation import resolve_cudagraph_mode
from pagedkv.compilation.split import structure_key
from pagedkv.config import EngineConfig, ModelConfig, set_current_engine_config
from pagedkv.forward_context import BatchDescriptor as D
from pagedkv.kv_cache.spec import get_kv_cache_config
from pagedkv.worker import cudagraph
from pagedkv.worker.attn_utils import init_attn_groups


# ---- resolve.py -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_no_full_graphs_without_split_lowers_straight_to_none(caplog: pytest.LogCaptureFixture, mode: M) -> None:
    """Rule 3 of pagedkv/compilation/resolve.py: support NEVER, decode FULL -> "PIECEWISE if attention is
    compiled piecewise, else NONE". Not split: one change, announced once, FULL... -> NONE; the
    log must not claim a PIECEWISE mode the engine can never run."""
    caplog.set_level(logging.WARNING, logger="pagedkv")
    resolved = resolve_cudagraph_mode(mode, S.NEVER, backend_name="TORCH_REF", attention_compiled_piecewise=False)
    assert resolved is M.NONE
    messages = [r.getMessage() for r in caplog.records if r.name == "pagedkv"]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        f"CUDAGraphMode.{mode.name} is not supported with TORCH_REF backend (support: NEVER); "
        "setting cudagraph_mode=NONE"
    )


# ---- split.py: structure_key ------------------------------------------------------------------


def test_structure_key_tells_apart_pieces_that_differ_only_in_wiring() -> None:
    """Two pieces with the same ops but different argument wiring (x - y vs y - x) must not share
    one compiled callable: the backend would run the first one's code for both."""
    a, b = fx.symbolic_trace(lambda x, y: x - y), fx.symbolic_trace(lambda x, y: y - x)
    args = (torch.randn(4, 3), torch.randn(4, 3))
    assert structure_key(a, args) != structure_key(b, args)
    assert structure_key(a, args) == structure_key(fx.symbolic_trace(lambda x, y: x - y), args)


def test_structure_key_tells_apart_inputs_of_other_strides() -> None:
    """Inductor specialises on strides: a piece compiled for contiguous inputs must not be reused
    for a transposed input of the same shape."""
    g = fx.symbolic_trace(lambda x: x * 2)
    contiguous, transposed = torch.randn(4, 6), torch.randn(6, 4).t()
    assert contiguous.shape == transposed.shape
    assert structure_key(g, (contiguous,)) != structure_key(g, (transposed,))


# ---- cudagraph.py: the dispatcher with speculative decode -------------------------------------


def test_decode_graphs_cover_max_num_seqs_requests_of_several_tokens() -> None:
    """Decode steps of 2 query tokens, at most 4 requests: decode FULL graphs for 2..8 tokens
    (4 requests x 2 tokens), worked by hand; 8 tokens of uniform decode replays FULL."""
    dispatcher = cudagraph.CudagraphDispatcher(M.FULL_DECODE_ONLY, [1, 2, 4, 8, 16], max_num_seqs=4,
                                               uniform_decode_query_len=2)
    decode = sorted(k.num_tokens for mode, k in dispatcher.captures() if k.uniform_decode)
    assert decode == [2, 4, 8]
    assert dispatcher.dispatch(7, True) == (M.FULL, D(8, True))
    assert dispatcher.dispatch(16, True) == (M.NONE, D(16, True))


# ---- attn_utils.py: attention groups ----------------------------------------------------------


def test_layers_with_other_query_head_counts_get_their_own_group() -> None:
    """Attention groups as vllm/v1/worker/gpu_model_runner.py forms them: layers with the same backend, the same KV cache spec and the same number
    of query heads form one attention group; a different query-head count (same KV heads, so the
    same spec and KV cache group) gets its own group and builder."""
    cfg = EngineConfig(ModelConfig(model="test"))
    with set_current_engine_config(cfg):
        layers = {
            "model.layers.0.attn": Attention(4, 8, 0.35, 2, prefix="model.layers.0.attn", attn_backend=TorchRefBackend),
            "model.layers.1.attn": Attention(8, 8, 0.35, 2, prefix="model.layers.1.attn", attn_backend=TorchRefBackend),
            "model.layers.2.attn": Attention(4, 8, 0.35, 2, prefix="model.layers.2.attn", attn_backend=TorchRefBackend),
        }
    specs = {name: layer.get_kv_cache_spec() for name, layer in layers.items()}
    kv_config = get_kv_cache_config(specs, num_blocks=8)
    assert len(kv_config.kv_cache_groups) == 1  # one spec: one KV cache group
    (groups,) = init_attn_groups(layers, kv_config, cfg, torch.device("cpu"))
    got = sorted((g.num_heads, tuple(g.layer_names)) for g in groups)
    assert got == [(4, ("model.layers.0.attn", "model.layers.2.attn")), (8, ("model.layers.1.attn",))]
    assert groups[0].metadata_builder is not groups[1].metadata_builder


# ---- wrapper.py: when piecewise graphs exist --------------------------------------------------


def test_piecewise_needs_the_cache_write_split_out_too() -> None:
    """Splitting at every attention op but `unified_kv_cache_update` leaves the cache write inside
    a compiled piece: a piecewise graph would freeze the capture's slot mapping, so attention is
    not "compiled piecewise" and FULL_AND_PIECEWISE lowers to FULL_DECODE_ONLY."""
    from pagedkv.compilation import attention_compiled_piecewise
    from pagedkv.compilation.wrapper import ATTENTION_OPS
    from pagedkv.config import CompilationConfig

    everything = CompilationConfig(compile=True, splitting_ops=list(ATTENTION_OPS))
    assert attention_compiled_piecewise(everything)
    for left_out in ("pagedkv::unified_kv_cache_update", "pagedkv::unified_mla_kv_cache_update"):
        ops = [op for op in everything.splitting_ops if op != left_out]
        assert not attention_compiled_piecewise(CompilationConfig(compile=True, splitting_ops=ops)), left_out
    assert not attention_compiled_piecewise(CompilationConfig(compile=False, splitting_ops=list(ATTENTION_OPS)))


# ---- the custom ops' lookups (attention/ops.py: get_attention_context) ------------------------


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
    with set_forward_context({"other": 1}, cfg), pytest.raises(
        KeyError, match="The forward context has no attention metadata for layer 'm.0.attn' \\(it has 1 entries\\)"
    ):
        get_attention_context("m.0.attn")


def test_lookups_take_a_list_of_per_micro_batch_dicts_and_refuse_other_metadata() -> None:
    """Dual-batch overlap (and speculative decoding) hand the ops a list of per-ubatch dicts:
    index 0 is the one (vllm/model_executor/layers/attention/attention.py:713). Anything else
    but a dict or None is refused in one line, a string without its characters counted."""
    from pagedkv.attention import get_attention_context
    from pagedkv.forward_context import set_forward_context

    cfg = EngineConfig(ModelConfig(model="test"))
    with set_current_engine_config(cfg):
        layer = Attention(2, 4, 0.5, prefix="m.0.attn")
    with set_forward_context([{"m.0.attn": "UBATCH0"}, {"m.0.attn": "UBATCH1"}], cfg):  # type: ignore[arg-type]
        assert get_attention_context("m.0.attn")[:2] == ("UBATCH0", layer)
    with set_forward_context([{"other": 1}], cfg), pytest.raises(  # type: ignore[arg-type]
        KeyError, match="no attention metadata for layer 'm.0.attn' \\(it has 1 entries\\)"
    ):
        get_attention_context("m.0.attn")
    for metadata, kind in (("m.0.attn", "str"), (("m.0.attn",), "tuple"), ([], "list")):
        with set_forward_context(metadata, cfg), pytest.raises(TypeError) as info:  # type: ignore[arg-type]
            get_attention_context("m.0.attn")
        message = str(info.value)
        assert "\n" not in message and "entries" not in message
        assert (f"got a {kind}." in message) if kind != "list" else ("empty list" in message)
