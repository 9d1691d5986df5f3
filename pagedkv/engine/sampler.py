"""The sampler: logits of the requests that finished their tokens this step -> next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.engine.request import SamplingParams


@dataclass
class SamplerOutput:
    """The tokens of one step's sampling rows (interim: the row-by-row sampler's results)."""

    token_ids: torch.Tensor
    error_rows: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    _results: list[int | Exception] = field(default_factory=list, repr=False)

    def to_host(self) -> SamplerOutput:
        return self

    def rows(self, req_ids: list[str], params: list[SamplingParams]) -> list[tuple[int | Exception, dict[int, float] | None]]:
        return [(t, None) for t in self._results]


class Sampler:
    """Greedy, or temperature + top-k + top-p sampling with an optional per-request seed."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]) -> SamplerOutput:
        results = self._sample_rows(logits, req_ids, params)
        ids = torch.tensor([0 if isinstance(t, Exception) else t for t in results], device=logits.device)
        errors = torch.tensor([isinstance(t, Exception) for t in results], device=logits.device)
        return SamplerOutput(ids, errors, _results=results)

    def _sample_rows(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]) -> list[int | Exception]:
        """logits [num_reqs, vocab] -> per row, the next token id, or the exception sampling it raised.

        Rows are sampled one request at a time, so one request's failure (logits that are all NaN,
        say) is reported for that request alone and the other rows still get their tokens.
        """
        logits = logits.float()
        tokens: list[int | Exception] = logits.argmax(dim=-1).tolist()
        # argmax of a row with a NaN is the NaN's index, of an all -inf row index 0: no real token.
        broken = (logits.isnan().any(-1) | (logits == float("-inf")).all(-1)).tolist()
        # A seeded request's generator state before this call: a step interrupted here (Ctrl-C)
        # is run again, and must draw the same tokens as if it had run once.
        states = {r: g.get_state() for r, g in self._generators.items() if r in req_ids}
        try:
            for row, (req_id, p) in enumerate(zip(req_ids, params)):
                if p.greedy:
                    if broken[row]:
                        tokens[row] = ValueError(f"request {req_id}: its logits hold NaN (or are all -inf), so "
                                                 "greedy decoding has no token to choose")
                    continue
                try:
                    tokens[row] = int(self._sample(logits[row], p, self._generator(req_id, p, logits.device)))
                except Exception as error:  # noqa: BLE001 -- attributed to this request by the caller
                    tokens[row] = error
        except BaseException:
            for req_id, state in states.items():
                self._generators[req_id].set_state(state)
            for req_id in set(req_ids) - states.keys():  # made in this call: made again, freshly seeded
                self._generators.pop(req_id, None)
            raise
        return tokens

    def _generator(self, req_id: str, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        if req_id not in self._generators:
            self._generators[req_id] = torch.Generator(device=device).manual_seed(params.seed)
        return self._generators[req_id]

    @staticmethod
    def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
        logits = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Drop a token when the tokens before it already reach top_p (the first always stays).
            drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
