"""An independent reference for engine tests: the engine's weights run by `transformers` in float64.

The engine computes logits through the paged cache, a backend and the scheduler's batches and
chunks; the reference runs the same weights over each finished sequence in one dense,
unpaged, float64 forward pass of Hugging Face's own model code. Teacher forcing makes the
comparison exact per step: the logits the engine sampled its k-th token from must equal the
reference's logits at the position before that token.

    recorder = LogitsRecorder(llm)                  # a step listener
    outputs = llm.generate(prompts, greedy)
    check_against_reference(llm, outputs, recorder, atol=FP32_ATOL)

`tests/attention/test_broken_backends.py` runs the engine tests' scenarios with deliberately broken
backends to show that this check catches them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from pagedkv import LLM, SamplingParams, StepEvent
from pagedkv.engine.request import RequestOutput
from pagedkv.models.hf_export import to_transformers

FP32_ATOL = 1e-3
"""Logit tolerance for a float32 engine (its errors against float64 are about 1e-5 on logits of ~10)."""


class LogitsRecorder:
    """A step listener keeping, per request, the logits row each of its tokens was sampled from."""

    def __init__(self, llm: LLM) -> None:
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.detach = llm.add_step_listener(self)

    def __call__(self, event: StepEvent) -> None:
        # Row i of the step's logits belongs to sampling_req_ids[i].
        for i, req_id in enumerate(event.result.batch.sampling_req_ids):
            self.rows[req_id].append(event.result.logits[i].detach().to("cpu", torch.float64))


@torch.no_grad()
def reference_logits(hf: torch.nn.Module, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """[len(generated), vocab]: row k holds the logits that predict generated[k] (teacher forcing)."""
    sequence = torch.tensor([[*prompt, *generated[:-1]]])
    return hf(sequence).logits[0, len(prompt) - 1 :]


def engine_and_reference(
    llm: LLM, outputs: Sequence[RequestOutput], recorder: LogitsRecorder
) -> list[tuple[RequestOutput, torch.Tensor, torch.Tensor]]:
    """Per request: (output, engine logits, reference logits), both [len(generated), vocab] float64."""
    hf = to_transformers(llm.model)
    pairs = []
    for out in outputs:
        generated = out.outputs[0].token_ids
        rows = recorder.rows[out.request_id]
        assert len(rows) == len(generated), (
            f"request {out.request_id}: {len(rows)} logits rows recorded for {len(generated)} tokens"
        )
        pairs.append((out, torch.stack(rows), reference_logits(hf, out.prompt_token_ids, generated)))
    return pairs


def reference_errors(llm: LLM, outputs: Sequence[RequestOutput], recorder: LogitsRecorder) -> dict[str, float]:
    """Per request, the largest |engine logit - reference logit| over its sampled tokens."""
    return {
        out.request_id: (ours - ref).abs().max().item()
        for out, ours, ref in engine_and_reference(llm, outputs, recorder)
    }


def check_against_reference(
    llm: LLM, outputs: Sequence[RequestOutput], recorder: LogitsRecorder, *, atol: float = FP32_ATOL
) -> None:
    """Assert the engine's logits match the float64 reference within `atol`, and greedy tokens are its argmax.

    A token must be the reference's argmax only where the reference's best logit leads the
    runner-up by more than 2 * atol: within that, rounding may break a near-tie either way.
    """
    for out, ours, expected in engine_and_reference(llm, outputs, recorder):
        generated = out.outputs[0].token_ids
        error = (ours - expected).abs().amax(dim=-1)
        worst = int(error.argmax())
        assert error[worst] <= atol, (
            f"request {out.request_id}: logits differ from the float64 transformers reference by "
            f"{error[worst].item():.3g} (tolerance {atol}) at generated token {worst}"
        )
        top2 = expected.topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * atol
        wrong = [k for k in range(len(generated)) if clear[k] and generated[k] != top2.indices[k, 0].item()]
        assert not wrong, (
            f"request {out.request_id}: greedy token {wrong[0]} is {generated[wrong[0]]}, the reference's "
            f"argmax is {top2.indices[wrong[0], 0].item()}"
        )


def generate_checked(
    llm: LLM, prompts: list, params: SamplingParams, *, atol: float = FP32_ATOL
) -> list[RequestOutput]:
    """`llm.generate` with greedy `params`, checked against the float64 reference (see above)."""
    if params.temperature != 0:
        raise ValueError(f"generate_checked compares greedy runs; got temperature={params.temperature}")
    recorder = LogitsRecorder(llm)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        recorder.detach()
    check_against_reference(llm, outputs, recorder, atol=atol)
    return outputs
