"""The sampler: one step's logits -> one token per row, for the whole batch at once, on the device.

As vLLM's samplers (vllm/v1/sample/sampler.py, and Model Runner V2's vllm/v1/worker/gpu/sample/), the
sampling parameters of the batch are tensors (`SamplingMetadata`, pagedkv/worker/sampling_metadata.py),
so the work is a handful of batched kernels however many requests there are, and nothing waits for the
device (the host reads the tokens later, through `SamplerOutput.to_host` / `rows`, which is what lets
async scheduling run ahead).

    logits [rows, vocab] -> logit bias, min_tokens, penalties (pagedkv/engine/logits_processors.py)
                         --argmax-------------------------------------------------> greedy rows
                         --/ temperature -> min-p -> top-k -> top-p -> weights w
                           -> u = hash(seed, position) in [0, 1): first column with
                              cumsum(w) > u * sum(w) (the inverse CDF) ---------------> random rows

The sampler is stateless: a row's randomness is one uniform, a hash of its request's seed and the
position of the token it draws (`uniform_noise`), not the state of a generator. So there is nothing
to snapshot or restore when a step is interrupted and run again, seeded and unseeded rows take the
same batched path, and a request's token at a position does not depend on its batch, chunking,
preemption, drafts or the step it is drawn in. Why one uniform per row and an inverse CDF, rather than
vLLM's per-column Gumbel noise: pagedkv/worker/sampling_metadata.py.

Rows with a top-k never touch the whole vocabulary after one `topk`: their k candidates, sorted, are all
that min-p, top-p and the draw need (sorting 151,936 logits per row is the expensive part of top-p). A
row without one draws over the vocabulary in two levels (`inverse_cdf_chunked`): sums of 1,024-column
chunks, the chunk holding u * total, then a cumulative sum inside it, which costs a pass of sums
instead of a sequential cumulative sum over every column (one CPU thread, 128 x 151,936: ~5 ms against
~50 ms). Zero-weight (filtered) columns are never chosen, not even when u * total rounds up to the total.

One thing outside a row can still reach its draw: `topk` may order exactly tied logits differently for
another k, and the batch's largest k sets the candidates' width; a draw landing among tied candidates
may then pick another of them (same probability, another id). Without the batch-invariant mode, float
rounding of reductions may also differ with the batch's shape, which moves a draw only when u falls
within a rounding of a boundary between two tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv import batch_invariant
from pagedkv.engine.logits_processors import apply_logits_processors
from pagedkv.engine.request import Request, SamplingParams
from pagedkv.worker.sampling_metadata import TARGET_SALT, SamplingMetadata, seed_as_int64, uniform_noise
from pagedkv.worker.states import RequestStates, RowSamplingParams, to_device


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
        # torch.cuda.Event.__new__ has no annotations in torch (torch/cuda/streams.py).
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
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


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids the model has no logit for (a logit_bias key, a stop token id): checked when a
    request is added, so that it never reaches an index on the device."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
        bad = sorted(t for t in ids if t >= vocab_size)
        if bad:
            raise ValueError(
                f"{name} names token id {bad[0]}, but the model's vocabulary has {vocab_size} tokens "
                f"(ids 0 to {vocab_size - 1})."
            )


def row_sampling_params(request: Request, vocab_size: int) -> RowSamplingParams:
    """A request's parameters as its row in the runner holds them: a greedy request's temperature as
    0.0, a top-k of the vocabulary or more as 0 (none), the seed as an int64; min_tokens' stop ids
    (its end-of-sequence ids unless it ignores them, and its stop token ids); with a penalty, a
    reference to its token list (`RowSamplingParams.token_ids`)."""
    params = request.sampling_params
    stop_ids = [] if params.ignore_eos else list(request.eos_token_ids)
    row = RowSamplingParams(
        temperature=0.0 if params.greedy else params.temperature,
        top_k=params.top_k if 0 < params.top_k < vocab_size else 0,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=seed_as_int64(request.sampling_seed),
        num_logprobs=-1 if params.logprobs is None else params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        num_prompt_tokens=request.num_prompt_tokens,
        logit_bias=tuple((params.logit_bias or {}).items()),
        min_tokens=params.min_tokens,
        min_tokens_stop_ids=tuple(dict.fromkeys([*stop_ids, *params.stop_token_ids])),
    )
    return dataclasses.replace(row, token_ids=request.all_token_ids) if row.penalized else row


def sampling_metadata(
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int] | torch.Tensor,
    vocab_size: int,
    device: torch.device | str,
    histories: list[tuple[list[int], list[int]]] | None = None,
    eos_token_ids: list[int] | None = None,
) -> SamplingMetadata:
    """A `SamplingMetadata` from host values, one entry per logits row: each row's parameters, its
    request's seed, and the position of the token it draws (a list, or a tensor on the device); for
    penalties, each row's (prompt, output) tokens, those before its position; for min_tokens, the
    end-of-sequence ids. Made as an engine step makes it, through request rows of its own
    (`RequestStates.sampling_metadata`), for driving a sampler directly (tests, exercises)."""
    requests = [
        Request(str(i), list(prompt), p, eos_token_ids or [], output_token_ids=list(output), sampling_seed=seed)
        for i, (p, seed, (prompt, output)) in enumerate(zip(params, seeds, histories or [([], [])] * len(params)))
    ]
    rows = [row_sampling_params(request, vocab_size) for request in requests]
    if histories is None and any(row.penalized for row in rows):
        raise ValueError("A row with a penalty needs its tokens: pass histories=[(prompt, output), ...].")
    width = max((r.num_tokens for r in requests), default=0) + 1
    states = RequestStates(len(params), width, [1], torch.device(device))
    for request, row in zip(requests, rows):
        states.stage_tokens(states.add(request.request_id, row), 0, request.all_token_ids)
    states.apply()
    if not isinstance(positions, torch.Tensor):
        positions = torch.tensor(positions, dtype=torch.int64)
    positions = positions.to(device, torch.int64, non_blocking=True)
    return states.sampling_metadata(np.arange(len(params)), positions)


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (the greedy token), and whether the row failed: held a NaN (argmax is the
    NaN's index) or was all -inf (argmax is some -inf), so no real token can be picked."""
    tokens = logits.argmax(dim=-1)
    best = logits.gather(1, tokens[:, None])[:, 0]
    return tokens, best.isnan() | (best == float("-inf"))


