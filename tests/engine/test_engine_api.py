"""The engine's public API under bad input and failures: validation, per-request errors,
all-or-nothing `generate`, `abort_request`, streaming `step()` outputs and the CLI."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.__main__ import BACKENDS_ENGINE_ARGS, build_parser
from pagedkv.__main__ import main as cli
from pagedkv.checks import check_optional_bool
from pagedkv.config import CacheConfig, CompilationConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedkv.engine.arg_utils import CLI_ARGS, RESOLVED_AT_START_UP, EngineArgs
from tests.reference import generate_checked

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def ids(n: int, start: int = 1) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(start + 7 * j) % 250 + 1 for j in range(n)]}


def small_llm(**kwargs) -> LLM:
    return LLM("tiny", device="cpu", **{"num_kv_blocks": 16, "block_size": 4, **kwargs})


def assert_idle(llm: LLM) -> None:
    """No request left anywhere, every block back in the pool, no record kept."""
    assert not llm.has_unfinished_requests()
    assert llm.kv_cache_manager.num_free_blocks() == llm.kv_cache_manager.num_usable_blocks
    assert llm._requests == {}, "finished or aborted requests must not stay recorded"


def run_steps(llm: LLM) -> dict[str, list]:
    """Drive the engine with step() to the end; every RequestOutput seen, per request id."""
    seen: dict[str, list] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


# ---- bug 2: SamplingParams are checked field by field --------------------------------------

BAD_SAMPLING = [
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature=math.inf), ValueError, "temperature"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature="0.7"), TypeError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p="1"), TypeError, "top_p"),
    (dict(seed=2**70), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=-(2**63) - 1), ValueError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(seed=False), TypeError, "seed"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
    (dict(max_tokens=True), TypeError, "max_tokens"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(ignore_eos=1), TypeError, "ignore_eos"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[True]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[-3]), ValueError, "stop_token_ids"),
    (dict(temperature=None), TypeError, "temperature"),
    (dict(max_tokens=None), TypeError, "max_tokens"),
    (dict(n=0), ValueError, "n must"),
    (dict(n=1.5), TypeError, "n must"),
    (dict(presence_penalty=2.5), ValueError, "presence_penalty"),
    (dict(frequency_penalty=-3), ValueError, "frequency_penalty"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
    (dict(repetition_penalty=math.inf), ValueError, "repetition_penalty"),
    (dict(logit_bias=[1, 2]), TypeError, "logit_bias"),
    (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias"),
    (dict(logit_bias={"a": 1.0}), TypeError, "logit_bias"),
    (dict(logit_bias={5: 101.0}), ValueError, "logit_bias"),
    (dict(logit_bias={5: "up"}), TypeError, "logit_bias"),
    (dict(min_tokens=-1), ValueError, "min_tokens"),
    (dict(min_tokens=17), ValueError, "min_tokens"),  # above max_tokens (16)
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop=5), TypeError, "stop"),
    (dict(stop=["a", 3]), TypeError, "stop"),
    (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output"),
    (dict(prompt_logprobs=21), ValueError, "prompt_logprobs"),
    (dict(prompt_logprobs=-1), ValueError, "prompt_logprobs"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_SAMPLING, ids=[repr(k) for k, _, _ in BAD_SAMPLING])
def test_sampling_params_reject_bad_values(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field) as info:
        SamplingParams(**kwargs)
    assert type(info.value) is error
    assert repr(next(iter(kwargs.values())))[:12] in str(info.value), "the message shows the value"


def test_sampling_params_accept_what_works_and_normalise_it() -> None:
    p = SamplingParams(temperature=1, top_k=np.int64(3), max_tokens=np.int32(4), stop_token_ids=(7, np.int64(9)))
    assert (p.temperature, p.top_k, p.max_tokens, p.stop_token_ids) == (1.0, 3, 4, [7, 9])
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert type(p.top_k) is int and type(p.max_tokens) is int and all(type(t) is int for t in p.stop_token_ids)
    # The seed range is exactly what torch.Generator.manual_seed takes (negatives wrap modulo 2**64).
    llm = small_llm()
    for seed in (2**64 - 1, -(2**63), -1):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=2, ignore_eos=True)
        (out,) = llm.generate(ids(3), params)
        assert len(out.outputs[0].token_ids) == 2 and out.error is None
    assert_idle(llm)


def test_parameters_changed_after_construction_are_checked_when_added() -> None:
    llm = small_llm()
    params = SamplingParams(temperature=0.5)
    params.temperature = math.nan
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request(ids(3), params)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request(ids(3), {"temperature": 0})
    assert_idle(llm)


def test_parameters_changed_while_the_request_runs_change_nothing() -> None:
    """The request keeps a checked copy: a field set to a bad value afterwards used to make every
    later step raise (the engine jammed until the request was aborted)."""
    llm = small_llm()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.add_request(ids(3), params)
    params.max_tokens = "x"
    outputs = run_steps(llm)
    assert [len(o.outputs[0].token_ids) for o in outputs["0"]] == [1, 2, 3] and outputs["0"][-1].finished
    assert_idle(llm)


def test_a_temperature_below_sampling_eps_is_greedy() -> None:
    """1e-38 is a valid temperature, but logits divided by it overflow (the request failed with
    'probability tensor contains inf'); below 1e-5 the sampler takes the argmax, as vLLM does."""
    llm = small_llm()
    greedy = llm.generate(ids(4), GREEDY)[0].outputs[0].token_ids
    for temperature in (1e-38, 5e-324, 1e-6):
        out = llm.generate(ids(4), SamplingParams(temperature=temperature, max_tokens=5, ignore_eos=True))[0]
        assert out.error is None and out.outputs[0].token_ids == greedy


def test_misused_generate_and_listener_arguments_are_named() -> None:
    llm = small_llm()
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, a list of them .* got 5"):
        llm.generate("a", 5)
    with pytest.raises(ValueError, match=r"prompt 0: The prompt cannot be encoded as UTF-8: .*surrogate"):
        llm.generate("\ud800", GREEDY)
    with pytest.raises(ValueError, match=r"The prompt cannot be encoded as UTF-8"):
        llm.add_request("\ud800", GREEDY)
    with pytest.raises(TypeError, match="pass a function, got 5"):
        llm.add_step_listener(5)
    assert_idle(llm)


def nan_logits_for(llm: LLM, request_id: str) -> None:
    """Make the model's logits NaN in `request_id`'s row of every step (a broken model, for one request)."""
    real = llm.runner.execute_model

    def patched(*args, **kwargs):
        result = real(*args, **kwargs)
        rows = result.batch.sampling_req_ids
        if request_id not in rows:
            return result
        logits = result.logits.clone()
        logits[rows.index(request_id)] = float("nan")
        return dataclasses.replace(result, logits=logits)

    llm.runner.execute_model = patched


def test_a_request_that_fails_in_a_step_is_finished_with_an_error() -> None:
    """A sampled (not greedy) request whose logits are NaN fails alone; the batch's others go on."""
    good = SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True)
    bad = SamplingParams(temperature=0.8, seed=666, max_tokens=5, ignore_eos=True)
    expected = small_llm().generate(ids(6), good)[0].outputs[0].token_ids

    llm = small_llm()
    good_id, bad_id = llm.add_request(ids(6), good), llm.add_request(ids(9, start=3), bad)
    nan_logits_for(llm, bad_id)
    seen = run_steps(llm)
    (failed,) = seen[bad_id]  # reported once, when it failed, with no token
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "no token can be sampled" in failed.error and failed.outputs[0].token_ids == []
    assert seen[good_id][-1].outputs[0].token_ids == expected, "the other request goes on untouched"
    assert seen[good_id][-1].error is None
    assert_idle(llm)
    assert vars(llm.sampler) == {"batch_invariant": False}  # nothing per request to forget

    # Through generate: the failure is an output, the batch's other prompts complete.
    nan_logits_for(llm, "3")  # the second prompt of this call (ids count on from the two above)
    outs = llm.generate([ids(6), ids(9, start=3)], [good, bad])
    assert outs[0].outputs[0].token_ids == expected and outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "error" and "NaN" in outs[1].error
    assert_idle(llm)


