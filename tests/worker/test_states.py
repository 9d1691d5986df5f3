"""The persistent request state and the inputs gathered from it (pagedkv/worker/states.py,
pagedkv/worker/prepare_inputs.py), against hand-worked examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.worker.input_batch import PLACEHOLDER_TOKEN_ID, SampledTokens, ScheduledTokens
from pagedkv.worker.prepare_inputs import StepSchedule, prepare_inputs
from pagedkv.worker.states import RequestStates, RowSamplingParams
from tests.conftest import needs_triton_on_cpu

CPU = dict(device="cpu", attention_backend="TORCH_REF", enable_prefix_caching=False)


def tiny_runner(model: str = "tiny", **engine):
    return LLM(model, block_size=4, num_kv_blocks=32, **{**CPU, **engine}).runner


def test_the_step_is_gathered_from_the_rows_as_input_batch_py_draws_it() -> None:
    """input_batch.py's example, block size 4: decodes A (5 cached) and B (2 cached, its token a
    placeholder the previous step sampled: 42), then C's prefill chunk of 3."""
    runner = tiny_runner()
    scheduled = [
        ScheduledTokens("A", [7], 5, True, [[3, 8]]),
        ScheduledTokens("B", [PLACEHOLDER_TOKEN_ID], 2, True, [[2]]),
        ScheduledTokens("C", [4, 5, 6], 0, False, [[5]]),
    ]
    previous = SampledTokens(["X", "B"], torch.tensor([11, 42]))
    with torch.inference_mode():
        batch = runner.prepare_inputs(scheduled, previous)
    assert batch.input_ids.tolist() == [7, 42, 4, 5, 6]
    assert batch.positions.tolist() == [5, 2, 0, 1, 2]
    assert batch.query_start_loc.tolist() == batch.query_start_loc_cpu.tolist() == [0, 1, 2, 5]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu.tolist() == [6, 3, 3]
    assert batch.slot_mappings[0].tolist() == [8 * 4 + 1, 2 * 4 + 2, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    assert batch.block_tables[0][:, :2].tolist() == [[3, 8], [2, 0], [5, 0]]
    assert batch.logits_indices.tolist() == [0, 1] and batch.sampling_req_ids == ["A", "B"]
    # The placeholder's token is in B's row now: the next step reads it from there.
    assert runner.states.token_ids[runner.states.row_of["B"], 2].item() == 42


def test_a_decode_reads_its_earlier_tokens_from_its_row_not_from_the_host() -> None:
    """The prompt goes to the row once; a later step sends only its new token, and a step whose
    token is a placeholder is served from the row too."""
    runner = tiny_runner()
    with torch.inference_mode():
        runner.prepare_inputs([ScheduledTokens("A", [9, 8, 7], 0, True, [[4]])])
        runner.prepare_inputs([ScheduledTokens("A", [6], 3, True, [[4, 5]])])
        row = runner.states.row_of["A"]
        assert runner.states.token_ids[row, :4].tolist() == [9, 8, 7, 6]
        batch = runner.prepare_inputs(
            [ScheduledTokens("A", [PLACEHOLDER_TOKEN_ID], 4, True, [[4, 5]])], SampledTokens(["A"], torch.tensor([3]))
        )
    assert batch.input_ids.tolist() == [3] and batch.slot_mappings[0].tolist() == [5 * 4 + 0]


def test_block_rows_are_staged_by_what_changed() -> None:
    """Appended blocks, a tail given back (rejected drafts) and refilled, a front nulled (a sliding
    window): the device row always equals the manager's row, zeros past its end."""
    states = RequestStates(2, 64, [6], torch.device("cpu"))
    row = states.add("r", RowSamplingParams())
    for ids in ([4], [4, 9, 2], [4, 9], [4, 9, 7, 1], [0, 0, 7, 1], [0, 0, 7]):
        states.stage_blocks(row, [ids])
        states.apply()
        assert states.block_tables[0][row].tolist() == ids + [0] * (6 - len(ids)), ids
    assert states.block_tables[0][states.padding_row].tolist() == [0] * 6
    # The row's next owner: its first blocks overwrite the last owner's, the rest are zeroed.
    states.remove(["r"])
    assert states.add("s", RowSamplingParams()) == row
    states.stage_blocks(row, [[5]])
    states.apply()
    assert states.block_tables[0][row].tolist() == [5, 0, 0, 0, 0, 0]


def test_a_step_that_fails_while_staging_changes_no_row() -> None:
    """A bad request in the middle of a step: the rows it added are given back, nothing staged
    reaches the device, and the same runner then runs a good step correctly."""
    runner = tiny_runner()
    with torch.inference_mode():
        runner.prepare_inputs([ScheduledTokens("A", [1, 2], 0, True, [[3]])])
        before = runner.states.token_ids.clone(), runner.states.block_tables[0].clone()
        bad = [
            ScheduledTokens("A", [5], 2, True, [[3, 6]]),
            ScheduledTokens("B", [1, 2, 3], 0, True, [[7]]),
            ScheduledTokens("C", [1], 0, True, [[8], [9]]),  # two groups: the runner has one
        ]
        with pytest.raises(ValueError, match="Request 'C' brings block ids for 2 KV cache groups"):
            runner.prepare_inputs(bad)
        assert set(runner.states.row_of) == {"A"}
        assert torch.equal(runner.states.token_ids, before[0]) and torch.equal(runner.states.block_tables[0], before[1])
        batch = runner.prepare_inputs(bad[:2])
    assert batch.input_ids.tolist() == [5, 1, 2, 3]
    assert batch.slot_mappings[0].tolist() == [3 * 4 + 2, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]


def test_finished_and_preempted_requests_give_their_rows_back() -> None:
    """Through the engine, with preemptions (few blocks) and more requests than rows over time:
    every request finishes with the tokens of an engine that never preempts, and rows are given back."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 9 + i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM("tiny", **CPU).generate(prompts, params)]
    llm = LLM("tiny", block_size=4, num_kv_blocks=12, max_num_seqs=3, **CPU)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.stats.num_preemptions > 0, "the check needs preemptions"
    # The last to finish is told to the runner with the next step: until then its row is held.
    assert set(llm.runner.states.row_of) <= set(llm.scheduler.freed_req_ids)
    llm.generate([prompts[0]], params)
    assert len(llm.runner.states.row_of) == 1 and len(llm.runner.states._free) == 2


def test_the_schedule_indexes_its_logits_and_drafts() -> None:
    """Two sampling requests, the second with 2 drafts, between them a prefill chunk that does not sample."""
    schedule = StepSchedule(
        ["a", "b", "c"],
        np.array([0, 1, 2], dtype=np.int32),
        np.array([1, 4, 3], dtype=np.int32),
        np.array([9, 0, 4], dtype=np.int32),
        np.array([0, 0, 2], dtype=np.int32),
        np.array([True, False, True]),
    )
    assert schedule.logits_indices().tolist() == [0, 5, 6, 7]
    assert schedule.draft_indices().tolist() == [6, 7]
    assert schedule.sampling_req_ids == ["a", "c"]


@needs_triton_on_cpu("the prepare-inputs kernels under the interpreter")
def test_the_triton_kernels_gather_what_the_torch_ops_gather() -> None:
    """Random rows, prompt chunks longer than a kernel block, decodes, padding for a graph, two KV
    cache groups (tiny-hybrid): the two ways of building the step's inputs agree everywhere."""
    runner = tiny_runner("tiny-hybrid", max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512)
    assert len(runner.block_sizes) == 2
    runner.states.token_ids.copy_(torch.randint(0, 100, runner.states.token_ids.shape))
    for g, table in enumerate(runner.states.block_tables):
        table.copy_(torch.randint(1, 32, table.shape))
        runner.states.block_columns[g] = table.shape[1]
    schedule = StepSchedule(
        ["a", "b", "c", "d"],
        np.array([5, 0, 3, 8], dtype=np.int32),  # 8: the padding row
        np.array([1, 1, 300, 2], dtype=np.int32),
        np.array([40, 7, 100, 0], dtype=np.int32),
        np.zeros(4, dtype=np.int32),
        np.array([True, True, False, True]),
    )
    with torch.inference_mode():  # results copied before the next call (with graphs, one set of buffers)
        args = (runner.states, schedule, runner.buffers, runner.block_sizes, 320, 6)
        got = prepare_inputs(*args, use_kernels=True)
        with_kernels = [t.clone() for t in (got.input_ids, got.positions, *got.slot_mappings)]
        got = prepare_inputs(*args, use_kernels=False)
    plain = [got.input_ids, got.positions, *got.slot_mappings]
    for a, b in zip(with_kernels, plain, strict=True):
        assert torch.equal(a, b)
    assert plain[1][2:5].tolist() == [100, 101, 102] and plain[2][304:].tolist() == [-1] * 16
    assert not torch.equal(plain[2], plain[3]), "the two groups' tables differ, so must their slots"
    row3 = runner.states.token_ids[3]
    assert plain[0][2:302].tolist() == row3[100:400].tolist()


def test_an_eager_step_keeps_its_own_inputs() -> None:
    """Without CUDA graphs every step gets fresh input tensors: a step kept by a listener (a
    ForwardContext, a StepEvent) still holds its own values after later steps (notebook 03 prints
    them after the run)."""
    llm = LLM("tiny", block_size=4, num_kv_blocks=32, **CPU)
    kept: list[tuple] = []
    llm.add_step_listener(
        lambda e: kept.append(
            (e.result.batch, e.result.batch.slot_mappings[0].clone(), e.result.batch.input_ids.clone())
        )
    )
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(kept) == 4
    for batch, slots, ids in kept:
        assert torch.equal(batch.slot_mappings[0], slots) and torch.equal(batch.input_ids, ids)
