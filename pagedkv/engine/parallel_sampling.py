"""`n` outputs of one prompt (SamplingParams.n), as vLLM V1 fans them out (vllm/v1/engine/parallel_sampling.py).

The engine runs n ordinary requests, the children, that share the prompt: the scheduler and the
runner never hear of the parent. Prefix caching makes the children share the prompt's full KV
cache blocks (a block is hashed when the step that fills it is planned, so a child admitted in the
same step as the first already hits its blocks: pagedkv/kv_cache/manager.py). Only the caller's side
knows the parent:

    add_request("Hi", SamplingParams(n=3, seed=7), "req")  ->  children "0_req", "1_req", "2_req"
                                                               seeds       7       8       9
    step()      RequestOutput("req", outputs=[CompletionOutput(index=1, ...)], finished=False)
                ...                               the last child's last output: finished=True
    generate()  RequestOutput("req", outputs=[index 0, index 1, index 2])
"""

from __future__ import annotations

from dataclasses import replace

from pagedkv.engine.request import SEED_RANGE, Request, RequestOutput, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """The engine's own id of a parent's `index`-th child (vLLM's form)."""
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """A child's parameters: one output, and with a seed, seed + index (modulo 2**64, as a seed is used:
    a parent seeded with the largest uint64 still has n distinct children)."""
    seed = params.seed
    if seed is not None:
        seed += index
        if seed > SEED_RANGE[1]:
            seed -= 2**64
    return replace(params, n=1, seed=seed)


class ParentRequest:
    """The children of one prompt with n > 1, and which of them the caller has seen finish."""

    def __init__(self, request_id: str, children: list[Request]) -> None:
        self.request_id = request_id
        self.children = children
        self._live = {child.request_id for child in children}
        """Children whose final output has not been made, and that were not dropped (aborted, failed)."""

    def stream(self, output: RequestOutput, child: Request) -> RequestOutput:
        """A child's streamed output, `finished` only on the last child's last one: the whole prompt is
        then done (as vLLM's AsyncLLM streams n > 1 with output_kind CUMULATIVE)."""
        if output.finished:
            self._live.discard(child.request_id)
            output.finished = not self._live
        return output

    def forget(self, child: Request) -> bool:
        """A child left the engine (finished, aborted or failed); True once none is left."""
        self._live.discard(child.request_id)
        return not self._live


def merge_outputs(parent_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput of a prompt from its children's final ones: every completion, by index; the
    first error, if any child failed."""
    first = outputs[0]
    completions = sorted((c for out in outputs for c in out.outputs), key=lambda c: c.index)
    errors = [out.error for out in outputs if out.error is not None]
    return replace(
        first,
        request_id=parent_id,
        outputs=completions,
        finished=all(out.finished for out in outputs),
        error=errors[0] if errors else None,
    )
