"""The model runner's start-up and KV cache plumbing: kernel-block views, the profile run,
memory-based sizing, kernel block size selection and KV sharing at run time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import pagedkv.models.llama as llama
from pagedkv import LLM, SamplingParams
from pagedkv.attention.backend import AttentionBackend, AttentionType, MultipleOf
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.layer import Attention
from pagedkv.attention.selector import register_backend, unregister_backend
from pagedkv.config import EngineConfig, ModelConfig, set_current_engine_config
from pagedkv.kv_cache.spec import get_kv_cache_config
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.loader import PRESETS
from pagedkv.worker.attn_utils import init_attn_groups, select_kernel_block_size
from pagedkv.worker.input_batch import ScheduledTokens
from pagedkv.worker.memory import CPU_DEFAULT_KV_CACHE_BYTES
from pagedkv.worker.model_runner import ModelRunner
from tests.conftest import needs_triton_on_cpu

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _reads(
    name: str, sizes: list[int | MultipleOf], base: type[AttentionBackend] = TorchRefBackend
) -> type[AttentionBackend]:
    """A subclass of `base` whose kernel claims to read pages of `sizes` only."""
    return type(
        name,
        (base,),
        {
            "get_name": staticmethod(lambda: name),
            "get_supported_kernel_block_sizes": staticmethod(lambda: list(sizes)),
        },
    )


@pytest.fixture
def registered() -> Iterator[Callable[[type[AttentionBackend]], str]]:
    """Register backends for one test; unregister them afterwards."""
    names: list[str] = []

    def register(backend: type[AttentionBackend]) -> str:
        register_backend(backend)
        names.append(backend.get_name())
        return backend.get_name()

    yield register
    for name in names:
        unregister_backend(name)


def _logits_per_step(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[torch.Tensor]:
    """The logits of every step of `generate` (rows: the requests that sampled)."""
    steps: list[torch.Tensor] = []
    detach = llm.add_step_listener(lambda event: steps.append(event.result.logits.clone()))
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    detach()
    return steps


# ---- kernel blocks smaller than the manager's blocks ----------------------------------------

PROMPTS = [list(range(1, 90)), list(range(100, 131)), [7, 8, 9]]


@pytest.mark.parametrize(
    ("model", "block_size", "kernel_block_size"),
    [("tiny", 64, 16), ("tiny", 32, 16), ("tiny", 32, 8), ("tiny-hybrid", 32, 8)],
)
def test_kernel_blocks_read_the_same_cache_as_manager_blocks(
    registered, model: str, block_size: int, kernel_block_size: int
) -> None:
    """A backend reading smaller pages gets the same logits as TORCH_REF on whole blocks."""
    name = registered(_reads(f"READS_{kernel_block_size}_TEST", [kernel_block_size]))
    kwargs = dict(device="cpu", block_size=block_size, num_kv_blocks=12, max_num_batched_tokens=48)
    llm = LLM(model, attention_backend=name, **kwargs)
    k = block_size // kernel_block_size
    for layer in llm.runner.attn_layers.values():
        assert tuple(layer.kv_cache.shape[:3]) == (2, 12 * k, kernel_block_size)
    for groups, group_spec in zip(llm.runner.attn_groups, llm.runner.kv_cache_config.kv_cache_groups, strict=True):
        assert group_spec.kv_cache_spec.block_size == block_size  # the manager keeps its blocks
        for group in groups:
            assert group.metadata_builder is not None
            assert group.metadata_builder.kv_cache_spec.block_size == kernel_block_size
    ours = _logits_per_step(llm, PROMPTS)
    ref = _logits_per_step(LLM(model, attention_backend="TORCH_REF", **kwargs), PROMPTS)
    assert len(ours) == len(ref) > 4  # chunked prefill steps, then decodes
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@needs_triton_on_cpu("TRITON_ATTN")
def test_triton_kernel_reads_kernel_blocks(registered) -> None:
    pytest.importorskip("triton")
    from pagedkv.attention.backends.triton_attn import TritonAttentionBackend

    name = registered(_reads("TRITON_READS_16_TEST", [16], TritonAttentionBackend))
    kwargs = dict(device="cpu", block_size=32, num_kv_blocks=8)
    prompts = [list(range(1, 40)), [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=2)
    ours = _logits_per_step(LLM("tiny", attention_backend=name, **kwargs), prompts, params)
    ref = _logits_per_step(LLM("tiny", attention_backend="TORCH_REF", **kwargs), prompts, params)
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_select_kernel_block_size() -> None:
    exact, multiple = _reads("EXACT", [16, 32]), _reads("MULTIPLE", [MultipleOf(16)])
    assert select_kernel_block_size([exact], 32) == 32  # exact match
    assert select_kernel_block_size([multiple], 48) == 48  # a multiple of 16 is read as it is
    assert select_kernel_block_size([exact], 64) == 32  # the largest exact size dividing 64
    assert select_kernel_block_size([exact], 48) == 16
    assert select_kernel_block_size([_reads("ODD", [8, 24, 32])], 48) == 24
    # Backends sharing a KV cache group agree on one size that all of them read.
    assert select_kernel_block_size([multiple, exact], 64) == 32
    assert select_kernel_block_size([exact, _reads("SMALL", [16])], 64) == 16
    with pytest.raises(ValueError) as err:
        select_kernel_block_size([_reads("READS_24", [24])], 64)
    assert str(err.value) == (
        "No kernel block size divides block_size=64 and is read by every backend of the KV cache group "
        "(READS_24 reads [24]); choose a block_size that is a multiple of a size they all read."
    )
    with pytest.raises(ValueError, match=r"READS_24 reads \[24\]; MULTIPLE reads \[MultipleOf\(base=16\)\]"):
        select_kernel_block_size([_reads("READS_24", [24]), multiple], 48)


# ---- the profile run and memory-based sizing --------------------------------------------------


def test_profile_run_outputs_zeros_and_writes_no_cache() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=8, max_num_batched_tokens=24, max_num_seqs=3)
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(lambda m, args, out, name=name: outputs.__setitem__(name, out.clone()))
        for name, layer in llm.runner.attn_layers.items()
    ]
    llm.runner.profile_run()
    for hook in hooks:
        hook.remove()
    assert set(outputs) == set(llm.runner.attn_layers)
    for out in outputs.values():
        assert out.shape == (24, PRESETS["tiny"].hidden_size) and not out.any()
    assert all(not cache.any() for cache in llm.runner.kv_caches.values())
    # A real step, by contrast, writes the cache (so the check above can see a write).
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1))
    assert all(cache.any() for cache in llm.runner.kv_caches.values())


def _bytes_per_block(block_size: int, model: str = "tiny") -> int:
    """K and V of `block_size` float32 tokens, in every layer of a preset."""
    cfg = PRESETS[model]
    assert cfg.num_key_value_heads is not None and cfg.head_dim is not None
    return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers


@pytest.mark.parametrize(("model", "block_size"), [("tiny", 16), ("tiny-hybrid", 8)])
def test_cache_sized_from_an_explicit_memory_budget(monkeypatch, model: str, block_size: int) -> None:
    profiled: list[int] = []
    real_profile = ModelRunner.profile_run
    monkeypatch.setattr(ModelRunner, "profile_run", lambda self: profiled.append(1) or real_profile(self))
    budget = 1_000_003
    # Two requests of 64 tokens would need far fewer blocks: an explicit budget is not capped.
    llm = LLM(model, device="cpu", block_size=block_size, kv_cache_memory=budget, max_num_seqs=2, max_model_len=64)
    assert profiled == [1]
    num_blocks = budget // _bytes_per_block(block_size, model)
    assert num_blocks > 2 * 64 // block_size + 1
    assert llm.runner.kv_cache_config.num_blocks == num_blocks
    assert all(cache.shape[1] == num_blocks for cache in llm.runner.kv_caches.values())
    assert sum(c.numel() * c.element_size() for c in llm.runner.kv_caches.values()) <= budget
    LLM(model, device="cpu", num_kv_blocks=5)
    assert profiled == [1], "an explicit num_kv_blocks needs no profile run"


def test_cpu_default_budget_and_its_cap() -> None:
    llm = LLM("tiny", device="cpu", block_size=16)
    assert llm.runner.kv_cache_config.num_blocks == CPU_DEFAULT_KV_CACHE_BYTES // _bytes_per_block(16)
    # 2 requests of at most 100 tokens need 2 * 7 blocks of 16, plus the null block.
    small = LLM("tiny", device="cpu", block_size=16, max_num_seqs=2, max_model_len=100)
    assert small.runner.kv_cache_config.num_blocks == 2 * 7 + 1
    with pytest.raises(ValueError, match=r"would hold 1 blocks of \d+ bytes .*; at least 2 are needed"):
        LLM("tiny", device="cpu", kv_cache_memory=_bytes_per_block(16) * 2 - 1)


# ---- KV sharing at run time ----------------------------------------------------------------------

SHARED = "model.layers.3.self_attn.attn"
TARGET = "model.layers.1.self_attn.attn"


def _sharing_attention(targets: dict[str, str]) -> Callable[..., Attention]:
    """Stands in for `Attention` in llama.py: layers named in `targets` reuse another's cache."""

    def make(*args: Any, prefix: str, **kwargs: Any) -> Attention:
        return Attention(*args, prefix=prefix, kv_sharing_target_layer_name=targets.get(prefix), **kwargs)

    return make


