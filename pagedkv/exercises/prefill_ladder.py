"""Checker for notebook 15 (the prefill ladder): write rung 1, FlashAttention-2's causal prefill kernel.

    check_flash_prefill(kernel, launch)     launch(kernel, q, k, v, out, scale, block)

q, k, v and out are contiguous [num_tokens, num_heads, head_dim] float32 tensors of one sequence
(so one pair of strides serves all four); query t attends to keys 0..t. The kernel runs one
program per (query tile of `block` rows, head) and walks the key tiles of `block` keys with an
online softmax. Notebook 06's puzzle harness (`pagedkv.exercises.kernels.check_launches`) runs
it: a `@triton.jit` kernel is required (pagedkv's own refused), the launcher is watched (it may
allocate and view, not compute), and only then is the float64 reference worked out, in nested code.
Under Triton's interpreter the loads and stores are part of the verdict: program (i, h) loads only
its own query rows and the keys and values of head h before its tile's last query (the causal
skip: a key tile past the diagonal is never loaded), every row of out is written, and each load
of K or V takes at most one tile of `block` keys (the online softmax is what lets a program hold
one key tile at a time; a whole row of scores at once is rung 0 again).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pagedkv.exercises import CheckResult, exercise
from pagedkv.exercises.kernels import ACCESS_HINT, Case, Launch, _run_launcher, check_launches, unwritten
from pagedkv.platforms import default_device

WHAT = "flash prefill"
CASES = [(40, 2, 16, 16, 0), (37, 3, 32, 32, 1), (50, 1, 16, 16, 2)]
"""(num_tokens, num_heads, head_dim, block, seed): lengths that leave a partial last tile, and a
second tile size, so the launcher reads `block` and the shapes from its arguments."""
HINT = (
    "for key tiles start_n = 0, block, ... up to the tile's last query: s = q @ k^T * scale, -inf where "
    "key > query; m_new = max(m, max(s)), alpha = exp(m - m_new), p = exp(s - m_new), l = l * alpha + "
    "sum(p), acc = acc * alpha + p @ v; out = acc / l."
)


def _case(num_tokens: int, num_heads: int, head_dim: int, block: int, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(num_tokens, num_heads, head_dim, generator=gen) for _ in range(3))
    scale = head_dim**-0.5
    device = default_device()  # compiled Triton needs GPU tensors; the interpreter takes CPU ones
    args = [t.to(device, copy=True) for t in (q, k, v)]  # copies: a kernel writing them cannot change the reference
    out = torch.full(q.shape, float("nan"), device=device)

    def attend(t: int, h: int, last_key: int, scale: float) -> torch.Tensor:
        """float64 attention of query t, head h over keys 0..last_key, [head_dim]."""
        scores = k[: last_key + 1, h].double() @ q[t, h].double() * scale
        return torch.softmax(scores, 0) @ v[: last_key + 1, h].double()

    def reference() -> dict[str, torch.Tensor]:
        expected = torch.empty(q.shape, dtype=torch.float64)
        for t in range(num_tokens):
            for h in range(num_heads):
                expected[t, h] = attend(t, h, t, scale)
        return {"out": expected}

    def explain(name: str, index: tuple[int, ...], got: float, expected: Any) -> tuple[str, Any]:
        t, h, d = index
        tile_end = min((t // block + 1) * block, num_tokens) - 1
        near = {
            " (that is query t attending to every key: mask the keys after it with -inf)": attend(
                t, h, num_tokens - 1, scale
            ),
            f" (that is query t attending to every key of its tile, up to {tile_end}: the diagonal tile "
            "needs the causal mask, key > query gets -inf)": attend(t, h, tile_end, scale),
            " (that is the attention without the scale: multiply the scores by scale)": attend(t, h, t, 1.0),
        }
        shows = next((text for text, value in near.items() if abs(float(value[d]) - got) < 1e-4), "")
        if got != got:
            shows = unwritten(got, float("nan")) or " (a 0 / 0 or -inf - (-inf) on the way)"

        def work() -> str:
            scores = k[: t + 1, h].double() @ q[t, h].double() * scale
            weights = torch.softmax(scores, 0)
            values = v[: t + 1, h, d].double()
            return "\n".join(
                [
                    f"query {t}, head {h}: keys 0..{t} (causal); its tile is rows {t // block * block}.."
                    f"{min(t // block * block + block, num_tokens) - 1}, so its program loads key tiles up to there.",
                    f"scores q . k * {scale:.4f}: {_numbers(scores)}",
                    f"softmax weights: {_numbers(weights)}",
                    f"v[:, {h}, {d}] of those keys: {_numbers(values)}",
                    f"out[{t}, {h}, {d}] = sum of weight * v = {float(weights @ values):.4g}",
                ]
            )

        return shows, work

    def may_load(rows_of: Any) -> Any:
        """Program (i, h, 0) may load rows `rows_of(i)` of head h, every dim."""

        def allowed(program: tuple[int, int, int]) -> np.ndarray:
            mask = np.zeros(q.shape, dtype=bool)
            mask[rows_of(program[0]), program[1]] = True
            return mask

        return allowed

    return Case(
        args=[*args, out, scale, block],
        outputs={"out": out},
        description=f"{num_tokens} tokens, {num_heads} heads of {head_dim}, block {block}",
        reference=reference,
        explain=explain,
        inputs=dict(zip("qkv", args)),
        access={
            "rows_written": {"out": 1},
            "allowed": {
                "q": may_load(lambda i: slice(i * block, (i + 1) * block)),
                "k": may_load(lambda i: slice(0, (i + 1) * block)),
                "v": may_load(lambda i: slice(0, (i + 1) * block)),
            },
            "reasons": {
                "q": "outside the program's query tile (program (i, h) loads rows i * block ... of head h)",
                **{
                    name: "past its tile's last query, or of another head (causal: stop the key loop at the diagonal)"
                    for name in "kv"
                },
            },
        },
    )


def _numbers(values: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in values.tolist()) + "]"


def _whole_rows_loaded(kernel: Any, launch: Launch) -> CheckResult | None:
    """None, unless one load of K or V took more than one key tile (interpreter only: compiled, the
    loads cannot be recorded)."""
    case = _case(*CASES[0])
    block, row_size = case.args[-1], case.args[0].shape[1] * case.args[0].shape[2]
    logs: list[Any] = []
    _, rejected = _run_launcher([kernel], launch, case, WHAT, run=True, log=logs)
    if rejected is not None or not logs:
        return rejected
    for _, access in logs[0].accesses(kind="load"):
        keys = np.unique(access.offsets // row_size).size
        if access.tensor in ("k", "v") and access.inside and keys > block:
            return CheckResult(
                False,
                f"{WHAT}: the right values, but program {access.program[:2]} loads {keys} keys of {access.tensor} "
                f"in one load: a program holds one tile of block = {block} keys at a time and keeps a running "
                f"max, sum and output (online softmax), not a whole row of scores.\nHint: {ACCESS_HINT}",
            )
    return None


@exercise("15: rung 1, a FlashAttention-2 prefill kernel")
def check_flash_prefill(kernel: Any, launch: Launch) -> CheckResult:
    """Rung 1: `launch(kernel, q, k, v, out, scale, block)` writes causal attention of q, k, v into
    out, one program per (query tile of `block` rows, head), key tiles up to the diagonal."""
    result = check_launches([kernel], launch, [functools.partial(_case, *c) for c in CASES], WHAT, HINT)
    if not result:
        return result
    whole_rows = _whole_rows_loaded(kernel, launch)  # a CheckResult is falsy when it fails: test for None
    return result if whole_rows is None else whole_rows