def test_a_failing_model_step_aborts_its_requests_and_the_engine_recovers() -> None:
    llm = small_llm(max_num_seqs=1)
    reference = small_llm().generate(ids(5), GREEDY)[0].outputs[0].token_ids
    first, second = llm.add_request(ids(5), GREEDY), llm.add_request(ids(5), GREEDY)
    real = llm.runner.execute_model

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    llm.runner.execute_model = broken
    with pytest.raises(RuntimeError, match="device fell over") as info:
        llm.step()
    assert first in "\n".join(getattr(info.value, "__notes__", [])), "the note names the aborted request"
    llm.runner.execute_model = real
    # The scheduled request was aborted and its blocks freed; the waiting one still runs.
    seen = run_steps(llm)
    assert list(seen) == [second] and seen[second][-1].outputs[0].token_ids == reference
    assert_idle(llm)


def test_a_failing_step_leaves_no_cached_block_it_never_wrote() -> None:
    """The aborted request's full blocks were hashed when scheduled, but the step never wrote
    them: all must leave the prefix cache, else a later prompt that extends it reads garbage."""
    llm = small_llm(max_num_seqs=1, attention_backend="TORCH_REF")
    llm.add_request(ids(12), GREEDY)  # three full blocks of 4
    real = llm.runner.execute_model

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    llm.runner.execute_model = broken
    with pytest.raises(RuntimeError, match="device fell over"):
        llm.step()
    llm.runner.execute_model = real
    assert not llm.kv_cache_manager.block_pools[0].cached_block_hash_to_block
    generate_checked(llm, [ids(13)], GREEDY)  # logits against the float64 reference


