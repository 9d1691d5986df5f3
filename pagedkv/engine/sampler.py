"""The sampler: one step's logits -> one token per row, for the whole batch at once, on the device.

As vLLM's `Sampler` (vllm/v1/sample/sampler.py, vllm/v1/sample/ops/topk_topp_sampler.py), the
sampling parameters of the batch are tensors, so the work is a handful of batched kernels however
many requests there are; nothing waits for the device (the host reads the tokens later, through
`SamplerOutput.to_host` / `rows`, which is what lets async scheduling run ahead).

    logits [rows, vocab] --argmax--------------------------------------> greedy rows
                         --/ temperature -> min-p -> top-k -> top-p
                           -> softmax = p -> argmax(p / q), q ~ Exp(1) --> random rows

`argmax(p / q)` with independent exponential q is a draw from p (the "exponential race": token i
wins with probability p_i), which needs no cumulative sum and no host sync, unlike
`torch.multinomial`. Rows with a top-k never touch the whole vocabulary after one `topk`: their k
candidates, sorted, are all that top-p, min-p and the race need (sorting 151,936 logits per row
is the expensive part of top-p). A request with a seed draws its q from its own generator, so its
tokens depend on nothing else in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.engine.request import SamplingParams


@dataclass
class SamplerOutput:
    """One step's samples: on the device when made; `to_host` starts their copy to the host."""

    token_ids: torch.Tensor
    """[rows] int64: each row's token (0 in a failed row)."""
    failed: torch.Tensor
    """[rows] bool: the row's logits held NaN, or were all -inf: no token can be drawn."""
    logprob_token_ids: torch.Tensor | None = None
    """[rows, 1 + N] int64, when a row asked for N logprobs: the sampled token, then the N most likely."""
    logprobs: torch.Tensor | None = None
    """[rows, 1 + N] float32: their log-probabilities (of the model's distribution, before temperature)."""
    ready: torch.cuda.Event | None = None
    """Set by `to_host` on a GPU: done when the copies have landed."""

    def to_host(self) -> SamplerOutput:
        """The same samples on their way to pinned host memory (non-blocking; `rows` waits)."""
        if self.token_ids.device.type == "cpu":
            return self
        copy = [
            t if t is None else t.to("cpu", non_blocking=True)
            for t in (self.token_ids, self.failed, self.logprob_token_ids, self.logprobs)
        ]
        ready = torch.cuda.Event()
        ready.record()
        return SamplerOutput(*copy, ready=ready)

    def rows(
        self, req_ids: list[str], params: list[SamplingParams]
    ) -> list[tuple[int | Exception, dict[int, float] | None]]:
        """Per row, its token (or the error that ended its request) and the logprobs it asked for."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, failed = self.token_ids.tolist(), self.failed.tolist()
        top_ids = self.logprob_token_ids.tolist() if self.logprob_token_ids is not None else None
        top_lps = self.logprobs.tolist() if self.logprobs is not None else None
        out: list[tuple[int | Exception, dict[int, float] | None]] = []
        for row, (req_id, p) in enumerate(zip(req_ids, params)):
            if failed[row]:
                what = "greedy decoding has no token to choose" if p.greedy else "no token can be sampled"
                out.append((ValueError(f"request {req_id}: its logits hold NaN (or are all -inf), so {what}"), None))
                continue
            logprobs = None
            if p.logprobs is not None and top_ids is not None and top_lps is not None:
                logprobs = dict(zip(top_ids[row][: 1 + p.logprobs], top_lps[row][: 1 + p.logprobs]))
            out.append((tokens[row], logprobs))
        return out


class Sampler:
    """Greedy, or temperature + min-p + top-k + top-p sampling, batched, with optional per-request seeds."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        """A seeded request's own generator, made at its first sampled token."""

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]) -> SamplerOutput:
        """logits [rows, vocab] of the requests `req_ids` (in row order) -> their next tokens."""
        logits = logits.float()
        device = logits.device
        tokens = logits.argmax(dim=-1)
        # argmax of a row with a NaN is the NaN's index, of an all -inf row some -inf: no real token.
        best = logits.gather(1, tokens[:, None])[:, 0]
        failed = best.isnan() | (best == float("-inf"))
        # Rows by how they are drawn: with a top-k (k candidates), without (the whole vocabulary).
        candidate_rows = [i for i, p in enumerate(params) if not p.greedy and 0 < p.top_k < logits.shape[1]]
        full_rows = [i for i, p in enumerate(params) if not p.greedy and not 0 < p.top_k < logits.shape[1]]
        # A seeded request's generator state before this call: a step interrupted here (Ctrl-C)
        # is run again, and must draw the same tokens as if it had run once.
        states = {r: self._generators[r].get_state() for r in req_ids if r in self._generators}
        try:
            for rows, draw in ((candidate_rows, self._sample_top_k), (full_rows, self._sample_full)):
                if rows:
                    index = _index(rows, len(params), device)
                    sampled = draw(
                        logits if index is None else logits[index],
                        [params[i] for i in rows],
                        [self._generator(req_ids[i], params[i], device) for i in rows],
                    )
                    tokens = sampled if index is None else tokens.index_copy(0, index, sampled)
        except BaseException:
            for req_id, state in states.items():
                self._generators[req_id].set_state(state)
            for req_id in set(req_ids) - states.keys():  # made in this call: made again, freshly seeded
                self._generators.pop(req_id, None)
            raise
        output = SamplerOutput(tokens.masked_fill(failed, 0), failed)
        num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_logprobs is not None:
            output.logprob_token_ids, output.logprobs = _logprobs(logits, output.token_ids, num_logprobs)
        return output

    def _generator(self, req_id: str, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        if req_id not in self._generators:
            self._generators[req_id] = torch.Generator(device=device).manual_seed(params.seed)
        return self._generators[req_id]

    def _sample_top_k(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Rows that all have a top-k: filter and draw among each row's k best tokens only.

        logits [rows, vocab] --topk(max k)--> values [rows, K] (sorted), their token ids
        column j of a row with k <= j: -inf (so each row keeps its own k)
        """
        k = _to_device([p.top_k for p in params], logits.device)
        values, token_ids = logits.topk(int(max(p.top_k for p in params)), dim=-1)
        values = values.masked_fill(torch.arange(values.shape[1], device=logits.device) >= k[:, None], float("-inf"))
        values = _filter(values, params, sorted_descending=True)
        # A seeded row's noise covers its own k columns only, so that it does not depend on the
        # other rows' k; its columns beyond k have probability 0 whatever their noise.
        picks = self._race(values.softmax(dim=-1), generators, [p.top_k for p in params])
        return token_ids.gather(1, picks[:, None])[:, 0]

    def _sample_full(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Rows without a top-k: filter and draw over the whole vocabulary."""
        probs = _filter(logits, params, sorted_descending=False).softmax(dim=-1)
        return self._race(probs, generators, [probs.shape[1]] * len(params))

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator | None], widths: list[int]) -> torch.Tensor:
        """One draw per row of `probs`: argmax(p / q), q ~ Exp(1); a seeded row's q (its first
        `width` columns) from its own generator, one request after the other."""
        noise = torch.empty_like(probs).exponential_()
        for row, (generator, width) in enumerate(zip(generators, widths)):
            if generator is not None:
                self._seeded_noise(noise[row, :width], generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _seeded_noise(row: torch.Tensor, generator: torch.Generator) -> None:
        """Fill one seeded request's row of the race's noise from its own generator."""
        row.exponential_(generator=generator)


def _to_device(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied without waiting: `torch.tensor(values, device=...)`
    would wait for everything queued on the GPU (the forward just launched) before copying."""
    return torch.tensor(values).to(device, non_blocking=True)


def _index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """`rows` as an index tensor; None when they are every row in order (no gather needed)."""
    return None if rows == list(range(num_rows)) else _to_device(rows, device)


def _filter(logits: torch.Tensor, params: list[SamplingParams], sorted_descending: bool) -> torch.Tensor:
    """Temperature, then min-p, then top-p (vLLM's order; top-k was applied by the caller).

    min-p keeps tokens whose probability is at least min_p x the largest one, i.e. whose logit is
    within log(min_p) of the row's max (no softmax needed). top-p keeps the smallest set of the
    most likely tokens whose probability reaches top_p: a token is dropped when the tokens before
    it (in descending order) already reach it, so the most likely one always stays.
    """
    device = logits.device
    temperature = _to_device([p.temperature for p in params], device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = _to_device([p.min_p for p in params], device)
        low = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # log(0) = -inf keeps all
        logits = logits.masked_fill(logits < low, float("-inf"))
    if all(p.top_p >= 1.0 for p in params):
        return logits
    top_p = _to_device([p.top_p for p in params], device)
    if sorted_descending:
        values, order = logits, None
    else:  # stable: of equal logits, the lower token id counts as the more likely
        values, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = values.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    if order is not None:
        drop = drop.scatter(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sampled token and its n most likely, with their log-probabilities ([rows, 1 + n])."""
    logprobs = logits.log_softmax(dim=-1)
    top = logprobs.topk(n, dim=-1)
    token_ids = torch.cat([sampled[:, None], top.indices], dim=1)
    return token_ids, logprobs.gather(1, token_ids)
