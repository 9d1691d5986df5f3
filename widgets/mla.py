"""Notebook 11's views of multi-head latent attention: the decode / prefill split of a step, and
what the latent cache saves against the same model with MHA.

    MLASplitView(trace)           one step's tokens: which went to forward_mqa, which to forward_mha
    cache_bytes(config)           bytes per token per layer: MLA's latent row vs every head's K and V
    latent_cache_table(models)    the same for several model shapes, as HTML, with the tokens that fit
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedkv.kv_cache.spec import MLAAttentionSpec
from pagedkv.models.configs import DeepseekV2Config
from pagedkv.trace import AttentionGroupInfo, MLASplitRecord, RequestRecord, StepRecord
from pagedkv.widgets.common import (
    ACCENT,
    BASE_STYLE,
    BG_HEADER,
    BORDER,
    FG_MUTED,
    PALETTE,
    SVG_STYLE,
    TraceView,
    esc,
)

# Two colours of the request palette (>= 3:1 on the light and the dark background), one per
# representation: blue = latent space (forward_mqa attends over the cached latent rows; the
# latent cache), vermillion = per-head K and V (forward_mha up-projects them; an MHA cache).
LATENT_COLOR = PALETTE[0]
HEADS_COLOR = PALETTE[1]

PATHS = {
    "forward_mqa": (
        LATENT_COLOR,
        "decodes: W_UK absorbed into the query, every head attends over the same latent rows (MQA with one KV head)",
    ),
    "forward_mha": (
        HEADS_COLOR,
        "prefills: each latent up-projected to per-head K and V by kv_b_proj, ordinary causal attention",
    ),
}

MAX_CELL = 22
"""Width of one token's cell in the strip; narrower when the step has many tokens."""
STRIP_WIDTH = 960
HEAD_CELLS = 6
"""A request with more tokens than HEAD_CELLS + 2 shows its first HEAD_CELLS, a "+n" cell, its last."""


@dataclass(frozen=True)
class _Group:
    """One request's run of tokens in the strip."""

    request: RequestRecord
    path: str
    first_token: int
    """Index of its first token in the step."""
    cells: list[str]
    """Cell labels: a position, or "+n" for n positions left out."""


def _groups(record: StepRecord, split: MLASplitRecord) -> list[_Group]:
    """The step's requests in batch order, each with its path and the cells it is drawn with."""
    groups, token = [], 0
    for i, request in enumerate(record.scheduled):
        start, n = request.num_computed_tokens, request.num_new_tokens
        positions = [str(p) for p in range(start, start + n)]
        if n > HEAD_CELLS + 2:
            positions = [*positions[:HEAD_CELLS], f"+{n - HEAD_CELLS - 1}", positions[-1]]
        path = "forward_mqa" if i < split.num_decodes else "forward_mha"
        groups.append(_Group(request, path, token, positions))
        token += n
    return groups


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + "s" * (n != 1)


def _tooltip(group: _Group) -> str:
    r = group.request
    first, last_position = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens - 1
    if r.phase == "decode":
        what = f"decode of position {first}"
    elif last_position < r.num_prompt_tokens:
        what = f"prefill of prompt positions {first}-{last_position} of {r.num_prompt_tokens}"
    else:  # a preempted request recomputes its generated tokens too
        generated = last_position + 1 - r.num_prompt_tokens
        what = (
            f"recompute of positions {first}-{last_position} ({r.num_prompt_tokens} prompt + "
            f"{_count(generated, 'generated token')})"
        )
    last = group.first_token + r.num_new_tokens - 1
    return f"request {r.req_id}: {what}; step tokens {group.first_token}-{last} -> {group.path}"