def with_logprobs(
    output: SamplerOutput, logits: torch.Tensor, max_num_logprobs: int | None, invariant: bool = False
) -> SamplerOutput:
    """`output` with the logprobs its rows ask for (the N most likely of each row, N the most any row
    asks for), its tokens' first. Without a full-vocabulary log-softmax: log p(token) = logit - logsumexp
    of the row, and the N most likely tokens are the N largest logits (the log-softmax only shifts a row)."""
    if max_num_logprobs is None:
        return output
    lse = rowwise(_LOGSUMEXP, logits, invariant)
    token_ids = torch.cat([output.token_ids[:, None], logits.topk(max_num_logprobs, dim=-1).indices], dim=1)
    output.logprob_token_ids, output.logprobs = token_ids, logits.gather(1, token_ids) - lse[:, None]
    return output


# Along the vocabulary, one row at a time: what `rowwise` runs in row blocks in the batch-invariant mode.
_SOFTMAX = functools.partial(torch.softmax, dim=-1)
_CUMSUM = functools.partial(torch.cumsum, dim=-1)
_LOGSUMEXP = functools.partial(torch.logsumexp, dim=-1)

CHUNK = 1024
"""Columns per chunk of the two-level inverse CDF over the vocabulary (`inverse_cdf_chunked`)."""