def _randomize(model: torch.nn.Module, std: float = 0.2) -> None:
    """Wide weights, so that attention (and so which K/V a layer reads) moves the logits a lot."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def dense_logits(model: LlamaForCausalLM, token_ids: list[int], shares: dict[int, int]) -> torch.Tensor:
    """Float64 logits at every position of one sequence, from the model's weights alone:
    no cache, no paging. Layer i in `shares` attends with the keys/values of layer shares[i]."""
    cfg = model.config
    assert cfg.num_key_value_heads is not None and cfg.head_dim is not None
    w = {name: p.detach().double() for name, p in model.named_parameters()}
    heads, kv_heads, dim, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(token_ids)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    inv_freq = cfg.rope_theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq  # [n, dim / 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [n, heads, dim], rotate-half layout
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"]) @ w[p + "self_attn.qkv_proj.weight"].T
        q, k, v = h.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        kv[i] = (rope(k.view(n, kv_heads, dim)), v.view(n, kv_heads, dim))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in kv[shares.get(i, i)])
        scores = torch.einsum("qhd,khd->hqk", rope(q.view(n, heads, dim)), k) * dim**-0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        gate, up = (norm(x, w[p + "post_attention_layernorm.weight"]) @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ model.lm_head.weight.detach().double().T


def test_kv_sharing_layer_reads_its_targets_cache(monkeypatch) -> None:
    """Layer 3 attends with layer 1's keys and values: the engine's logits match a dense float64
    model wired that way, and differ from the same model without sharing."""
    monkeypatch.setattr(llama, "Attention", _sharing_attention({SHARED: TARGET}))
    llm = LLM("tiny", device="cpu", block_size=8, num_kv_blocks=24, max_num_batched_tokens=16)
    _randomize(llm.model)
    runner = llm.runner
    assert [g.layer_names for g in runner.kv_cache_config.kv_cache_groups] == [
        [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2)]
    ]
    assert runner.attn_layers[SHARED].kv_cache is runner.kv_caches[TARGET]
    assert runner.layer_kv_group[SHARED] == runner.layer_kv_group[TARGET] == 0

    prompts = [list(range(3, 40)), list(range(200, 221))]
    per_request: dict[str, list[torch.Tensor]] = {}

    def record(event: Any) -> None:
        assert event.result.attn_metadata[SHARED] is event.result.attn_metadata[TARGET]
        for req_id, row in zip(event.result.batch.sampling_req_ids, event.result.logits):
            per_request.setdefault(req_id, []).append(row.double())

    llm.add_step_listener(record)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5))
    for out, prompt in zip(outputs, prompts):
        tokens = out.outputs[0].token_ids
        got = torch.stack(per_request[out.request_id])  # logits at positions len(prompt) - 1, ...
        sequence = prompt + tokens[:-1]
        want = dense_logits(llm.model, sequence, shares={3: 1})[len(prompt) - 1 :]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        unshared = dense_logits(llm.model, sequence, shares={})[len(prompt) - 1 :]
        assert (unshared - want).abs().max() > 0.1, "sharing must change the logits for this check to mean anything"


def test_kv_sharing_target_cannot_be_the_layer_itself() -> None:
    with set_current_engine_config(EngineConfig(model_config=ModelConfig(model="tiny"))):
        with pytest.raises(ValueError) as err:
            Attention(
                4,
                16,
                0.25,
                2,
                prefix="model.layers.2.self_attn.attn",
                kv_sharing_target_layer_name="model.layers.2.self_attn.attn",
            )
    assert str(err.value) == (
        "KV sharing target 'model.layers.2.self_attn.attn' of layer 'model.layers.2.self_attn.attn' "
        "cannot be the layer itself."
    )


def test_layers_share_one_rope_table_per_model() -> None:
    """One cos/sin table per model (not per layer), never shared across two engines."""
    a, b = (LLM("tiny", device="cpu", num_kv_blocks=16, dtype=dtype) for dtype in ("float32", "bfloat16"))
    tables = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in a.model.model.layers}
    assert len(tables) == 1
    rope_a, rope_b = a.model.model.layers[0].self_attn.rotary_emb, b.model.model.layers[0].self_attn.rotary_emb
    assert rope_a is not rope_b and rope_a.cos_sin_cache.dtype == torch.float32


def test_the_scheduler_sends_each_requests_block_rows() -> None:
    """Block ids travel inside ScheduledTokens: the rows the KV cache manager holds at planning time."""
    llm = LLM("tiny", num_kv_blocks=32, block_size=4, enable_prefix_caching=False)
    llm.add_request({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, GREEDY)
    plan = llm.scheduler.schedule()
    sent = plan.runner_input()
    assert [s.block_ids for s in sent] == [llm.kv_cache_manager.get_block_ids(s.req_id) for s in sent]
    assert len(sent[0].block_ids[0]) == 2  # 6 tokens in blocks of 4
    llm.scheduler.undo(plan)


def test_causal_is_set_per_kv_cache_group_from_its_layers_attention_type() -> None:
    """CommonAttentionMetadata.causal comes from the KV cache group's layers: decoder self-attention
    is causal, encoder-only (bidirectional) attention is not; a group mixing the two is refused."""
    llm = LLM("tiny-hybrid", num_kv_blocks=32, enable_prefix_caching=False)
    runner = llm.runner
    assert runner.kv_group_causal == [True, True]
    events: list[Any] = []
    llm.add_step_listener(events.append)
    llm.generate(["Hi"], GREEDY)
    assert all(metadata.causal for metadata in events[0].result.attn_metadata.values())

    group0 = {name for group in runner.attn_groups[0] for name in group.layer_names}
    for name in group0:
        runner.attn_layers[name].attn_type = AttentionType.ENCODER_ONLY
    runner.initialize_kv_cache(runner.kv_cache_config)
    assert runner.kv_group_causal == [False, True]
    with torch.inference_mode():  # as in execute_model: on a GPU the inputs go to the graphs' buffers
        batch = runner.prepare_inputs([ScheduledTokens("r", [1, 2, 3], 0, True, [[1], [2]])])
    assert [runner.common_attn_metadata(batch, g).causal for g in range(2)] == [False, True]

    runner.attn_layers[min(group0)].attn_type = AttentionType.DECODER
    kv_caches, states = runner.kv_caches, runner.states
    with pytest.raises(ValueError, match=r"KV cache group 0 mixes attention types \['decoder', 'encoder_only'\]"):
        runner.initialize_kv_cache(runner.kv_cache_config)
    # Refused before anything is allocated: the runner keeps what it had.
    assert runner.kv_caches is kv_caches and runner.states is states
    assert runner.kv_group_causal == [False, True]


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