class MLASplitView(TraceView):
    """One step's tokens in batch order, coloured by the attention path the MLA backend sent them to.

        tokens  | r0 | r1 | r2 |  r3 r3 r3 r3 r3  |  r4 r4 r4  |
                | forward_mqa -|--------- forward_mha ---------|
                0              num_decode_tokens               num_actual_tokens

    The split is the metadata builder's (`StepRecord.mla_split`): the leading requests with one
    query token are decodes, everything from the first longer request on is a prefill. Cells show
    token positions; a long prefill chunk is drawn with its first positions, a "+n" cell and its last.
    """

    def render(self, record: StepRecord) -> str:
        split = record.mla_split
        if split is None:
            why = (
                "this trace was recorded before traces kept the split (StepRecord.mla_split): record it again"
                if self._mla_group() is not None
                else f"{esc(self.engine.model)} has no MLA layers, so no decode / prefill split to draw (try tiny-mla)"
            )
            return (
                f'<div class="pkv-mla-split" data-step="{record.step}" style="{BASE_STYLE}; color: {FG_MUTED}">'
                f"step {record.step}: {why}.</div>"
            )
        groups = _groups(record, split)
        return (
            f'<div class="pkv-mla-split" data-step="{record.step}" data-num-decode-tokens="{split.num_decode_tokens}" '
            f'style="{BASE_STYLE}">{self._caption(record, split, groups)}{self._strip(split, groups)}'
            f"{self._legend()}</div>"
        )

    def _mla_group(self) -> AttentionGroupInfo | None:
        """The engine's (first) attention group of MLA layers, or None for a model without them."""
        return next((g for g in self.engine.attention_groups if g.spec.kind == MLAAttentionSpec.__name__), None)

    def _caption(self, record: StepRecord, split: MLASplitRecord, groups: list[_Group]) -> str:
        group = self._mla_group()
        backend = f" &middot; {esc(group.backend)}, latent rows of {group.spec.head_size} values" if group else ""
        text = (
            f"<b>step {record.step}</b> &middot; {_count(record.num_tokens, 'token')}: "
            f"{_count(split.num_decodes, 'decode')} ({_count(split.num_decode_tokens, 'token')}) &rarr; "
            f"<b>forward_mqa</b>; {_count(split.num_prefills, 'prefill')} "
            f"({_count(split.num_prefill_tokens, 'token')}) &rarr; <b>forward_mha</b>{backend}"
        )
        # The split goes by query length, the scheduler's phase by whether the prompt is done.
        for g in groups:
            if g.request.phase == "prefill" and g.path == "forward_mqa":
                text += (
                    f"<div style='color: {FG_MUTED}'>request {esc(g.request.req_id)} is still prefilling, "
                    "but its chunk is one token right after the decodes: forward_mqa computes it "
                    "(both paths give the same attention).</div>"
                )
        return f"<div>{text}</div>"

    def _strip(self, split: MLASplitRecord, groups: list[_Group]) -> str:
        gap = 6
        num_cells = sum(len(g.cells) for g in groups)
        cell = min(MAX_CELL, (STRIP_WIDTH - gap * len(groups)) / max(num_cells, 1))
        parts, x, boundary = [], 0.0, None
        for g in groups:
            if g.path == "forward_mha" and boundary is None:
                boundary = x - gap / 2
            color = LATENT_COLOR if g.path == "forward_mqa" else HEADS_COLOR
            label = f"r{g.request.req_id}"
            body = [f"<title>{esc(_tooltip(g))}</title>"]
            if len(g.cells) * cell >= 6 * len(label):  # the request's label fits above its cells
                body.append(f'<text x="{x:.1f}" y="11" font-size="10">{esc(label)}</text>')
            for text in g.cells:
                body.append(
                    f'<rect x="{x:.1f}" y="16" width="{cell - 2:.1f}" height="24" rx="2" fill="{color}" '
                    f'fill-opacity="0.22" stroke="{color}" stroke-width="1.5"/>'
                )
                if cell >= 16:  # room for a position number
                    body.append(
                        f'<text x="{x + (cell - 2) / 2:.1f}" y="32" font-size="9" text-anchor="middle">'
                        f"{esc(text)}</text>"
                    )
                x += cell
            parts.append(
                f'<g class="pkv-mla-request" data-req-id="{esc(g.request.req_id)}" data-path="{g.path}">'
                f"{''.join(body)}</g>"
            )
            x += gap
        width = max(x - gap, 1.0)
        if boundary is None:  # decodes only: the boundary is the end of the batch
            boundary = width + 1
        label = f"num_decode_tokens = {split.num_decode_tokens}"
        label_width = 6.2 * len(label)  # px of 10 px monospace
        # Right of the line where it fits in the strip (or has no room on the left), else left of it.
        right = boundary + 4 + label_width <= STRIP_WIDTH or boundary < label_width + 4
        text_x, anchor = (boundary + 4, "start") if right else (boundary - 4, "end")
        parts.append(
            f'<g class="pkv-mla-boundary"><line x1="{boundary:.1f}" y1="2" x2="{boundary:.1f}" y2="46" '
            f'style="stroke: {ACCENT}" stroke-width="2" stroke-dasharray="4 2"/>'
            f'<text x="{text_x:.1f}" y="56" font-size="10" text-anchor="{anchor}" style="fill: {ACCENT}">'
            f"{label}</text></g>"
        )
        if right:
            width = max(width, boundary + 4 + label_width)
        return (
            f'<svg class="pkv-mla-strip" width="{width + 8:.0f}" height="60" viewBox="-4 0 {width + 8:.0f} 60" '
            f'style="max-width: 100%; margin-top: 6px; {SVG_STYLE}" xmlns="http://www.w3.org/2000/svg">'
            f"{''.join(parts)}</svg>"
        )

    def _legend(self) -> str:
        items = [
            f"<div>{_bar(10, color)} <b>{path}</b> <span style='color: {FG_MUTED}'>{esc(meaning)}</span></div>"
            for path, (color, meaning) in PATHS.items()
        ]
        return f'<div style="margin-top: 2px">{"".join(items)}</div>'


