"""`SlotMappingView`: where each token of a step writes its K/V in the paged cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets

from pagedkv.checks import check_int
from pagedkv.trace import StepRecord, StepTrace
from pagedkv.widgets.common import BASE_STYLE, BORDER_LIGHT, TraceView, esc, request_color

_CELL = f"padding:1px 3px; border:1px solid {BORDER_LIGHT}; text-align:center"


class SlotMappingView(TraceView):
    """One column per token of the step: its request, position, block and slot.

        logical block = position // block_size          (which entry of the request's row)
        physical block = block_table[request][logical]  (which block of the pool)
        slot = physical block * block_size + position % block_size

    A trace holds the step's own tokens only (padding up to a captured CUDA graph size, slot -1,
    is cut off when the step is recorded). A step with more than `tokens_per_page` tokens (a
    prefill) is drawn a page at a time: the "token page" slider above the table (`view.pager`)
    pages through all of them. The default page (20 tokens of up to 4 digits) fits the ~850 px
    output area of a 1280 px JupyterLab window with the file browser open.
    """

    def __init__(self, trace: StepTrace, *, tokens_per_page: int = 20, **kwargs: Any) -> None:
        self.tokens_per_page = check_int("tokens_per_page", tokens_per_page, 1, hint=" (tokens drawn per page)")
        self.pager = ipywidgets.IntSlider(value=1, min=1, max=1, description="token page", continuous_update=True)
        self.pager.add_class("pkv-token-pager")
        self._clamping = False
        super().__init__(trace, **kwargs)
        self.pager.observe(self._on_page, "value")

    @property
    def controls(self) -> tuple[ipywidgets.Widget, ...]:
        return (self.pager,)

    def _on_page(self, _change: dict[str, Any]) -> None:
        if not self._clamping:
            self.redraw()

    def _page_range(self, num_slots: int) -> tuple[int, int, int]:
        """(first token, end token, number of pages) of the page on display (pages count from 1);
        a step with fewer pages clamps the page."""
        pages = max(-(-num_slots // self.tokens_per_page), 1)
        if self.pager.max != pages:
            self._clamping = True  # lowering max lowers value: this render already draws the clamped page
            try:
                self.pager.max = pages
            finally:
                self._clamping = False
        first = (self.pager.value - 1) * self.tokens_per_page
        return first, min(first + self.tokens_per_page, num_slots), pages

    def render(self, record: StepRecord) -> str:
        rows_by_req = {r.req_id: r.block_ids for r in record.scheduled}
        req_ids = record.token_req_ids()
        token_rows = [rows_by_req[r] for r in req_ids]  # per token: its request's block table rows
        num_slots = max(len(s) for s in record.slot_mappings)
        first, end, pages = self._page_range(num_slots)
        shown = range(first, end)

        def row(label: str, cells: list[str]) -> str:
            return f'<tr><th style="{_CELL}; text-align:right; white-space:nowrap">{label}</th>{"".join(cells)}</tr>'

        def cell(i: int, text: object, slot: int | None = None) -> str:
            color = request_color(req_ids[i])
            data = f' class="pkv-slot" data-slot="{slot}"' if slot is not None else ""
            return f'<td{data} style="{_CELL}; border-top:3px solid {color}">{esc(text)}</td>'

        def per_token(values: list[Any]) -> list[str]:
            return [cell(i, values[i]) for i in shown]

        table = [
            row("token #", [cell(i, i) for i in shown]),
            row("request", per_token(req_ids)),
            row("token id", per_token(record.input_ids)),
            row("position", per_token(record.positions)),
        ]
        for group in self.engine.kv_cache_groups:
            table += self._group_rows(record, group.group_id, group.spec.block_size, shown, token_rows, cell, row)
        where = f"tokens {first}..{end - 1} of {num_slots} (page {self.pager.value} of {pages})"
        return (
            f'<div class="pkv-slot-mapping" data-step="{record.step}" data-first-token="{first}" '
            f'data-pages="{pages}" style="{BASE_STYLE}">'
            f"<div><b>step {record.step}</b> &middot; {record.num_tokens} tokens &middot; {where}</div>"
            "<div>slot = block_table[request][position // block_size] * block_size + position % block_size</div>"
            f'<div style="overflow-x:auto"><table style="border-collapse:collapse; margin-top:4px">'
            f"{''.join(table)}</table></div></div>"
        )

    def _group_rows(
        self,
        record: StepRecord,
        g: int,
        bs: int,
        shown: range,
        token_rows: list[Any],
        cell: Callable[..., str],
        row: Callable[[str, list[str]], str],
    ) -> list[str]:
        """The four rows that turn a position into a slot, for KV cache group `g`."""
        suffix = f" (g{g})" if self.engine.num_kv_cache_groups > 1 else ""
        logical, physical, offset, slots = [], [], [], []
        for i in shown:
            slot = record.slot_mappings[g][i]
            pos = record.positions[i]
            logical.append(cell(i, pos // bs))
            physical.append(cell(i, token_rows[i][g][pos // bs]))
            offset.append(cell(i, pos % bs))
            slots.append(cell(i, slot, slot))
        return [
            row(f"pos // {bs}{suffix}", logical),
            row(f"block table{suffix}", physical),
            row(f"pos % {bs}{suffix}", offset),
            row(f"<b>slot</b>{suffix}", slots),
        ]