# ---- bug 3: no silent conversions ---------------------------------------------------------

BAD_PROMPTS = [
    {"prompt_token_ids": "567"},
    {"prompt_token_ids": [5.9, 6.2]},
    {"prompt_token_ids": [True, 5]},
    {"prompt_token_ids": ["5", "6"]},
    {"prompt_token_ids": 5},
    {"prompt_token_ids": [np.float32(3.0)]},
    {"prompt_token_ids": {1, 2}},
]


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=[repr(p["prompt_token_ids"]) for p in BAD_PROMPTS])
def test_prompt_token_ids_must_be_ints(prompt: dict) -> None:
    llm = small_llm()
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate(prompt, GREEDY)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.add_request(prompt, GREEDY)
    assert_idle(llm)


def test_integer_scalars_of_numpy_and_torch_are_token_ids() -> None:
    llm = small_llm()
    plain = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0]
    mixed = llm.generate({"prompt_token_ids": (np.int64(5), torch.tensor(6), 7)}, GREEDY)[0]
    assert mixed.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in mixed.prompt_token_ids)
    assert mixed.outputs[0].token_ids == plain.outputs[0].token_ids


# ---- bug 4: generate is all or nothing; abort_request; records are freed -------------------


def test_a_rejected_prompt_rejects_the_whole_batch() -> None:
    llm = small_llm(max_model_len=32)
    for batch in ([ids(4), ids(3), {"prompt_token_ids": "1"}], [ids(4), ids(40)], [ids(4), 7]):
        with pytest.raises((TypeError, ValueError)):
            llm.generate(batch, GREEDY)
        assert_idle(llm)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([ids(4), ids(40)], GREEDY)
    assert llm.stats.num_steps == 0, "nothing ran"


def test_stats_count_how_each_step_ran() -> None:
    """`num_steps_by_graph_mode` agrees with what each step's result says (eager on the CPU: "NONE")."""
    llm = small_llm()
    seen: list[str] = []
    llm.add_step_listener(lambda event: seen.append(event.result.cudagraph_mode.name))
    llm.generate([ids(4), ids(9, start=20)], GREEDY)
    assert seen and llm.stats.num_steps_by_graph_mode == {"NONE": len(seen)} and llm.stats.num_steps == len(seen)