@dataclass(frozen=True)
class CacheBytes:
    """KV cache per token of one model shape: MLA's latent row against every head's K and V (MHA)."""

    num_layers: int
    mla_values: int
    """Values MLA caches per token and layer: kv_lora_rank + qk_rope_head_dim."""
    mha_values: int
    """The same layer with MHA: num_heads x (qk_head_dim for K + v_head_dim for V)."""
    mla_bytes: int
    """Per token and layer, as the engine sizes its blocks: MLAAttentionSpec.page_size_bytes / block_size."""
    mha_bytes: int

    @property
    def ratio(self) -> float:
        """How many times more an MHA cache takes (= how many times more tokens MLA fits)."""
        return self.mha_bytes / self.mla_bytes

    def tokens_in(self, memory_bytes: int) -> tuple[int, int]:
        """Tokens whose cache, every layer, fits in `memory_bytes`: (with MLA, with MHA)."""
        return (memory_bytes // (self.mla_bytes * self.num_layers), memory_bytes // (self.mha_bytes * self.num_layers))


def cache_bytes(config: DeepseekV2Config, dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> CacheBytes:
    """The cache per token of `config`'s attention layers, in `dtype`: MLA and the MHA it replaces."""
    # The spec the engine's MLAAttention layers report (one "KV head" of the whole latent row).
    spec = MLAAttentionSpec(block_size, config.num_key_value_heads, config.head_dim, dtype)
    mha_values = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return CacheBytes(
        config.num_hidden_layers, config.head_dim, mha_values, spec.page_size_bytes // block_size, mha_values * itemsize
    )


def _bar(width_px: float, color: str) -> str:
    """A bar (or a legend swatch) `width_px` wide."""
    return (
        f'<span style="display: inline-block; vertical-align: middle; height: 9px; '
        f'width: {max(width_px, 1):.0f}px; background: {color}"></span>'
    )


def latent_cache_table(
    models: Mapping[str, DeepseekV2Config], memory_bytes: int = 40 * 10**9, dtype: torch.dtype = torch.bfloat16
) -> str:
    """HTML: per model shape, the cache per token per layer with MLA and with MHA, the ratio, and
    how many tokens (every layer's rows) fit in `memory_bytes`."""
    cell = f"padding: 2px 6px; border: 1px solid {BORDER}"
    value_cell = f"{cell}; white-space: nowrap"  # headers may wrap (narrow columns), numbers may not
    dtype_name = str(dtype).removeprefix("torch.")
    header = [
        "model",
        "layers",
        f"cache per token per layer ({esc(dtype_name)})",
        "MHA / MLA",
        f"tokens in {memory_bytes / 1e9:g} GB (all layers)",
    ]
    rows = ["<tr>" + "".join(f'<th style="{cell}; background: {BG_HEADER}">{h}</th>' for h in header) + "</tr>"]
    for name, config in models.items():
        b = cache_bytes(config, dtype)
        mla_tokens, mha_tokens = b.tokens_in(memory_bytes)
        values = [
            esc(name),
            str(b.num_layers),
            f"{_bar(100 / b.ratio, LATENT_COLOR)} MLA {b.mla_values:,} values = {b.mla_bytes:,} B<br>"
            f"{_bar(100, HEADS_COLOR)} MHA {b.mha_values:,} values = {b.mha_bytes:,} B",
            f"<b>{b.ratio:.1f}x</b>",
            f"MLA {mla_tokens:,}<br>MHA {mha_tokens:,}",
        ]
        rows.append(
            f'<tr data-model="{esc(name)}">' + "".join(f'<td style="{value_cell}">{v}</td>' for v in values) + "</tr>"
        )
    legend = (
        f"<div style='margin-top: 4px; color: {FG_MUTED}'>MLA caches one row [c_kv | k_pe] per token and "
        f"layer ({_bar(10, LATENT_COLOR)} latent); MHA would cache every head's K and V "
        f"({_bar(10, HEADS_COLOR)} per head).</div>"
    )
    return (
        f'<div class="pkv-latent-cache" style="{BASE_STYLE}"><table style="border-collapse: collapse">'
        f"{''.join(rows)}</table>{legend}</div>"
    )
