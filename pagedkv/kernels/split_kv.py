"""Split-KV scratch and the merge kernel.

When one sequence's keys are split over S programs, program s returns the attention of the
query over its share of the keys, already normalised (`o_s`), and the log-sum-exp of its
scores (`lse_s`, base 2). Softmax over the union of the shares is the weighted mix

    out = sum_s w_s * o_s,    w_s = 2^(lse_s - lse),    lse = log2(sum_s 2^lse_s)

because `2^lse_s` is exactly the softmax denominator of share s. The merge subtracts the
largest `lse_s` before exponentiating, so nothing overflows; an empty share has
`lse_s = -inf` and weight 0, and a sequence with no keys at all (every share empty, e.g. an MLA
decode of length 0) merges to 0.

With programmatic dependent launch (`early_launch=True`, Hopper and later) the merge is launched while
the attention kernel still runs: its programs take their places on the SMs as the attention
programs leave, and wait (`gdc_wait`, in hardware) until the attention kernel has finished and
its writes are visible. The attention kernel must allow it early (`gdc_launch_dependents`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.common import next_power_of_2


class SplitKVWorkspace:
    """Scratch for split-KV partial results; allocate once, reuse every step (CUDA-graph safe).

    `rows` bounds `num_tokens * num_splits` of a call: the launcher picks fewer splits rather
    than overflow it.
    """

    def __init__(self, rows: int, num_q_heads: int, head_size: int, device: torch.device | str) -> None:
        self.rows = rows
        self.partial_out = torch.empty(rows, num_q_heads, head_size, dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(rows, num_q_heads, dtype=torch.float32, device=device)
        self._last: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def views(self, num_tokens: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `num_tokens * num_splits` rows (row = token * num_splits + split); no copy.

        Every layer of a step asks for the same rows, so the last pair of views is reused
        (slicing costs a few microseconds of host time per call).
        """
        needed = num_tokens * num_splits
        if needed > self.rows:
            raise ValueError(f"split-KV workspace has {self.rows} rows, this call needs {needed}")
        if self._last is None or self._last[0] != needed:
            self._last = (needed, (self.partial_out[:needed], self.partial_lse[:needed]))
        return self._last[1]


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])  # per-step values: no variant per value
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_splits,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_po_r,
    stride_po_h,
    stride_po_d,
    stride_lse_r,
    stride_lse_h,
    SPLITS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # query_start_loc is an input of the attention kernel, complete before that kernel started:
    # read while waiting for it, the padding check costs no round trip to memory after the wait
    # (up to 1 point of bandwidth for the MLA decode at 32 x 4096 on an H200).
    num_tokens = tl.load(query_start_loc_ptr + num_reqs)
    if EARLY_LAUNCH:
        tl.extra.cuda.gdc_wait()  # launched early: the partials are complete only from here on
    if token >= num_tokens:
        return  # a padding token: no program wrote its partials

    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    rows = token.to(tl.int64) * num_splits + splits
    split_ok = splits < num_splits
    lse = tl.load(partial_lse_ptr + rows * stride_lse_r + head * stride_lse_h, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # all empty: weights 0, not NaN
    total = tl.sum(weights, 0)
    weights = weights / tl.where(total == 0.0, 1.0, total)  # ... and the merged output 0
    parts = tl.load(
        partial_out_ptr + rows[:, None] * stride_po_r + head * stride_po_h + dims[None, :] * stride_po_d,
        mask=split_ok[:, None] & (dims[None, :] < HEAD_SIZE),
        other=0.0,
    )
    merged = tl.sum(parts * weights[:, None], 0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims * stride_o_d, merged, mask=dims < HEAD_SIZE)


def merge_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_splits: int,
    early_launch: bool = False,
) -> None:
    """out[t, h] = log-sum-exp weighted mix of the `num_splits` partial rows of token t.

    `early_launch`: launch early, behind an attention kernel that calls `gdc_launch_dependents` (the
    caller checks `is_hopper_or_newer`)."""
    num_tokens, num_q_heads, head_size = out.shape
    _merge_splits_kernel[(num_tokens, num_q_heads)](
        out,
        partial_out,
        partial_lse,
        query_start_loc,
        query_start_loc.shape[0] - 1,
        num_splits,
        *out.stride(),
        *partial_out.stride(),
        *partial_lse.stride(),
        SPLITS_PAD=next_power_of_2(num_splits),
        HEAD_SIZE=head_size,
        HEAD_PAD=next_power_of_2(head_size),
        EARLY_LAUNCH=early_launch,
        num_warps=1 if head_size * num_splits <= 2048 else 4,
        launch_pdl=early_launch,
    )
