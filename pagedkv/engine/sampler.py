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
tokens depend on nothing else in the batch. `target_probs` (the filtered p) is shared with the
rejection sampler of speculative decoding (pagedkv/engine/rejection_sampler.py), which verifies
drafts against the same p.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedkv import batch_invariant
from pagedkv.engine.request import SamplingParams


@dataclass
class SamplerOutput:
    """One step's samples: on the device when made; `to_host` starts their copy to the host.

    A request has one row, or under speculative decoding 1 + k rows (its k drafts verified, vLLM's
    vllm/v1/sample/rejection_sampler.py), of which it emits the first `num_tokens`.
    """

    token_ids: torch.Tensor
    """[rows] int64: each row's token (0 in a failed row)."""
    failed: torch.Tensor
    """[rows] bool: the row's logits held NaN, or were all -inf: no token can be drawn."""
    logprob_token_ids: torch.Tensor | None = None
    """[rows, 1 + N] int64, when a row asked for N logprobs: the row's token, then the N most likely."""
    logprobs: torch.Tensor | None = None
    """[rows, 1 + N] float32: their log-probabilities (of the model's distribution, before temperature)."""
    num_rows: list[int] | None = None
    """Per request, its number of rows (1 + its drafts); None: one row each."""
    num_tokens: torch.Tensor | None = None
    """[requests] int64: the tokens each request emits this step (accepted drafts + 1); None: one each."""
    ready: torch.cuda.Event | None = None
    """Set by `to_host` on a GPU: done when the copies have landed."""

    def to_host(self) -> SamplerOutput:
        """The same samples on their way to pinned host memory (non-blocking; `rows` waits)."""
        if self.token_ids.device.type == "cpu":
            return self
        names = ("token_ids", "failed", "logprob_token_ids", "logprobs", "num_tokens")
        copies = {n: t.to("cpu", non_blocking=True) for n in names if (t := getattr(self, n)) is not None}
        ready = torch.cuda.Event()
        ready.record()
        return dataclasses.replace(self, **copies, ready=ready)

    def last_token_ids(self) -> torch.Tensor:
        """[requests] on the device: each request's last emitted token (the next step's input)."""
        if self.num_rows is None or self.num_tokens is None:
            return self.token_ids
        starts = [0]
        for n in self.num_rows[:-1]:
            starts.append(starts[-1] + n)
        return self.token_ids[to_device(starts, self.token_ids.device) + self.num_tokens - 1]

    def rows(
        self, req_ids: list[str], params: list[SamplingParams]
    ) -> list[tuple[list[int] | Exception, list[dict[int, float]] | None]]:
        """Per request, its emitted tokens (or the error that ended it) and the logprobs it asked
        for (one dict per emitted token)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, failed = self.token_ids.tolist(), self.failed.tolist()
        top_ids = self.logprob_token_ids.tolist() if self.logprob_token_ids is not None else None
        top_lps = self.logprobs.tolist() if self.logprobs is not None else None
        num_rows = self.num_rows or [1] * len(req_ids)
        num_tokens = self.num_tokens.tolist() if self.num_tokens is not None else [1] * len(req_ids)
        out: list[tuple[list[int] | Exception, list[dict[int, float]] | None]] = []
        start = 0
        for req_id, p, n_rows, n_tokens in zip(req_ids, params, num_rows, num_tokens):
            emitted, start = range(start, start + n_tokens), start + n_rows
            if any(failed[row] for row in emitted):  # a failed row the request did not reach does not end it
                what = "greedy decoding has no token to choose" if p.greedy else "no token can be sampled"
                out.append((ValueError(f"request {req_id}: its logits hold NaN (or are all -inf), so {what}"), None))
                continue
            logprobs = None
            if p.logprobs is not None and top_ids is not None and top_lps is not None:
                n = 1 + p.logprobs
                logprobs = [dict(zip(top_ids[row][:n], top_lps[row][:n])) for row in emitted]
            out.append(([tokens[row] for row in emitted], logprobs))
        return out


@dataclass
class TargetProbs:
    """The sampling distribution p of some rows of a batch (all with a top-k, or all without): the
    logits after temperature, min-p, top-k and top-p, softmaxed; what a token is drawn from."""

    rows: list[int]
    """The batch rows, in order."""
    index: torch.Tensor | None
    """`rows` on the device; None when they are every row of the batch in order."""
    probs: torch.Tensor
    """[len(rows), columns] float32: p over each row's columns."""
    column_token_ids: torch.Tensor | None
    """[len(rows), columns]: the token of each column (a top-k row's candidates, most likely
    first); None: column j is token j (the whole vocabulary)."""
    widths: list[int]
    """Per row, the columns it may use (its top-k, or the vocabulary): a seeded row's noise covers
    only these, so that it does not depend on the other rows' k."""

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """This group's entries of a [batch rows] tensor."""
        return values if self.index is None else values[self.index]

    def put(self, values: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """`into` [batch rows] with this group's rows replaced by `values` [len(rows)]."""
        return values if self.index is None else into.index_copy(0, self.index, values)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """[len(rows)] column per row -> its token id."""
        if self.column_token_ids is None:
            return columns
        return self.column_token_ids.gather(1, columns[:, None])[:, 0]

    def is_token(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[len(rows), columns] bool: the columns holding each row's `token_ids` entry (none for -1)."""
        if self.column_token_ids is None:
            return torch.arange(self.probs.shape[1], device=self.probs.device) == token_ids[:, None]
        return self.column_token_ids == token_ids[:, None]


def target_probs(logits: torch.Tensor, params: list[SamplingParams], invariant: bool = False) -> list[TargetProbs]:
    """p of every non-greedy row of `logits` [rows, vocab] (float32), `params` one per row: the rows
    with a top-k over their k best tokens only (one `topk`, sorted), the others over the vocabulary.
    `invariant`: each row's softmax and top-p sums independent of the other rows (`rowwise`)."""
    vocab, device = logits.shape[1], logits.device
    rows_by_kind: dict[bool, list[int]] = {True: [], False: []}  # with a top-k or not
    for i, p in enumerate(params):
        if not p.greedy:
            rows_by_kind[0 < p.top_k < vocab].append(i)
    groups = []
    for top_k, rows in rows_by_kind.items():
        if not rows:
            continue
        index = _index(rows, len(params), device)
        group_logits, group_params = logits if index is None else logits[index], [params[i] for i in rows]
        if top_k:
            # values [rows, K] (sorted) and their token ids; column j of a row with k <= j: -inf.
            k = to_device([p.top_k for p in group_params], device)
            values, column_token_ids = group_logits.topk(int(max(p.top_k for p in group_params)), dim=-1)
            values = values.masked_fill(torch.arange(values.shape[1], device=device) >= k[:, None], float("-inf"))
            probs = rowwise(_SOFTMAX, _filter(values, group_params, True, invariant), invariant)
            groups.append(TargetProbs(rows, index, probs, column_token_ids, [p.top_k for p in group_params]))
        else:
            probs = rowwise(_SOFTMAX, _filter(group_logits, group_params, False, invariant), invariant)
            groups.append(TargetProbs(rows, index, probs, None, [vocab] * len(rows)))
    return groups


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (the greedy token), and whether the row failed: held a NaN (argmax is the
    NaN's index) or was all -inf (argmax is some -inf), so no real token can be picked."""
    tokens = logits.argmax(dim=-1)
    best = logits.gather(1, tokens[:, None])[:, 0]
    return tokens, best.isnan() | (best == float("-inf"))


def with_logprobs(
    output: SamplerOutput, logits: torch.Tensor, params: list[SamplingParams], invariant: bool = False
) -> SamplerOutput:
    """`output` with the logprobs its rows ask for (`params` one per row), its tokens' first."""
    n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if n is not None:
        logprobs = rowwise(_LOG_SOFTMAX, logits, invariant)
        token_ids = torch.cat([output.token_ids[:, None], logprobs.topk(n, dim=-1).indices], dim=1)
        output.logprob_token_ids, output.logprobs = token_ids, logprobs.gather(1, token_ids)
    return output


# Along the vocabulary, one row at a time: what `rowwise` runs in row blocks in the batch-invariant mode.
_SOFTMAX = functools.partial(torch.softmax, dim=-1)
_LOG_SOFTMAX = functools.partial(torch.log_softmax, dim=-1)
_CUMSUM = functools.partial(torch.cumsum, dim=-1)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, invariant: bool) -> torch.Tensor:
    """fn(rows); with `invariant`, in fixed-size blocks of rows, so that every call has the same shape
    and no kernel choice depends on how many rows there are (pagedkv/batch_invariant.py)."""
    return batch_invariant.row_blocks(fn, rows) if invariant else fn(rows)


class Sampler:
    """Greedy, or temperature + min-p + top-k + top-p sampling, batched, with optional per-request seeds.
    With `batch_invariant`, each row's softmax, log-softmax and top-p sums run in fixed-shape blocks."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self._generators: dict[str, torch.Generator] = {}
        """A seeded request's own generator, made at its first sampled token."""

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]) -> SamplerOutput:
        """logits [rows, vocab] of the requests `req_ids` (in row order) -> their next tokens."""
        logits = logits.float()
        tokens, failed = argmax_rows(logits)
        with self.restoring_generators(req_ids):
            for group in target_probs(logits, params, self.batch_invariant):
                generators = [self.generator(req_ids[i], params[i], logits.device) for i in group.rows]
                tokens = group.put(group.token_ids(self.race(group.probs, generators, group.widths)), tokens)
        output = SamplerOutput(tokens.masked_fill(failed, 0), failed)
        return with_logprobs(output, logits, params, self.batch_invariant)

    @contextmanager
    def restoring_generators(self, req_ids: list[str]) -> Iterator[None]:
        """On an exception, put the requests' generators back as they were before: a step
        interrupted here (Ctrl-C) is run again, and must draw the same tokens as if it had run once."""
        states = {r: self._generators[r].get_state() for r in req_ids if r in self._generators}
        try:
            yield
        except BaseException:
            for req_id, state in states.items():
                self._generators[req_id].set_state(state)
            for req_id in set(req_ids) - states.keys():  # made in this call: made again, freshly seeded
                self._generators.pop(req_id, None)
            raise

    def generator(self, req_id: str, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        """A seeded request's own generator (made, seeded, at its first use); None without a seed."""
        if params.seed is None:
            return None
        if req_id not in self._generators:
            self._generators[req_id] = torch.Generator(device=device).manual_seed(params.seed)
        return self._generators[req_id]

    def race(self, probs: torch.Tensor, generators: list[torch.Generator | None], widths: list[int]) -> torch.Tensor:
        """One draw (a column) per row of `probs`: argmax(p / q), q ~ Exp(1); a seeded row's q (its
        first `width` columns) from its own generator, one row after the other."""
        noise = torch.empty_like(probs).exponential_()
        for row, (generator, width) in enumerate(zip(generators, widths)):
            if generator is not None:
                self._seeded_noise(noise[row, :width], generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _seeded_noise(row: torch.Tensor, generator: torch.Generator) -> None:
        """Fill one seeded row of the race's noise from its request's own generator."""
        row.exponential_(generator=generator)


def to_device(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied without waiting: `torch.tensor(values, device=...)`
    would wait for everything queued on the GPU (the forward just launched) before copying."""
    return torch.tensor(values).to(device, non_blocking=True)


def _index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """`rows` as an index tensor; None when they are every row in order (no gather needed)."""
    return None if rows == list(range(num_rows)) else to_device(rows, device)


def _filter(
    logits: torch.Tensor, params: list[SamplingParams], sorted_descending: bool, invariant: bool = False
) -> torch.Tensor:
    """Temperature, then min-p, then top-p (vLLM's order; top-k was applied by the caller).

    min-p keeps tokens whose probability is at least min_p x the largest one, i.e. whose logit is
    within log(min_p) of the row's max (no softmax needed). top-p keeps the smallest set of the
    most likely tokens whose probability reaches top_p: a token is dropped when the tokens before
    it (in descending order) already reach it, so the most likely one always stays.
    """
    device = logits.device
    temperature = to_device([p.temperature for p in params], device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], device)
        low = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # log(0) = -inf keeps all
        logits = logits.masked_fill(logits < low, float("-inf"))
    if all(p.top_p >= 1.0 for p in params):
        return logits
    top_p = to_device([p.top_p for p in params], device)
    if sorted_descending:
        values, order = logits, None
    else:  # stable: of equal logits, the lower token id counts as the more likely
        values, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = rowwise(_SOFTMAX, values, invariant)
    drop = rowwise(_CUMSUM, probs, invariant) - probs >= top_p[:, None]
    if order is not None:
        drop = drop.scatter(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))
