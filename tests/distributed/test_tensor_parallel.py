"""Tensor parallelism on the CPU (gloo): tp = 2 and 4 against tp = 1 and Hugging Face transformers.

Every engine is pinned to the CPU, so these tests run the same on a machine with one GPU (the
ranks on GPUs: tests/gpu/test_tensor_parallel_cuda.py).

Every engine here spawns worker processes; each test ends them (context manager or shutdown) and
checks that none is left. Models are tiny Hugging Face directories with the head layouts
`pagedkv.models.layers.head_layout` handles (vllm/model_executor/layers/linear.py, QKVParallelLinear):
GQA split, KV heads replicated (MQA, and GQA with tp > num_kv_heads), MHA.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from tests.conftest import write_hf_llama
from tests.reference import LogitsRecorder, reference_logits

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 3, 44, 101, 7], [60, 12, 8], list(range(20, 52))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def serve(model: str, tp: int, **engine: object) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS and, per request, the logits rows they were sampled from."""
    with LLM(
        model, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, tensor_parallel_size=tp, **engine
    ) as llm:
        recorder = LogitsRecorder(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs], [torch.stack(recorder.rows[o.request_id]) for o in outs])


def with_random_biases(model_dir: Path, std: float = 0.3) -> Path:
    """transformers initialises every bias to 0, which hides a bias added tp times: draw them."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * std
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def assert_no_workers_left() -> None:
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "name,tp,shape",
    [
        ("gqa_split", 2, dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64)),
        ("mqa_replicated", 2, dict(num_attention_heads=4, num_key_value_heads=1)),
        ("gqa_replicated_tp4", 4, dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)),
        (
            "mha_tied_odd_vocab",
            2,
            dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, vocab_size=131),
        ),
        # RowParallelLinear's bias must be added once, after the all-reduce (added on every rank
        # before it, it counts tp times); transformers initialises biases to 0: they are drawn.
        (
            "gqa_random_biases",
            2,
            dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
        ),
        # Qwen3: each rank normalises its own heads with the whole q_norm / k_norm (replicated, not
        # split); head_dim 24 is not hidden_size / heads; attention_bias puts the biases on q/k/v and o_proj.
        (
            "qwen3_gqa_split_random_biases",
            2,
            dict(family="Qwen3", num_attention_heads=8, num_key_value_heads=4, head_dim=24, attention_bias=True),
        ),
    ],
)
def test_tp_matches_tp1_and_transformers(tmp_path: Path, name: str, tp: int, shape: dict) -> None:
    model_dir = write_hf_llama(tmp_path / name, **shape)
    if shape.get("attention_bias"):
        with_random_biases(model_dir)
    tokens_1, logits_1 = serve(str(model_dir), 1)
    tokens_tp, logits_tp = serve(str(model_dir), tp)
    assert_no_workers_left()
    assert tokens_tp == tokens_1
    for a, b in zip(logits_tp, logits_1):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, generated, ours in zip(PROMPTS, tokens_tp, logits_tp):
            torch.testing.assert_close(ours, reference_logits(hf, prompt, generated).double(), atol=1e-4, rtol=0)


def test_preemption_under_tp_keeps_every_request() -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7 * i + j for j in range(12)]} for i in range(6)]
    engine = dict(device="cpu", num_kv_blocks=14, block_size=4, max_num_seqs=6, dtype="float32")
    expected = [o.outputs[0].token_ids for o in LLM("tiny", **engine).generate(prompts, params, use_tqdm=False)]
    with LLM("tiny", tensor_parallel_size=2, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats.num_preemptions > 0  # the cache is too small for all six at once
    assert got == expected
    assert_no_workers_left()


@pytest.mark.parametrize(
    "speculative_config",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": "tiny-hybrid", "num_speculative_tokens": 2},
    ],
    ids=["ngram", "draft-model"],
)
def test_speculative_decoding_under_tp_gives_the_single_rank_tokens(speculative_config: dict) -> None:
    """Drafts (from prompt lookup, or a draft model sharded on every rank) verified on two ranks, with
    preemptions: the tokens of the single-rank engine without speculation."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(5 * i + j % 6) % 250 + 3 for j in range(18)]} for i in range(5)]
    engine = dict(device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=5, dtype="float32")
    expected = [o.outputs[0].token_ids for o in LLM("tiny", **engine).generate(prompts, params, use_tqdm=False)]
    with LLM("tiny", tensor_parallel_size=2, speculative_config=speculative_config, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats.num_draft_tokens > 0 and llm.stats.num_preemptions > 0
    assert got == expected
    assert_no_workers_left()


def test_killed_worker_is_an_error_not_a_hang() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    llm.add_request("hello", GREEDY)
    llm.step()
    os.kill(llm._executor.workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 was killed by signal 9"):
        llm.step()
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="cannot continue"):  # the engine says it cannot go on
        llm._executor.execute_model(None)  # type: ignore[arg-type]
    assert_no_workers_left()


def test_script_without_a_main_guard_fails_at_once_with_the_fix(tmp_path: Path) -> None:
    """The spawned worker imports the script again, whose LLM(...) then dies in the worker's
    start-up: the driver says so at once and names the fix, where it used to wait out the
    group's 120 s start-up timeout and report a gloo "Wait timeout"."""
    script = tmp_path / "serve.py"
    script.write_text("from pagedkv import LLM\nLLM('tiny', device='cpu', num_kv_blocks=32, tensor_parallel_size=2)\n")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert "worker rank 1 exited with code 1 while starting" in done.stderr
    assert 'create the LLM under `if __name__ == "__main__":`' in done.stderr


def test_garbage_collected_engine_ends_its_workers() -> None:
    llm = LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    assert len(multiprocessing.active_children()) == 1
    del llm
    import gc

    gc.collect()
    assert_no_workers_left()


@pytest.mark.parametrize(
    "tp,match",
    [(3, r"num_attention_heads \(4\) must be divisible by tp_size \(3\)"), (0, "tensor_parallel_size must be")],
)
def test_bad_tensor_parallel_size_is_refused_before_any_process_starts(tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=tp)
    assert multiprocessing.active_children() == []


def test_cli_tensor_parallel_size_prints_the_tp1_text(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.__main__ import main as cli

    texts = []
    for tp in ("1", "2"):
        cli(
            [
                "generate",
                "--model",
                "tiny-pydoc",
                "--prompt",
                "A class definition",
                "--max-tokens",
                "24",
                "--num-kv-blocks",
                "16",
                "--device",
                "cpu",
                "--tensor-parallel-size",
                tp,
            ]
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and "executable" in texts[0]
    assert_no_workers_left()


def test_start_up_error_on_rank_0_is_raised_as_is_and_ends_the_workers() -> None:
    with pytest.raises(ValueError, match="NOT_A_BACKEND"):
        LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2, attention_backend="NOT_A_BACKEND")
    assert_no_workers_left()


@pytest.mark.parametrize("engine", [dict(cudagraph_mode="FULL_AND_PIECEWISE"), dict(compile=True)])
def test_piecewise_graphs_and_compile_are_refused_under_tp(engine: dict) -> None:
    with pytest.raises(NotImplementedError, match="captures whole-model CUDA graphs only"):
        LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2, **engine)
    assert multiprocessing.active_children() == []