def _chunk_sums(weights: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(columns / CHUNK)]: each chunk's sum of `weights` [rows, columns] (the last chunk
    may be shorter)."""
    full = weights.shape[1] // CHUNK * CHUNK
    sums = [weights[:, :full].view(weights.shape[0], -1, CHUNK).sum(dim=-1)] if full else []
    if full < weights.shape[1]:
        sums.append(weights[:, full:].sum(dim=-1, keepdim=True))
    return torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, invariant: bool) -> torch.Tensor:
    """fn(rows); with `invariant`, in fixed-size blocks of rows, so that every call has the same shape
    and no kernel choice depends on how many rows there are (pagedkv/batch_invariant.py)."""
    return batch_invariant.row_blocks(fn, rows) if invariant else fn(rows)


def inverse_cdf(cdf: torch.Tensor, target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """[rows]: the first column whose cumulative weight `cdf` [rows, columns] exceeds `target` [rows]
    (u * total). `target` is held below `total` (the row's last cdf value): u < 1, but u * total may
    round up to it, and then no column would exceed it. With 0 <= target < total the column found has
    cdf[j] > target >= cdf[j - 1], so its own weight is positive: a filtered column is never chosen.
    (Clamped to the row: a NaN row, which fails anyway, must still index inside it.)"""
    below = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(target, below)
    column = torch.searchsorted(cdf, target[:, None].contiguous(), right=True)[:, 0]
    return column.clamp_(max=cdf.shape[1] - 1)


def inverse_cdf_chunked(weights: torch.Tensor, u: torch.Tensor, invariant: bool) -> torch.Tensor:
    """[rows]: a column of each row of `weights` [rows, columns] (>= 0, not normalised) drawn with
    probability proportional to its weight, by the uniform u [rows]: the inverse CDF in two levels.
    The chunk whose cumulative chunk sum first exceeds u * total, then the column inside it whose
    cumulative weight first exceeds what is left; only that chunk gets a cumulative sum."""
    rows, columns = weights.shape
    sums = rowwise(_chunk_sums, weights, invariant)
    chunk_cdf = rowwise(_CUMSUM, sums, invariant)
    total = chunk_cdf[:, -1]
    target = u * total
    chunk = inverse_cdf(chunk_cdf, target, total)
    before = chunk_cdf.gather(1, (chunk - 1).clamp(min=0)[:, None])[:, 0].masked_fill(chunk == 0, 0.0)
    offsets = chunk[:, None] * CHUNK + torch.arange(CHUNK, device=weights.device)
    inside = weights.gather(1, offsets.clamp(max=columns - 1)).masked_fill(offsets >= columns, 0.0)
    inside_cdf = rowwise(_CUMSUM, inside, invariant)
    # The chunk's own cumulative total may differ from its sum above by a rounding: `inverse_cdf`
    # holds the rest below it, so the column found still has a positive weight.
    column = inverse_cdf(inside_cdf, (target - before).clamp(min=0.0), inside_cdf[:, -1])
    return chunk * CHUNK + column


CPU_BLOCK_ELEMENTS = 16 * 151_936
"""Logits per block of whole-vocabulary rows on the CPU (9.7 MB of float32): the heap reuses it."""


class Sampler:
    """Greedy, or temperature + min-p + top-k + top-p sampling, batched and stateless: each random row
    draws by the inverse CDF of its distribution at a uniform hashed from its seed and position.
    With `batch_invariant`, each row's softmax, sums, cumulative sums and logsumexp run in fixed-shape
    blocks of rows."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [rows, vocab], `meta` one entry per row -> each row's next token."""
        logits = logits.float()
        # Bias, min_tokens, penalties: every row draws from (greedy rows: the argmax of) these.
        processed = apply_logits_processors(logits, meta)
        if meta.all_greedy:
            tokens, failed = argmax_rows(processed)
        else:
            # A row fails when it holds a NaN (amax is NaN) or is all -inf: as `argmax_rows` says it.
            row_max = processed.amax(dim=-1, keepdim=True)
            failed = row_max[:, 0].isnan() | (row_max[:, 0] == float("-inf"))
            tokens = self.draw(processed, row_max, meta)
            if not meta.all_random:  # greedy rows: the argmax, bit for bit as without random rows
                tokens = torch.where(meta.temperature == 0, processed.argmax(dim=-1), tokens)
        output = SamplerOutput(tokens.masked_fill(failed, 0), failed)
        # The logprobs are the model's own distribution's, before any of the above (vLLM's raw_logprobs).
        return with_logprobs(output, logits, meta.max_num_logprobs, self.batch_invariant)

    def draw(self, logits: torch.Tensor, row_max: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[rows] every row's random draw (greedy rows' are computed at temperature 1 and thrown away):
        through its top-k candidates if it has a top-k, else over the whole vocabulary."""
        u = uniform_noise(meta.seeds, meta.positions, TARGET_SALT)
        # Greedy rows (temperature 0) divide by 1 instead: their draws are discarded, and must not be NaN.
        temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
        by_top_k = self._draw_top_k(logits, meta, temperature, u) if meta.max_top_k else None
        if meta.all_top_k:
            assert by_top_k is not None
            return by_top_k
        whole = self._draw_whole_vocabulary(logits, row_max, meta, temperature, u)
        return whole if by_top_k is None else torch.where(meta.top_k > 0, by_top_k, whole)

    def _draw_top_k(
        self, logits: torch.Tensor, meta: SamplingMetadata, temperature: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        """Rows with a top-k: their k best tokens (one `topk` of the batch's largest k, sorted), then
        min-p and top-p on those columns, then the inverse CDF over them. Sorted, both filters keep a
        prefix of the columns, so one cumulative sum of the weights serves top-p and the draw."""
        width = meta.max_top_k
        values, token_ids = logits.topk(width, dim=-1)
        columns = torch.arange(width, device=logits.device)
        k = torch.where(meta.top_k > 0, meta.top_k, width)  # a row without one is drawn elsewhere
        # z = (logit - max) / temperature <= 0, and 0 in column 0 (the most likely token).
        z = ((values - values[:, :1]) / temperature[:, None]).masked_fill(columns >= k[:, None], float("-inf"))
        if meta.any_min_p:  # p / p_max = exp(z) >= min_p; log(0) = -inf keeps every column
            z = z.masked_fill(z < meta.min_p.log()[:, None], float("-inf"))
        weights = rowwise(torch.exp, z, self.batch_invariant)  # row blocks in the batch-invariant mode
        cdf = rowwise(_CUMSUM, weights, self.batch_invariant)
        limit = cdf[:, -1]  # the filtered columns add exact zeros: the last value is the kept total
        if meta.any_top_p:
            # A column is dropped when the columns before it already reach top_p of the total; the
            # kept ones are the first `kept` (column 0 always: nothing is before it).
            before = torch.cat([torch.zeros_like(cdf[:, :1]), cdf[:, :-1]], dim=1)
            kept = (before < meta.top_p[:, None] * limit[:, None]).sum(dim=-1)
            last = (kept - 1).clamp(min=0)  # kept 0: a NaN (or all -inf) row, which fails anyway
            limit = torch.where(meta.top_p < 1.0, cdf.gather(1, last[:, None])[:, 0], limit)
        column = inverse_cdf(cdf, u * limit, limit)
        return token_ids.gather(1, column[:, None])[:, 0]

    def _draw_whole_vocabulary(
        self,
        logits: torch.Tensor,
        row_max: torch.Tensor,
        meta: SamplingMetadata,
        temperature: torch.Tensor,
        u: torch.Tensor,
    ) -> torch.Tensor:
        """Rows without a top-k, in blocks of rows (`_whole_vocabulary_block`). On the CPU a [rows, vocab]
        temporary (78 MB for 128 x 151,936 floats) is mapped fresh by the allocator every step, and the
        page faults cost more than the arithmetic; blocks of CPU_BLOCK_ELEMENTS logits (9.7 MB, 16 rows of
        Qwen's vocabulary) reuse the heap. On a GPU the
        caching allocator keeps its memory: one block, fewer kernel launches. In the batch-invariant mode
        the blocks are always 16 rows (the last one zero-padded), so every kernel sees one shape."""
        rows = logits.shape[0]
        if logits.device.type != "cpu" and not self.batch_invariant:
            return self._whole_vocabulary_block(logits, row_max, meta, temperature, u, slice(None))
        # Invariant: always ROWS. Otherwise blocks of about CPU_BLOCK_ELEMENTS (16 rows of Qwen's vocabulary;
        # a small vocabulary's rows all in one block, where more blocks would only add calls).
        size = batch_invariant.ROWS
        if not self.batch_invariant:
            size = max(size, CPU_BLOCK_ELEMENTS // logits.shape[1])
        columns = []
        for start in range(0, rows, size):
            block = slice(start, min(start + size, rows))
            columns.append(self._whole_vocabulary_block(logits, row_max, meta, temperature, u, block))
        return torch.cat(columns)

    def _whole_vocabulary_block(
        self,
        logits: torch.Tensor,
        row_max: torch.Tensor,
        meta: SamplingMetadata,
        temperature: torch.Tensor,
        u: torch.Tensor,
        block: slice,
    ) -> torch.Tensor:
        """One block of rows: weights exp((logit - max) / temperature) over the vocabulary, min-p and top-p
        zeroing some, then the two-level inverse CDF in token order (the order must not depend on whether
        another row of the batch has a top-p: a row's token depends on its own row only)."""
        x, m, t, min_p, top_p, v = (a[block] for a in (logits, row_max, temperature, meta.min_p, meta.top_p, u))
        rows = x.shape[0]
        if self.batch_invariant and rows < batch_invariant.ROWS:  # padded rows: weights exp(0) = 1, dropped after
            pad = batch_invariant.ROWS - rows
            x, m = torch.cat([x, x.new_zeros(pad, x.shape[1])]), torch.cat([m, m.new_zeros(pad, 1)])
            t, top_p = torch.cat([t, t.new_ones(pad)]), torch.cat([top_p, top_p.new_ones(pad)])
            min_p, v = torch.cat([min_p, min_p.new_zeros(pad)]), torch.cat([v, v.new_zeros(pad)])
        inverse = (1.0 / t)[:, None]
        z = torch.addcmul(-m * inverse, x, inverse)  # (logit - max) / temperature, in one pass
        if meta.any_min_p:  # p / p_max = exp(z) >= min_p; log(0) = -inf keeps every column
            z.masked_fill_(z < min_p.log()[:, None], float("-inf"))
        if meta.any_top_p:
            # Stable: of equal logits, the lower token id counts as the more likely.
            values, order = z.sort(dim=-1, descending=True, stable=True)
            probs = rowwise(_SOFTMAX, values, self.batch_invariant)
            drop = rowwise(_CUMSUM, probs, self.batch_invariant) - probs >= top_p[:, None]
            drop &= (top_p < 1.0)[:, None]  # a row with top_p 1 drops nothing, not even by a rounding
            z.masked_fill_(drop.scatter(1, order, drop), float("-inf"))
        return inverse_cdf_chunked(z.exp_(), v, self.batch_invariant)[:rows]