@pytest.mark.parametrize("error", [RuntimeError("listener broke"), KeyboardInterrupt()])
def test_generate_aborts_its_requests_when_interrupted(error: BaseException) -> None:
    llm = small_llm()
    expected = [o.outputs[0].token_ids for o in small_llm().generate([ids(4), ids(6)], GREEDY)]

    def listener(event) -> None:
        if event.step == 2:
            raise error

    detach = llm.add_step_listener(listener)
    with pytest.raises(type(error)):
        llm.generate([ids(4), ids(6)], GREEDY)
    assert_idle(llm)
    detach()
    assert [o.outputs[0].token_ids for o in llm.generate([ids(4), ids(6)], GREEDY)] == expected


def test_a_listener_that_raises_in_step_loses_no_output() -> None:
    """The listener raises in the step where a request finishes: the exception reaches the caller
    (with a note), and the next step() returns that step's outputs, the final one included. They
    were lost: the request had been forgotten and its last output was never returned."""
    llm = small_llm()
    expected = small_llm().generate(ids(4), GREEDY)[0].outputs[0].token_ids

    def listener(event) -> None:
        if event.finished_req_ids:
            raise RuntimeError("listener broke")

    llm.add_step_listener(listener)
    request_id = llm.add_request(ids(4), GREEDY)
    seen, raised = [], 0
    while llm.has_unfinished_requests():
        try:
            seen += llm.step()
        except RuntimeError as error:
            raised += 1
            assert "the next step() returns them first" in str(error.__notes__)
    assert raised == 1
    assert [o.request_id for o in seen] == [request_id] * len(expected)
    assert seen[-1].finished and seen[-1].outputs[0].token_ids == expected
    assert_idle(llm)

    # generate() on an engine still holding such outputs names them
    request_id = llm.add_request(ids(4), GREEDY)
    with pytest.raises(RuntimeError):
        while True:
            llm.step()
    with pytest.raises(ValueError, match=r"0 request\(s\) added with add_request are unfinished and 1 output\(s\)"):
        llm.generate(ids(3), GREEDY)
    seen = llm.step()
    assert seen[-1].finished and seen[-1].outputs[0].token_ids == expected
    assert_idle(llm)


def test_abort_request_waiting_and_running() -> None:
    llm = small_llm(max_num_seqs=1)
    running, waiting, kept = (llm.add_request(ids(5, start=s), GREEDY) for s in (1, 2, 3))
    assert [o.request_id for o in llm.step()] == [running]
    assert llm.kv_cache_manager.num_free_blocks() < llm.kv_cache_manager.num_usable_blocks
    assert llm.abort_request(running) is True
    assert llm.abort_request(waiting) is True
    assert llm.abort_request(waiting) is False, "already aborted"
    assert llm.abort_request("no-such-id") is False
    with pytest.raises(TypeError, match="request_id"):
        llm.abort_request(3)
    seen = run_steps(llm)
    assert list(seen) == [kept] and seen[kept][-1].finished
    assert llm.abort_request(kept) is False, "already finished"
    assert_idle(llm)


def test_a_request_aborted_during_generate_is_returned_as_aborted() -> None:
    llm = small_llm()
    expected = small_llm().generate(ids(6), GREEDY)[0].outputs[0].token_ids
    llm.add_step_listener(lambda event: event.step == 2 and llm.abort_request("0"))
    aborted, kept = llm.generate([ids(4), ids(6)], GREEDY)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 2, "the tokens of steps 1 and 2"
    assert kept.outputs[0].token_ids == expected and kept.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_generate_needs_an_idle_engine() -> None:
    llm = small_llm()
    pending = llm.add_request(ids(4), GREEDY)
    with pytest.raises(ValueError, match="abort_request"):
        llm.generate(ids(4), GREEDY)
    assert llm.abort_request(pending)
    assert_idle(llm)


def test_records_do_not_grow_with_add_request_and_step() -> None:
    llm = small_llm()
    for _ in range(5):
        for s in range(3):
            llm.add_request(ids(3, start=s), SamplingParams(temperature=0, max_tokens=2))
        run_steps(llm)
        assert_idle(llm)


# ---- bug 5: engine arguments ---------------------------------------------------------------

BAD_ENGINE_ARGS = [
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=-8), ValueError, "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=64.0), TypeError, "max_num_batched_tokens"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_seqs="4"), TypeError, "max_num_seqs"),
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(max_model_len=1), ValueError, "max_model_len"),
    (dict(max_model_len=64.0), TypeError, "max_model_len"),
    (dict(block_size=16.0), TypeError, "block_size"),
    (dict(block_size=True), TypeError, "block_size"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(num_kv_blocks=2.5), TypeError, "num_kv_blocks"),
    (dict(num_kv_blocks=True), TypeError, "num_kv_blocks"),
    (dict(num_kv_blocks=-4), ValueError, "num_kv_blocks"),
    (dict(num_kv_blocks=None, gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(num_kv_blocks=None, gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(num_kv_blocks=None, gpu_memory_utilization=math.nan), ValueError, "gpu_memory_utilization"),
    (dict(num_kv_blocks=None, gpu_memory_utilization="high"), TypeError, "gpu_memory_utilization"),
    (dict(num_kv_blocks=None, kv_cache_memory=0), ValueError, "kv_cache_memory"),
    (dict(num_kv_blocks=None, kv_cache_memory=-1), ValueError, "kv_cache_memory"),
    (dict(num_kv_blocks=None, kv_cache_memory=2.5e6), TypeError, "kv_cache_memory"),
    (dict(model=None), TypeError, "model"),
    (dict(model=5), TypeError, "model"),
    (dict(dtype="float8"), ValueError, "dtype"),
    (dict(dtype=torch.int32), ValueError, "dtype"),
    (dict(dtype=16), TypeError, "dtype"),
    (dict(device="banana"), ValueError, "device"),
    (dict(device=3.5), TypeError, "device"),
    (dict(device="mps"), ValueError, r"device='mps': pagedkv runs on 'cpu' or 'cuda'"),
    (dict(device="xpu"), ValueError, r"device='xpu': pagedkv runs on 'cpu' or 'cuda'"),
    (dict(enable_chunked_prefill="no"), TypeError, "enable_chunked_prefill"),
    (dict(attention_backend=3), TypeError, "attention_backend"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(layer_attention_backends=["TORCH_REF"]), TypeError, "layer_attention_backends"),
    (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
    # A typo: Python's own message (LLM.__init__ has a real signature; help(LLM) lists the arguments).
    (dict(max_num_seq=8), TypeError, r"unexpected keyword argument 'max_num_seq'"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_ENGINE_ARGS, ids=[repr(k) for k, _, _ in BAD_ENGINE_ARGS])
def test_engine_arguments_are_checked(kwargs: dict, error: type, field: str) -> None:
    args = {"model": "tiny", "device": "cpu", "num_kv_blocks": 16, **kwargs}
    with pytest.raises(error, match=field) as info:
        LLM(**args)
    assert type(info.value) is error


def test_a_kv_cache_too_large_to_allocate_names_its_arguments() -> None:
    """16 PB: more than any machine has; refused before allocating (the allocator's message alone
    named no argument)."""
    with pytest.raises(
        ValueError,
        match=r"needs 15258789\.06 GiB on cpu, but only .* GiB is available: it was sized "
        r"by num_kv_blocks=1000000000000, kv_cache_memory=None; lower them",
    ):
        LLM("tiny", device="cpu", num_kv_blocks=10**12)


def test_a_block_too_large_for_the_memory_names_block_size() -> None:
    with pytest.raises(ValueError, match=r"would hold 0 blocks .*block_size=1000000 tokens.* a smaller block_size"):
        LLM("tiny", device="cpu", block_size=10**6, kv_cache_memory=2**20)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_says_so() -> None:
    with pytest.raises(ValueError, match=r"no CUDA device.*device=\"cpu\""):
        LLM("tiny", device="cuda", num_kv_blocks=16)


def test_engine_args_are_what_llm_builds_its_config_from() -> None:
    args = EngineArgs(
        "tiny", device="cpu", num_kv_blocks=16, max_num_seqs=3, max_model_len=256, enable_chunked_prefill=False
    )
    config, model_config = args.create_engine_config()
    assert (config.cache_config.num_kv_blocks, config.scheduler_config.max_num_seqs) == (16, 3)
    assert config.scheduler_config.max_num_batched_tokens == EngineArgs.max_num_batched_tokens  # the default
    assert (config.model_config.max_model_len, config.scheduler_config.enable_chunked_prefill) == (256, False)
    assert model_config.max_position_embeddings > 256
    llm = LLM(**dataclasses.asdict(args))
    for part in dataclasses.fields(config):  # the compilation config gains the layers, by name, as the model is built
        if part.name != "compilation_config":
            assert getattr(llm.config, part.name) == getattr(config, part.name), part.name
    assert set(llm.config.compilation_config.static_forward_context) == set(llm.runner.attn_layers)


def test_llm_signature_lists_the_engine_args() -> None:
    """help(LLM) and notebooks see every argument with its type and default: LLM.__init__'s own signature."""
    params = inspect.signature(LLM).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        (f.name, f.default) for f in dataclasses.fields(EngineArgs)
    ]
    assert [p.annotation for p in params.values()] == [f.type for f in dataclasses.fields(EngineArgs)]
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {p.kind for name, p in params.items() if name != "model"} == {inspect.Parameter.KEYWORD_ONLY}


def test_llm_passes_every_argument_to_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of LLM's arguments reaches EngineArgs under its own name (none dropped or swapped)."""
    given = {f.name: object() for f in dataclasses.fields(EngineArgs)}  # distinct markers, never checked

    class Built(Exception):
        pass

    def capture(args: EngineArgs) -> None:
        raise Built(args)

    monkeypatch.setattr(EngineArgs, "create_engine_config", capture)
    with pytest.raises(Built) as built:
        LLM(**given)  # type: ignore[arg-type]
    args = built.value.args[0]
    assert all(getattr(args, name) is value for name, value in given.items())


CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, CompilationConfig, EngineConfig)


def test_each_default_is_written_once() -> None:
    """An engine argument's default is its config field's (pagedkv/config.py), or None where
    `create_engine_config` resolves it for the model / machine; the CLI's default is EngineArgs'
    (one object: the CLI writes no default of its own)."""
    args = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    shared = 0
    for config in CONFIGS:
        for field in dataclasses.fields(config):  # those with a default (ModelConfig.model has none)
            has_default = field.default is not dataclasses.MISSING
            if has_default and field.name in args and field.name not in RESOLVED_AT_START_UP:
                assert args[field.name] == field.default, f"EngineArgs.{field.name} / {config.__name__}.{field.name}"
                shared += 1
    assert shared >= 12  # block_size, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, ...
    assert all(args[name] is None for name in RESOLVED_AT_START_UP)
    generate = vars(build_parser().parse_args(["generate"]))
    backends = vars(build_parser().parse_args(["backends"]))
    for name in CLI_ARGS:
        assert generate[name] is args[name], name
    assert all(backends[name] is args[name] for name in BACKENDS_ENGINE_ARGS)


def test_check_optional_bool_takes_none_true_false_only() -> None:
    """The check of enable_prefix_caching, generate's use_tqdm and the block table's show_caching."""
    assert [check_optional_bool("x", v) for v in (None, True, False)] == [None, True, False]
    for value in (1, 0, "yes", 1.0):
        with pytest.raises(TypeError, match=r"^x must be True, False or None \(None: auto\), got .*\.$"):
            check_optional_bool("x", value, hint=" (None: auto)")


def test_max_model_len_none_means_the_models_limit() -> None:
    llm = small_llm(max_model_len=None)
    assert llm.config.model_config.max_model_len == llm.model_config.max_position_embeddings


def test_step_without_requests_returns_nothing() -> None:
    llm = small_llm()
    assert llm.step() == []
    assert llm.stats.num_steps == 0


# ---- streaming -----------------------------------------------------------------------------


def test_step_streams_one_output_per_new_token() -> None:
    llm = small_llm(num_kv_blocks=32, max_num_batched_tokens=8)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    expected = small_llm(num_kv_blocks=32).generate([ids(20), ids(3)], [GREEDY, two])
    long_id = llm.add_request(ids(20), GREEDY)  # 20 prompt tokens in chunks of 8: no token in steps 1-2
    short_id = llm.add_request(ids(3), two)
    first = llm.step()
    assert [o.request_id for o in first] == [], "a prompt chunk that does not finish the prompt yields nothing"
    seen = run_steps(llm)
    for req_id, final in ((long_id, expected[0]), (short_id, expected[1])):
        outs = seen[req_id]
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(outs) + 1)), "one token per output"
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        for o in outs:
            assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)
            assert o.prompt_token_ids == final.prompt_token_ids
        assert outs[-1].outputs[0].token_ids == final.outputs[0].token_ids
        assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].error is None
    assert_idle(llm)


# ---- the CLI -------------------------------------------------------------------------------


def test_cli_streams_token_id_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    cli(
        [
            "generate",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "16",
            "--max-tokens",
            "3",
            "--stream",
            "--prompt-token-ids",
            "5,6,7",
            "--prompt",
            "hi",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    prompts = [{"prompt_token_ids": [5, 6, 7]}, "hi"]
    expected = small_llm().generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    # While streaming, one line per new token: "[request id] token id 'text piece'"; then one line per request.
    for req_id, want in enumerate(expected):
        tokens = [int(line.split()[1]) for line in out if re.match(rf"\[{req_id}\] \d+ ", line)]
        assert tokens == want.outputs[0].token_ids
        assert f"[{req_id}] done (length): {want.outputs[0].text!r}" in out


def test_cli_options_are_the_engine_args() -> None:
    """`generate` has an option per EngineArgs field with a flag, typed from the field's annotation."""
    argv = [
        "generate",
        "--max-num-seqs",
        "3",
        "--gpu-memory-utilization",
        "0.5",
        "--no-enable-chunked-prefill",
        "--cudagraph-mode",
        "full",
        "--no-prefix-caching",
        "--async-scheduling",
        "--max-model-len",
        "64",
    ]
    got = vars(build_parser().parse_args(argv))
    assert {
        k: got[k]
        for k in (
            "max_num_seqs",
            "gpu_memory_utilization",
            "enable_chunked_prefill",
            "cudagraph_mode",
            "enable_prefix_caching",
            "async_scheduling",
            "max_model_len",
        )
    } == dict(
        max_num_seqs=3,
        gpu_memory_utilization=0.5,
        enable_chunked_prefill=False,
        cudagraph_mode="full",
        enable_prefix_caching=False,
        async_scheduling=True,
        max_model_len=64,
    )
    assert set(CLI_ARGS) == {f.name for f in dataclasses.fields(EngineArgs)} - {"seed", "layer_attention_backends"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt-token-ids", "1,x,3"],
        ["--prompt-token-ids", "1,2", "--max-tokens", "0"],
        ["--prompt", "hi", "--temperature", "nan"],
        ["--prompt", "hi", "--block-size", "0"],
    ],
)
def test_cli_user_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli(["generate", "--device", "cpu", "--num-kv-blocks", "16", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and err[0].startswith("pagedkv: error:")


def test_request_token_ids_between_is_a_slice_of_all_token_ids() -> None:
    from pagedkv.engine.request import Request

    req = Request("0", [5, 6, 7], SamplingParams(), eos_token_ids=[], prompt=None)
    for token in (8, 9):
        req.append_output_token_id(token)
    full = req.all_token_ids
    assert full == [5, 6, 7, 8, 9] and req.output_token_ids == [8, 9]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids_between(start, end) == full[start:end], (start, end)


def test_help_shows_every_engine_argument():
    """help(LLM) documents each argument with its default and its docstring (the README promises it)."""
    import pydoc

    from pagedkv.engine.arg_utils import attribute_docs

    text = pydoc.render_doc(LLM, renderer=pydoc.plaintext)
    words = " ".join(text.replace("|", " ").split())  # pydoc starts each line of a class with "|"
    docs = attribute_docs(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        assert f"{f.name} (default {f.default!r})" in text, f.name
        assert " ".join(docs[f.name].replace("|", " ").split()[:8]) in words, f.name
